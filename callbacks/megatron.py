"""Megatron Core hook registration: Megatron's own optimizer step, translated into session calls.

    model, optimizer, scheduler = setup_model_and_optimizer(...)
    resiliency = enable_resiliency(model, optimizer, opt_param_scheduler=scheduler, interval=10)
    args.iteration = resiliency.step_count
    train(...)

Megatron's training step ends in `optimizer.step()`, which returns `(update_successful, grad_norm,
num_zeros_in_grad)` and is called once per iteration on every rank (a `ChainedOptimizer` steps its
members inside it). That call is wrapped on the optimizer instance (the class is never touched,
and `remove()` puts the original back):

* before it: the session's `before_optimizer_step` (SCOUT replay, wait for the in-flight copy);
* after an applied update: `after_optimizer_step` (GEMINI capture if due; the scheduler, which the
  loop steps right after, is read before the next forward);
* after a skipped update (fp16 loss-scale overflow, `update_successful` False): no capture, the
  parameters did not change, but the iteration counts, as it does in Megatron's `args.iteration`,
  so `session.step_count` stays equal to it.

A forward pre-hook on the first model chunk is the session's `before_forward`.

Megatron's own checkpoint is loaded inside `setup_model_and_optimizer()`, before this attaches.
Pass its iteration as `iteration=args.iteration`: when GEMINI holds nothing, `step_count` continues
from it; when GEMINI holds a step older than it, the attach fails instead of resuming from the
older state.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from lm_resiliency._values import is_int
from lm_resiliency.adapter import StepCallbacks
from lm_resiliency.adapters.megatron import SUPPORTED_OPTIONS, MegatronAdapter
from lm_resiliency.attach import AttachOptions, attach
from lm_resiliency.session import ResiliencySession

logger = logging.getLogger(__name__)


class MegatronStepHooks:
    """The hooks one session registers on Megatron's optimizer and first model chunk."""

    def __init__(self, adapter: MegatronAdapter, callbacks: StepCallbacks) -> None:
        optimizer = adapter.optimizer
        if "step" in vars(optimizer):
            raise RuntimeError("optimizer.step is already wrapped on this Megatron optimizer (is another "
                               "lm-resiliency session attached? close() it first)")
        skipped_optimizer_step = callbacks.skipped_optimizer_step
        if skipped_optimizer_step is None:
            raise TypeError("Megatron hooks need a session that handles skipped (overflow) optimizer steps")
        self.optimizer = optimizer
        self.callbacks = callbacks
        original = optimizer.step

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            callbacks.before_optimizer_step()
            result = original(*args, **kwargs)
            applied = result[0] if isinstance(result, tuple) else result
            if applied:
                callbacks.after_optimizer_step()
            else:
                skipped_optimizer_step()
            return result

        optimizer.step = step
        self._forward_handle = adapter.model_chunks[0].register_forward_pre_hook(
            lambda module, args: callbacks.before_forward(), prepend=True)

    def remove(self) -> None:
        optimizer, self.optimizer = self.optimizer, None
        if optimizer is None:
            return
        self._forward_handle.remove()
        if "step" in vars(optimizer):
            del optimizer.step


def build_adapter(model_chunks: Any, optimizer: Any, options: Optional[dict] = None,
                  timeout_s: float = 300.0) -> MegatronAdapter:
    """The Megatron adapter with these hooks (collective: it gathers the data-parallel groups,
    waiting at most `timeout_s`)."""
    options = dict(options or {})
    unsupported = sorted(set(options) - SUPPORTED_OPTIONS)
    if unsupported:
        raise TypeError(f"enable_resiliency: the megatron adapter does not accept {unsupported}; supported "
                        f"options: {sorted(SUPPORTED_OPTIONS)}")
    if optimizer is None:
        raise TypeError("enable_resiliency: the megatron adapter needs the MegatronOptimizer as the second argument "
                        "(enable_resiliency(model_chunks, optimizer, opt_param_scheduler=scheduler))")
    options.pop("iteration", None)
    return MegatronAdapter(model_chunks, optimizer, hooks=MegatronStepHooks, timeout_s=timeout_s, **options)


def attach_model(model_chunks: Any, options: AttachOptions, optimizer: Any = None,
                 framework_options: Optional[dict] = None) -> ResiliencySession:
    """Attach to Megatron's model chunks, optimizer and scheduler; `enable_resiliency` dispatches
    a list of model chunks here. `iteration=` is the iteration Megatron's own checkpoint loaded."""
    iteration = (framework_options or {}).get("iteration", 0)
    if not is_int(iteration) or iteration < 0:
        raise TypeError(f"enable_resiliency(iteration=...): expected args.iteration (an int >= 0), got {iteration!r}")
    adapter = build_adapter(model_chunks, optimizer, framework_options, options.config.timeout_s)

    def recover(session: ResiliencySession) -> None:
        step = session.recover()
        if session.recovered_from == "gemini" and step is not None and step < iteration:
            session.keep_state_for_relaunch()
            raise RuntimeError(
                f"lm-resiliency: GEMINI's newest state is step {step}, older than the Megatron checkpoint "
                f"setup_model_and_optimizer() loaded (iteration {iteration}); resuming would go back in time. Stop "
                "this launch (the model and optimizer now hold GEMINI's older step). To resume from the Megatron "
                "checkpoint, relaunch with a new GEMINI run id (or enable_checkpoint=False); to resume from "
                "GEMINI, relaunch without loading the newer Megatron checkpoint.")
        if session.recovered_from is None and iteration:
            session.continue_from(iteration)
            logger.info("lm-resiliency: no GEMINI state; step_count continues from Megatron's iteration %d",
                        iteration)

    return attach(adapter, options, recover=recover)


__all__ = ["MegatronStepHooks", "attach_model", "build_adapter"]
