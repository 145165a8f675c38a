"""SCOUT results and JSON-ready fault reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from lm_resiliency.payload import Payload

# Report kinds and scopes (strings, so reports stay JSON-ready).
SDC = "sdc"
SDC_PEER_GROUP = "sdc_peer_group"        # 2 peers disagree: detected, not pinned on a rank
SDC_INCONCLUSIVE = "sdc_inconclusive"    # no strict majority
COMPUTE_STRAGGLER = "compute_straggler"
COMMUNICATION_STRAGGLER = "communication_straggler"
HANG = "hang"
DATALOADER_STALL = "dataloader_stall"
CHECKPOINT_IO_STALL = "checkpoint_io_stall"
# The check that names where non-finite values first appeared (resource "gradients:non_finite").
NON_FINITE_CHECK = "gradients"

SCOPE_RANK, SCOPE_PEER_GROUP, SCOPE_NODE, SCOPE_LINK, SCOPE_GPU = "rank", "peer_group", "node", "link", "gpu"


class SCOUTFaultReport(Payload):
    """One localized fault, JSON-ready: a read-only dict (``json.dumps(report)``,
    ``report["ranks"]``) whose fields also read as attributes (`ranks` and `hosts` as tuples).

    kind: what was found (`SDC`, `HANG`, `COMPUTE_STRAGGLER`, ...).
    scope: what it is pinned on: "rank", "gpu", "node", "link" or "peer_group" (detected, no
        single rank blamed).
    ranks: the global ranks it names; hosts: their host names, in the same order.
    resource: where ("output:layers.2", "barrier(group=[2,3])", "dataloader:train", ...).
    evidence: the JSON evidence behind it (signatures, timings, rules).
    confidence: 0..1. step: the optimizer step it was found at, if known.
    detected_at: wall-clock time of detection (seconds since the epoch).
    """

    __slots__ = ()
    _FIELDS = ("kind", "scope", "ranks", "hosts", "resource", "evidence", "confidence", "step", "detected_at")
    _ATTRS = {"ranks": tuple, "hosts": tuple}

    kind: str
    scope: str
    ranks: Tuple[int, ...]
    hosts: Tuple[str, ...]
    resource: str
    evidence: Dict[str, Any]
    confidence: float
    step: Optional[int]
    detected_at: float

    def __init__(self, kind: str, scope: str, ranks: Sequence[int], hosts: Sequence[str] = (), resource: str = "",
                 evidence: Optional[Dict[str, Any]] = None, confidence: float = 1.0, step: Optional[int] = None,
                 detected_at: Optional[float] = None) -> None:
        self._init(kind=kind, scope=scope, ranks=tuple(ranks), hosts=tuple(hosts), resource=resource,
                   evidence=dict(evidence or {}), confidence=float(confidence), step=step,
                   detected_at=time.time() if detected_at is None else float(detected_at))


SCOUTFaultCallback = Callable[[SCOUTFaultReport], None]


@dataclass(frozen=True)
class CheckOutcome:
    """One replay check on one equivalent-peer group.

    verdict: "clean" (all signatures equal), "sdc" (strict majority; `faulty` are the ranks
    outside it), "peer_group" (2 peers disagree: detected, no rank blamed), "inconclusive"
    (no strict majority) or "error" (the check failed on every peer: SCOUT's own failure, no
    evidence about any device; `detail` says why)."""

    check: str                      # "embedding" | "hidden" | "output" | "optimizer" | "parameters"
                                    # | "optimizer_state" | "live" | "input" | "backward"
                                    # | "gradients" (non-finite origin, not a vote)
    module_path: str
    group_ranks: Tuple[int, ...]
    signatures: Dict[int, str]      # rank -> 64-bit signature (hex)
    verdict: str
    faulty: Tuple[int, ...] = ()
    hosts: Dict[int, str] = field(default_factory=dict)
    timings_s: Dict[int, float] = field(default_factory=dict)
    detail: str = ""                # why an "error" outcome failed, or why a vote was not localized


@dataclass(frozen=True)
class StragglerFinding:
    kind: str                       # "compute" | "communication"
    ranks: Tuple[int, ...]
    hosts: Tuple[str, ...]
    slowdown: float                 # observed / group median
    confirmed: bool
    confidence: float
    evidence: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayResult:
    """Everything one scheduled SCOUT check found on this rank's view of the job."""

    step: int
    checks: Tuple[CheckOutcome, ...] = ()
    stragglers: Tuple[StragglerFinding, ...] = ()

    @property
    def sdc(self) -> bool:
        return any(c.verdict in ("sdc", "peer_group") for c in self.checks)

    @property
    def inconclusive(self) -> bool:
        return any(c.verdict == "inconclusive" for c in self.checks)

    @property
    def errors(self) -> Tuple[CheckOutcome, ...]:
        """Checks that failed on every peer (SCOUT's own failures, not SDC evidence)."""
        return tuple(c for c in self.checks if c.verdict == "error")

    @property
    def healthy(self) -> bool:
        return not self.sdc and not self.inconclusive and not any(s.confirmed for s in self.stragglers)


def replay_fault_reports(result: ReplayResult) -> List[SCOUTFaultReport]:
    """JSON-ready reports for every SDC, inconclusive check and confirmed straggler in `result`."""
    reports = []
    for check in result.checks:
        resource = f"{check.check}:{check.module_path}"
        ranks_by_signature: Dict[str, List[int]] = {}
        for rank in sorted(check.signatures):
            ranks_by_signature.setdefault(check.signatures[rank], []).append(rank)
        evidence = {"signatures": {str(r): s for r, s in check.signatures.items()},
                    "group_ranks": list(check.group_ranks), "split": ranks_by_signature}
        if check.detail:
            evidence["detail"] = check.detail
        if check.verdict == "sdc" and check.check != NON_FINITE_CHECK:   # origins are not voted
            evidence["assumes"] = ("a strict healthy majority: ranks faulty alike that outnumber the healthy ones "
                                   "would look the same")
        if check.verdict == "sdc":
            reports.append(SCOUTFaultReport(
                kind=SDC, scope=SCOPE_RANK, ranks=check.faulty,
                hosts=tuple(check.hosts.get(r, "") for r in check.faulty), resource=resource,
                evidence=evidence, confidence=1.0 - len(check.faulty) / max(len(check.group_ranks), 1) / 2,
                step=result.step))
        elif check.verdict == "peer_group":
            reports.append(SCOUTFaultReport(
                kind=SDC_PEER_GROUP, scope=SCOPE_PEER_GROUP, ranks=check.group_ranks,
                hosts=tuple(check.hosts.get(r, "") for r in check.group_ranks), resource=resource,
                evidence=evidence, confidence=0.5, step=result.step))
        elif check.verdict == "inconclusive":
            reports.append(SCOUTFaultReport(
                kind=SDC_INCONCLUSIVE, scope=SCOPE_PEER_GROUP, ranks=check.group_ranks,
                hosts=tuple(check.hosts.get(r, "") for r in check.group_ranks), resource=resource,
                evidence=evidence, confidence=0.0, step=result.step))
    for finding in result.stragglers:
        if not finding.confirmed:
            continue
        communication = finding.kind == "communication"
        reports.append(SCOUTFaultReport(
            kind=COMMUNICATION_STRAGGLER if communication else COMPUTE_STRAGGLER,
            scope=SCOPE_NODE if communication else SCOPE_RANK, ranks=finding.ranks, hosts=finding.hosts,
            resource="collective" if communication else "compute",
            evidence=dict(finding.evidence, slowdown=finding.slowdown), confidence=finding.confidence,
            step=result.step))
    return reports
