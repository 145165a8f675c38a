"""TorchTitan hook registration: the `Trainer` lifecycle, translated into session calls.

    resiliency = enable_resiliency(trainer, interval=10)   # after config.build(), before train()
    trainer.train()

TorchTitan's trainer calls its checkpoint manager at exactly the points GEMINI needs, whether or
not durable checkpointing is enabled, so the hooks sit on `trainer.checkpointer` (instance
attributes; the class is never touched and `remove()` puts the originals back):

* `maybe_wait_for_staging()` runs right before `optimizers.step()`: the session's
  `before_optimizer_step` (SCOUT replay, wait for the in-flight copy);
* `save(step)` runs after `optimizers.step()` and `lr_schedulers.step()` and before the next batch
  is fetched: the step boundary. The data position and counters are read there, then
  `after_optimizer_step` (capture if due). The `OptimizersContainer` step hooks are not used: its
  `state_dict()` runs a zero-lr step that fires them outside any training step;
* `load(step)` at the start of `train()`: coordinated with GEMINI (below);
* `close()` (from `trainer.close()`): the session completes its last capture first.

A forward pre-hook on the first model part is the session's `before_forward`.

Durable loads: when GEMINI recovered step N before `train()`, TorchTitan's `load()` of the latest
checkpoint is skipped if that checkpoint is not newer than N (GEMINI's state is the newest), and
refused with `RuntimeError` if it is newer, or if a specific `checkpoint.load_step` was asked for:
a durable load never silently overwrites GEMINI-recovered state. When GEMINI had nothing, TorchTitan
loads its own checkpoint as usual and `session.step_count` follows `trainer.step`.

For an opt-in from the job config without editing the trainer, see `ResilientCheckpointManager`
in `lm_resiliency.integrations.torchtitan`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

from lm_resiliency.adapter import StepCallbacks
from lm_resiliency.attach import AttachOptions, attach
from lm_resiliency.session import ResiliencySession
from lm_resiliency.adapters.torchtitan import SUPPORTED_OPTIONS, TorchTitanAdapter

logger = logging.getLogger(__name__)

_WRAPPED = ("maybe_wait_for_staging", "save", "load", "close")


def _wrapper(original: Any, replacement: Any) -> Any:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    return wrapped


def latest_durable_step(checkpointer: Any) -> Optional[int]:
    """The newest step in TorchTitan's checkpoint folder, or None (disabled, or no checkpoint)."""
    if not getattr(checkpointer, "enable", False):
        return None
    find = getattr(checkpointer, "_find_load_step", None)
    if find is None:
        return None
    step = int(find())
    return step if step >= 0 else None


class TorchTitanTrainerHooks:
    """The hooks one session registers on one TorchTitan trainer (see module doc)."""

    def __init__(self, adapter: TorchTitanAdapter, callbacks: StepCallbacks) -> None:
        checkpointer = adapter.trainer.checkpointer
        for name in _WRAPPED:
            if name in vars(checkpointer):
                raise RuntimeError(f"trainer.checkpointer.{name} is already wrapped (is another lm-resiliency "
                                   "session attached to this trainer? close() it first)")
        self.adapter = adapter
        self.trainer = adapter.trainer
        self.checkpointer = checkpointer
        if callbacks.session is None:
            raise TypeError("TorchTitan trainer hooks need the session's step count (StepCallbacks.session)")
        self.callbacks = callbacks
        self.session = callbacks.session
        self.managed_steps = 0
        self._originals = {name: getattr(checkpointer, name) for name in _WRAPPED}
        for name in _WRAPPED:
            setattr(checkpointer, name, _wrapper(self._originals[name], getattr(self, f"_{name}")))
        self._forward_handle = adapter.model_parts[0].register_forward_pre_hook(
            lambda module, args: callbacks.before_forward(), prepend=True)

    # ------------------------------------------------------------------ step

    def _maybe_wait_for_staging(self, *args: Any, **kwargs: Any) -> Any:
        session = self.session
        # train() increments trainer.step before train_step(): the coming step is trainer.step.
        if session.step_count() != int(self.trainer.step) - 1:
            raise RuntimeError(
                f"lm-resiliency: trainer.step is {self.trainer.step} but the resiliency step count is "
                f"{session.step_count()}; the trainer's step counter was changed outside train(). Restore state "
                "with trainer.checkpointer.load() (train() does) or let GEMINI recover it.")
        self.callbacks.before_optimizer_step()
        return self._originals["maybe_wait_for_staging"](*args, **kwargs)

    def _save(self, curr_step: int, *args: Any, **kwargs: Any) -> Any:
        session = self.session
        if int(curr_step) == session.step_count() + 1 == int(self.trainer.step):
            self.adapter.snapshot_boundary()
            self.managed_steps += 1
            self.callbacks.after_optimizer_step()  # step_count -> trainer.step; GEMINI capture if due
        elif int(curr_step) != session.step_count():
            raise RuntimeError(f"lm-resiliency: checkpointer.save({curr_step}) after step {session.step_count()}; "
                               "expected one save per optimizer step, called by Trainer.train()")
        return self._originals["save"](curr_step, *args, **kwargs)

    # ------------------------------------------------------------------ load

    def _load(self, step: int = -1, *args: Any, **kwargs: Any) -> Any:
        session = self.session
        recovered = self.adapter.recovered_step
        if self.managed_steps > 0:
            raise RuntimeError(
                f"trainer.checkpointer.load() refused: resiliency-managed training already ran {self.managed_steps} "
                f"step(s) (step {session.step_count()}); a durable load now would replace the state GEMINI has been "
                "capturing. Load before training starts, or close() the session first.")
        if recovered is None:
            loaded = self._originals["load"](step, *args, **kwargs)
            if loaded:
                session.continue_from(int(self.trainer.step))
                logger.info("lm-resiliency: no GEMINI state; TorchTitan loaded its own checkpoint, step_count "
                            "seeded from trainer.step=%d", session.step_count())
            return loaded
        durable = latest_durable_step(self.checkpointer)
        if int(step) != -1 or (durable is not None and durable > recovered):
            asked = f"checkpoint.load_step={step}" if int(step) != -1 else f"its newest checkpoint (step {durable})"
            # This launch ends abnormally: keep the host slots (they may be the only copy of step N).
            session.keep_state_for_relaunch()
            raise RuntimeError(
                f"trainer.checkpointer.load() refused: lm-resiliency restored this trainer from GEMINI step "
                f"{recovered} (model, optimizers, LR schedulers, dataloader and train state), and TorchTitan was "
                f"about to load {asked}, which would overwrite it. To resume from the durable checkpoint instead, "
                "start without GEMINI state (enable_checkpoint=False, or a new run id); to keep GEMINI's state, "
                "leave checkpoint.load_step at -1 and do not keep durable checkpoints newer than GEMINI's interval.")
        logger.info("lm-resiliency: TorchTitan checkpoint load skipped: GEMINI step %d is the newest state "
                    "(durable: %s)", recovered, durable if durable is not None else "none")
        return False

    # ----------------------------------------------------------------- close

    def _close(self, *args: Any, **kwargs: Any) -> Any:
        """trainer.close(): the session completes its last capture and stops its threads first."""
        original = self._originals["close"]
        try:
            self.session.close()  # removes these hooks too
        finally:
            result = original(*args, **kwargs)
        return result

    # ----------------------------------------------------------------- remove

    def remove(self) -> None:
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        self.checkpointer = None
        self._forward_handle.remove()
        for name in _WRAPPED:
            if name in vars(checkpointer):
                delattr(checkpointer, name)


def build_adapter(trainer: Any, optimizer: Any = None, options: Optional[dict] = None) -> TorchTitanAdapter:
    """The TorchTitan adapter with these hooks; `enable_resiliency` dispatches TorchTitan trainers here."""
    if optimizer is not None:
        raise TypeError("enable_resiliency: a TorchTitan Trainer owns its optimizers; pass only the trainer "
                        "(enable_resiliency(trainer, interval=...))")
    unsupported = sorted(set(options or {}) - SUPPORTED_OPTIONS)
    if unsupported:
        raise TypeError(f"enable_resiliency: the torchtitan adapter does not accept {unsupported}; it takes the "
                        "trainer and the common arguments only (interval, checkpoint, replay, ...)")
    return TorchTitanAdapter(trainer, hooks=TorchTitanTrainerHooks)


def attach_trainer(trainer: Any, options: AttachOptions, optimizer: Any = None,
                   framework_options: Optional[dict] = None) -> ResiliencySession:
    """Attach to an initialized TorchTitan Trainer; `enable_resiliency` dispatches trainers here.
    The hooks read the session's step count (it follows `trainer.step`) through StepCallbacks.session."""
    return attach(build_adapter(trainer, optimizer, framework_options), options)


__all__ = ["TorchTitanTrainerHooks", "attach_trainer", "build_adapter", "latest_durable_step"]
