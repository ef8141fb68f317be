"""Checkpointer: bitwise round trip, meta, retention (N latest + best), partial/corrupt detection."""

import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jaxrl_llm import checkpoint as ckpt_lib
from jaxrl_llm.checkpoint import Checkpointer, CheckpointWarning
from jaxrl_llm.learner import TrainState


def make_state(seed: int = 0):
  """A run-like state: TrainState with adamw state after one update, snapshots, key data, bf16, numpy."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  params = {"w_DF": jax.random.normal(k1, (4, 3)), "emb_VD": jax.random.normal(k2, (5, 4)).astype(jnp.bfloat16)}
  tx = optax.adamw(1e-2, weight_decay=0.1)
  opt_state = tx.init(params)
  grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  train = TrainState(params=params, opt_state=opt_state, step=jnp.int32(7), version=jnp.int32(6),
                     loss_state={"dual": jnp.float32(0.25)}, skipped=jnp.int32(0))
  snapshots = {"5": jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), "6": params}
  return {"train": train, "snapshots": snapshots, "key": jax.random.key_data(k3),
          "iterator_pos_B": np.arange(3, dtype=np.int32) + seed}


def assert_bitwise_equal(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def numeric_dirs(path):
  return sorted(int(n) for n in os.listdir(path) if n.isdigit())


META = {"config": {"loss": {"name": "ppo_clip"}, "lr": 1e-3, "mode": "fixed_lag"}, "jaxrl_llm": "0.1.0",
        "iterator": {"epoch": 1, "index": 17}, "counters": [3, 0, 2], "buffered_ids": ["a-1", "b-2"],
        "flag": True, "none": None}


def test_round_trip_bitwise_with_live_and_eval_shape_targets(tmp_path):
  state = make_state()
  with Checkpointer(tmp_path) as ck:
    assert ck.save(3, state, META)
    for target in (state, jax.eval_shape(lambda: make_state())):
      step, restored, meta = ck.latest_valid(target)
      assert step == 3 and meta == META
      assert_bitwise_equal(restored, state)
    assert isinstance(restored["train"], TrainState)
    assert restored["snapshots"]["5"]["w_DF"].dtype == jnp.bfloat16
    assert restored["train"].params["w_DF"].sharding == state["train"].params["w_DF"].sharding
    # numpy leaves of a live target come back as numpy
    restored = ck.restore(3, state)[0]
    assert isinstance(restored["iterator_pos_B"], np.ndarray)


def test_meta_round_trip_and_integrity_record(tmp_path):
  with Checkpointer(tmp_path) as ck:
    ck.save(1, {"x": jnp.arange(3.0)}, META)
    _, meta = ck.restore(1, {"x": jnp.zeros(3)})
  assert meta == META
  with open(tmp_path / "1" / "integrity" / "metadata") as f:
    integrity = json.load(f)
  import jaxrl_llm
  assert integrity["jaxrl_llm_version"] == jaxrl_llm.__version__
  assert integrity["format"] == ckpt_lib.FORMAT_VERSION


def test_saving_an_existing_step_is_a_no_op(tmp_path):
  with Checkpointer(tmp_path) as ck:
    assert ck.save(2, {"x": jnp.ones(2)}, {"v": 1})
    assert not ck.save(2, {"x": jnp.zeros(2)}, {"v": 2}, force=True)
    state, meta = ck.restore(2, {"x": jnp.zeros(2)})
  np.testing.assert_array_equal(state["x"], np.ones(2))
  assert meta == {"v": 1}


@pytest.mark.parametrize("mode,values,best", [
    ("max", [0.1, 0.9, 0.3, 0.5, 0.2, 0.4], 2),
    ("min", [0.5, 0.9, 0.05, 0.5, 0.2, 0.4], 3),
])
def test_retention_keeps_latest_n_plus_best(tmp_path, mode, values, best):
  with Checkpointer(tmp_path, keep=2, best_metric="acc", best_mode=mode, keep_best=1) as ck:
    for step, v in enumerate(values, start=1):
      ck.save(step, {"x": jnp.full(2, step, jnp.float32)}, {}, metrics={"acc": v})
    assert ck.all_steps() == sorted({5, 6, best})
  assert numeric_dirs(tmp_path) == sorted({5, 6, best})


def test_retention_ignores_steps_without_metrics_for_best(tmp_path):
  with Checkpointer(tmp_path, keep=2, best_metric="acc", keep_best=1) as ck:
    ck.save(1, {"x": jnp.ones(1)}, {}, metrics={"acc": 0.7})
    ck.save(2, {"x": jnp.ones(1)}, {}, metrics={"acc": 0.1})
    for step in (3, 4):  # e.g. SIGTERM saves, no metrics
      ck.save(step, {"x": jnp.ones(1)}, {})
    assert ck.all_steps() == [1, 3, 4]


def test_retention_without_best_keeps_latest(tmp_path):
  with Checkpointer(tmp_path, keep=3) as ck:
    for step in range(1, 7):
      ck.save(step, {"x": jnp.ones(1)}, {}, metrics={"acc": float(step)})
    assert ck.all_steps() == [4, 5, 6]


# --- corruption, done to the files directly -------------------------------------------------------


def _data_files(step_dir):
  # OCDBT keeps small arrays inline in its b-tree nodes (state/d/) and large ones in data files
  # (state/ocdbt.process_0/d/): both are array data.
  files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
  assert files
  return files


def _truncate_data(step_dir):
  for f in _data_files(step_dir):
    with open(f, "r+b") as fh:
      fh.truncate(os.path.getsize(f) // 2)


def _flip_one_byte(step_dir):
  f = max(_data_files(step_dir), key=os.path.getsize)
  data = bytearray(open(f, "rb").read())
  data[len(data) // 2] ^= 0x01
  open(f, "wb").write(bytes(data))


def _partial_step3(step_dir):
  # A save of step 3 that never committed: Orbax's tmp directory with part of the files.
  tmp = os.path.join(os.path.dirname(step_dir), "3.orbax-checkpoint-tmp-1700000000")
  shutil.copytree(step_dir, tmp)
  os.remove(os.path.join(tmp, "_CHECKPOINT_METADATA"))


CORRUPTIONS = {
    "truncated": (_truncate_data, "step 2.*restore failed"),
    "state_metadata_deleted": (lambda d: os.remove(os.path.join(d, "state", "_METADATA")), "step 2.*restore failed"),
    "step_metadata_deleted": (lambda d: os.remove(os.path.join(d, "_CHECKPOINT_METADATA")),
                              "step 2.*step metadata"),
    "step_metadata_garbage": (lambda d: open(os.path.join(d, "_CHECKPOINT_METADATA"), "w").write("{tru"),
                              "step 2.*step metadata"),
    "meta_json_truncated": (lambda d: open(os.path.join(d, "meta", "metadata"), "w").write('{"v": '),
                            "step 2.*restore failed"),
    "integrity_deleted": (lambda d: shutil.rmtree(os.path.join(d, "integrity")), "step 2"),
    "partial_tmp_dir": (_partial_step3, "step 3.*partial save"),
}


def _two_steps(path):
  """Saves steps 1 and 2 and closes; corruption is then read by a new Checkpointer, as a resumed run
  would (the writer's tensorstore cache could otherwise serve the bytes it wrote)."""
  s1, s2 = make_state(1), make_state(2)
  with Checkpointer(path, keep=5) as ck:
    ck.save(1, s1, {"step": 1})
    ck.save(2, s2, {"step": 2})
  return s1, s2


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_or_partial_latest_falls_back_with_warning(tmp_path, name):
  corrupt, reason = CORRUPTIONS[name]
  s1, s2 = _two_steps(tmp_path)
  corrupt(str(tmp_path / "2"))
  ck = Checkpointer(tmp_path, keep=5)
  expected_step, expected_state = (2, s2) if name == "partial_tmp_dir" else (1, s1)
  with pytest.warns(CheckpointWarning, match=reason):
    step, state, meta = ck.latest_valid(s1)
  assert (step, meta) == (expected_step, {"step": expected_step})
  assert_bitwise_equal(state, expected_state)
  # The bad step was quarantined: a second call is silent, and the resumed run can save that step again.
  assert os.listdir(tmp_path / "quarantine")
  with Checkpointer(tmp_path, keep=5) as ck2:
    assert ck2.latest_valid(s1)[0] == expected_step
    assert ck2.save(3, s2, {"step": 3})
    assert ck2.latest_valid(s1)[0] == 3
  ck.close()


def test_byte_flip_in_array_data_is_caught_by_checksum(tmp_path):
  # 16 KiB of random floats: stored in an OCDBT data file, incompressible, so the flipped byte lands in
  # the raw values and Orbax restores the wrong numbers without complaint; only the checksum sees it.
  state = {"w": jax.random.normal(jax.random.key(0), (64, 64))}
  with Checkpointer(tmp_path) as ck:
    ck.save(1, state, {})
    ck.save(2, state, {})
  _flip_one_byte(str(tmp_path / "2"))
  with Checkpointer(tmp_path) as ck:
    target, restore_args = ckpt_lib._restore_args(state)
    raw = ck._mngr.restore(2, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(target, restore_args=restore_args)))["state"]
    assert not np.array_equal(np.asarray(raw["w"]), np.asarray(state["w"]))  # Orbax alone: wrong data
    with pytest.warns(CheckpointWarning, match="step 2.*checksum mismatch"):
      step, restored, _ = ck.latest_valid(state, quarantine=False)
  assert step == 1
  assert_bitwise_equal(restored, state)


@pytest.mark.parametrize("change", ["dtype", "shape", "structure"])
def test_target_mismatch_is_reported(tmp_path, change):
  with Checkpointer(tmp_path) as ck:
    ck.save(1, {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}, {})
    target = {"dtype": {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.zeros(3)},
              "shape": {"w": jnp.ones((2, 4)), "b": jnp.zeros(3)},
              "structure": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3), "c": jnp.zeros(1)}}[change]
    with pytest.warns(CheckpointWarning, match="step 1"):
      assert ck.latest_valid(target, quarantine=False) is None
    assert ck.all_steps() == [1]  # read-only inspection leaves it in place
    with pytest.raises(ValueError, match="step 1"):
      ck.restore(1, target)


def test_no_checkpoint_and_all_corrupt_give_none(tmp_path):
  with Checkpointer(tmp_path / "empty") as ck:
    assert ck.latest_valid({"x": jnp.ones(1)}) is None
  s1, _ = _two_steps(tmp_path / "run")
  for step in ("1", "2"):
    os.remove(tmp_path / "run" / step / "state" / "_METADATA")
  ck = Checkpointer(tmp_path / "run")
  with pytest.warns(CheckpointWarning) as record:
    assert ck.latest_valid(s1) is None
  assert sorted(str(w.message).split()[2] for w in record) == ["1", "2"]
  assert ck.all_steps() == []
  ck.close()


def test_async_save_round_trip(tmp_path):
  state = make_state(3)
  with Checkpointer(tmp_path, async_save=True) as ck:
    ck.save(4, state, {"a": 1})
    ck.wait()
    step, restored, meta = ck.latest_valid(state)
  assert step == 4 and meta == {"a": 1}
  assert_bitwise_equal(restored, state)


def test_checksums_detect_single_bit_flip_and_swap():
  x = jnp.arange(8, dtype=jnp.float32)
  base = ckpt_lib.state_checksums({"x": x})
  flipped = jax.lax.bitcast_convert_type(x, jnp.uint32).at[5].set(
      jax.lax.bitcast_convert_type(x, jnp.uint32)[5] ^ 1)
  assert ckpt_lib.state_checksums({"x": jax.lax.bitcast_convert_type(flipped, jnp.float32)}) != base
  swapped = x.at[1].set(x[2]).at[2].set(x[1])
  s = ckpt_lib.state_checksums({"x": swapped})
  assert s[0][0] == base[0][0] and s[0][1] != base[0][1]  # plain sum blind to order, weighted sum not
  # golden values by hand for uint32 words [1, 2, 3]: sum 6, weighted 1*1 + 2*2 + 3*3 = 14
  assert ckpt_lib.state_checksums([np.array([1, 2, 3], np.uint32)]) == [[6, 14]]
  # bf16 and bool leaves are widened, not reinterpreted as wider words
  assert ckpt_lib.state_checksums([np.array([True, False, True])]) == [[2, 4]]
  one_bf16 = int(np.array(1.0, jnp.bfloat16).view(np.uint16))
  assert ckpt_lib.state_checksums([jnp.ones(2, jnp.bfloat16)]) == [[2 * one_bf16, 3 * one_bf16]]


def test_bad_options_raise(tmp_path):
  with pytest.raises(ValueError, match="best_mode"):
    Checkpointer(tmp_path, best_mode="up")
  with pytest.raises(ValueError, match="keep"):
    Checkpointer(tmp_path, keep=0)
