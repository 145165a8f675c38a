"""The node-local fault records and the agents' step selection behind SCOUT-named retirement
(the real-torchrun flow is tests/torchrun/test_retirement.py)."""

from __future__ import annotations

import json
import os
import time

import pytest

from lm_resiliency.scout.reports import CheckOutcome, ReplayResult
from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.retirement import FaultWatch, NodeFault, fault_for, read_fault, write_fault
from lm_resiliency.torchrun.selection import NodeReport, SelectionRefused, select_step
from tests.torchrun.test_backend import _restore_environment  # noqa: F401 - the autouse fixture


def _dir(tmp_path) -> str:
    directory = str(tmp_path / "ctx")
    ctx.ensure_private_dir(directory)
    return directory


def test_a_fault_names_node_slots_by_local_world_size_and_round_trips(tmp_path):
    directory = _dir(tmp_path)
    fault = fault_for("run", 3, "sdc", [5, 2, 5], local_world_size=2, step=8, verified_step=6)
    assert (fault.ranks, fault.slots) == ((2, 5), (1, 2))
    write_fault(directory, 0, fault)
    write_fault(directory, 1, fault)
    assert read_fault(directory, "run", 3) == fault
    assert read_fault(directory, "run", 2) is None and read_fault(directory, "other", 3) is None
    assert os.stat(os.path.join(directory, "fault-0.json")).st_mode & 0o777 == 0o600


def test_corrupt_or_disagreeing_fault_records_fail_closed(tmp_path):
    directory = _dir(tmp_path)
    write_fault(directory, 0, fault_for("run", 1, "sdc", [3], 2, 8, 6))
    write_fault(directory, 1, fault_for("run", 1, "sdc", [1], 2, 8, 6))
    with pytest.raises(ctx.ContextError, match="recorded different faults for generation 1"):
        read_fault(directory, "run", 1)
    doc = fault_for("run", 1, "sdc", [3], 2, 8, 6).to_json()
    for change in ({"kind": "bitflip"}, {"slots": [1, 0]}, {"verified_step": -2}, {"extra": 1}, {"step": True}):
        with open(os.path.join(directory, "fault-1.json"), "w") as f:
            json.dump(dict(doc, **change), f)
        with pytest.raises(ctx.ContextError, match="fault record|kind one of|sorted list|verified_step|step must"):
            read_fault(directory, "run", 1)


def test_worker_records_carry_the_verified_step_and_the_node_takes_the_minimum(tmp_path):
    directory = _dir(tmp_path)
    assert ctx.node_steps(directory, "run") is None
    ctx.write_worker_record(directory, 0, "run", 8, 2, 6)
    ctx.write_worker_record(directory, 1, "run", 6, 2, 6)
    ctx.write_worker_record(directory, 2, "other-run", 2, 2, -1)
    assert ctx.node_steps(directory, "run") == ctx.NodeSteps(latest=6, verified=6)
    with open(ctx.record_path(directory, 1), "w") as f:
        json.dump({"schema": ctx.RECORD_SCHEMA, "run_id": "run", "step": 6, "local_world_size": 2}, f)
    with pytest.raises(ctx.ContextError, match="not a worker record"):
        ctx.node_steps(directory, "run")


def test_selection_takes_the_latest_common_capture_without_a_fault():
    assert select_step([NodeReport(-1, -1, None)] * 2).source == "none"
    chosen = select_step([NodeReport(8, 6, None), NodeReport(6, 6, None), NodeReport(-1, -1, None)])
    assert (chosen.step, chosen.source, chosen.trust, chosen.retired_slots) == (6, "gemini", "latest", ())


def test_selection_after_a_fault_takes_the_newest_verified_step_every_node_holds():
    fault = fault_for("run", 0, "sdc", [3], 2, 8, 6)
    chosen = select_step([NodeReport(8, 6, fault), NodeReport(-1, -1, None)])  # survivor, fresh standby
    assert (chosen.step, chosen.trust, chosen.retired_slots) == (6, "recovery_verified", (1,))
    assert "node slots [1] retired: step 6, the newest RECOVERY_VERIFIED step" in chosen.reason
    assert select_step([NodeReport(8, 6, fault), NodeReport(8, 4, None)]).step == 4
    with pytest.raises(SelectionRefused, match="a node holds none"):
        select_step([NodeReport(8, -1, fault_for("run", 0, "sdc", [3], 2, 8, None))])


class _Ledger:
    def __init__(self, latched: bool, verified) -> None:
        self.requires_verified_recovery = latched
        self.recovery_verified_step = verified

    def verified_steps(self) -> list:
        return [] if self.recovery_verified_step is None else [self.recovery_verified_step, 2]


class _Session:
    def __init__(self, ledger) -> None:
        self.ledger = ledger
        self.kept = False

    def keep_state_for_relaunch(self) -> None:
        self.kept = True


def _check(verdict: str, faulty=()) -> CheckOutcome:
    return CheckOutcome("output", "0", (0, 1, 2, 3), {}, verdict, faulty)


def test_the_worker_ends_its_generation_only_once_the_ledger_requires_verified_recovery(tmp_path):
    from lm_resiliency.torchrun.retirement import TorchrunFaultDetected

    directory = _dir(tmp_path)
    watch = FaultWatch("run", 2, directory, local_rank=1, local_world_size=2)
    watch.after_step(_Session(_Ledger(True, 6)))  # no SCOUT verdict yet: nothing to do
    watch.on_replay_result(ReplayResult(8, (_check("clean"),)))  # healthy: nothing to note
    watch.on_replay_result(ReplayResult(8, (_check("clean"), _check("sdc", (3,)))))
    session = _Session(_Ledger(False, 6))
    watch.after_step(session)  # the verdict's boundary has not latched yet
    session.ledger.requires_verified_recovery = True
    with pytest.raises(TorchrunFaultDetected, match=r"SDC at step 8 on global ranks \[3\] \(node slots \[1\]\)"):
        watch.after_step(session)
    assert session.kept
    assert read_fault(directory, "run", 2) == NodeFault("run", 2, "sdc", (3,), (1,), 8, 6)


def test_a_verified_generation_loads_nothing_unless_the_ledger_certified_its_step():
    from lm_resiliency.gemini.manager import RecoveryUnavailable
    from lm_resiliency.torchrun.retirement import require_verified_step

    def context(step: int, trust: str = "recovery_verified") -> ctx.RestartContext:
        return ctx.RestartContext("run", "n" * 32, 1, 0, 2, ctx.topology_digest("run", 2), None, step, "gemini",
                                  "same-node restart", trust=trust, reason="SDC on rank 3")
    require_verified_step(_Session(_Ledger(True, 6)), context(6))
    require_verified_step(_Session(_Ledger(True, 6)), context(2))  # older verified steps are fine too
    require_verified_step(_Session(None), context(8, trust="latest"))
    with pytest.raises(RecoveryUnavailable, match=r"RECOVERY_VERIFIED step 8 \(SDC on rank 3\), but this run's "
                                                  r"trust ledger certifies \[6, 2\]; loading nothing"):
        require_verified_step(_Session(_Ledger(True, 6)), context(8))
    with pytest.raises(RecoveryUnavailable, match=r"certifies no step \(SCOUT is off\)"):
        require_verified_step(_Session(None), context(6))


def test_a_retired_node_may_not_rejoin_the_run(tmp_path, monkeypatch):
    from torch.distributed import FileStore

    from lm_resiliency.integrations.torchrun import create_rendezvous_handler, derive_torchrun_node_id
    from lm_resiliency.torchrun.backend import RendezvousRefused
    from lm_resiliency.torchrun.coordinator import run_store
    from tests.torchrun.test_backend import _params
    from tests.torchrun.launcher import machine_id_file

    monkeypatch.setenv("LM_RESILIENCY_MACHINE_ID_PATH", machine_id_file(str(tmp_path), "faulty"))
    run_id = "retired-run"
    # What `_retire` leaves in the store before the agent exits.
    run_store(FileStore(str(tmp_path / "rdzv")), run_id).set(f"retired/{derive_torchrun_node_id()}",
                                                            "SCOUT found sdc at step 8 on global ranks [3]")
    with pytest.raises(RendezvousRefused, match=r"was retired from run 'retired-run' \(SCOUT found sdc at step 8 "
                                                r"on global ranks \[3\]\); it may not rejoin"):
        create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2))
    create_rendezvous_handler(_params(tmp_path, run_id="another-run", max_nodes=2)).shutdown()


class _Exited(BaseException):
    pass


def _hang(ranks, kind: str = "hang", scope: str = "rank"):
    from lm_resiliency.scout.reports import SCOUTFaultReport

    return SCOUTFaultReport(kind=kind, scope=scope, ranks=tuple(ranks), step=8)


def test_the_worker_that_reports_a_hang_records_it_waits_for_its_agent_and_ends_its_process(tmp_path, monkeypatch):
    import threading

    from lm_resiliency.torchrun import retirement

    def exit_(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(retirement.os, "_exit", exit_)
    directory = _dir(tmp_path)
    watch = FaultWatch("run", 2, directory, local_rank=0, local_world_size=2)
    session = _Session(_Ledger(False, 6))
    watch.on_hang_report(_hang([2], kind="dataloader_stall"), session)  # a local stall names no node
    watch.on_hang_report(_hang([0, 1, 2, 3], scope="peer_group"), session)  # nor a hang SCOUT could not narrow
    assert read_fault(directory, "run", 2) is None and not session.kept

    def agent() -> None:  # what the agent's monitor loop does once it sees the record
        while read_fault(directory, "run", 2) is None:
            time.sleep(0.05)
        retirement.acknowledge_fault(directory, 1)  # an older generation's acknowledgement is not this one's
        time.sleep(0.5)
        retirement.acknowledge_fault(directory, 2)

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    begun = time.monotonic()
    with pytest.raises(_Exited) as exited:
        watch.on_hang_report(_hang([3, 2]), session)
    assert exited.value.args == (retirement.HANG_EXIT_CODE,) and time.monotonic() - begun >= 0.5
    assert session.kept
    assert read_fault(directory, "run", 2) == NodeFault("run", 2, "hang", (2, 3), (1,), 8, 6)


def test_a_hang_report_ends_the_process_even_when_recording_fails(tmp_path, monkeypatch):
    from lm_resiliency.torchrun import retirement

    def exit_(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(retirement.os, "_exit", exit_)
    watch = FaultWatch("run", 2, str(tmp_path / "missing"), local_rank=0, local_world_size=2)
    with pytest.raises(_Exited) as exited:
        watch.on_hang_report(_hang([2]), _Session(_Ledger(False, 6)))
    assert exited.value.args == (retirement.HANG_EXIT_CODE,)


def test_the_agent_publishes_its_nodes_hang_record_and_the_named_agent_retires_before_joining(tmp_path, monkeypatch):
    from torch.distributed import FileStore

    from lm_resiliency.integrations.torchrun import create_rendezvous_handler
    from lm_resiliency.torchrun.coordinator import run_store
    from lm_resiliency.torchrun.retirement import NodeRetired, fault_acknowledged
    from tests.torchrun.launcher import machine_id_file
    from tests.torchrun.test_backend import _params

    monkeypatch.setenv("LM_RESILIENCY_MACHINE_ID_PATH", machine_id_file(str(tmp_path), "observer"))
    run_id = "hang-run"
    observer = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2))
    observer.next_rendezvous()
    generation = ctx.read_context(str(tmp_path / "ctx-a" / "context.json")).generation
    store = run_store(FileStore(str(tmp_path / "rdzv")), run_id)
    assert observer.num_nodes_waiting() == 0 and not store.check([f"retire/{generation}/1"])
    hang = fault_for(run_id, generation, "hang", [2], 2, 8, 6)
    write_fault(str(tmp_path / "ctx-a"), 0, hang)
    observer.num_nodes_waiting()
    assert json.loads(store.get(f"retire/{generation}/1")) == hang.to_json()
    assert fault_acknowledged(str(tmp_path / "ctx-a"), generation)
    assert not fault_acknowledged(str(tmp_path / "ctx-a"), generation + 1)
    # The named agent (slot 0 of this one-node run, so name slot 0) finds the key before joining.
    store.set(f"retire/{generation}/0", json.dumps(fault_for(run_id, generation, "hang", [1], 2, 8, 6).to_json()))
    with pytest.raises(NodeRetired):
        observer.next_rendezvous()
    assert b"SCOUT found hang at step 8 on global ranks [1]" in store.get(
        f"retired/{observer.node_id}")
    observer.shutdown()
