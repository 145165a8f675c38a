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
import sys
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from lm_resiliency._values import is_int
from lm_resiliency.files import atomic_write
from lm_resiliency.scout.reports import HANG, SCOPE_RANK
from lm_resiliency.torchrun.context import TRUST_VERIFIED, ContextError, RestartContext, encode_json, read_json

logger = logging.getLogger(__name__)

FAULT_SCHEMA = "lm-resiliency-torchrun-fault/1"
FAULT_KINDS = ("sdc", "hang")
ACK_NAME = "published-fault.json"  # the agent's {"generation": g}: this node's fault of g is in the store
HANG_EXIT_CODE = 87  # the reporting worker ended its process after a hang report
ACK_TIMEOUT_S = 60.0
_ACK_POLL_S = 0.1


class TorchrunFaultDetected(RuntimeError):
    """Raised in every worker when SCOUT's verdict ends the generation: the agents retire the named
    node slot(s) and restart from the newest RECOVERY_VERIFIED step."""


class NodeRetired(SystemExit):
    """The agent's own node was named faulty: it left the rendezvous and exits (status 0: the
    retirement is the recovery working, and a supervisor must not restart it into the run)."""

    def __init__(self) -> None:
        super().__init__(0)


@dataclass(frozen=True)
class NodeFault:
    """A fault SCOUT localized in `generation`: global `ranks`, their node `slots` (rank //
    LOCAL_WORLD_SIZE), the step it was found at, and the newest RECOVERY_VERIFIED step (-1: none)."""

    run_id: str
    generation: int
    kind: str
    ranks: Tuple[int, ...]
    slots: Tuple[int, ...]
    step: int
    verified_step: int

    def to_json(self) -> dict:
        return {"schema": FAULT_SCHEMA, "run_id": self.run_id, "generation": self.generation, "kind": self.kind,
                "ranks": list(self.ranks), "slots": list(self.slots), "step": self.step,
                "verified_step": self.verified_step}

    @classmethod
    def from_json(cls, data: Any, where: str) -> "NodeFault":
        names = ("run_id", "generation", "kind", "ranks", "slots", "step", "verified_step")
        if not isinstance(data, dict) or data.get("schema") != FAULT_SCHEMA or set(data) != {"schema", *names}:
            raise ContextError(f"{where}: not a fault record ({FAULT_SCHEMA})")
        if not isinstance(data["run_id"], str) or data["kind"] not in FAULT_KINDS:
            raise ContextError(f"{where}: run_id must be a string and kind one of {FAULT_KINDS}")
        for name in ("generation", "step"):
            if not is_int(data[name]) or data[name] < 0:
                raise ContextError(f"{where}: {name} must be a non-negative integer")
        if not is_int(data["verified_step"]) or data["verified_step"] < -1:
            raise ContextError(f"{where}: verified_step must be -1 (none) or a non-negative step")
        for name in ("ranks", "slots"):
            values = data[name]
            if not isinstance(values, list) or not all(is_int(v) and v >= 0 for v in values) \
                    or values != sorted(set(values)):
                raise ContextError(f"{where}: {name} must be a sorted list of distinct non-negative integers")
        return cls(data["run_id"], data["generation"], data["kind"], tuple(data["ranks"]), tuple(data["slots"]),
                   data["step"], data["verified_step"])


def fault_for(run_id: str, generation: int, kind: str, ranks: List[int], local_world_size: int, step: int,
              verified_step: Optional[int]) -> NodeFault:
    """The record for faulty global `ranks`: a rank's node slot is rank // LOCAL_WORLD_SIZE."""
    ranks = sorted(set(ranks))
    return NodeFault(run_id, generation, kind, tuple(ranks), tuple(sorted({r // local_world_size for r in ranks})),
                     step, -1 if verified_step is None else verified_step)


def fault_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"fault-{local_rank}.json")


def write_fault(directory: str, local_rank: int, fault: NodeFault) -> None:
    atomic_write(fault_path(directory, local_rank), encode_json(fault.to_json()))


def acknowledge_fault(directory: str, generation: int) -> None:
    """The agent's side: this node's fault of `generation` is published in the rendezvous store."""
    atomic_write(os.path.join(directory, ACK_NAME), encode_json({"generation": generation}))


def fault_acknowledged(directory: str, generation: int) -> bool:
    try:
        data = read_json(os.path.join(directory, ACK_NAME))
    except FileNotFoundError:  # not written yet (the write is atomic: never half-read)
        return False
    return isinstance(data, dict) and data.get("generation") == generation


def read_fault(directory: str, run_id: str, generation: int) -> Optional[NodeFault]:
    """The fault this node's workers recorded in `generation` of `run_id` (None: none). Records
    of other runs or generations are ignored; corrupt or disagreeing ones fail closed."""
    found: List[NodeFault] = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("fault-") and name.endswith(".json")):
            continue
        path = os.path.join(directory, name)
        fault = NodeFault.from_json(read_json(path), path)
        if fault.run_id == run_id and fault.generation == generation:
            found.append(fault)
    if not found:
        return None
    if any((f.kind, f.slots, f.verified_step) != (found[0].kind, found[0].slots, found[0].verified_step)
           for f in found):
        raise ContextError(f"{directory}: this node's workers recorded different faults for generation "
                           f"{generation}: {[f.to_json() for f in found]}; the verdict should be collective")
    return found[0]


class FaultWatch:
    """A worker's side: collects the ranks SCOUT's replay votes blame, and once the trust ledger
    latches RECOVERY_VERIFIED-only recovery (the capture boundary after the verdict, agreed on
    every rank), records the fault for the agent and ends the generation on every rank alike."""

    def __init__(self, run_id: str, generation: int, directory: str, local_rank: int, local_world_size: int) -> None:
        self.run_id = run_id
        self.generation = generation
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
        fault = fault_for(self.run_id, self.generation, "hang", list(report.ranks), self.local_world_size, step,
                          verified)
        write_fault(self.directory, self.local_rank, fault)
        if session is not None:
            session.keep_state_for_relaunch()
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while not fault_acknowledged(self.directory, self.generation) and time.monotonic() < deadline:
            time.sleep(_ACK_POLL_S)
        logger.critical(
            "lm-resiliency torchrun worker: SCOUT localized a hang at step %d on global ranks %s (node slots %s); %s. "
            "This worker ends its process (exit status %d) so that every worker group ends, the agents retire the "
            "named node(s) and restart from the newest RECOVERY_VERIFIED step (%s)", fault.step, list(fault.ranks),
            list(fault.slots), "the agent published it" if fault_acknowledged(self.directory, self.generation) else
            f"the agent did not publish it within {ACK_TIMEOUT_S:g}s: only a named node that reads its own record "
            "retires", HANG_EXIT_CODE, "none" if verified is None else verified)

    def after_step(self, session: Any) -> None:
        """After each optimizer step: end the generation once recovery must be RECOVERY_VERIFIED."""
        ledger = session.ledger
        if self.step is None or (ledger is not None and not ledger.requires_verified_recovery):
            return
        verified = ledger.recovery_verified_step if ledger is not None else None
        fault = fault_for(self.run_id, self.generation, "sdc", self.ranks, self.local_world_size, self.step,
                          verified)
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
