"""SCOUT results and JSON-ready fault reports."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

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


@dataclass(frozen=True)
class SCOUTFaultReport:
    """One localized fault. `to_json()` is what orchestration receives."""

    kind: str
    scope: str
    ranks: Tuple[int, ...]
    hosts: Tuple[str, ...] = ()
    resource: str = ""
    evidence: Dict[str, Any] = field(default_factory=dict)
    confidence: float = 1.0
    step: Optional[int] = None
    detected_at: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["ranks"], doc["hosts"] = list(self.ranks), list(self.hosts)
        return doc


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
