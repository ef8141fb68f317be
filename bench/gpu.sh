#!/usr/bin/env bash
# Workload R on one NVIDIA GPU: ours (JAX with CUDA) against plain PyTorch (torch with CUDA), taking turns
# block by block, plus feature variants of ours; about 5-10 minutes after the installs. Never run by CI or
# `make bench` (which measure on the CPU).
#
# Run it from anywhere, on a Linux machine with an NVIDIA GPU (driver >= 525) and Python >= 3.11:
#   bash bench/gpu.sh                      # installs on first use, then measures
#   DRY_RUN=1 bash bench/gpu.sh            # prints the commands instead of running them
#   WORKLOAD=R_small VARIANTS= bash bench/gpu.sh   # smaller workload, no variants
#
# What it does:
#   1. $GPU_VENV (default .venv-gpu): the project with pyproject's `gpu` extra (jax[cuda12]) through the
#      Makefile's $(VENV)/.base and $(VENV)/.jax-gpu targets;
#   2. SmolLM2-135M-Instruct imported once into ~/.cache/jaxrl_llm (SMOLLM2_DIR overrides) through the Makefile's
#      $(VENV)/.smollm2 target: the GGUF route of `make smollm2`, without its CPU-pinned torch (a second torch
#      build beside jax's CUDA wheels is what that pin avoids);
#   3. $PEER_VENV (default bench/.venv-bench-gpu): torch unpinned (its CUDA build), transformers, safetensors
#      for bench/peers/torch_grpo.py, which picks CUDA when torch.cuda.is_available();
#   4. `python -m bench.run --only-real --real $WORKLOAD --peers torch` with JAX_PLATFORMS unset (ours on JAX's
#      default device, the GPU), writing $OUT (bench/results-gpu.json) and $README (bench/README-gpu.md).
#      JAX may take XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU (0.5 here), leaving the rest to the torch peer.
#   5. `python -m bench.remat` on the same workload (each `model.remat` mode's train step, taking turns), writing
#      $REMAT_MD (bench/profiles/<WORKLOAD>_remat_gpu.md).
# Knobs (environment): PYTHON, GPU_VENV, PEER_VENV, WORKLOAD (R or R_small), FEATURES (ours' features),
# VARIANTS (';'-separated feature sets of ours, bench/features.py; empty: none), OUT, README, REMAT_MD, DRY_RUN.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
GPU_VENV=${GPU_VENV:-.venv-gpu}
PEER_VENV=${PEER_VENV:-bench/.venv-bench-gpu}
WORKLOAD=${WORKLOAD:-R}
FEATURES=${FEATURES:-}
VARIANTS=${VARIANTS-remat=none;slots=32,slot_chunk=16;pack_width=auto;spec_gamma=4}
OUT=${OUT:-bench/results-gpu.json}
README=${README:-bench/README-gpu.md}
REMAT_MD=${REMAT_MD:-bench/profiles/${WORKLOAD}_remat_gpu.md}
DRY_RUN=${DRY_RUN:-0}
SMOLLM2_DIR=${SMOLLM2_DIR:-}

run() {  # prints the command; runs it unless DRY_RUN=1
  echo "+ $(printf '%q ' "$@")" >&2
  if [ "$DRY_RUN" != 1 ]; then "$@"; fi
}

if [ "$DRY_RUN" != 1 ] && ! command -v nvidia-smi > /dev/null; then
  echo "bench/gpu.sh: no nvidia-smi on PATH: this script measures on an NVIDIA GPU (see its header)" >&2
  exit 1
fi
[ "$DRY_RUN" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. ours: JAX with CUDA (pyproject's gpu extra)
run make VENV="$GPU_VENV" PYTHON="$PYTHON" JAX_EXTRA=gpu "$GPU_VENV/.base" "$GPU_VENV/.jax-gpu"
# 2. the real model (no-op when imported before: the stamp)
run make VENV="$GPU_VENV" PYTHON="$PYTHON" ${SMOLLM2_DIR:+SMOLLM2_DIR="$SMOLLM2_DIR"} "$GPU_VENV/.smollm2"
# 3. the peer: torch's CUDA build (unpinned), in its own venv
if [ ! -e "$PEER_VENV/.torch-cuda" ]; then
  run "$PYTHON" -m venv "$PEER_VENV"
  run "$PEER_VENV/bin/pip" install -q --upgrade pip
  run "$PEER_VENV/bin/pip" install -q torch transformers safetensors numpy
  run touch "$PEER_VENV/.torch-cuda"
fi
run env JAX_PLATFORMS= "$GPU_VENV/bin/python" -c "import jax; d = jax.devices()[0]; print('JAX on', d.platform, d.device_kind); assert d.platform == 'gpu', 'JAX sees no GPU'"
run "$PEER_VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.cuda.is_available()); assert torch.cuda.is_available(), 'torch sees no GPU'"

# 4. workload R: ours (and its variants) against plain PyTorch, taking turns. A fresh $OUT: with an existing
#    entry, `--peers` would re-measure the peer's rows only (the previous file is kept as $OUT.prev).
if [ -e "$OUT" ]; then run mv "$OUT" "$OUT.prev"; fi
args=(--only-real --real "$WORKLOAD" --peers torch --peer-python "$PEER_VENV/bin/python" --out "$OUT" --readme "$README")
[ -z "$SMOLLM2_DIR" ] || args+=(--model "$SMOLLM2_DIR")
[ -z "$FEATURES" ] || args+=(--features "$FEATURES")
[ -z "$VARIANTS" ] || args+=(--variants "$VARIANTS")
run env JAX_PLATFORMS= XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}" \
  TF_CPP_MIN_LOG_LEVEL=2 "$GPU_VENV/bin/python" -m bench.run "${args[@]}" --command "bash bench/gpu.sh (WORKLOAD=$WORKLOAD)"
# 5. the fused reference + train step under each model.remat mode, taking turns: the order `model.remat="auto"`
#    tries on a GPU (jaxrl_llm/memory.py's REMAT_ORDER) is measured only on CPU so far.
remat_args=(--variant "$WORKLOAD" --rounds 3 --markdown "$REMAT_MD")
[ -z "$SMOLLM2_DIR" ] || remat_args+=(--model "$SMOLLM2_DIR")
run env JAX_PLATFORMS= TF_CPP_MIN_LOG_LEVEL=2 "$GPU_VENV/bin/python" -m bench.remat "${remat_args[@]}"
echo "bench/gpu.sh: tables in $README and $REMAT_MD, numbers in $OUT" >&2
