"""Explicit DeepSpeed entry point: `enable_resiliency(engine, interval=...)` for a DeepSpeed engine.

Same as `lm_resiliency.enable_resiliency(engine, framework="deepspeed", ...)`; the engine hooks
live in `lm_resiliency.callbacks.deepspeed` and the state mapping in
`lm_resiliency.adapters.deepspeed`. DeepSpeed is imported only when this is called.
"""

from __future__ import annotations

from typing import Any

from lm_resiliency.api import enable_resiliency as _enable_resiliency
from lm_resiliency.session import ResiliencySession


def enable_resiliency(engine: Any, **kwargs: Any) -> ResiliencySession:
    """Attach lm-resiliency to the engine returned by `deepspeed.initialize()`; DeepSpeed owns the
    optimizer, so pass only the engine and the common arguments (`interval`, `checkpoint`, ...)."""
    return _enable_resiliency(engine, framework="deepspeed", **kwargs)


__all__ = ["enable_resiliency"]
