"""SCOUT-named node retirement under the built-in torchrun policy.

SDC: when SCOUT localizes SDC and the trust ledger requires RECOVERY_VERIFIED recovery, every
worker writes `fault-<local rank>.json` into its node's restart-context directory (the faulty
global ranks, their node slots, the newest RECOVERY_VERIFIED step) and ends its generation with
`TorchrunFaultDetected`.

Hang: only the one rank whose out-of-band monitor reports the hang learns it, on its monitor
thread, while every training thread sits blocked in a collective. That rank writes the same
record (kind "hang"), waits until its agent has published the named slots in the rendezvous
store (`ACK_NAME`), keeps GEMINI's shared memory and ends its process with `HANG_EXIT_CODE`; its
peers' collectives then fail and every worker group ends.

Agents: at the next rendezvous round the agent whose slot was named (by its own node's record
or by the store key another agent published) retires (`NodeRetired`); the others publish the
fault with their steps, so every agent, the admitted standby included, selects the verified step."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import (PRIVATE, RecordRejected, RecordSchema, array, atomic_write, check_record,
                                 encode_record, integer, parse_record, read_record, text)
from lm_resiliency.scout.reports import HANG, SCOPE_RANK
from lm_resiliency.torchrun.binding import RoundBinding, foreign
from lm_resiliency.torchrun.context import ID, RUN_ID, TRUST_VERIFIED, ContextError, RestartContext

logger = logging.getLogger(__name__)

FAULT_SCHEMA = "lm-resiliency-torchrun-fault/2"
ACK_SCHEMA = "lm-resiliency-torchrun-fault-ack/1"
FAULT_KINDS = ("sdc", "hang")
ACK_NAME = "published-fault.json"  # the agent's: this node's fault of a generation is in the store
HANG_EXIT_CODE = 87  # the reporting worker ended its process after a hang report
ACK_TIMEOUT_S = 60.0
_ACK_POLL_S = 0.1
_FAULT_NAME = re.compile(r"fault-\d{1,6}\.json")

FAULT_RECORD = RecordSchema(what="fault record", identity=("schema", FAULT_SCHEMA), fields={
    "run_id": RUN_ID, "launch_id": ID, "node_id": ID, "generation": integer(0), "kind": text(choices=FAULT_KINDS),
    "ranks": array(integer(0)), "slots": array(integer(0)), "step": integer(0), "verified_step": integer(-1)})
ACK_RECORD = RecordSchema(what="fault acknowledgement", identity=("schema", ACK_SCHEMA), fields={
    "run_id": RUN_ID, "launch_id": ID, "node_id": ID, "generation": integer(0)})


class TorchrunFaultDetected(ResiliencyError, RuntimeError):
    """Raised in every worker when SCOUT's verdict ends the generation: the agents retire the named
    node slot(s) and restart from the newest RECOVERY_VERIFIED step."""


class NodeRetired(SystemExit):
    """The agent's own node was named faulty: it left the rendezvous and exits (status 0: the
    retirement is the recovery working, and a supervisor must not restart it into the run)."""

    def __init__(self) -> None:
        super().__init__(0)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeFault:
    """A fault SCOUT localized in `generation` of launch `launch_id`, recorded on node `node_id`:
    global `ranks`, their node `slots` (rank // LOCAL_WORLD_SIZE), the step it was found at, and the
    newest RECOVERY_VERIFIED step (-1: none)."""

    run_id: str
    launch_id: str
    node_id: str
    generation: int
    kind: str
    ranks: Tuple[int, ...]
    slots: Tuple[int, ...]
    step: int
    verified_step: int

    def to_json(self) -> dict:
        return {"schema": FAULT_SCHEMA, "run_id": self.run_id, "launch_id": self.launch_id, "node_id": self.node_id,
                "generation": self.generation, "kind": self.kind, "ranks": list(self.ranks),
                "slots": list(self.slots), "step": self.step, "verified_step": self.verified_step}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "NodeFault":
        doc = check_record(data, FAULT_RECORD, where, error=ContextError)
        for name in ("ranks", "slots"):
            if doc[name] != sorted(set(doc[name])):
                raise ContextError(f"{where}: {name} must be a sorted list of distinct non-negative integers")
        return cls(**dict({k: v for k, v in doc.items() if k != "schema"}, ranks=tuple(doc["ranks"]),
                          slots=tuple(doc["slots"])))

    @classmethod
    def parse(cls, data: bytes, where: str) -> "NodeFault":
        return cls.from_json(parse_record(data, FAULT_RECORD, where, error=ContextError), where)


def fault_for(binding: RoundBinding, kind: str, ranks: List[int], local_world_size: int, step: int,
              verified_step: Optional[int]) -> NodeFault:
    """The record for faulty global `ranks` in `binding`'s generation: a rank's node slot is rank //
    LOCAL_WORLD_SIZE."""
    ranks = sorted(set(ranks))
    return NodeFault(run_id=binding.run_id, launch_id=binding.launch_id, node_id=binding.node_id,
                     generation=binding.generation, kind=kind, ranks=tuple(ranks),
                     slots=tuple(sorted({r // local_world_size for r in ranks})), step=step,
                     verified_step=-1 if verified_step is None else verified_step)


def fault_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"fault-{local_rank}.json")


def write_fault(directory: str, local_rank: int, fault: NodeFault) -> None:
    atomic_write(fault_path(directory, local_rank), encode_record(fault.to_json(), FAULT_RECORD))


def fault_problem(fault: NodeFault, binding: RoundBinding) -> Optional[str]:
    """Why `fault` is not a fault of `binding`'s generation on its launch (None: it is)."""
    if fault.run_id != binding.run_id:
        return f"it belongs to run {fault.run_id!r}"
    if fault.launch_id != binding.launch_id:
        return (f"it was left by launch {fault.launch_id[:12]} (this launch is {binding.launch_id[:12]}; rounds "
                "restart at 0 in every launch)")
    if fault.generation != binding.generation:
        return f"it is of generation {fault.generation}, not of generation {binding.generation} that just ended"
    return None


def acknowledge_fault(directory: str, binding: RoundBinding) -> None:
    """The agent's side: this node's fault of `binding`'s generation is published in the rendezvous store."""
    doc = {"schema": ACK_SCHEMA, "run_id": binding.run_id, "launch_id": binding.launch_id,
           "node_id": binding.node_id, "generation": binding.generation}
    atomic_write(os.path.join(directory, ACK_NAME), encode_record(doc, ACK_RECORD))


def fault_acknowledged(directory: str, binding: RoundBinding) -> bool:
    """The worker's side: whether its agent acknowledged this generation's fault (an acknowledgement
    of another run, launch, node or generation is not this one's)."""
    path = os.path.join(directory, ACK_NAME)
    try:
        doc = read_record(path, ACK_RECORD, trust=PRIVATE, error=ContextError)
    except ContextError as exc:
        logger.warning("lm-resiliency torchrun worker: ignoring %s", exc)
        return False
    return doc is not None and foreign(doc, binding) is None and (doc["launch_id"], doc["generation"]) == (
        binding.launch_id, binding.generation)


def read_fault(directory: str, binding: RoundBinding) -> Tuple[Optional[NodeFault], List[str]]:
    """The fault this node's workers recorded in `binding`'s generation (None: none), and every
    fault record ignored (of another run, launch, node or generation, unsafe or malformed), with
    why. Records of this generation that disagree fail closed (ContextError)."""
    found: List[NodeFault] = []
    ignored: List[str] = []
    for name in sorted(os.listdir(directory)):
        if not _FAULT_NAME.fullmatch(name):
            continue
        path = os.path.join(directory, name)
        try:
            doc = read_record(path, FAULT_RECORD, trust=PRIVATE, error=ContextError)
            fault = None if doc is None else NodeFault.from_json(doc, path)
        except RecordRejected as exc:
            ignored.append(f"fault record {exc}")
            continue
        if fault is None:
            continue
        why = foreign(fault.to_json(), binding) or fault_problem(fault, binding)
        if why is not None:
            ignored.append(f"fault record {path}: {why}")
            continue
        found.append(fault)
    if not found:
        return None, ignored
    if any((f.kind, f.slots, f.verified_step) != (found[0].kind, found[0].slots, found[0].verified_step)
           for f in found):
        raise ContextError(f"{directory}: this node's workers recorded different faults for generation "
                           f"{binding.generation}: {[f.to_json() for f in found]}; the verdict should be collective")
    return found[0], ignored


class FaultWatch:
    """A worker's side: collects the ranks SCOUT's replay votes blame, and once the trust ledger
    latches RECOVERY_VERIFIED-only recovery (the capture boundary after the verdict, agreed on
    every rank), records the fault for the agent and ends the generation on every rank alike."""

    def __init__(self, binding: RoundBinding, directory: str, local_rank: int, local_world_size: int) -> None:
        self.binding = binding
        self.generation = binding.generation
        self.directory = directory
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.ranks: List[int] = []
        self.step: Optional[int] = None

    def on_replay_result(self, result: Any) -> None:
        """The session's `fault_callback`: a replay result that is not healthy (same on every rank)."""
        if not result.sdc:
            return  # stragglers and inconclusive votes alone do not latch verified-only recovery
        self.ranks.extend(rank for check in result.checks if check.verdict == "sdc" for rank in check.faulty)
        self.step = result.step if self.step is None else self.step

    def on_hang_report(self, report: Any, session: Any) -> None:
        """The session's `oob_fault_callback`, on the monitor thread of the one rank that reports
        a hang: record it, wait (bounded) until the agent published the named slots, keep GEMINI's
        shared memory and end this process, whatever fails on the way (the training thread is
        blocked in a collective: an exception could not end it)."""
        if report.kind != HANG or not report.ranks:
            return  # a local stall names no node
        if report.scope != SCOPE_RANK:
            logger.error("lm-resiliency torchrun worker: SCOUT reports a hang it could not narrow down (every stalled "
                         "rank is a candidate: %s); retiring them all would end the run, so no node is retired. "
                         "Find the stuck rank from the report's evidence: %s", list(report.ranks), report.evidence)
            return
        try:
            self._record_hang(report, session)
        except Exception:  # noqa: BLE001 - the process must end either way; the record may be missing
            logger.exception("lm-resiliency torchrun worker: recording the hang for the agent failed")
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)

    def _record_hang(self, report: Any, session: Any) -> None:
        ledger = session.ledger if session is not None else None
        verified = ledger.recovery_verified_step if ledger is not None else None
        step = report.step if report.step is not None else (session.step_count if session is not None else 0)
        fault = fault_for(self.binding, "hang", list(report.ranks), self.local_world_size, step, verified)
        write_fault(self.directory, self.local_rank, fault)
        if session is not None:
            session.keep_state_for_relaunch()
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while not fault_acknowledged(self.directory, self.binding) and time.monotonic() < deadline:
            time.sleep(_ACK_POLL_S)
        logger.critical(
            "lm-resiliency torchrun worker: SCOUT localized a hang at step %d on global ranks %s (node slots %s); %s. "
            "This worker ends its process (exit status %d) so that every worker group ends, the agents retire the "
            "named node(s) and restart from the newest RECOVERY_VERIFIED step (%s)", fault.step, list(fault.ranks),
            list(fault.slots), "the agent published it" if fault_acknowledged(self.directory, self.binding) else
            f"the agent did not publish it within {ACK_TIMEOUT_S:g}s: only a named node that reads its own record "
            "retires", HANG_EXIT_CODE, "none" if verified is None else verified)

    def after_step(self, session: Any) -> None:
        """After each optimizer step: end the generation once recovery must be RECOVERY_VERIFIED."""
        ledger = session.ledger
        if self.step is None or (ledger is not None and not ledger.requires_verified_recovery):
            return
        verified = ledger.recovery_verified_step if ledger is not None else None
        fault = fault_for(self.binding, "sdc", self.ranks, self.local_world_size, self.step, verified)
        write_fault(self.directory, self.local_rank, fault)
        session.keep_state_for_relaunch()  # the verified capture may live only in this node's memory
        raise TorchrunFaultDetected(
            f"lm-resiliency torchrun worker: SCOUT detected SDC at step {fault.step} on global ranks "
            f"{list(fault.ranks) or 'not localized to a rank'} (node slots {list(fault.slots)}); ending generation "
            f"{self.generation} so the agents retire the named node(s) and restart from the newest "
            f"RECOVERY_VERIFIED step ({'none' if verified is None else verified})")


def require_verified_step(session: Any, context: RestartContext) -> None:
    """Before a generation that must resume from RECOVERY_VERIFIED state loads anything: its step
    must be one the trust ledger certified (the ledger agrees job-wide, so every rank decides alike)."""
    if context.trust != TRUST_VERIFIED:
        return
    from lm_resiliency.gemini.manager import RecoveryUnavailable

    verified = session.ledger.verified_steps() if session.ledger is not None else []
    if context.checkpoint_step not in verified:
        raise RecoveryUnavailable(
            f"lm-resiliency torchrun worker: generation {context.generation} must resume from RECOVERY_VERIFIED "
            f"step {context.checkpoint_step} ({context.reason}), but this run's trust ledger certifies "
            f"{verified or 'no step'}{'' if session.ledger is not None else ' (SCOUT is off)'}; loading nothing")
