"""Explicit Accelerate entry point: `enable_resiliency(accelerator, interval=...)` after `prepare()`.

Same as `ResiliencyPlugin(**kwargs).attach(accelerator)`; the plugin lives in
`lm_resiliency.callbacks.accelerate` and the state mapping in `lm_resiliency.adapters.accelerate`.
Under Accelerate's DeepSpeed integration it hooks the DeepSpeed engine. Accelerate is imported only
when this is called.
"""

from __future__ import annotations

from typing import Any

from lm_resiliency.session import ResiliencySession


def enable_resiliency(accelerator: Any, **kwargs: Any) -> ResiliencySession:
    """Attach lm-resiliency to an `accelerate.Accelerator` whose model and optimizer are prepared;
    collective, recovers before returning (`step_count` is the resume point). Takes the common
    arguments (`interval`, `checkpoint`, ...) and `resume_dataloaders`. For `resume_epoch` or
    `skip_first_batches`, keep the `ResiliencyPlugin` itself instead."""
    from lm_resiliency.callbacks.accelerate import ResiliencyPlugin

    return ResiliencyPlugin(**kwargs).attach(accelerator)


__all__ = ["enable_resiliency"]
