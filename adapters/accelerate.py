"""Hugging Face Accelerate adapter: where a prepared `Accelerator` keeps training state.

After `accelerator.prepare(...)` the accelerator holds the prepared objects:

- `_models`: the user's module (Accelerate appends it before wrapping; the DDP wrapper under
  MULTI_CPU/MULTI_GPU is only returned to the caller; under FSDP2 it is the `fully_shard` module).
  Model and optimizer capture/restore is the reference `PyTorchAdapter`'s, run on this module
  (its forward pre-hook fires inside DDP's forward) and on the *inner* torch optimizer.
- `_optimizers`: `AcceleratedOptimizer` wrappers. Their `step()` calls the inner optimizer only
  when gradients sync (`accelerator.sync_gradients`), and a GradScaler may skip it on overflow,
  so the session's step hooks go on the inner optimizer: one session step per applied
  optimizer step, never per micro-batch.
- `_schedulers`: `AcceleratedScheduler` wrappers (each steps `num_processes` times per optimizer
  step, and bumps `_step_count` on accumulation micro-steps); their state is read after the
  loop's `scheduler.step()`, like the reference adapter's scheduler.
- `_dataloaders`: `DataLoaderShard`/`DataLoaderDispatcher`. Each is tracked in place (its class
  is swapped for a subclass whose `__iter__` counts the batches the loop consumed), so the data
  position at every optimizer step is known: epoch (`iteration`), batches consumed in it, and
  the synchronized sampler generator's state at the start of that epoch. On recovery the
  position is applied to the live loaders (see `RESUME_MODES`).
- also captured: `accelerator.step` (the accumulation micro-step counter), the GradScaler,
  `project_configuration.iteration` (the `save_state` counter) and the objects registered with
  `accelerator.register_for_checkpointing`, i.e. what `accelerator.save_state` would save.

All of the above except model and optimizer is `AccelerateLoopState`. Under Accelerate's DeepSpeed
integration `_models[0]` is the DeepSpeed engine and the prepared optimizer's `step()` is a no-op:
`AccelerateDeepSpeedAdapter` takes model, optimizer, engine counters and the engine's LR scheduler
from the DeepSpeed adapter (its hooks wrap `engine.step()`), and the loop state from here.

Everything framework-specific is imported lazily; importing this module needs torch only.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional

import torch

from lm_resiliency.adapter import FrameworkAdapter, StepCallbacks, Topology
from lm_resiliency.adapters import _accelerate_compat as compat
from lm_resiliency._torch_compat import find_wrapper, pin_bucket_layout
from lm_resiliency.adapters.deepspeed import DeepSpeedAdapter
from lm_resiliency.adapters.pytorch import PyTorchAdapter
from lm_resiliency.config import DATALOADER_RESUME_MODES
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.session import capture_rng, restore_rng

logger = logging.getLogger(__name__)

# What the prepared dataloaders do after a recovery (see docs/frameworks.md, "Accelerate"):
#   "auto":     for loops that start over at epoch 0 (`for epoch in range(num_epochs)`): epochs that
#               completed before the failure yield no batches, the interrupted epoch continues after
#               its last consumed batch, later epochs are normal. An unchanged script resumes exactly.
#   "continue": for loops that start at `resume_epoch` themselves, or draw batches by step: the next
#               iteration of each loader continues the interrupted epoch after its last consumed batch.
#   "manual":   the loaders are left alone; the loop uses `resume_epoch`, `resume_batches` and
#               `ResiliencyPlugin.skip_first_batches(dataloader)`.
RESUME_MODES = DATALOADER_RESUME_MODES

_TRACKED_CLASSES: Dict[type, type] = {}


class AcceleratePreparationError(ResiliencyError, RuntimeError):
    """The Accelerator is not in a state lm-resiliency can attach to (nothing prepared, ...)."""


# ----------------------------------------------------------------------------- data position


def _tracked_class(cls: type) -> type:
    tracked = _TRACKED_CLASSES.get(cls)
    if tracked is None:
        tracked = type(cls.__name__, (cls,), {"__iter__": _tracked_iter, "__module__": cls.__module__,
                                              "_lmr_original_class": cls})
        _TRACKED_CLASSES[cls] = tracked
    return tracked


def _tracked_iter(self):
    tracker = self.__dict__.get("_lmr_tracker")
    base_iter = type(self)._lmr_original_class.__iter__
    if tracker is None:
        yield from base_iter(self)
        return
    yield from tracker.iterate(base_iter)


class _RngNeutralIterator:
    """Wraps a fresh DataLoader iterator so that creating it and fetching its first batch leave the
    global RNG streams untouched. In the interrupted run both happened before the capture (the
    per-epoch `_base_seed` draw, and the look-ahead fetch of the next batch), so the recovered RNG
    state already includes them; doing them again on resume would shift every later draw."""

    def __init__(self, make_iterator: Callable[[], Any]) -> None:
        saved = capture_rng()
        try:
            self._iterator = make_iterator()
            self._first = next(self._iterator)
            self._exhausted = False
        except StopIteration:
            self._exhausted = True
        finally:
            restore_rng(saved)
        self._saved: Optional[Dict[str, Any]] = saved  # None once the first batch was handed out

    def __iter__(self):
        return self

    def __next__(self):
        if self._saved is not None:
            self._saved = None
            if self._exhausted:
                raise StopIteration
            return self._first
        return next(self._iterator)

    def __getattr__(self, name: str) -> Any:  # _num_yielded, state_dict(), ... of the real iterator
        return getattr(self.__dict__["_iterator"], name)


def _neutralize_next_iterator(base_dataloader: Any) -> None:
    """The next `base_dataloader.__iter__()` call (made inside Accelerate's loader) returns an
    `_RngNeutralIterator`; later calls are normal."""
    original = type(base_dataloader).__iter__

    def once():
        del base_dataloader.__dict__["__iter__"]
        return _RngNeutralIterator(lambda: original(base_dataloader))

    base_dataloader.__dict__["__iter__"] = once


class DataLoaderTracker:
    """Counts the batches the loop consumed from one prepared dataloader and applies a recovered
    position to it. Attached in place: the loop keeps using the object `prepare()` returned."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader
        self.original_class = type(dataloader)
        self.epoch = 0
        self.consumed = 0
        self.iterating = False
        self.trained = False          # an optimizer step happened while this loader was being iterated
        self.source: Any = None       # the loader iterated right now (this one, or a skip loader)
        self.epoch_start_generator: Optional[torch.Tensor] = None
        self.resume: Optional[Dict[str, Any]] = None     # applied at the next iteration
        self.recovered: Optional[Dict[str, Any]] = None  # the recovered position, kept for "manual" loops
        self.resume_mode = "auto"
        self.before_iteration: Optional[Callable[[], None]] = None  # the LM_RESILIENCY flag's lazy attach

    @classmethod
    def of(cls, dataloader: Any) -> "DataLoaderTracker":
        """The dataloader's tracker, attaching one if it has none."""
        tracker = dataloader.__dict__.get("_lmr_tracker")
        if tracker is None:
            tracker = cls(dataloader)
            dataloader.__dict__["_lmr_tracker"] = tracker
            compat.swap_class(dataloader, _tracked_class(type(dataloader)))
        return tracker

    def detach(self) -> None:
        if self.dataloader.__dict__.get("_lmr_tracker") is self:
            del self.dataloader.__dict__["_lmr_tracker"]
            compat.swap_class(self.dataloader, self.original_class)

    # -------------------------------------------------------------- iteration

    def _generator(self) -> Optional[torch.Generator]:
        return getattr(self.dataloader, "synchronized_generator", None)

    def iterate(self, base_iter: Callable[[Any], Any]):
        dl = self.dataloader
        if self.before_iteration is not None:
            self.before_iteration()  # may recover, which sets self.resume
        resume = self.resume
        source, consumed = dl, 0
        if resume is not None:
            if self.resume_mode == "auto" and resume["trained"] and dl.iteration < resume["iteration"]:
                dl.iteration += 1  # this epoch completed before the failure: nothing left to yield
                return
            self.resume = self.recovered = None  # applied once
            source, consumed = self._apply(resume)
        generator = self._generator()
        self.epoch_start_generator = generator.get_state() if generator is not None else None
        self.epoch, self.consumed, self.source, self.iterating = dl.iteration, consumed, source, True
        try:
            for batch in (base_iter(dl) if source is dl else iter(source)):
                self.consumed += 1
                yield batch
        finally:
            self.iterating = False
        if source is not dl:
            dl.iteration += 1  # the skip loader advanced its own counter, not this one's

    def _apply(self, resume: Dict[str, Any]) -> tuple:
        """Position the loader at the recovered epoch and batch; returns (loader to iterate, batches
        already consumed in this epoch)."""
        dl = self.dataloader
        dl.iteration = resume["iteration"]
        generator = self._generator()
        if generator is not None and resume["generator"] is not None:
            generator.set_state(resume["generator"].clone())
        skip = resume["batches"]
        if resume.get("stateful") is not None:
            dl.load_state_dict(copy.deepcopy(resume["stateful"]))
            _neutralize_next_iterator(dl.base_dataloader)
            return dl, skip
        if skip == 0:
            return dl, 0
        from accelerate.data_loader import skip_first_batches

        skipping = skip_first_batches(dl, skip)
        _neutralize_next_iterator(skipping.base_dataloader if hasattr(skipping, "base_dataloader") else skipping)
        return skipping, skip

    # ---------------------------------------------------------------- capture

    def position(self, optimizer_step: bool = True) -> Dict[str, Any]:
        """Where the loop is, read right after an optimizer step."""
        dl = self.dataloader
        generator = self._generator()
        stateful = copy.deepcopy(dl.state_dict()) if getattr(dl, "use_stateful_dataloader", False) else None
        if self.iterating and optimizer_step:
            self.trained = True
        if self.iterating and not getattr(self.source, "end_of_dataloader", False):
            return {"iteration": int(self.epoch), "batches": int(self.consumed), "trained": self.trained,
                    "generator": self.epoch_start_generator, "stateful": stateful}
        # Between epochs, or the epoch's last batch was consumed: the next position is the start of
        # the next epoch, whose sampler draws from the generator as it is now.
        iteration = self.epoch + 1 if self.iterating else int(dl.iteration)
        return {"iteration": int(iteration), "batches": 0, "trained": self.trained,
                "generator": generator.get_state() if generator is not None else None,
                "stateful": stateful if not self.iterating else None}

    def restore(self, position: Dict[str, Any], mode: str) -> None:
        self.resume_mode = mode
        self.trained = bool(position["trained"])
        self.recovered = dict(position)
        self.resume = None if mode == "manual" else dict(position)

    def continue_next_iteration(self) -> None:
        """Arm the recovered position for this loader's next iteration ("continue" semantics)."""
        if self.recovered is not None:
            self.resume_mode = "continue"
            self.resume, self.recovered = self.recovered, None


# ---------------------------------------------------------------------------- the adapters


def _distributed_type(accelerator: Any) -> str:
    value = getattr(accelerator, "distributed_type", None)
    return str(getattr(value, "value", value))


def uses_deepspeed(accelerator: Any) -> bool:
    """Whether `accelerator` runs Accelerate's DeepSpeed integration (its prepared model is the engine)."""
    return _distributed_type(accelerator) == "DEEPSPEED"


def check_prepared(accelerator: Any) -> None:
    """Raise a clear error unless `accelerator.prepare()` has produced one model and one optimizer."""
    try:
        from accelerate import Accelerator
    except ImportError as exc:  # pragma: no cover - only without the extra
        raise ImportError("the Accelerate integration needs `accelerate` (pip install 'lm-resiliency[accelerate]')") \
            from exc
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"expected an accelerate.Accelerator, got {type(accelerator).__module__}."
                        f"{type(accelerator).__qualname__}")
    models, optimizers = compat.models(accelerator), compat.optimizers(accelerator)
    if not models and not optimizers:
        raise AcceleratePreparationError(
            "lm-resiliency was attached to an Accelerator before accelerator.prepare(): nothing is prepared "
            "yet. Call `model, optimizer, ... = accelerator.prepare(model, optimizer, dataloader, scheduler)` "
            "first, then attach (GEMINI captures the prepared objects, not the originals).")
    if not models or not optimizers:
        missing = "model" if not models else "optimizer"
        raise AcceleratePreparationError(
            f"lm-resiliency needs the prepared {missing} too: accelerator.prepare() has seen "
            f"{len(models)} model(s) and {len(optimizers)} optimizer(s). Prepare the model and its optimizer "
            "before attaching.")
    if len(models) > 1 or len(optimizers) > 1:
        raise AcceleratePreparationError(
            f"lm-resiliency's Accelerate integration supports one prepared model and one optimizer; this "
            f"Accelerator has {len(models)} model(s) and {len(optimizers)} optimizer(s)")


def trackable(accelerator: Any) -> List[Any]:
    """The prepared dataloaders whose position can be tracked (Accelerate's own loader classes)."""
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard

    loaders = []
    for dl in compat.dataloaders(accelerator):
        if isinstance(dl, (DataLoaderShard, DataLoaderDispatcher)):
            loaders.append(dl)
        else:
            logger.warning("lm-resiliency: prepared dataloader of type %s is not an Accelerate DataLoaderShard/"
                           "DataLoaderDispatcher; its position is not captured", type(dl).__qualname__)
    return loaders


class AccelerateLoopState:
    """What an Accelerate loop keeps besides the model and optimizer: the prepared schedulers and
    dataloader positions, `accelerator.step`, the registered custom objects, the GradScaler and the
    `save_state` counter. Both adapters capture it, whoever owns the optimizer step."""

    def __init__(self, accelerator: Any, resume_dataloaders: str) -> None:
        if resume_dataloaders not in RESUME_MODES:
            raise ValueError(f"resume_dataloaders must be one of {RESUME_MODES}, got {resume_dataloaders!r}")
        self.accelerator = accelerator
        self.resume_dataloaders = resume_dataloaders
        self.trackers: List[DataLoaderTracker] = [DataLoaderTracker.of(dl) for dl in trackable(accelerator)]
        self._positions: List[Dict[str, Any]] = [t.position(optimizer_step=False) for t in self.trackers]
        self._micro_step = int(accelerator.step)

    def snapshotting(self, callbacks: StepCallbacks) -> StepCallbacks:
        """`callbacks` with the loop position read at every applied optimizer step, before the loop
        fetches its next batch (the capture itself completes later, before the next forward)."""
        def after_optimizer_step() -> None:
            self._positions = [t.position() for t in self.trackers]
            self._micro_step = int(self.accelerator.step)
            callbacks.after_optimizer_step()

        return dataclasses.replace(callbacks, after_optimizer_step=after_optimizer_step)

    def state(self) -> Dict[str, Any]:
        acc = self.accelerator
        state: Dict[str, Any] = {
            "schedulers": [s.state_dict() for s in compat.schedulers(acc)],
            "dataloaders": [dict(p) for p in self._positions],
            "accelerate": {"step": self._micro_step,
                           "gradient_accumulation_steps": int(acc.gradient_accumulation_steps),
                           "num_processes": int(acc.num_processes),
                           "save_iteration": int(acc.project_configuration.iteration)},
            "custom_objects": [obj.state_dict() for obj in compat.custom_objects(acc)],
        }
        if getattr(acc, "scaler", None) is not None:
            state["scaler"] = acc.scaler.state_dict()
        return state

    def load(self, state: Dict[str, Any]) -> None:
        acc = self.accelerator
        for what, live in (("schedulers", compat.schedulers(acc)), ("dataloaders", self.trackers),
                           ("custom_objects", compat.custom_objects(acc))):
            if len(state[what]) != len(live):
                raise ValueError(f"the recovered checkpoint has {len(state[what])} {what.replace('_', ' ')}, "
                                 f"this Accelerator has {len(live)} prepared/registered; resume with the same "
                                 "prepare() and register_for_checkpointing() calls as the run that captured it")
        if ("scaler" in state) != (getattr(acc, "scaler", None) is not None):
            raise ValueError("the recovered checkpoint and this Accelerator disagree on a GradScaler (mixed "
                             "precision fp16); resume with the same mixed_precision setting")
        meta = state["accelerate"]
        if int(meta["num_processes"]) != int(acc.num_processes):
            raise ValueError(f"the recovered checkpoint was captured with {meta['num_processes']} processes, "
                             f"this run has {acc.num_processes}")
        if int(meta["gradient_accumulation_steps"]) != int(acc.gradient_accumulation_steps):
            logger.warning("lm-resiliency: gradient_accumulation_steps changed from %s to %s since the capture",
                           meta["gradient_accumulation_steps"], acc.gradient_accumulation_steps)
        for scheduler, saved in zip(compat.schedulers(acc), state["schedulers"]):
            scheduler.load_state_dict(saved)
        for obj, saved in zip(compat.custom_objects(acc), state["custom_objects"]):
            obj.load_state_dict(saved)
        if "scaler" in state:
            acc.scaler.load_state_dict(state["scaler"])
        acc.step = int(meta["step"])
        acc.project_configuration.iteration = int(meta["save_iteration"])
        for tracker, position in zip(self.trackers, state["dataloaders"]):
            tracker.restore(position, self.resume_dataloaders)
        self._positions = [dict(p) for p in state["dataloaders"]]
        self._micro_step = int(meta["step"])

    def resume_position(self) -> tuple:
        """(epoch, batches consumed in it) of the first loader that fed optimizer steps."""
        for position in self._positions:
            if position["trained"]:
                return int(position["iteration"]), int(position["batches"])
        return (int(self._positions[0]["iteration"]), int(self._positions[0]["batches"])) if self._positions \
            else (0, 0)

    def detach(self) -> None:
        for tracker in self.trackers:
            tracker.detach()


class _LoopStateMixin(FrameworkAdapter):
    """The adapter side of `AccelerateLoopState`: captured as deferred state (read after the loop's
    `scheduler.step()`), positions snapshotted at each applied step, trackers detached on remove."""

    loop: AccelerateLoopState

    def deferred_state(self) -> Dict[str, Any]:
        return self.loop.state()

    def load_deferred_state(self, state: Dict[str, Any]) -> None:
        self.loop.load(state)

    def install(self, callbacks: StepCallbacks) -> None:
        super().install(self.loop.snapshotting(callbacks))

    def remove(self) -> None:
        super().remove()
        self.loop.detach()


class AccelerateAdapter(_LoopStateMixin, PyTorchAdapter):
    """Maps a prepared `Accelerator` onto the session (see the module docstring)."""

    framework = "accelerate"

    def __init__(self, accelerator: Any, *, resume_dataloaders: str = "auto",
                 skip_replication_if_hsdp: bool = True) -> None:
        check_prepared(accelerator)
        kind = _distributed_type(accelerator)
        if kind == "DEEPSPEED":
            raise AcceleratePreparationError(
                "this Accelerator uses DeepSpeed: its optimizer wrapper's step() is a no-op, so the DeepSpeed "
                "engine must be hooked instead (AccelerateDeepSpeedAdapter; ResiliencyPlugin.attach picks it)")
        if kind in ("MEGATRON_LM", "XLA"):
            raise AcceleratePreparationError(f"Accelerate distributed type {kind} is not supported by lm-resiliency")
        model = compat.models(accelerator)[0]
        if kind == "FSDP":
            from torch.distributed.fsdp import FullyShardedDataParallel

            if isinstance(model, FullyShardedDataParallel):
                raise AcceleratePreparationError(
                    "Accelerate FSDP1 (FullyShardedDataParallel wrapper) is not supported; use FSDP2 "
                    "(FullyShardedDataParallelPlugin(fsdp_version=2)), whose DTensor shards GEMINI captures per rank")
        loop = AccelerateLoopState(accelerator, resume_dataloaders)
        wrapped = compat.optimizers(accelerator)[0]
        optimizer = getattr(wrapped, "optimizer", wrapped)
        super().__init__(model, optimizer, skip_replication_if_hsdp=skip_replication_if_hsdp)
        self.accelerator = accelerator
        self.accelerated_optimizer = wrapped
        self.loop = loop
        if kind.startswith("MULTI_"):
            # Accelerate hands its DDP wrapper only to the caller: one bucket layout for every run.
            ddp = find_wrapper(model)
            if ddp is not None:
                pin_bucket_layout(ddp)

    def topology(self) -> Topology:
        base = super().topology()
        kind, descriptor = base.kind, dict(base.descriptor)
        if kind == "replicated" and _distributed_type(self.accelerator).startswith("MULTI_"):
            # Accelerate keeps the unwrapped module in `_models` and hands the DDP wrapper only to the
            # caller; the hooks sit on the module (inside DDP's forward), the layout is DDP's.
            kind = descriptor["kind"] = "ddp"
        descriptor.update({"framework": "accelerate", "distributed_type": _distributed_type(self.accelerator)})
        return Topology(kind=kind, replicate=base.replicate, descriptor=descriptor)

    def describe(self) -> str:
        return f"accelerate/{_distributed_type(self.accelerator)}/{self.topology().kind}"


class AccelerateDeepSpeedAdapter(_LoopStateMixin, DeepSpeedAdapter):
    """Accelerate's DeepSpeed integration: the prepared model is the DeepSpeed engine and the
    prepared optimizer's `step()` is a no-op (`accelerator.backward` calls `engine.step()` when
    gradients sync). Model, optimizer, engine counters and the engine's LR scheduler are the
    DeepSpeed adapter's, through the engine hooks (`hooks`, from lm_resiliency.callbacks.deepspeed);
    the loop state is the same `AccelerateLoopState` as under MULTI_CPU/MULTI_GPU."""

    def __init__(self, accelerator: Any, *, hooks: Callable[[DeepSpeedAdapter, StepCallbacks], Any],
                 resume_dataloaders: str = "auto") -> None:
        check_prepared(accelerator)
        if not uses_deepspeed(accelerator):
            raise AcceleratePreparationError(
                f"AccelerateDeepSpeedAdapter needs an Accelerator with a DeepSpeedPlugin; this one is "
                f"{_distributed_type(accelerator)} (use AccelerateAdapter)")
        loop = AccelerateLoopState(accelerator, resume_dataloaders)
        super().__init__(compat.models(accelerator)[0], hooks=hooks)
        self.accelerator = accelerator
        self.loop = loop

    def topology(self) -> Topology:
        base = super().topology()
        descriptor = dict(base.descriptor, framework="accelerate", distributed_type="DEEPSPEED")
        return Topology(kind=base.kind, replicate=base.replicate, descriptor=descriptor)

    def describe(self) -> str:
        return f"accelerate/DEEPSPEED/{super().describe()}"
