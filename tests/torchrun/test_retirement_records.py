"""The node-local fault records and the agents' step selection behind SCOUT-named retirement
(the real-torchrun flow is tests/torchrun/test_retirement.py)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from lm_resiliency.scout.reports import CheckOutcome, ReplayResult
from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.binding import RoundBinding
from lm_resiliency.torchrun.retirement import FaultWatch, NodeFault, fault_for, read_fault, write_fault
from lm_resiliency.torchrun.selection import NodeReport, SelectionRefused, select_step
from lm_resiliency.torchrun.worker_records import WorkerRecord, node_steps, record_path, write_worker_record
from tests.torchrun.test_backend import _restore_environment  # noqa: F401 - the autouse fixture


LAUNCH, EARLIER = "1" * 32, "2" * 32
NODE = "n" * 32


def _dir(tmp_path) -> str:
    directory = str(tmp_path / "ctx")
    ctx.ensure_context_dir(directory)
    return directory


def _round(generation: int = 3, *, launch: str = LAUNCH, node: str = NODE, nodes: int = 2,
           nproc=2, run: str = "run") -> RoundBinding:
    return RoundBinding(run_id=run, launch_id=launch, node_id=node, generation=generation, nodes=nodes,
                        nproc_per_node=nproc)


def test_a_fault_names_node_slots_by_local_world_size_and_round_trips(tmp_path):
    directory = _dir(tmp_path)
    fault = fault_for(_round(3), "sdc", [5, 2, 5], local_world_size=2, step=8, verified_step=6)
    assert (fault.ranks, fault.slots, fault.launch_id, fault.node_id) == ((2, 5), (1, 2), LAUNCH, NODE)
    write_fault(directory, 0, fault)
    write_fault(directory, 1, fault)
    assert read_fault(directory, _round(3)) == (fault, [])
    assert os.stat(os.path.join(directory, "fault-0.json")).st_mode & 0o777 == 0o600
    for other in (_round(2), _round(3, run="other")):
        found, ignored = read_fault(directory, other)
        assert found is None and len(ignored) == 2


def test_a_fault_record_of_an_earlier_launch_is_ignored_never_acted_on(tmp_path):
    """Issue 22, item 2: rounds restart at 0 in every launch, so the record an earlier launch with
    the same --rdzv-id left for generation 0 must not retire this launch's node."""
    directory = _dir(tmp_path)
    write_fault(directory, 0, fault_for(_round(0, launch=EARLIER), "sdc", [0], 2, 8, 6))
    write_fault(directory, 1, fault_for(_round(0, node="m" * 32), "sdc", [0], 2, 8, 6))  # a copied directory
    found, ignored = read_fault(directory, _round(0))
    assert found is None
    assert any(f"fault-0.json: it was left by launch {EARLIER[:12]}" in line for line in ignored), ignored
    assert any("fault-1.json: it was written on another node" in line for line in ignored), ignored


def test_corrupt_unsafe_or_disagreeing_fault_records(tmp_path):
    directory = _dir(tmp_path)
    write_fault(directory, 0, fault_for(_round(1), "sdc", [3], 2, 8, 6))
    write_fault(directory, 1, fault_for(_round(1), "sdc", [1], 2, 8, 6))
    with pytest.raises(ctx.ContextError, match="recorded different faults for generation 1"):
        read_fault(directory, _round(1))
    doc = fault_for(_round(1), "sdc", [3], 2, 8, 6).to_json()
    for change, message in (({"kind": "bitflip"}, "kind must be one of"), ({"slots": [1, 0]}, "sorted list"),
                            ({"verified_step": -2}, "verified_step must be at least -1"),
                            ({"extra": 1}, r"unknown key\(s\)"), ({"step": True}, "step must be int")):
        with open(os.path.join(directory, "fault-1.json"), "w") as f:
            json.dump(dict(doc, **change), f)
        found, ignored = read_fault(directory, _round(1))  # the malformed one is ignored, with why
        assert found is not None and len(ignored) == 1 and re.search(message, ignored[0]), ignored
    os.chmod(os.path.join(directory, "fault-1.json"), 0o644)
    assert "has mode 644" in read_fault(directory, _round(1))[1][0]
    os.unlink(os.path.join(directory, "fault-1.json"))
    os.symlink(os.path.join(directory, "fault-0.json"), os.path.join(directory, "fault-1.json"))
    assert "is a symbolic link; refusing to follow it" in read_fault(directory, _round(1))[1][0]
    os.unlink(os.path.join(directory, "fault-1.json"))
    with open(os.path.join(directory, "fault-1.json"), "w") as f:
        f.write(json.dumps(doc)[:40])  # truncated
    os.chmod(os.path.join(directory, "fault-1.json"), 0o600)
    assert "not valid JSON" in read_fault(directory, _round(1))[1][0]


def _record(local_rank: int, step: int, *, launch: str = LAUNCH, generation: int = 1, node: str = NODE,
            lws: int = 2, nodes: int = 2, verified: int = -1, refused=()) -> WorkerRecord:
    return WorkerRecord(binding=_round(generation, launch=launch, node=node, nodes=nodes, nproc=lws), slot=0,
                        local_rank=local_rank, step=step, verified_step=verified, refused_steps=tuple(refused))


def test_worker_records_carry_the_verified_step_and_the_node_takes_the_minimum(tmp_path):
    directory = _dir(tmp_path)
    assert node_steps(directory, _round(3)).latest == -1
    write_worker_record(directory, _record(0, 8, verified=6))
    write_worker_record(directory, _record(1, 6, verified=6, refused=(10,)))
    steps = node_steps(directory, _round(3))
    assert (steps.latest, steps.verified, steps.refused, steps.ignored, steps.inherited_from) == (6, 6, (10,), (),
                                                                                                 None)
    with open(record_path(directory, 1), "w") as f:
        json.dump({"schema": "lm-resiliency-torchrun-worker/3", "run_id": "run", "step": 6}, f)
    steps = node_steps(directory, _round(3))
    assert steps.latest == 8 and "missing keys" in steps.ignored[0]


def test_stale_worker_records_are_ignored_with_why(tmp_path):
    """Issue 22, item 3: records of another run, node, width or topology, of a generation that has
    not run, and (when the agent cannot learn its --nproc-per-node) of an earlier launch."""
    directory = _dir(tmp_path)
    write_worker_record(directory, _record(0, 6, lws=3))  # a wider launch's record
    write_worker_record(directory, _record(1, 6, generation=3))
    write_worker_record(directory, _record(2, 6, lws=3))  # only exists with --nproc-per-node 3
    steps = node_steps(directory, _round(3))
    assert steps.latest == -1
    why = "\n".join(steps.ignored)
    assert "worker-0.json: it was recorded with LOCAL_WORLD_SIZE 3 (--nproc-per-node); this launch runs 2" in why
    assert "worker-1.json: it claims generation 3 of this launch, which has not run yet" in why
    assert "worker-2.json: it was recorded with LOCAL_WORLD_SIZE 3" in why
    write_worker_record(directory, _record(0, 6, nodes=3))
    write_worker_record(directory, _record(1, 4, node="m" * 32))
    write_worker_record(directory, _record(2, 4, launch=EARLIER, lws=3))
    why = "\n".join(node_steps(directory, _round(3)).ignored)
    assert "worker-0.json: it was recorded with 3 nodes; this round has 2" in why
    assert "worker-1.json: it was written on another node" in why
    write_worker_record(directory, _record(0, 6, launch=EARLIER))
    write_worker_record(directory, _record(1, 4, launch=EARLIER))
    unknown = node_steps(directory, _round(0, nproc=None))
    assert unknown.latest == -1 and "could not learn its own --nproc-per-node" in unknown.ignored[0]
    os.unlink(record_path(directory, 2))
    inherited = node_steps(directory, _round(0))
    assert (inherited.latest, inherited.inherited_from, inherited.ignored) == (4, EARLIER[:12], ())


def test_selection_takes_the_latest_common_capture_without_a_fault():
    assert select_step([NodeReport(latest=-1, verified=-1)] * 2).source == "none"
    chosen = select_step([NodeReport(latest=8, verified=6), NodeReport(latest=6, verified=6),
                          NodeReport(latest=-1, verified=-1)])
    assert (chosen.step, chosen.source, chosen.trust, chosen.retired_slots) == (6, "gemini", "latest", ())


def test_selection_never_repeats_a_step_a_generation_could_not_load():
    """Issue 22, item 3: the workers of a generation that could not load step 6 rewrote their
    records (what every rank can load: 4); a node whose workers died before that still names 6."""
    chosen = select_step([NodeReport(latest=4, verified=-1, refused=(6,)), NodeReport(latest=6, verified=-1)])
    assert (chosen.step, chosen.refused) == (4, (6,))
    fresh = select_step([NodeReport(latest=-1, verified=-1, refused=(6,)), NodeReport(latest=6, verified=6)])
    assert (fresh.source, fresh.refused) == ("none", (6,)) and "steps [6] could not be loaded" in fresh.reason


def test_selection_after_a_fault_takes_the_newest_verified_step_every_node_holds():
    fault = fault_for(_round(0), "sdc", [3], 2, 8, 6)
    chosen = select_step([NodeReport(latest=8, verified=6, fault=fault), NodeReport(latest=-1, verified=-1)])
    assert (chosen.step, chosen.trust, chosen.retired_slots) == (6, "recovery_verified", (1,))
    assert "node slots [1] retired: step 6, the newest RECOVERY_VERIFIED step" in chosen.reason
    assert select_step([NodeReport(latest=8, verified=6, fault=fault), NodeReport(latest=8, verified=4)]).step == 4
    with pytest.raises(SelectionRefused, match="a node holds none"):
        select_step([NodeReport(latest=8, verified=-1, fault=fault_for(_round(0), "sdc", [3], 2, 8, None))])


def test_node_reports_in_the_store_are_schema_checked():
    report = NodeReport(latest=6, verified=4, fault=fault_for(_round(2), "hang", [1], 2, 7, 4), refused=(8,),
                        node_id=NODE)
    data = json.dumps(report.to_json(2, 1)).encode()
    assert NodeReport.parse(data, "store key gen/2/node/1", 2, 1) == report
    with pytest.raises(ctx.ContextError, match="a report for generation 2 slot 1, not for generation 3 slot 1"):
        NodeReport.parse(data, "store key gen/3/node/1", 3, 1)
    for change, message in (({"latest": "6"}, "latest must be int"), ({"fault": {"kind": "sdc"}}, "fault"),
                            ({"node": NODE}, r"unknown key\(s\)")):
        with pytest.raises(ctx.ContextError, match=message):
            NodeReport.parse(json.dumps(dict(report.to_json(2, 1), **change)).encode(), "store key k", 2, 1)


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
    watch = FaultWatch(_round(2), directory, local_rank=1, local_world_size=2)
    watch.after_step(_Session(_Ledger(True, 6)))  # no SCOUT verdict yet: nothing to do
    watch.on_replay_result(ReplayResult(8, (_check("clean"),)))  # healthy: nothing to note
    watch.on_replay_result(ReplayResult(8, (_check("clean"), _check("sdc", (3,)))))
    session = _Session(_Ledger(False, 6))
    watch.after_step(session)  # the verdict's boundary has not latched yet
    session.ledger.requires_verified_recovery = True
    with pytest.raises(TorchrunFaultDetected, match=r"SDC at step 8 on global ranks \[3\] \(node slots \[1\]\)"):
        watch.after_step(session)
    assert session.kept
    assert read_fault(directory, _round(2))[0] == NodeFault(run_id="run", launch_id=LAUNCH, node_id=NODE, generation=2,
                                                           kind="sdc", ranks=(3,), slots=(1,), step=8, verified_step=6)


def test_a_verified_generation_loads_nothing_unless_the_ledger_certified_its_step():
    from lm_resiliency.gemini.manager import RecoveryUnavailable
    from lm_resiliency.torchrun.retirement import require_verified_step

    def context(step: int, trust: str = "recovery_verified") -> ctx.RestartContext:
        return ctx.RestartContext(run_id="run", launch_id=LAUNCH, node_id=NODE, generation=1, slot=0, nodes=2,
                                  nproc_per_node=2, topology_digest=ctx.topology_digest("run", 2), policy_digest=None,
                                  checkpoint_step=step, checkpoint_source="gemini", decision="same-node restart",
                                  trust=trust, reason="SDC on rank 3")
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
    from lm_resiliency.torchrun.launches import run_store
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
    watch = FaultWatch(_round(2), directory, local_rank=0, local_world_size=2)
    session = _Session(_Ledger(False, 6))
    watch.on_hang_report(_hang([2], kind="dataloader_stall"), session)  # a local stall names no node
    watch.on_hang_report(_hang([0, 1, 2, 3], scope="peer_group"), session)  # nor a hang SCOUT could not narrow
    assert read_fault(directory, _round(2))[0] is None and not session.kept

    def agent() -> None:  # what the agent's monitor loop does once it sees the record
        while read_fault(directory, _round(2))[0] is None:
            time.sleep(0.05)
        retirement.acknowledge_fault(directory, _round(1))  # an older generation's acknowledgement is not this one's
        time.sleep(0.3)
        retirement.acknowledge_fault(directory, _round(2, launch=EARLIER))  # nor another launch's
        time.sleep(0.3)
        retirement.acknowledge_fault(directory, _round(2))

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    begun = time.monotonic()
    with pytest.raises(_Exited) as exited:
        watch.on_hang_report(_hang([3, 2]), session)
    assert exited.value.args == (retirement.HANG_EXIT_CODE,) and time.monotonic() - begun >= 0.6
    assert session.kept
    assert read_fault(directory, _round(2))[0] == NodeFault(run_id="run", launch_id=LAUNCH, node_id=NODE, generation=2,
                                                           kind="hang", ranks=(2, 3), slots=(1,), step=8,
                                                           verified_step=6)


def test_a_hang_report_ends_the_process_even_when_recording_fails(tmp_path, monkeypatch):
    from lm_resiliency.torchrun import retirement

    def exit_(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(retirement.os, "_exit", exit_)
    watch = FaultWatch(_round(2), str(tmp_path / "missing"), local_rank=0, local_world_size=2)
    with pytest.raises(_Exited) as exited:
        watch.on_hang_report(_hang([2]), _Session(_Ledger(False, 6)))
    assert exited.value.args == (retirement.HANG_EXIT_CODE,)


def test_the_agent_publishes_its_nodes_hang_record_and_the_named_agent_retires_before_joining(tmp_path, monkeypatch):
    from torch.distributed import FileStore

    from lm_resiliency.integrations.torchrun import create_rendezvous_handler
    from lm_resiliency.torchrun.launches import launch_store
    from lm_resiliency.torchrun.retirement import NodeRetired, fault_acknowledged
    from tests.torchrun.launcher import machine_id_file
    from tests.torchrun.test_backend import _params

    monkeypatch.setenv("LM_RESILIENCY_MACHINE_ID_PATH", machine_id_file(str(tmp_path), "observer"))
    run_id = "hang-run"
    observer = create_rendezvous_handler(_params(tmp_path, run_id=run_id, max_nodes=2))
    observer.next_rendezvous()
    generation = ctx.read_context(str(tmp_path / "ctx-a" / "context.json"))[0].generation
    store = launch_store(FileStore(str(tmp_path / "rdzv")), run_id, observer.launch_id)
    assert observer.num_nodes_waiting() == 0 and not store.check([f"retire/{generation}/1"])
    binding = _round(generation, run=run_id, launch=observer.launch_id, node=observer.node_id, nodes=1)
    hang = fault_for(binding, "hang", [2], 2, 8, 6)
    write_fault(str(tmp_path / "ctx-a"), 0, hang)
    observer.num_nodes_waiting()
    assert json.loads(store.get(f"retire/{generation}/1")) == hang.to_json()
    assert fault_acknowledged(str(tmp_path / "ctx-a"), binding)
    assert not fault_acknowledged(str(tmp_path / "ctx-a"), _round(generation + 1, run=run_id,
                                                                  launch=observer.launch_id, node=observer.node_id))
    # The named agent (slot 0 of this one-node run, so name slot 0) finds the key before joining.
    store.set(f"retire/{generation}/0", json.dumps(fault_for(binding, "hang", [1], 2, 8, 6).to_json()))
    with pytest.raises(NodeRetired):
        observer.next_rendezvous()
    from lm_resiliency.torchrun.launches import run_store

    assert b"SCOUT found hang at step 8 on global ranks [1]" in run_store(FileStore(str(tmp_path / "rdzv")),
                                                                          run_id).get(f"retired/{observer.node_id}")
    observer.shutdown()
