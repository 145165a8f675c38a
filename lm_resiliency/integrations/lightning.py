"""Explicit Lightning entry point: `enable_resiliency(trainer, interval=...)` before `trainer.fit()`.

Same as passing `ResiliencyCallback(**kwargs)` in `Trainer(callbacks=[...])`; the callback lives
in `lm_resiliency.callbacks.lightning` and the state mapping in `lm_resiliency.adapters.lightning`.
Lightning is imported only when this is called.
"""

from __future__ import annotations

from typing import Any


def enable_resiliency(trainer: Any, **kwargs: Any) -> Any:
    """Add a `ResiliencyCallback(**kwargs)` to `trainer` and return it. The session is built, and the
    newest state recovered, when `trainer.fit(...)` starts (`callback.session`, `callback.recovered_step`)."""
    from lm_resiliency.callbacks.lightning import ResiliencyCallback

    callbacks = getattr(trainer, "callbacks", None)
    if not isinstance(callbacks, list) or not callable(getattr(trainer, "fit", None)):
        raise TypeError(f"enable_resiliency: expected a Lightning Trainer, got {type(trainer).__module__}."
                        f"{type(trainer).__qualname__}")
    if any(isinstance(cb, ResiliencyCallback) and not cb.from_entry_point for cb in callbacks):
        raise ValueError("enable_resiliency: this Trainer already has a ResiliencyCallback")
    callback = ResiliencyCallback(**kwargs)
    # Where Trainer(callbacks=[...]) would put it: Lightning's own ordering (checkpoint callbacks last),
    # from the trainer's package (lightning.pytorch or pytorch_lightning).
    trainer.callbacks = trainer._callback_connector._reorder_callbacks(callbacks + [callback])
    return callback


__all__ = ["enable_resiliency"]
