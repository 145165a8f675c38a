"""DeepSpeed engine hook registration: the DeepSpeed lifecycle, translated into session calls.

    resiliency = enable_resiliency(engine, interval=10)        # or register_resiliency_hooks(engine, ...)
    engine.load_checkpoint(...)                                  # generation zero only (see below)
    while engine.global_steps < max_steps:                       # == resiliency.step_count
        loss = engine(batch); engine.backward(loss); engine.step()

`DeepSpeedEngineHooks` wraps four things on the engine instance (the class is never touched, and
`remove()` puts the originals back):

* a forward pre-hook on the engine: the session's `before_forward` (starts a pending GEMINI copy,
  arms SCOUT's input capture);
* `engine.step`: at a gradient-accumulation boundary, `before_optimizer_step` runs before the
  real step (SCOUT replay, wait for the in-flight copy); after it, `engine.global_steps` is read.
  An applied step (`engine.was_step_applied()`) is reported as `after_optimizer_step`, so the
  capture happens after it. A step DeepSpeed skipped (fp16/bf16 gradient overflow) still counts in
  `global_steps`, so `session.step_count` follows without a capture. Micro-batch calls of
  `step()` inside an accumulation window are passed straight through;
* `engine.load_checkpoint`: after GEMINI recovered this engine, a framework load would overwrite
  the recovered model and optimizer and is refused with `RuntimeError`. In generation zero (no
  GEMINI state) a successful load before the first managed step is allowed and seeds
  `session.step_count` from `engine.global_steps`; after managed training started it is refused;
* `engine.destroy`: the session is closed first (last capture completed, threads stopped) while
  the process groups still exist.

`session.step_count` equals `engine.global_steps` at every step boundary; a disagreement (the
counter changed outside `engine.step()`) raises instead of numbering captures wrongly.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from lm_resiliency.adapter import StepCallbacks
from lm_resiliency.adapters.deepspeed import SUPPORTED_OPTIONS, DeepSpeedAdapter, with_config_section
from lm_resiliency.attach import AttachOptions, attach
from lm_resiliency.session import ResiliencySession

logger = logging.getLogger(__name__)


_WRAPPED = ("step", "load_checkpoint", "destroy")


def _wrapper(original: Any, replacement: Any) -> Any:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    return wrapped


class DeepSpeedEngineHooks:
    """The hooks one session registers on one DeepSpeed engine (see module doc)."""

    def __init__(self, adapter: DeepSpeedAdapter, callbacks: StepCallbacks) -> None:
        engine = adapter.engine
        for name in _WRAPPED:
            if name in vars(engine):
                raise RuntimeError(f"engine.{name} is already wrapped on this engine instance (is another "
                                   "lm-resiliency session attached? close() it first)")
        if callbacks.skipped_optimizer_step is None or callbacks.session is None:
            raise TypeError("DeepSpeed engine hooks need a session that handles skipped (overflow) optimizer steps "
                            "and hands over its step count (StepCallbacks.session)")
        self.adapter = adapter
        self.engine = engine
        self.callbacks = callbacks
        self._skipped_optimizer_step = callbacks.skipped_optimizer_step
        self.session = callbacks.session
        self.managed_steps = 0
        self._original_step = engine.step
        self._original_load = engine.load_checkpoint
        self._original_destroy = engine.destroy
        engine.step = _wrapper(self._original_step, self._step)
        engine.load_checkpoint = _wrapper(self._original_load, self._load_checkpoint)
        engine.destroy = _wrapper(self._original_destroy, self._destroy)
        self._forward_handle = engine.register_forward_pre_hook(
            lambda module, args: callbacks.before_forward(), prepend=True)

    # ------------------------------------------------------------------ step

    def _is_boundary(self) -> bool:
        """Whether the coming `engine.step()` is an optimizer step (evaluated before it runs)."""
        engine = self.engine
        managed = getattr(engine, "managed_gradient_accumulation", None)
        if managed is not None and not managed():
            return True  # unmanaged accumulation: every step() call is the caller-owned boundary
        return bool(engine.is_gradient_accumulation_boundary())

    def _align_counter(self) -> None:
        """Before a managed step: the session's step count must equal engine.global_steps."""
        session = self.session
        global_steps = int(self.engine.global_steps)
        if session.step_count() == global_steps:
            return
        if self.managed_steps == 0 and self.adapter.recovered_step is None and session.step_count() == 0:
            # Generation zero: the engine's counters were restored by the application's own loader.
            logger.info("lm-resiliency: step_count seeded from engine.global_steps=%d", global_steps)
            session.continue_from(global_steps)
            return
        raise RuntimeError(
            f"lm-resiliency: engine.global_steps is {global_steps} but the resiliency step count is "
            f"{session.step_count()}; the engine's step counter was changed outside engine.step() (or a load_fallback "
            "returned a step that disagrees with the engine). Restore DeepSpeed state with engine.load_checkpoint() "
            "before the first step, or let GEMINI recover it.")

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._is_boundary():
            before = self.engine.global_steps
            result = self._original_step(*args, **kwargs)
            if self.engine.global_steps != before:
                raise RuntimeError("lm-resiliency: engine.step() applied an optimizer step that was not announced "
                                   "as a gradient-accumulation boundary; refusing to continue without the "
                                   "pre-step checkpoint barrier")
            return result
        self._align_counter()
        self.callbacks.before_optimizer_step()
        before = int(self.engine.global_steps)
        result = self._original_step(*args, **kwargs)
        self.managed_steps += 1
        after = int(self.engine.global_steps)
        if after != before + 1:
            raise RuntimeError(f"lm-resiliency: engine.global_steps went from {before} to {after} in one boundary "
                               "engine.step(); expected one optimizer step")
        if self.engine.was_step_applied():
            self.callbacks.after_optimizer_step()  # step_count -> global_steps; GEMINI capture if due
        else:
            # Skipped (gradient overflow): parameters unchanged, counter advanced, nothing to capture;
            # SCOUT's out-of-band monitor still sees progress.
            self._skipped_optimizer_step()  # step_count -> global_steps (checked aligned above)
        return result

    # ------------------------------------------------------- load_checkpoint

    def _load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        session = self.session
        if self.adapter.recovered_step is not None:
            raise RuntimeError(
                f"engine.load_checkpoint() refused: lm-resiliency restored this engine from GEMINI step "
                f"{self.adapter.recovered_step} (model, optimizer, LR scheduler and engine counters); a DeepSpeed "
                "checkpoint load now would overwrite that exact state with an older one. Load the durable "
                "checkpoint only when nothing was recovered, e.g. `if resiliency.recovered_from != \"gemini\": "
                "engine.load_checkpoint(...)`, or pass it as enable_resiliency(..., load_fallback=...).")
        if self.managed_steps > 0:
            raise RuntimeError(
                f"engine.load_checkpoint() refused: resiliency-managed training already ran {self.managed_steps} "
                f"optimizer step(s) (step {session.step_count()}); loading a DeepSpeed checkpoint now would replace "
                "state GEMINI has been capturing. Load it before the first engine.step(), or close() the session "
                "first.")
        result = self._original_load(*args, **kwargs)
        load_path = result[0] if isinstance(result, tuple) and result else result
        if load_path is not None:
            session.continue_from(int(self.engine.global_steps))
            logger.info("lm-resiliency: DeepSpeed checkpoint %s loaded before the first managed step; step_count "
                        "seeded from engine.global_steps=%d", load_path, session.step_count())
        return result

    # ---------------------------------------------------------------- destroy

    def _destroy(self, *args: Any, **kwargs: Any) -> Any:
        """engine.destroy() is the engine's teardown: the session completes its last capture and stops
        its threads first, while the process groups still exist."""
        original = self._original_destroy
        try:
            self.session.close()  # removes these hooks too; raises if the final flush failed
        finally:
            result = original(*args, **kwargs)
        return result

    # ----------------------------------------------------------------- remove

    def remove(self) -> None:
        engine = self.engine
        if engine is None:
            return
        self.engine = None
        self._forward_handle.remove()
        for name in _WRAPPED:
            if name in vars(engine):
                delattr(engine, name)


def build_adapter(engine: Any, optimizer: Any = None, options: Optional[dict] = None,
                  timeout_s: float = 300.0) -> DeepSpeedAdapter:
    """The DeepSpeed adapter with these hooks (collective for an MoE engine: it gathers the
    expert-data-parallel groups, waiting at most `timeout_s`)."""
    if optimizer is not None:
        raise TypeError("enable_resiliency: DeepSpeed owns its optimizer; pass only the engine "
                        "(enable_resiliency(engine, interval=...))")
    unsupported = sorted(set(options or {}) - SUPPORTED_OPTIONS)
    if unsupported:
        raise TypeError(f"enable_resiliency: the deepspeed adapter does not accept {unsupported}; it takes the "
                        "engine and the common arguments only (interval, checkpoint, replay, extra_state_fn, "
                        "load_extra_state_fn, load_fallback, ...)")
    return DeepSpeedAdapter(engine, hooks=DeepSpeedEngineHooks, timeout_s=timeout_s)


def attach_engine(engine: Any, options: AttachOptions, optimizer: Any = None,
                  framework_options: Optional[dict] = None) -> ResiliencySession:
    """Attach to a DeepSpeed engine; `enable_resiliency` dispatches DeepSpeed engines here. The
    engine config's optional "lm_resiliency" section fills the arguments left unset."""
    options = with_config_section(engine, options)
    adapter = build_adapter(engine, optimizer, framework_options, options.config.timeout_s)
    return attach(adapter, options)


def register_resiliency_hooks(engine: Any, **kwargs: Any) -> ResiliencySession:
    """Attach lm-resiliency to a DeepSpeed engine; same as `enable_resiliency(engine, **kwargs)`.

    Call on every rank after `deepspeed.initialize()`, before the training loop. Returns the
    session; `session.step_count` (== `engine.global_steps`) is the resume point."""
    options, rest = AttachOptions.split(kwargs)
    optimizer = rest.pop("optimizer", None)
    return attach_engine(engine, options, optimizer, rest)


__all__ = ["DeepSpeedEngineHooks", "attach_engine", "build_adapter", "register_resiliency_hooks"]
