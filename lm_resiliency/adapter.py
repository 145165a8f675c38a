"""The contract between a framework adapter (`lm_resiliency.adapters.*`) and the session.

An adapter knows where its framework keeps model, optimizer, scheduler and process groups.
It never captures, replicates or recovers anything itself: it reports optimizer-step
boundaries to the session and reads/writes framework state when the session asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from lm_resiliency import wire


@dataclass(frozen=True)
class SessionControls:
    """The session's public methods a surface's hooks may call, handed to them at install (no
    session object, no adapter pointing back at the session): for frameworks that keep their own
    step counter (DeepSpeed `global_steps`, TorchTitan `trainer.step`) and teardown."""

    step_count: Callable[[], int]                   # optimizer steps completed
    continue_from: Callable[[int], None]            # the framework loaded its own checkpoint at step N
    keep_state_for_relaunch: Callable[[], None]     # this launch ends abnormally: keep host slots
    close: Callable[[], None]


@dataclass
class StepCallbacks:
    """What the session wants to hear from the framework lifecycle."""

    before_optimizer_step: Callable[[], None]
    after_optimizer_step: Callable[[], None]
    before_forward: Callable[[], None]
    # A step boundary whose optimizer.step() was skipped (AMP gradient overflow): it still counts.
    skipped_optimizer_step: Optional[Callable[[], None]] = None
    session: Optional[SessionControls] = None


@dataclass(frozen=True)
class Topology:
    """An adapter's description of this rank's place in the parallel layout."""

    kind: str                          # "single", "ddp", "fsdp2", "hsdp", ...
    replicate: bool = True             # False: natural replicas make GEMINI peer copies redundant
    descriptor: Dict[str, Any] = field(default_factory=dict)  # JSON, part of the topology fingerprint
    # The user's SCOUT peer group on this rank (Gloo), instead of the groups SCOUT derives from
    # the descriptor; None: derived.
    scout_group: Any = None


class FrameworkAdapter:
    """Base class; see `lm_resiliency.adapters.pytorch` for the reference implementation."""

    framework: str = ""
    # True when the framework builds data (datasets, dataloaders) between recovery and the first
    # resumed batch: the adapter restores the RNG streams itself, right before that batch, so what
    # is built in between sees the RNG an uninterrupted run's would have seen at that point.
    defers_rng_restore: bool = False

    def topology(self) -> Topology:
        raise NotImplementedError

    def framework_state(self) -> Dict[str, Any]:
        """Model, optimizer and other framework-owned state at an optimizer boundary."""
        raise NotImplementedError

    def deferred_state(self) -> Dict[str, Any]:
        """Framework state that settles after the optimizer step (e.g. an LR scheduler that the
        loop steps right after `optimizer.step()`); read just before the next forward."""
        return {}

    def load_framework_state(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError

    def load_deferred_state(self, state: Dict[str, Any]) -> None:
        """Restore what `deferred_state` returned."""

    def install(self, callbacks: StepCallbacks) -> None:
        raise NotImplementedError

    def replay_targets(self) -> tuple:
        """(root module, optimizer) that SCOUT replays and checks."""
        raise NotImplementedError

    def overwrite_targets(self) -> tuple:
        """The modules and optimizers whose `load_state_dict` by user code is refused right after a
        GEMINI recovery (lm_resiliency.recovered_state). Empty (the default): the framework's own
        restore path loads the recovered state after the session's recovery (Lightning), or
        guards its own loader (DeepSpeed, TorchTitan)."""
        return ()

    def remove(self) -> None:
        """Remove every hook installed by `install`. Idempotent."""

    def describe(self) -> str:
        return self.framework


class HookFactoryAdapter(FrameworkAdapter):
    """An adapter whose framework hooks are one object built by its surface's factory,
    `hooks(adapter, callbacks)`, which has a `remove()` (DeepSpeed, TorchTitan)."""

    def __init__(self, hooks: Callable[..., Any]) -> None:
        self._hooks_factory = hooks
        self._hooks: Any = None

    def install(self, callbacks: StepCallbacks) -> None:
        self._remove_hooks()  # not remove(): a subclass's remove() may undo more than the hooks
        self._hooks = self._hooks_factory(self, callbacks)

    def remove(self) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.remove()


def check_extra_state(extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Caller-owned state must not smuggle in model/optimizer state (the adapter owns those)."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"extra_state_fn must return a dict, got {type(extra).__name__}")
    forbidden = sorted(k for k in extra if str(k).lower() in {"model", "optimizer", "optim", "model_state",
                                                             "optimizer_state"})
    if forbidden:
        raise ValueError(f"extra_state_fn returned {forbidden}: model and optimizer state are captured by "
                         "the framework adapter; return only caller-owned state (scheduler, sampler, ...)")
    return extra


def gather_partition(ranks: Sequence[int], timeout_s: float, source: str) -> List[List[int]]:
    """The process groups of one kind across the job, from every rank's own group `ranks` (one
    all-gather over the world, bounded by `timeout_s`): their partition of the ranks, sorted.
    RuntimeError, naming `source`, when they do not partition the job."""
    gathered = wire.all_gather_json(sorted(int(r) for r in ranks), timeout_s=timeout_s)
    groups = [list(group) for group in sorted({tuple(g) for g in gathered})]
    if sorted(r for group in groups for r in group) != list(range(len(gathered))):
        raise RuntimeError(f"{source}: the process groups {groups} do not partition the {len(gathered)} ranks; were "
                           "they created alike on every rank?")
    return groups
