"""Recovery trust: which checkpoint a restart may use after a given failure.

| failure                                          | selected mode      |
|--------------------------------------------------|--------------------|
| accessible straggler                             | LATEST             |
| hang/uncertain, all ranks accessible, clean sweep | LATEST             |
| hang/uncertain with SDC, incomplete or no sweep   | RECOVERY_VERIFIED  |
| SDC already detected                             | RECOVERY_VERIFIED  |
| a required rank or machine inaccessible          | RECOVERY_VERIFIED  |
"""

from __future__ import annotations

import enum
from typing import Callable, Optional, Sequence, Tuple

from lm_resiliency.payload import Payload


class RecoveryMode(str, enum.Enum):
    LATEST = "latest"
    RECOVERY_VERIFIED = "recovery_verified"


class FailureClass(str, enum.Enum):
    STRAGGLER = "straggler"
    HANG = "hang"
    UNCERTAIN = "uncertain"
    SDC = "sdc"
    DATALOADER_STALL = "dataloader_stall"
    CHECKPOINT_IO_STALL = "checkpoint_io_stall"
    INACCESSIBLE = "inaccessible"

    @classmethod
    def parse(cls, value: "str | FailureClass") -> "FailureClass":
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"unknown failure class {value!r}; expected one of {names}") from None


class SweepOutcome(str, enum.Enum):
    """Result of the full-catalog replay sweep a hang or uncertain failure triggers
    (`ResiliencySession.prepare_recovery`, lm_resiliency/scout/sweep.py).

    CLEAN: every catalog module's output and parameters agreed bitwise on every peer.
    SDC: some peer disagreed with a majority (or a peer pair disagreed).
    INCOMPLETE: a peer did not answer in time, a replay raised, or no strict majority formed.
    NOT_RUN: no evidence: SCOUT replay off, nothing recorded yet, or no peer to compare with."""

    CLEAN = "clean"
    SDC = "sdc"
    INCOMPLETE = "incomplete"
    NOT_RUN = "not_run"


class RecoveryDecision(Payload):
    """The JSON-ready checkpoint decision handed to orchestration (`report_recovery`): a read-only
    dict, so ``json.dumps(decision)`` and ``decision["step"]`` work; fields read as attributes too.

    failure: the failure class it answers ("sdc", "hang", "straggler", ...; `FailureClass`).
    mode: the selected trust, a `RecoveryMode` value ("latest" or "recovery_verified"); pass
        ``RecoveryMode(decision["mode"])`` as ``recovery_mode=`` on relaunch.
    source: where this rank's checkpoint for that trust lives ("memory", "disk", "durable", ...),
        None when there is none.
    step: that checkpoint's optimizer step, None when there is none.
    durable_checkpoint_id: the framework checkpoint's id when the source is durable.
    topology: the checkpoint-topology digest the step belongs to.
    available: whether this rank found a checkpoint for the selected trust.
    reason: why this trust and this checkpoint, in words.
    ranks: the global rank(s) that made the decision (a list in the document).
    """

    __slots__ = ()
    _FIELDS = ("failure", "mode", "source", "step", "durable_checkpoint_id", "topology", "available", "reason",
               "ranks")
    _ATTRS = {"ranks": tuple}

    failure: str
    mode: str
    source: Optional[str]
    step: Optional[int]
    durable_checkpoint_id: Optional[str]
    topology: Optional[str]
    available: bool
    reason: str
    ranks: Tuple[int, ...]

    def __init__(self, failure: str, mode: "str | RecoveryMode", source: Optional[str], step: Optional[int],
                 durable_checkpoint_id: Optional[str], topology: Optional[str], available: bool, reason: str,
                 ranks: Sequence[int] = ()) -> None:
        self._init(failure=str(failure), mode=RecoveryMode(mode).value, source=source, step=step,
                   durable_checkpoint_id=durable_checkpoint_id, topology=topology, available=bool(available),
                   reason=str(reason), ranks=tuple(ranks))

    @property
    def recovery_mode(self) -> RecoveryMode:
        """`mode` as the `RecoveryMode` a relaunch passes as ``recovery_mode=``."""
        return RecoveryMode(self["mode"])


RecoveryDecisionCallback = Callable[[RecoveryDecision], None]


def select_mode(failure: "str | FailureClass", *, all_ranks_accessible: bool,
                sweep: SweepOutcome = SweepOutcome.NOT_RUN) -> tuple:
    """(RecoveryMode, reason) for a failure, following the table in this module's docstring.
    `sweep` only matters for hang and uncertain failures with every rank accessible."""
    failure = FailureClass.parse(failure)
    if failure is FailureClass.SDC:
        return RecoveryMode.RECOVERY_VERIFIED, "silent data corruption was detected"
    if not all_ranks_accessible or failure is FailureClass.INACCESSIBLE:
        return RecoveryMode.RECOVERY_VERIFIED, "a required rank or machine is inaccessible"
    if failure in (FailureClass.STRAGGLER, FailureClass.DATALOADER_STALL, FailureClass.CHECKPOINT_IO_STALL):
        return RecoveryMode.LATEST, f"{failure.value}: every rank is accessible and state is not suspect"
    if sweep is SweepOutcome.CLEAN:
        return RecoveryMode.LATEST, f"{failure.value}: the full replay sweep completed clean"
    reasons = {
        SweepOutcome.SDC: "the full replay sweep detected SDC",
        SweepOutcome.INCOMPLETE: "the full replay sweep did not complete",
        SweepOutcome.NOT_RUN: "no replay evidence is available",
    }
    return RecoveryMode.RECOVERY_VERIFIED, f"{failure.value}: {reasons[sweep]}"
