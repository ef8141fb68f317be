"""bench/profile_step.py: the compiled module's dots and their FLOPs read from its text, counted by hand; a traced
call's ops mapped onto that module (forward and backward of a grad told apart); the CLI on a tiny checkpoint."""

import json
import sys

import jax
import jax.numpy as jnp
import pytest

from bench import profile_step, workloads


def _text(fn, *args):
  return jax.jit(fn).lower(*args).compile().as_text()


def test_dot_flops_by_hand():
  a, b = jnp.ones((24, 40)), jnp.ones((40, 56))
  x, y = jnp.ones((3, 8, 16)), jnp.ones((3, 16, 4))
  ops = profile_step.hlo_ops(_text(lambda a, b, x, y: (jax.nn.relu(a @ b) + 1.0, jnp.einsum("bmk,bkn->bmn", x, y)),
                                   a, b, x, y))
  # a product wrapped in a fusion counts for the fusion and for the dot inside its fused computation
  dots = {op.flops for op in ops.values() if op.flops}
  want = {2 * 24 * 40 * 56, 2 * 3 * 8 * 16 * 4}
  assert dots == want, dots
  assert all(op.flops == 0 for op in ops.values() if op.opcode in ("parameter", "add", "maximum", "broadcast"))


def test_origin_and_kind():
  assert profile_step.origin("jit(step)/jit(_train_step)/transpose(jvp())/while/body/dot_general") == \
      "_train_step backward"
  assert profile_step.origin("jit(step)/jit(_train_step)/jvp()/while/body/mul") == "_train_step forward"
  assert profile_step.origin("jit(step)/jit(score)/while/body/dot_general") == "score"
  assert profile_step.origin("jit(step)/jit(_train_step)/transpose(jvp())/jit(silu)/mul") == "_train_step backward"
  assert profile_step.origin("jit(generate)/while/body/jit(_uniform)/add") == "generate"
  assert profile_step.origin("") == "-"
  op = profile_step.Op("copy_bitcast_fusion.19", "f32[2]", "fusion", "", 0.0)
  assert profile_step.kind(op) == "copy_bitcast_fusion"
  assert profile_step.kind(profile_step.Op("ynn_fusion.3", "f32[2]", "fusion", "", 8.0)) == "dot"


def test_profile_maps_a_grad_onto_its_module():
  """A 3-layer scan's gradient: every traced op of the module is found in its text, the layer dots ran once per
  layer in the forward, the backward's ops are told apart, and the groups add up to the op time."""
  L, M, K = 3, 64, 96
  w_LKK = jax.random.normal(jax.random.key(0), (L, K, K)) / K
  x_MK = jax.random.normal(jax.random.key(1), (M, K))

  def loss(w_LKK, x_MK):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x_MK, w_LKK)
    return jnp.sum(h ** 2)

  g = jax.jit(jax.grad(loss))
  s = profile_step.profile(lambda: g(w_LKK, x_MK), g.lower(w_LKK, x_MK).compile().as_text(), top=5)
  assert s["ops"] and len(s["top"]) <= 5
  assert s["op_s"] == pytest.approx(sum(r["seconds"] for r in s["ops"]))
  assert s["op_s"] == pytest.approx(sum(x["seconds"] for x in s["groups"]))
  assert 0 < s["wall_s"] and 0 < s["dot_share"] <= 1
  fwd = [r for r in s["ops"] if r["flops"] and r["origin"].endswith("forward")]
  assert fwd and all(r["calls"] == L for r in fwd), fwd  # in the scan's loop body
  assert sum(r["flops"] for r in fwd) == 2 * M * K * K * L  # h @ w, once per layer
  assert any(r["origin"].endswith("backward") and r["flops"] for r in s["ops"])  # dW and dh
  # the backward moves at least the forward's FLOPs twice over (dW and dh of layers 2..L)
  assert s["dot_flops"] >= 2 * M * K * K * L + 2 * M * K * K * (2 * L - 1) - 1


def test_cli_on_a_tiny_checkpoint(tmp_path, monkeypatch, capsys):
  sys.path.insert(0, __import__("os").path.dirname(__file__))
  import tiny_hf
  ckpt = str(tiny_hf.make_checkpoint(tmp_path / "tiny", seed=0, max_seq_len=256))
  monkeypatch.setitem(workloads.REAL, "R_small", dict(prompts_per_step=2, group_size=2, max_new_tokens=4, remat="full"))
  out = tmp_path / "train.json"
  md = tmp_path / "train.md"
  s = profile_step.main(["--what", "train", "--model", ckpt, "--json", str(out), "--top", "8", "--markdown", str(md)])
  text = capsys.readouterr().out
  head = md.read_text().splitlines()
  assert head[0] == text.splitlines()[0] and head[2].startswith("Measured by `python -m bench.profile_step --what train")
  assert text.startswith("## train, workload R_small (4 rows") and "| origin | kind |" in text
  saved = json.loads(out.read_text())
  assert saved["what"] == "train" and len(saved["top"]) == 8 and saved["dot_flops"] == s["dot_flops"] > 0
  origins = {g["origin"] for g in saved["groups"]}
  assert any(o.endswith("backward") for o in origins) and "score" in origins, origins  # the fused reference
