"""The correction library: every policy-loss correction as a registered, pure, jittable function.

    from jaxrl_llm import losses
    spec = losses.get("ppo_clip")           # LossSpec(name, fn, Hparams, needs, init_state)
    loss_BN, aux = spec.fn(inputs, spec.Hparams())
    loss = losses.reduce(loss_BN, inputs.mask_BN, "token-mean")

One file per method; each file registers itself on import. `names()` lists them all.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from jaxrl_llm.losses.core import kl_to_ref_term, entropy_term  # noqa: F401
from jaxrl_llm.losses.reduce import MODES, combine_metrics, reduce, reduce_parts  # noqa: F401
from jaxrl_llm.losses.registry import (  # noqa: F401
    LossSpec, check_needs, check_shapes, get, make_hparams, micro_batching_error, missing_needs, names, register,
    run_hparams, unregister)

_INFRA = {"core", "dense", "reduce", "registry"}
# Every other module in this package is a loss file; importing it registers the loss.
for _m in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
  if _m not in _INFRA and not _m.startswith("_"):
    _importlib.import_module(f"{__name__}.{_m}")
