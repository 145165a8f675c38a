"""Orchestration hooks: the platform-neutral boundary between a training job and its manager.

An external manager (a scheduler, a control plane, a launcher) receives three things from a
worker through `OrchestrationHooks`:

- ``report_fault(report)``: a JSON-ready `SCOUTFaultReport` for each localized fault;
- ``report_recovery(decision)``: a JSON-ready `RecoveryDecision` saying which checkpoint trust a
  restart must use. It always arrives *before* the fault reports it corresponds to, so a manager
  that reacts to the first fault report already knows which checkpoint to restart from;
- ``restart_destination()``: where to copy this worker's checkpoint before it is replaced
  (None: nowhere).

Every hook is optional. Checkpoint lookup for a decision is rank-local and non-collective: a
fault may already have made the training process group unusable, so nothing here communicates.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from lm_resiliency._values import is_int
from lm_resiliency.config import ConfigError
from lm_resiliency.recovery import RecoveryDecisionCallback, RecoveryMode, select_mode
from lm_resiliency.scout.reports import ReplayResult, SCOUTFaultCallback, SCOUTFaultReport, replay_fault_reports
from lm_resiliency.trust.handoff import recovery_decision

logger = logging.getLogger(__name__)

RestartDestinationResolver = Callable[[], Optional[str]]
"""Returns the destination (a path or URI the manager understands) for a worker's checkpoint
before that worker is replaced or migrated, or None when there is nowhere to copy it."""

StepSource = Callable[[RecoveryMode], tuple]
"""Rank-local checkpoint lookup for a decision: given the selected trust mode, returns
``(step, source)`` or ``(step, source, durable_checkpoint_id)``; step None when no checkpoint of
that trust exists. It must not communicate (the process group may be unusable)."""


@dataclass(frozen=True)
class OrchestrationHooks:
    """Callbacks an external manager provides. Each is a callable or None (not called).

    report_fault: called with each `SCOUTFaultReport` (`report.to_json()` is the wire form).
    report_recovery: called with a `RecoveryDecision` before the fault reports it covers.
    restart_destination: `RestartDestinationResolver`, asked before a worker is replaced.
    """

    report_fault: Optional[SCOUTFaultCallback] = None
    report_recovery: Optional[RecoveryDecisionCallback] = None
    restart_destination: Optional[RestartDestinationResolver] = None

    def __post_init__(self) -> None:
        for name in ("report_fault", "report_recovery", "restart_destination"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"OrchestrationHooks.{name}: must be a callable or None, got "
                                  f"{type(value).__name__} {value!r}")


def _classify(result: ReplayResult) -> Tuple[str, RecoveryMode, str]:
    """(failure class, trust mode, reason) for a result that produced fault reports."""
    if result.sdc:
        mode, reason = select_mode("sdc", all_ranks_accessible=True)
        return "sdc", mode, reason
    if result.inconclusive:
        # Missing evidence is treated like an incomplete sweep: only verified state is trusted.
        return ("uncertain", RecoveryMode.RECOVERY_VERIFIED,
                "SCOUT replay evidence is inconclusive (no strict majority among equivalent peers); "
                "only a RECOVERY_VERIFIED checkpoint is trusted")
    mode, reason = select_mode("straggler", all_ranks_accessible=True)
    return "straggler", mode, reason


def _lookup(step_source: Optional[StepSource], mode: RecoveryMode) -> Tuple[Optional[int], Optional[str],
                                                                             Optional[str], str]:
    """(step, source, durable_checkpoint_id, problem) from the caller's rank-local lookup."""
    if step_source is None:
        return None, None, None, "no checkpoint lookup was provided"
    try:
        found = step_source(mode)
    except Exception as exc:  # reported in the decision; fault reports still go out
        logger.exception("lm-resiliency: checkpoint lookup for a %s recovery decision failed", mode.value)
        return None, None, None, f"checkpoint lookup failed: {type(exc).__name__}: {exc}"
    if not isinstance(found, tuple) or len(found) not in (2, 3):
        logger.error("lm-resiliency: step_source returned %r, not (step, source[, durable_checkpoint_id])",
                     found)
        return None, None, None, f"checkpoint lookup returned {found!r}, not (step, source[, checkpoint_id])"
    step, source = found[0], found[1]
    checkpoint_id = found[2] if len(found) == 3 else None
    valid = ((step is None or (is_int(step) and step >= 0))
             and (source is None or isinstance(source, str))
             and (checkpoint_id is None or isinstance(checkpoint_id, str)))
    if not valid:
        logger.error("lm-resiliency: step_source returned invalid values %r", found)
        return None, None, None, f"checkpoint lookup returned invalid values {found!r}"
    if step is None:
        return None, None, checkpoint_id, f"no {mode.value} checkpoint is available on this rank"
    return step, source, checkpoint_id, ""


def dispatch_replay_faults(result: ReplayResult, hooks: OrchestrationHooks, *, topology: Optional[str] = None,
                           step_source: Optional[StepSource] = None) -> List[SCOUTFaultReport]:
    """Send one replay result's recovery decision and fault reports to orchestration; returns
    the reports (also when a hook is None).

    Order: ``hooks.report_recovery(decision)`` first, then ``hooks.report_fault(report)`` for each
    report of `replay_fault_reports(result)`. The decision is

    - RECOVERY_VERIFIED, failure "sdc", when the result contains SDC (this also covers any
      straggler found in the same result: the conservative decision wins);
    - RECOVERY_VERIFIED, failure "uncertain", when it contains only inconclusive checks and
      possibly stragglers (missing evidence trusts only verified state);
    - LATEST, failure "straggler", when it contains only confirmed stragglers.

    A healthy result sends nothing. `step_source(mode)` is the rank-local lookup of the checkpoint
    for the selected mode (see `StepSource`); without it, or when it fails, the decision says
    ``available=False`` and why. An exception raised by a hook propagates to the caller; a failing
    ``report_recovery`` therefore stops the fault reports that would have followed it.
    """
    if not isinstance(result, ReplayResult):
        raise TypeError(f"dispatch_replay_faults: result must be a ReplayResult, got {type(result).__name__}")
    if not isinstance(hooks, OrchestrationHooks):
        raise TypeError(f"dispatch_replay_faults: hooks must be OrchestrationHooks, got {type(hooks).__name__}")
    if topology is not None and not isinstance(topology, str):
        raise TypeError(f"dispatch_replay_faults: topology must be a str or None, got {type(topology).__name__}")
    reports = replay_fault_reports(result)
    if not reports:
        return reports
    failure, mode, reason = _classify(result)
    step, source, checkpoint_id, problem = _lookup(step_source, mode)
    decision = recovery_decision(failure, mode, reason, step=step, source=source, checkpoint_id=checkpoint_id,
                                 topology=topology, problem=problem)
    if hooks.report_recovery is not None:
        hooks.report_recovery(decision)
    if hooks.report_fault is not None:
        for report in reports:
            hooks.report_fault(report)
    return reports


__all__ = [
    "OrchestrationHooks",
    "RestartDestinationResolver",
    "StepSource",
    "dispatch_replay_faults",
]
