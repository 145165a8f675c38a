"""Explicit Megatron Core entry point: `enable_resiliency(model_chunks, optimizer, ...)`.

Same as `lm_resiliency.enable_resiliency(model_chunks, optimizer, framework="megatron", ...)`,
with the objects `setup_model_and_optimizer()` returns:

    resiliency = enable_resiliency(model, optimizer, opt_param_scheduler=scheduler, interval=10)
    args.iteration = resiliency.step_count

The optimizer hook lives in `lm_resiliency.callbacks.megatron` and the state mapping in
`lm_resiliency.adapters.megatron`. Megatron Core is imported only when this is called.
"""

from __future__ import annotations

from typing import Any

from lm_resiliency.api import enable_resiliency as _enable_resiliency
from lm_resiliency.session import ResiliencySession


def enable_resiliency(model_chunks: Any, optimizer: Any, **kwargs: Any) -> ResiliencySession:
    """Attach lm-resiliency to Megatron's model chunks (a list, one per virtual pipeline stage), its
    `MegatronOptimizer` and, as `opt_param_scheduler=`, its `OptimizerParamScheduler`; plus the
    common arguments (`interval`, `checkpoint`, `extra_state_fn`, ...) and `iteration=args.iteration`
    when Megatron loaded its own checkpoint."""
    return _enable_resiliency(model_chunks, optimizer, framework="megatron", **kwargs)


__all__ = ["enable_resiliency"]
