"""`model.remat="auto"` and the step-memory estimator (`jaxrl_llm.memory`): numbers by hand, the decision
through the run's own setup path, the budget, validation, and a tiny run that takes a step with it."""

import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import config as config_lib
from jaxrl_llm import loop, memory, policy_init
from jaxrl_llm.models import ModelConfig, forward, init_params, token_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# V=32, D=8, L=2, H=4, K=2, hd=4 (H·hd = 16 != D: q and the attention output are counted at their own width), F=16
CFG = ModelConfig(vocab_size=32, d_model=8, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=16)
# Per layer: 2 norms (2·8) + wq 8·16 + wk, wv 2·(8·8) + wo 16·8 + gate, up, down 3·(8·16) = 16 + 128 + 128 + 128 + 384.
PARAMS = 32 * 8 + 2 * (16 + 128 + 128 + 128 + 384) + 8 + 8 * 32  # embed + layers + final norm + untied head = 2088
B, P, N = 3, 5, 4
T = P + N
# Floats per token and layer: all = 4·D + 2·H·hd + 2·K·hd + 3·F + H·T = 32 + 32 + 16 + 48 + 36.
ALL, DOTS = 164, 140  # dots = 3·D + 2·H·hd + 2·K·hd + 2·F + H·T = 24 + 32 + 16 + 32 + 36
HEAD = 4 * 2 * B * N * 32  # fp32 logits + their gradient; the whole N = 4 positions fit one chunk


def tiny(**over):
  c = config_lib.load_file(os.path.join(ROOT, "configs", "tiny.py"))
  c.log.tensorboard = False
  for k, v in over.items():
    node = c
    *path, leaf = k.split(".")
    for part in path:
      node = node[part]
    node[leaf] = v
  return c


def test_param_count_by_hand_and_from_init():
  assert memory.param_count(CFG) == PARAMS == 2088
  assert memory.param_bytes(CFG, 2) == 2 * 2088
  # the layout's own count, for the variants a hand formula would miss: qk-norm, q/k/v biases, experts, tied head
  for cfg in (dataclasses.replace(CFG, qk_norm=True, attn_bias=True, tie_embeddings=True),
              dataclasses.replace(CFG, num_experts=4)):
    assert memory.param_count(cfg) == sum(x.size for x in jax.tree.leaves(init_params(cfg, jax.random.key(0))))


def test_activation_bytes_by_hand():
  assert memory.activation_bytes(CFG, B, T, "none", N) == 4 * B * T * 2 * ALL + HEAD
  assert memory.activation_bytes(CFG, B, T, False, N) == 4 * B * T * 2 * ALL + HEAD
  # full: each layer's input (D) plus one layer's full set while it is recomputed
  assert memory.activation_bytes(CFG, B, T, "full", N) == 4 * B * T * (2 * 8 + ALL) + HEAD
  assert memory.activation_bytes(CFG, B, T, True, N) == 4 * B * T * (2 * 8 + ALL) + HEAD
  assert memory.activation_bytes(CFG, B, T, "dots", N) == 4 * B * T * (2 * DOTS + ALL) + HEAD
  # bf16 compute halves the layers' part; the lm-head stays fp32
  bf16 = dataclasses.replace(CFG, dtype="bfloat16")
  assert memory.activation_bytes(bf16, B, T, "none", N) == 2 * B * T * 2 * ALL + HEAD
  with pytest.raises(ValueError, match="auto"):
    memory.activation_bytes(CFG, B, T, "auto", N)


def test_lm_head_counts_the_chunk():
  # V = 2^20, B = 2: a chunk holds 2^22 // (2 · 2^20) = 2 positions of the N = 8 scored ones
  big = dataclasses.replace(CFG, vocab_size=1 << 20)
  layers = 4 * 2 * 10 * (2 * 8 + (4 * 8 + 2 * 16 + 2 * 8 + 3 * 16 + 4 * 10))
  assert memory.activation_bytes(big, 2, 10, "full", 8) == layers + 4 * 2 * 2 * 2 * (1 << 20)
  assert memory.activation_bytes(big, 2, 10, "full", 8, head_positions=8) == layers + 4 * 2 * 2 * 8 * (1 << 20)
  # the chunk the estimator assumes is the one the scorer asks for
  assert inspect.signature(token_logprobs).parameters["chunk_size"].default == memory.LM_HEAD_CHUNK


def test_lora_adapters_and_merged_weights_by_hand():
  # rank 2 on wq [8 -> 16] and wv [8 -> 8]: A [L, r, in] + B [L, out, r] = 2 · 2 · ((8 + 16) + (8 + 8)) = 160
  assert memory.lora_param_count(CFG, 2, ("wq", "wv")) == 160
  merged = 8 * 16 + 8 * 8  # one layer's merged targets, kept for the backward like activations
  base = memory.activation_bytes(CFG, B, T, "none", N)
  assert memory.activation_bytes(CFG, B, T, "none", N, lora_weights=("wq", "wv")) == base + 4 * 2 * merged
  base = memory.activation_bytes(CFG, B, T, "full", N)
  assert memory.activation_bytes(CFG, B, T, "full", N, lora_weights=("wq", "wv")) == base + 4 * merged


def test_phase_bytes_by_hand():
  shape = memory.StepShape(rows=B, prompt=P, new=N, micro_rows=B, frozen_copies=1)
  params = 4 * 2088
  resident = params * 5  # policy, reference, AdamW m and v, the sampler's published copy (all fp32)
  kv = 4 * 2 * 2 * B * T * 2 * 4  # K and V, 2 layers, K=2 heads of 4, fp32
  score = 4 * B * 4 * 32  # the scorer's one chunk of 4 positions
  acts = 4 * B * T * 2 * ALL + HEAD
  # the decode view's output-major copies: per layer wq 128 + wk 64 + wv 64 + wo 128 + gate, up, down 3 * 128, and
  # the untied head 8 * 32
  view = 4 * (2 * 768 + 256)
  got = memory.phase_bytes(CFG, shape, "none")
  assert got["params"] == params and got["resident"] == resident and got["kv_cache"] == kv
  assert got["decode_view"] == view
  assert got["prefill"] == resident + kv + view and got["decode"] == resident + kv + view + 4 * B * 32
  assert got["train"] == resident + params + score + acts
  f = memory.XLA_TEMP_FACTOR["none"]  # the decision's step: gradients + activations scaled by what XLA adds (measured)
  assert got["step"] == memory.step_bytes(CFG, shape, "none") == math.ceil(resident + score + f * (params + acts) + kv
                                                                           + view)
  # a bf16 sampler halves its copy, its cache and its view; the learner micro-batch scales the activations only
  half = memory.phase_bytes(CFG, dataclasses.replace(shape, sampler_dtype="bfloat16", micro_rows=1), "none")
  assert half["step"] == math.ceil(4 * params + params // 2 + score + f * (params + 4 * T * 2 * ALL + 4 * 2 * 1 * N * 32)
                                   + kv // 2 + view // 2)
  # through the layer scan a sampling call holds no copy
  scan = memory.phase_bytes(dataclasses.replace(CFG, decode_unroll=False), shape, "none")
  assert scan["decode_view"] == 0 and scan["decode"] == got["decode"] - view
  # LoRA: base + fp32 adapters + their moments and gradients; the reference is a copy of the base
  lora = memory.phase_bytes(CFG, dataclasses.replace(shape, lora_rank=2, lora_weights=("wq", "wv")), "full")
  adapters = 4 * 160
  assert lora["resident"] == params + adapters + params + 2 * adapters + params
  assert lora["gradients"] == adapters
  assert lora["activations"] == 4 * B * T * (2 * 8 + ALL) + 4 * (8 * 16 + 8 * 8) + HEAD
  # "dots" keeps the matmul outputs (+ one layer while it recomputes) and has its own measured XLA factor
  dots = memory.phase_bytes(CFG, shape, "dots")
  assert dots["activations"] == 4 * B * T * (2 * DOTS + ALL) + HEAD
  fd = memory.XLA_TEMP_FACTOR["dots"]
  assert dots["step"] == math.ceil(dots["train"] + kv + view + (fd - 1) * (params + dots["activations"]))


@pytest.mark.parametrize("kind", ["dense", "tied", "moe"])
def test_decode_view_bytes_count_what_the_view_copies(kind):
  """`decode_view_bytes` against the view itself: the output-major weights (`layers.OutIn`) of
  `transformer.unstack_layers` traced on the parameter shapes, less a tied head (the embedding, used as it is)."""
  from jaxrl_llm.models import transformer
  from jaxrl_llm.models.layers import OutIn
  cfg = {"dense": CFG, "tied": dataclasses.replace(CFG, tie_embeddings=True),
         "moe": dataclasses.replace(CFG, num_experts=4, experts_per_token=2)}[kind]
  view = jax.eval_shape(lambda p: transformer.unstack_layers(p, cfg), memory.param_shapes(cfg))
  is_out = lambda x: isinstance(x, OutIn)
  copies = [x.w_RD for x in jax.tree.leaves(view["layers"], is_leaf=is_out) if is_out(x)]
  if not cfg.tie_embeddings:
    copies.append(view["head_out_major"].w_RD)
  assert memory.decode_view_bytes(cfg, 4) == 4 * sum(math.prod(w.shape) for w in copies) > 0
  assert memory.decode_view_bytes(dataclasses.replace(cfg, decode_unroll=False), 4) == 0


def test_bench_uses_the_library_estimator():
  from bench import common, grpo_real
  assert common.param_bytes is memory.param_bytes and common.kv_cache_bytes is memory.kv_cache_bytes
  budget = grpo_real.memory_budget(CFG, B, P, N, "full")  # whole logits, no sampler copy: the bench's phases
  assert set(budget) == {"params", "resident", "decode_view", "prefill", "decode", "reference", "train"}
  assert budget["train"] == 4 * 4 * 2088 + 4 * 2088 + 4 * B * N * 32 + 4 * B * T * (2 * 8 + ALL) + 4 * 2 * B * N * 32


# ----------------------------------------------------------------------------- budget


def test_default_budget_is_positive_and_explicit_is_gb():
  assert memory.machine_budget_bytes() > 0 and memory.budget_bytes(0.0) > 0
  assert memory.budget_bytes(2.5) == 2_500_000_000


def _device(stats):
  return types.SimpleNamespace(memory_stats=lambda: stats)


def test_machine_budget_accelerator_limit_else_host_share(monkeypatch):
  monkeypatch.setattr(memory.jax, "local_devices", lambda: [_device({"bytes_limit": 12345, "bytes_in_use": 7})])
  assert memory.machine_budget_bytes() == 12345
  monkeypatch.setattr(memory.jax, "local_devices", lambda: [_device(None), _device(None)])  # CPU: no stats
  monkeypatch.setattr(memory, "host_available_bytes", lambda: 1000)
  assert memory.machine_budget_bytes() == int(memory.HOST_MEMORY_FRACTION * 1000 / 2)


def test_host_available_bytes_reads_meminfo():
  with open("/proc/meminfo") as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
  assert abs(memory.host_available_bytes() - 1024 * kb) < 0.25 * 1024 * kb  # the machine moves meanwhile


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), True, "8GB"])
def test_bad_budget_is_a_config_error_naming_the_field(value):
  c = tiny(**{"model.remat": "auto"})
  del c.model["memory_budget_gb"]  # a config file may hold any type; the default's float field refuses a str
  c.model.memory_budget_gb = value
  with pytest.raises(config_lib.ConfigError, match="config.model.memory_budget_gb"):
    config_lib.validate(c)


def test_remat_values_validated():
  config_lib.validate(tiny(**{"model.remat": "auto"}))
  with pytest.raises(config_lib.ConfigError, match="config.model.remat='most'"):
    config_lib.validate(tiny(**{"model.remat": "most"}))


# ----------------------------------------------------------------------------- the decision


# The accelerators' order (least recomputation first), put on this CPU so the setup path's decision is visible: on
# CPU itself "full" comes first and "auto" always takes it.
ACCEL_ORDER = ("none", "dots", "full")


def test_auto_resolves_by_budget_through_setup(monkeypatch):
  assert jax.default_backend() == "cpu" and memory.remat_order("cpu") == ("full", "dots", "none")
  cpu = loop.setup(tiny(**{"model.remat": "auto", "model.memory_budget_gb": 1000.0}))
  assert cpu.model_cfg.remat == "full" and cpu.remat_auto["order"] == ["full", "dots", "none"]
  monkeypatch.setitem(memory.REMAT_ORDER, "cpu", ACCEL_ORDER)
  big = loop.setup(tiny(**{"model.remat": "auto", "model.memory_budget_gb": 1000.0}))
  assert big.model_cfg.remat == "none" and big.sampler_model_cfg.remat == "none"
  assert big.remat_auto["remat"] == "none" and big.remat_auto["budget_gb"] == 1000.0
  assert big.remat_auto["order"] == list(ACCEL_ORDER)
  small = loop.setup(tiny(**{"model.remat": "auto", "model.memory_budget_gb": 1e-6}))  # 1 kB
  assert small.model_cfg.remat == "full" and small.remat_auto["remat"] == "full"
  # the estimates are the step of the run's shapes: 16 rows of P + N tokens
  shape = policy_init.step_shape(small.c, small.P)
  assert (shape.rows, shape.prompt, shape.new, shape.micro_rows) == (16, small.P, 4, 16)
  cfg = dataclasses.replace(small.model_cfg, remat="none")
  assert small.remat_auto["estimate_gb"] == {m: memory.step_bytes(cfg, shape, m) / memory.GB for m in ACCEL_ORDER}
  # a value other than "auto" is left alone and not reported
  plain = loop.setup(tiny(**{"model.remat": "dots"}))
  assert plain.model_cfg.remat == "dots" and plain.remat_auto is None


def test_choose_remat_takes_the_first_mode_that_fits():
  """Each platform's order, fastest first; a budget between two modes' estimates picks the next that fits;
  nothing fits: "full", the smallest."""
  cfg = dataclasses.replace(CFG, n_layers=16)  # at 2 layers "dots" (+ one layer recomputed) keeps more than "none"
  shape = memory.StepShape(rows=B, prompt=P, new=N, micro_rows=B)
  est = {m: memory.step_bytes(cfg, shape, m) for m in ("none", "dots", "full")}
  assert est["full"] < est["dots"] < est["none"]
  for platform, order in [("cpu", ("full", "dots", "none")), ("gpu", ACCEL_ORDER), ("tpu", ACCEL_ORDER)]:
    assert memory.remat_order(platform) == order
    for budget in (est["none"], est["dots"], est["full"], 1):
      assert memory.choose_remat(cfg, shape, budget, platform).estimates == {m: est[m] for m in order}
  assert memory.choose_remat(cfg, shape, est["none"], "gpu").remat == "none"
  assert memory.choose_remat(cfg, shape, est["none"] - 1, "gpu").remat == "dots"
  assert memory.choose_remat(cfg, shape, est["dots"], "gpu").remat == "dots"
  assert memory.choose_remat(cfg, shape, est["dots"] - 1, "gpu").remat == "full"
  assert memory.choose_remat(cfg, shape, 1, "gpu").remat == "full"  # nothing fits: the smallest
  assert memory.choose_remat(cfg, shape, est["none"], "cpu").remat == "full"
  # an order that puts "full" last still falls back to it when nothing before it fits
  memory.REMAT_ORDER["test"] = ("dots", "none", "full")
  try:
    assert memory.choose_remat(cfg, shape, est["none"], "test").remat == "dots"
    assert memory.choose_remat(cfg, shape, est["dots"] - 1, "test").remat == "full"
  finally:
    del memory.REMAT_ORDER["test"]
  assert memory.choose_remat(cfg, shape, est["none"]).order == memory.remat_order(jax.default_backend())


def test_sft_teacher_gets_a_decided_remat(monkeypatch):
  """The SFT teacher of a distillation run is built from the student's fields: "auto" is decided for its shapes."""
  from jaxrl_llm.distill import teacher as teacher_lib
  monkeypatch.setitem(memory.REMAT_ORDER, "cpu", ACCEL_ORDER)
  c = config_lib.load_file(os.path.join(ROOT, "configs", "opd_tiny.py"))
  c.model.remat, c.model.memory_budget_gb = "auto", 1e-6
  assert teacher_lib.teacher_model_config(c, 16, 64).remat == "full"
  c.model.memory_budget_gb = 1000.0
  assert teacher_lib.teacher_model_config(c, 16, 64).remat == "none"


def test_step_shape_follows_the_update_schedule_and_reference():
  c = tiny(**{"optim.grad_accum": 2, "optim.minibatches": 2, "loss.kl_coef": 0.1, "sampler.dtype": "bfloat16"})
  shape = policy_init.step_shape(c, 7)
  assert shape.micro_rows == 4 and shape.frozen_copies == 1 and shape.sampler_dtype == "bfloat16"
  assert policy_init.step_shape(tiny(), 7).frozen_copies == 0


def test_unresolved_auto_refused_by_the_model():
  cfg = dataclasses.replace(CFG, remat="auto")  # a ModelConfig accepts it (a run resolves it) ...
  params = init_params(CFG, jax.random.key(0))
  with pytest.raises(ValueError, match="remat='auto'"):  # ... a forward does not
    forward(params, jnp.zeros((1, 3), jnp.int32), cfg)


def test_cli_parses_auto():
  """`--config.model.remat=auto` (the default's field takes any type: a bool field would refuse it)."""
  code = ("import sys; from absl import flags; from ml_collections import config_flags\n"
          "C = config_flags.DEFINE_config_file('config', None, '', lock_config=True)\n"
          "flags.FLAGS(sys.argv); print(repr(C.value.model.remat), repr(C.value.model.memory_budget_gb))")
  out = subprocess.run([sys.executable, "-c", code, f"--config={ROOT}/configs/tiny.py", "--config.model.remat=auto",
                        "--config.model.memory_budget_gb=3"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["'auto'", "3.0"]


def test_tiny_run_with_auto_takes_a_step(tmp_path, capsys):
  """A run with remat="auto" and a budget only recomputation could meet: it decides "full", says so once,
  records it in run_info.json, and its step trains (finite loss)."""
  c = tiny(**{"model.remat": "auto", "model.memory_budget_gb": 1e-6, "num_steps": 1, "sft.steps": 0,
              "eval.every": 0})
  rows = loop.run(c, str(tmp_path))
  assert len(rows) == 1 and np.isfinite(rows[0]["loss"])
  lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("remat_auto")]
  assert len(lines) == 1 and lines[0].startswith("remat_auto -> full (est. ")
  info = json.loads((tmp_path / "run_info.json").read_text())
  assert info["remat_auto"]["remat"] == "full" and math.isclose(info["remat_auto"]["budget_gb"], 1e-6)
