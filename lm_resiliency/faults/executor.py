"""The executor interface: a request describing one matching call, a result saying what was done."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Mapping, Optional

from ._fields import check_json_ready
from .campaign import FaultSpec
from .errors import UnsupportedFaultError
from .records import InjectionStatus
from .taxonomy import FailureType


class _Unchanged:
    _instance = None

    def __new__(cls) -> "_Unchanged":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED: Any = _Unchanged()
"""`FaultExecutionResult.value` when the hooked value is left as it was."""


@dataclass(frozen=True, eq=False)
class FaultExecutionRequest:
    """One matching call of an armed fault, handed to an executor.

    `phase` says which call point this is: "forward" (value: the module output), "forward_pre"
    (value: the positional inputs tuple), "pre_step" / "post_step" (around optimizer.step),
    "iteration_start" (first forward of an iteration), "batch" (value: the fetched batch;
    `fetch` pulls the next one from the underlying loader), or "deactivate" (the occurrence
    ended: `FaultExecutor.deactivate`, with `reason` "expired", "replaced", "reset" or "closed").
    `context` is scratch space shared by every call of this fault in this occurrence, and handed
    to `deactivate`: keep there what it needs to undo the effect.
    `commit(evidence)` journals the INJECTED record immediately; executors call it right
    before an effect that leaves no chance to report afterwards (killing the process).
    """

    spec: FaultSpec
    occurrence_id: str
    incident_id: str
    rank: int
    world_size: int
    tick: int
    iteration: int
    call_index: int
    seed: int
    phase: str
    value: Any = None
    module: Any = None
    model: Any = None
    optimizer: Any = None
    sandbox_dir: Optional[str] = None
    context: Dict[str, Any] = field(default_factory=dict)
    fetch: Optional[Callable[[], Any]] = None
    commit: Optional[Callable[[Mapping[str, Any]], None]] = None
    reason: str = ""

    @property
    def fault_id(self) -> str:
        return self.spec.fault_id

    @property
    def type(self) -> FailureType:
        return self.spec.type

    @property
    def parameters(self) -> Mapping[str, Any]:
        return self.spec.parameters


@dataclass(frozen=True, eq=False)
class FaultExecutionResult:
    """What an executor did. `status` None means "staged, nothing to record yet" (a later phase
    of the same call records it, or `commit` already did). `value` replaces the hooked value
    (module output, inputs tuple, or for "batch" a tuple of batches to yield instead)."""

    status: Optional[InjectionStatus] = InjectionStatus.INJECTED
    evidence: Mapping[str, Any] = field(default_factory=dict)
    value: Any = UNCHANGED
    detail: str = ""

    def __post_init__(self) -> None:
        if self.status is not None and not isinstance(self.status, InjectionStatus):
            object.__setattr__(self, "status", InjectionStatus(self.status))
        object.__setattr__(self, "evidence", check_json_ready(dict(self.evidence), "evidence"))


class FaultExecutor(ABC):
    """Performs faults. The session calls `check(spec)` once at attach for every fault that
    targets its rank, `execute(request)` at each matching call while the fault is armed, and
    `deactivate(request)` once when an occurrence whose fault it executed ends.

    Either of the first two may raise `UnsupportedFaultError` (recorded as UNSUPPORTED);
    `execute` may raise `InjectedFault` as the effect itself (recorded as INJECTED, then
    re-raised)."""

    def check(self, spec: FaultSpec) -> None:
        """Raise UnsupportedFaultError if `spec` can never be performed here. Default: accept."""

    @abstractmethod
    def execute(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        """Perform one matching call of `request.spec`."""

    def deactivate(self, request: FaultExecutionRequest) -> Optional[FaultExecutionResult]:
        """Undo what `execute` started for this occurrence (a partition, a throttle, a held
        value), from what it kept in `request.context`. Called once per executed fault when the
        occurrence ends: its lifetime expired, a new occurrence of its incident replaced it, the
        clock was reset (`set_iteration`), or the session closed (`request.reason`). Return a
        result whose evidence says what was undone (journaled as DEACTIVATED; its status is
        ignored), or None when there was nothing to undo (nothing is journaled). Default: None."""
        return None


class CallbackFaultExecutor(FaultExecutor):
    """Plug your own effect: `fn(request)` returns a FaultExecutionResult (or None for a plain
    INJECTED with no evidence).

    `failure_types` limits which types `fn` handles; others go to `fallback` (for example a
    `LocalFaultExecutor`) or are unsupported. `deactivate(request)` undoes what `fn` started
    when the occurrence ends (see `FaultExecutor.deactivate`); a fallback type is deactivated
    by the fallback."""

    def __init__(self, fn: Callable[[FaultExecutionRequest], Optional[FaultExecutionResult]], *,
                 failure_types: Optional[Collection[FailureType]] = None,
                 fallback: Optional[FaultExecutor] = None,
                 deactivate: Optional[Callable[[FaultExecutionRequest], Optional[FaultExecutionResult]]] = None
                 ) -> None:
        if not callable(fn):
            raise TypeError(f"CallbackFaultExecutor: fn must be callable, got {type(fn).__name__}")
        if deactivate is not None and not callable(deactivate):
            raise TypeError(f"CallbackFaultExecutor: deactivate must be callable or None, got "
                            f"{type(deactivate).__name__}")
        self._fn = fn
        self._deactivate = deactivate
        self._types = None if failure_types is None else frozenset(FailureType(t) for t in failure_types)
        self._fallback = fallback

    def _handles(self, spec: FaultSpec) -> bool:
        return self._types is None or spec.type in self._types

    def _fallback_for(self, spec: FaultSpec) -> FaultExecutor:
        if self._fallback is None:
            raise UnsupportedFaultError(spec.fault_id, f"the callback executor does not handle "
                                                       f"{spec.type.value} and has no fallback")
        return self._fallback

    def check(self, spec: FaultSpec) -> None:
        if not self._handles(spec):
            self._fallback_for(spec).check(spec)

    def execute(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        if not self._handles(request.spec):
            fallback = self._fallback_for(request.spec)
            fallback.check(request.spec)
            return fallback.execute(request)
        result = self._fn(request)
        if result is None:
            return FaultExecutionResult()
        if not isinstance(result, FaultExecutionResult):
            raise TypeError(f"CallbackFaultExecutor: fn returned {type(result).__name__}, expected a "
                            "FaultExecutionResult or None")
        return result

    def deactivate(self, request: FaultExecutionRequest) -> Optional[FaultExecutionResult]:
        if not self._handles(request.spec):
            return self._fallback.deactivate(request) if self._fallback is not None else None
        if self._deactivate is None:
            return None
        result = self._deactivate(request)
        if result is not None and not isinstance(result, FaultExecutionResult):
            raise TypeError(f"CallbackFaultExecutor: deactivate returned {type(result).__name__}, expected a "
                            "FaultExecutionResult or None")
        return result


__all__ = ["CallbackFaultExecutor", "FaultExecutionRequest", "FaultExecutionResult", "FaultExecutor",
           "UNCHANGED"]
