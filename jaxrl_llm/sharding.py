"""Meshes, logical-axis rules (learner / sampler / teacher), sharded init, jit shardings, reshard.

One code path from one CPU device to a pod slice. The mesh has four named axes, sized by the config
(`mesh.data`, `mesh.fsdp`, `mesh.tensor`, `mesh.expert`; their product is the device count):

  data    pure data parallelism: batch split, parameters replicated
  fsdp    batch split *and* parameters sharded along their "embed" dimension (ZeRO-3 style)
  tensor  Megatron-style tensor parallelism: heads / MLP width / vocabulary split
  expert  MoE expert parallelism: experts split (and the batch, outside the experts)

Every parameter declares logical axis names (`jaxrl_llm.models.param_axes`); a `Rules` maps each
name to mesh axes. `LEARNER` shards for training (FSDP + tensor + expert), `SAMPLER` for decoding
(tensor + expert, replicated over data/fsdp so decode needs no all-gathers of weights), `TEACHER`
is the sampler layout. A mesh axis that does not divide a dimension is dropped for that dimension
(it stays replicated there), so one rule set serves every model size.

GSPMD propagates activation shardings from the parameter and batch shardings; the jitted steps
pin their inputs and outputs explicitly (`train_step_shardings`). Publishing parameters to the
sampler is `reshard(learner_params, sampler_shardings)`: always a copy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models import ModelConfig, init_params_per_leaf, lora, param_axes, param_shapes

Array = jax.Array
MESH_AXES = ("data", "fsdp", "tensor", "expert")
MeshAxes = str | tuple[str, ...] | None


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, expert: int = 1, devices=None) -> Mesh:
  """A ("data", "fsdp", "tensor", "expert") mesh over `devices` (default: all, every process).

  Raises ValueError naming the fields when the axis product differs from the device count.
  """
  devices = jax.devices() if devices is None else list(devices)
  shape = (data, fsdp, tensor, expert)
  if any(not isinstance(n, int) or n < 1 for n in shape):
    raise ValueError(f"config.mesh sizes must be ints >= 1, got data={data} fsdp={fsdp} tensor={tensor} expert={expert}")
  if math.prod(shape) != len(devices):
    raise ValueError(f"config.mesh: data*fsdp*tensor*expert = {data}*{fsdp}*{tensor}*{expert} = {math.prod(shape)} "
                     f"must equal the device count {len(devices)}")
  # Auto axes: GSPMD propagates activation shardings (no sharding-in-types annotations in the model).
  return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=devices)


def mesh_from_config(mesh_cfg, devices=None) -> Mesh:
  """`make_mesh` from a config section with fields data, fsdp, tensor, expert."""
  return make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor, mesh_cfg.expert, devices=devices)


@dataclasses.dataclass(frozen=True)
class Rules:
  """Logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated)."""
  batch: MeshAxes = None
  vocab: MeshAxes = None
  embed: MeshAxes = None
  heads: MeshAxes = None
  kv_heads: MeshAxes = None
  head_dim: MeshAxes = None
  mlp: MeshAxes = None
  experts: MeshAxes = None
  layers: MeshAxes = None


LEARNER = Rules(batch=("data", "fsdp", "expert"), vocab="tensor", embed="fsdp", heads="tensor", kv_heads="tensor",
                mlp="tensor", experts="expert")
SAMPLER = Rules(batch=("data", "fsdp", "expert"), vocab="tensor", heads="tensor", kv_heads="tensor", mlp="tensor",
                experts="expert")
TEACHER = SAMPLER
REPLICATED = Rules()


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(logical: tuple, shape: tuple, mesh, rules: Rules) -> PartitionSpec:
  """PartitionSpec of an array with these logical axes, dropping mesh axes that do not divide.

  For a multi-axis rule (e.g. batch over data, fsdp, expert) the longest prefix of mesh axes whose
  product divides the dimension is kept. A mesh axis is used at most once per array.
  """
  used: set[str] = set()
  spec = []
  for name, size in zip(logical, shape):
    kept: list[str] = []
    for ax in _as_tuple(getattr(rules, name) if name is not None else None):
      n = mesh.shape[ax]
      if ax in used or size % (math.prod(mesh.shape[a] for a in kept) * n):
        break
      kept.append(ax)
    kept = [ax for ax in kept if mesh.shape[ax] > 1]
    used.update(kept)
    spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*spec)


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> dict:
  """Pytree of NamedShardings shaped like the params of `cfg` under `rules`."""
  is_axes = lambda x: isinstance(x, tuple)
  shapes = jax.tree.map(lambda s: s.shape, param_shapes(cfg))
  return jax.tree.map(lambda ax, shp: NamedSharding(mesh, logical_to_spec(ax, shp, mesh, rules)),
                      param_axes(cfg), shapes, is_leaf=is_axes)


def replicated(mesh: Mesh) -> NamedSharding:
  """Fully replicated sharding on `mesh` (scalars, keys, metrics)."""
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rules: Rules, batch_size: int) -> NamedSharding:
  """Sharding of arrays whose leading axis is the batch (every Batch / generate input field)."""
  return NamedSharding(mesh, logical_to_spec(("batch",), (batch_size,), mesh, rules))


def init_params_sharded(cfg: ModelConfig, key: Array, shardings: dict) -> dict:
  """Random parameters generated directly into `shardings` (`models.init_params_per_leaf`).

  The init program is jitted with `out_shardings` and draws every leaf separately, so XLA
  partitions it and each device only allocates its shards (checked in tests through the compiled
  memory analysis). The values do not depend on the mesh (1 device or a pod: same parameters), but
  differ from `models.init_params`, whose single sliced draw cannot be partitioned.
  """
  return jax.jit(lambda k: init_params_per_leaf(cfg, k), out_shardings=shardings)(key)


def with_adapters(params_sh: dict, adapters, mesh: Mesh) -> dict:
  """`params_sh` of a base plus replicated shardings for a LoRA policy's `adapters` (`lora.Adapters`, abstract or
  concrete): rank-r factors are small next to the weights they adapt, so every device holds them whole and the
  merge `W + scale·(BA)ᵀ` takes W's layout (the learner's FSDP / tensor shards, the sampler's own)."""
  return lora.attach(params_sh, jax.tree.map(lambda _: replicated(mesh), adapters))


def state_shardings(state_shapes, params_sh, tx, mesh: Mesh):
  """Shardings of a `learner.TrainState` (abstract or concrete): params and their optimiser moments
  follow `params_sh`; step counters, loss state and hook params are replicated.

  Optimiser leaves that mirror a parameter are found with `optax.tree_map_params`, so any optax
  chain (clipping, AdamW, multi_transform) works. LoRA: the optimiser holds the adapters' moments only
  (`lora.trainable`), laid out as the adapters.
  """
  import optax  # local: sharding helpers are importable without pulling in optax at import time

  rep = replicated(mesh)
  own_sh = lora.trainable(params_sh)
  trainable_sh = own_sh if state_shapes.hook_params is None else (
      own_sh, jax.tree.map(lambda _: rep, state_shapes.hook_params))
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, state_shapes.opt_state, trainable_sh,
                                 transform_non_params=lambda _: rep,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))
  everything_else = jax.tree.map(lambda _: rep, state_shapes)
  return everything_else.replace(params=params_sh, opt_state=opt_sh,
                                 hook_params=None if state_shapes.hook_params is None else trainable_sh[1])


def init_state_sharded(params, tx, state_sh, loss_state=None, hook_params=None):
  """`learner.init_state` computed directly into `state_sh` (optimiser moments born sharded)."""
  from jaxrl_llm import learner
  return jax.jit(lambda p, ls, hk: learner.init_state(p, tx, ls, hk), out_shardings=state_sh)(
      params, loss_state, hook_params)


def train_step_shardings(state_sh, mesh: Mesh, rules: Rules, batch_size: int) -> tuple[tuple, tuple]:
  """(in_shardings, out_shardings) of `train_step(state, batch, key) -> (state, metrics)`.

  The batch sharding is one NamedSharding used as a pytree prefix for every Batch field (all lead
  with B), keys and metrics are replicated. Pass both to `learner.make_train_step`.
  """
  rep = replicated(mesh)
  return (state_sh, batch_sharding(mesh, rules, batch_size), rep), (state_sh, rep)


def reshard(tree, shardings, dtype=None):
  """A copy of `tree` laid out as `shardings` (one sharding or a matching pytree), optionally cast.

  Always a new buffer (never an alias of the input, which the learner step will donate), also when
  the layout does not change; works across meshes (learner and sampler on different devices).
  Floating leaves are cast to `dtype` when given, integer leaves are left alone.
  """
  def cast(x):
    if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)  # a new buffer already
    return x

  tree = jax.tree.map(cast, tree)
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)
  return jax.tree.map(_put_copy, tree, shardings)


def _put_copy(x, s):
  """`jax.device_put(x, s)` as a new buffer, also across device sets that span several processes.

  Multi-controller JAX reshards across hosts only within one device set, so there `x` is first
  replicated over its own devices (an all-gather every process runs; a transient full copy per
  device, one leaf at a time) and each process then copies the pieces its devices of `s` hold from
  its local replica.

  A host value or a process-local array going onto devices of several processes (the initial
  parameters: init, SFT warm start, an imported checkpoint) is cut into this process's shards
  (`put_global`), not `device_put`: for such an input `device_put` first checks that every process
  holds the same value by all-gathering it, a collective per leaf that moves the whole model between
  hosts. Every process computes these values
  deterministically from the same config (the multi-process tests check the runs equal one process).
  """
  if not s.is_fully_addressable and (not isinstance(x, jax.Array) or x.is_fully_addressable):
    return put_global(np.array(x, copy=True), s)  # a private host copy: the shards never alias `x`
  if (not isinstance(x, jax.Array) or x.is_fully_addressable or s.is_fully_addressable
      or x.sharding.device_set == s.device_set):
    return jax.device_put(x, s, may_alias=False)
  full = jax.device_put(x, replicated(x.sharding.mesh), may_alias=False).addressable_data(0)
  pieces = [jax.device_put(full[index], d, may_alias=False) for d, index in s.addressable_devices_indices_map(x.shape).items()]
  return jax.make_array_from_single_device_arrays(x.shape, s, pieces)


def put_global(tree, shardings) -> Any:
  """Host numpy arrays (the same full values on every process) -> global jax Arrays in `shardings`.

  Each process materialises only its addressable shards, so this is how a multi-host loop feeds a
  batch that every process computed deterministically. `shardings` is one sharding or a pytree.
  """
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)

  def put(x, s):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

  return jax.tree.map(put, tree, shardings)
