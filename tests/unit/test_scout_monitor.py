"""SCOUT OOB monitor: beacon, hang localization, local stalls, lifecycle, instrumentation."""

import json
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils.data import DataLoader, Dataset

from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.instrument import (
    InstrumentedDataLoader,
    checkpoint_io,
    instrument_dataloader,
    trace_collectives,
)
from lm_resiliency.scout.monitor import (
    COLLECTIVE_OPS,
    THREAD_NAME_PREFIX,
    MonitorError,
    OOBMonitor,
    ProgressBeacon,
    RankView,
    is_communication_op,
    localize_hang,
    observer_ranks,
)
from lm_resiliency.scout.reports import CHECKPOINT_IO_STALL, DATALOADER_STALL, HANG, SCOPE_RANK

pytestmark = pytest.mark.timeout(120)


def _config(hang=0.6, poll=0.05, dataloader=60.0, checkpoint=60.0):
    return ReplayHarnessConfig(hang_stall_threshold_s=hang, monitor_poll_interval_s=poll,
                               dataloader_stall_threshold_s=dataloader, checkpoint_io_stall_threshold_s=checkpoint)


def _wait_for(predicate, timeout, interval=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def _lmr_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


@pytest.fixture
def monitors():
    """Monitors created by a test; all closed (and verified gone) afterwards."""
    created = []
    yield created
    for monitor in created:
        monitor.close()
    assert _lmr_threads() == []


def _make_store(kind, tmp_path, world):
    if kind == "hash":
        return dist.HashStore()
    return dist.FileStore(str(tmp_path / "oob-store"), world)


# --------------------------------------------------------------------------------------- beacon


def test_beacon_counts_progress_on_exit_not_enter():
    beacon = ProgressBeacon()
    snap = beacon.snapshot()
    assert (snap["completed"], snap["activity"], snap["op"], snap["step"]) == (0, 0, None, None)
    time.sleep(0.05)
    beacon.enter("all_reduce", step=3)
    snap = beacon.snapshot()
    assert snap["op"] == "all_reduce" and snap["step"] == 3 and snap["activity"] == 1
    assert snap["idle_s"] >= 0.05, "entering an op is not progress"
    beacon.enter("dataloader:train")            # nested
    assert beacon.snapshot()["op"] == "dataloader:train"
    beacon.exit("dataloader:train")
    beacon.exit("all_reduce")
    snap = beacon.snapshot()
    assert snap["op"] is None and snap["completed"] == 2 and snap["collectives"] == 1
    assert snap["last_op"] == "all_reduce" and snap["idle_s"] < 0.05
    beacon.exit("never-entered")                 # unmatched exit: ignored
    assert beacon.snapshot()["completed"] == 2
    beacon.progress(4)
    assert beacon.step == 4
    json.dumps(beacon.snapshot())


def test_beacon_exit_closes_ops_left_open_inside():
    beacon = ProgressBeacon()
    beacon.enter("checkpoint:write:periodic")
    beacon.enter("barrier")                      # raised: never exited
    beacon.exit("checkpoint:write:periodic")
    assert beacon.snapshot()["active"] == []


def test_beacon_current_op_is_the_training_threads():
    beacon = ProgressBeacon()
    beacon.progress(0)                           # this thread is the training thread
    beacon.enter("all_reduce")
    background = threading.Thread(target=beacon.enter, args=("checkpoint:write:async",))
    background.start()
    background.join()
    snap = beacon.snapshot()
    assert snap["op"] == "all_reduce"
    assert [a["op"] for a in snap["active"]] == ["all_reduce", "checkpoint:write:async"]


def test_beacon_overhead_is_tiny():
    beacon = ProgressBeacon()
    n = 20000
    start = time.perf_counter()
    for i in range(n):
        beacon.enter("all_reduce")
        beacon.exit("all_reduce")
    per_pair_us = (time.perf_counter() - start) / n * 1e6
    assert per_pair_us < 50, per_pair_us        # typically ~1-2 us
    assert beacon.snapshot()["completed"] == n


def test_communication_op_classification():
    assert is_communication_op("all_reduce") and is_communication_op("barrier(group=[2,3])")
    assert is_communication_op("comm:pipeline-recv")
    assert not is_communication_op(None) and not is_communication_op("dataloader:train")
    assert not is_communication_op("checkpoint:write:x") and not is_communication_op("forward")


def test_observer_ranks_are_spread():
    assert observer_ranks(4) == (0, 1, 2, 3)
    assert observer_ranks(64) == (0, 16, 32, 48)
    assert observer_ranks(1) == (0,)
    assert observer_ranks(3, count=8) == (0, 1, 2)


# ------------------------------------------------------------------------------------ hang rule


def _v(rank, idle, op=None, op_age=None, collectives=10, step=5, last_op="all_reduce", activity=50):
    return RankView(rank=rank, host=f"h{rank}", idle_s=idle, op=op,
                    op_age_s=op_age if op_age is not None else (idle if op else None),
                    last_op=last_op, completed=collectives, collectives=collectives, step=step,
                    activity=activity)


def test_no_verdict_without_stall_or_before_activity():
    assert localize_hang({r: _v(r, 0.5, "all_reduce") for r in range(4)}, 4, 2.0) is None
    idle = {r: _v(r, 99.0, activity=0) for r in range(4)}
    assert localize_hang(idle, 4, 2.0) is None   # nothing ever happened: not armed


def test_the_rank_inside_the_odd_collective_is_named_not_the_waiters():
    views = {r: _v(r, 3.0, "all_reduce") for r in (0, 1, 3)}
    views[2] = _v(2, 3.0, "barrier(group=[2,3])")
    verdict = localize_hang(views, 4, 2.0)
    assert verdict.culprits == (2,) and verdict.rule == "minority_op"
    assert verdict.stalled == (0, 1, 2, 3)


def test_waiters_crossing_the_threshold_first_do_not_get_blamed():
    # The waiters entered their collective a little before rank 2 stopped: they cross the
    # threshold first, rank 2 is still counted as a candidate (idle >= threshold / 2).
    views = {r: _v(r, 2.05, "all_reduce") for r in (0, 1, 3)}
    views[2] = _v(2, 1.7, "barrier(group=[2,3])")
    verdict = localize_hang(views, 4, 2.0)
    assert verdict.culprits == (2,)


def test_lagging_collective_counter_names_the_rank_behind():
    # NCCL-style: collectives return at launch; everyone is outside any op, rank 1 never
    # launched the last collective.
    views = {r: _v(r, 5.0, None, collectives=11) for r in range(4)}
    views[1] = _v(1, 5.2, None, collectives=10, last_op="dataloader:train")
    verdict = localize_hang(views, 4, 2.0)
    assert verdict.culprits == (1,) and verdict.rule == "collective_lag"


def test_lagging_step_wins():
    views = {r: _v(r, 5.0, "all_reduce", step=8) for r in range(4)}
    views[3] = _v(3, 5.0, "all_reduce", step=7)
    assert localize_hang(views, 4, 2.0).culprits == (3,)


def test_rank_blocked_outside_collectives_while_others_wait_inside():
    views = {r: _v(r, 5.0, "all_reduce") for r in range(4)}
    views[0] = _v(0, 5.0, None)                  # stuck in its own compute
    verdict = localize_hang(views, 4, 2.0)
    assert verdict.culprits == (0,) and verdict.rule == "self_blocked"


def test_earliest_op_breaks_a_two_rank_tie():
    views = {0: _v(0, 9.0, "all_reduce", op_age=9.0), 1: _v(1, 9.0, "broadcast", op_age=4.0)}
    verdict = localize_hang(views, 2, 2.0)
    assert verdict.culprits == (0,) and verdict.rule == "earliest_op"


def test_ranks_still_progressing_are_never_blamed():
    views = {0: _v(0, 0.1, "all_reduce"), 1: _v(1, 0.2, None), 2: _v(2, 3.0, "recv"), 3: _v(3, 3.1, "send")}
    verdict = localize_hang(views, 4, 2.0)
    assert set(verdict.culprits) <= {2, 3} and verdict.candidates == (2, 3)


def test_indistinguishable_ranks_are_named_together_with_low_confidence():
    views = {r: _v(r, 3.0, "all_reduce") for r in range(4)}
    verdict = localize_hang(views, 4, 2.0, op_margin_s=0.5)
    assert verdict.culprits == (0, 1, 2, 3) and verdict.rule == "all_stalled" and verdict.confidence < 0.5


def test_silent_ranks_are_named_when_everyone_else_waits():
    views = {r: _v(r, 3.0, "all_reduce") for r in (0, 1, 2)}
    verdict = localize_hang(views, 4, 2.0)
    assert verdict.culprits == (3,) and verdict.rule == "missing_monitor"


# ------------------------------------------------------------------------- monitor end to end


def _start_job(store, world, config, reports, monitors):
    beacons = [ProgressBeacon() for _ in range(world)]
    for rank, beacon in enumerate(beacons):
        monitor = OOBMonitor(store, rank, world, config, beacon, host=f"host{rank // 2}",
                             on_report=lambda report, rank=rank: reports.append((rank, report, time.monotonic())))
        monitors.append(monitor)
        monitor.start()
    return beacons


def _settle(monitors, ranks=None):
    """Publish every rank's current state now (a loaded CI host can delay a monitor thread, and a
    snapshot taken mid-scenario would show a state the test never meant to create)."""
    for rank, monitor in enumerate(monitors):
        if ranks is None or rank in ranks:
            monitor.poll()


def _healthy_steps(beacons, steps, pause=0.01):
    for step in range(steps):
        for beacon in beacons:
            beacon.enter("all_reduce", step=step)
        for beacon in beacons:
            beacon.exit("all_reduce")
            beacon.progress(step)
        time.sleep(pause)


@pytest.mark.parametrize("store_kind", ["hash", "file"])
def test_hang_is_reported_once_naming_the_stuck_rank(tmp_path, monitors, store_kind):
    world, config = 4, _config(hang=0.6, poll=0.05)
    reports = []
    beacons = _start_job(_make_store(store_kind, tmp_path, world), world, config, reports, monitors)
    _healthy_steps(beacons, 40)                  # ~0.4 s of healthy steps: no report
    assert reports == []
    blocked_at = time.monotonic()
    beacons[2].enter("barrier(group=[2,3])")     # rank 2 waits in a collective nobody else joins
    for rank in (0, 1, 3):
        beacons[rank].enter("all_reduce")        # ... and everyone else waits for rank 2
    _settle(monitors)
    assert _wait_for(lambda: reports, timeout=5 * config.hang_stall_threshold_s)
    time.sleep(6 * config.monitor_poll_interval_s)   # more polls: still exactly one report
    assert len(reports) == 1, [(r, rep.ranks) for r, rep, _ in reports]
    reporter, report, at = reports[0]
    latency = at - blocked_at
    assert config.hang_stall_threshold_s * 0.8 <= latency <= 2 * config.hang_stall_threshold_s, latency
    assert reporter == 0                          # the lowest healthy observer (live monitor)
    assert report.kind == HANG and report.scope == SCOPE_RANK and report.ranks == (2,)
    assert report.hosts == ("host1",) and report.resource == "barrier(group=[2,3])"
    assert report.step == 39 and report.evidence["rule"] == "minority_op"
    assert set(report.evidence["ranks"]) == {"0", "1", "2", "3"}
    assert report.evidence["ranks"]["0"]["op"] == "all_reduce"
    assert report.evidence["stalled_s"]["2"] >= config.hang_stall_threshold_s / 2
    assert max(v["idle_s"] for v in report.evidence["ranks"].values()) >= config.hang_stall_threshold_s
    assert json.loads(json.dumps(report, allow_nan=False)) == report   # JSON-ready as handed over


def test_hang_of_the_lowest_rank_is_localized_by_lagging_collectives(monitors):
    world, config = 4, _config(hang=0.5, poll=0.05)
    reports = []
    beacons = _start_job(dist.HashStore(), world, config, reports, monitors)
    _healthy_steps(beacons, 5)
    # NCCL-like: ranks 1..3 launched the next collective (returns at once) and block in a sync;
    # rank 0 never launched it.
    for rank in (1, 2, 3):
        beacons[rank].enter("all_reduce")
        beacons[rank].exit("all_reduce")
    _settle(monitors)
    assert _wait_for(lambda: reports, timeout=3.0)
    time.sleep(0.3)
    assert [(reporter, report.ranks, report.evidence["rule"]) for reporter, report, _ in reports] == \
        [(0, (0,), "collective_lag")]              # rank 0's monitor is alive: it reports itself


def test_a_dead_reporter_is_replaced_by_the_next_live_observer(monitors):
    world, config = 4, _config(hang=0.4, poll=0.05)
    reports = []
    beacons = _start_job(dist.HashStore(), world, config, reports, monitors)
    _healthy_steps(beacons, 5)
    monitors[0].close()                          # rank 0's process is frozen: its snapshot stops
    for rank in (1, 2, 3):
        beacons[rank].enter("all_reduce")        # the others wait for it
    _settle(monitors, ranks=(1, 2, 3))
    assert _wait_for(lambda: reports, timeout=6.0)
    time.sleep(0.3)
    assert [(reporter, report.ranks) for reporter, report, _ in reports] == [(1, (0,))]
    assert reports[0][1].evidence["monitor_silent"] == [0]


def test_a_new_hang_after_recovery_is_reported_again(monitors):
    world, config = 2, _config(hang=0.4, poll=0.05)
    reports = []
    beacons = _start_job(dist.HashStore(), world, config, reports, monitors)
    _healthy_steps(beacons, 3)
    beacons[1].enter("recv")
    beacons[0].enter("all_reduce")
    _settle(monitors)
    assert _wait_for(lambda: len(reports) == 1, timeout=3.0)
    beacons[1].exit("recv")
    beacons[0].exit("all_reduce")
    _healthy_steps(beacons, 10)
    time.sleep(0.2)
    assert len(reports) == 1
    beacons[1].enter("recv")
    beacons[0].enter("all_reduce")
    _settle(monitors)
    assert _wait_for(lambda: len(reports) == 2, timeout=3.0)
    time.sleep(0.3)
    assert len(reports) == 2 and all(report.kind == HANG for _, report, _ in reports)


def test_healthy_job_produces_no_report(monitors):
    world, config = 4, _config(hang=0.3, poll=0.05)
    reports = []
    beacons = _start_job(dist.HashStore(), world, config, reports, monitors)
    _healthy_steps(beacons, 100)                 # ~1 s, > 3x the threshold
    assert reports == []


# ---------------------------------------------------------------------------------- local stalls


class _SlowDataset(Dataset):
    def __init__(self, slow_index, delay_s):
        self.slow_index, self.delay_s = slow_index, delay_s

    def __len__(self):
        return 6

    def __getitem__(self, index):
        if index == self.slow_index:
            time.sleep(self.delay_s)
        return torch.tensor([float(index)])


def test_dataloader_stall_is_reported_by_the_stalled_rank(monitors):
    config = _config(hang=60.0, poll=0.05, dataloader=0.3)
    beacon, reports = ProgressBeacon(), []
    monitor = OOBMonitor(dist.HashStore(), 0, 1, config, beacon, host="nodeA", on_report=reports.append)
    monitors.append(monitor)
    loader = instrument_dataloader(DataLoader(_SlowDataset(2, 0.8), batch_size=1), beacon, name="train")
    monitor.start()
    batches = []
    for step, batch in enumerate(loader):
        batches.append(batch)
        beacon.progress(step)
    assert len(batches) == 6
    time.sleep(0.2)
    assert len(reports) == 1, reports
    report = reports[0]
    assert report.kind == DATALOADER_STALL and report.scope == "rank" and report.ranks == (0,)
    assert report.resource == "dataloader:train" and report.hosts == ("nodeA",)
    assert 0.3 <= report.evidence["duration_s"] < 0.8 and report.evidence["threshold_s"] == 0.3
    assert report.step == 1                      # the step reached before the slow batch
    assert json.loads(json.dumps(report, allow_nan=False)) == report   # JSON-ready as handed over


def test_checkpoint_io_stall_is_reported(monitors):
    config = _config(hang=60.0, poll=0.05, checkpoint=0.3)
    beacon, reports = ProgressBeacon(), []
    monitor = OOBMonitor(dist.HashStore(), 0, 1, config, beacon, on_report=reports.append)
    monitors.append(monitor)
    monitor.start()
    beacon.progress(7)
    with checkpoint_io(beacon, "write", "periodic"):
        time.sleep(0.1)                          # fast write: nothing
    with checkpoint_io(beacon, "read", "recovery"):
        time.sleep(0.7)                          # slow read: one report
    time.sleep(0.2)
    assert [(r.kind, r.resource, r.ranks, r.step) for r in reports] == \
        [(CHECKPOINT_IO_STALL, "checkpoint:read:recovery", (0,), 7)]
    assert reports[0].evidence["duration_s"] >= 0.3


def test_checkpoint_io_rejects_bad_kind_and_name():
    beacon = ProgressBeacon()
    with pytest.raises(ValueError, match="kind"):
        checkpoint_io(beacon, "delete", "x")
    with pytest.raises(ValueError, match="name"):
        checkpoint_io(beacon, "write", "")
    with checkpoint_io(None, "write", "x"):      # SCOUT disabled: marks nothing
        pass


def test_hang_inside_an_instrumented_op_is_left_to_the_local_stall_report(monitors):
    world, config = 4, _config(hang=0.4, poll=0.05, dataloader=0.4)
    reports = []
    beacons = _start_job(dist.HashStore(), world, config, reports, monitors)
    _healthy_steps(beacons, 3)
    beacons[3].enter("dataloader:train")         # rank 3's loader is stuck
    for rank in (0, 1, 2):
        beacons[rank].enter("all_reduce")        # the others wait for it
    _settle(monitors)
    assert _wait_for(lambda: reports, timeout=3.0)
    time.sleep(0.5)
    assert [(reporter, report.kind, report.ranks) for reporter, report, _ in reports] == \
        [(3, DATALOADER_STALL, (3,))]


# -------------------------------------------------------------------------------------- lifecycle


def test_close_stops_the_thread_and_is_idempotent(monitors):
    beacon = ProgressBeacon()
    store = dist.HashStore()
    monitor = OOBMonitor(store, 0, 1, _config(poll=0.05), beacon, on_report=lambda r: None)
    monitor.start()
    monitor.start()                               # idempotent
    assert monitor.running and len(_lmr_threads()) == 1
    assert _wait_for(lambda: store.check(["lm_resiliency/oob/snapshot/0"]), timeout=2.0)
    doc = json.loads(store.get("lm_resiliency/oob/snapshot/0"))
    assert doc["rank"] == 0 and doc["v"] == 1
    started = time.monotonic()
    monitor.close()
    assert time.monotonic() - started < 1.0
    monitor.close()
    assert not monitor.running and _lmr_threads() == []
    with pytest.raises(MonitorError, match="closed"):
        monitor.start()


def test_callback_failures_surface_through_check(monitors):
    config = _config(hang=60.0, poll=0.05, checkpoint=0.1)
    beacon = ProgressBeacon()

    def broken(report):
        raise RuntimeError("manager unreachable")

    monitor = OOBMonitor(dist.HashStore(), 0, 1, config, beacon, on_report=broken)
    monitors.append(monitor)
    monitor.start()
    monitor.check()
    def surfaced():
        try:
            monitor.check()
        except MonitorError as exc:
            return "manager unreachable" in str(exc)
        return False

    with checkpoint_io(beacon, "write", "w"):
        assert _wait_for(surfaced, timeout=2.0)
    with pytest.raises(MonitorError, match="manager unreachable"):
        monitor.check()


def test_monitor_validates_arguments():
    beacon, store, config = ProgressBeacon(), dist.HashStore(), _config()
    with pytest.raises(ValueError, match="rank"):
        OOBMonitor(store, 4, 4, config, beacon, on_report=print)
    with pytest.raises(ValueError, match="world_size"):
        OOBMonitor(store, 0, 0, config, beacon, on_report=print)
    with pytest.raises(TypeError, match="config"):
        OOBMonitor(store, 0, 1, object(), beacon, on_report=print)
    with pytest.raises(TypeError, match="on_report"):
        OOBMonitor(store, 0, 1, config, beacon, on_report=None)


def test_missing_and_malformed_snapshots_never_block(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    store.set("lm_resiliency/oob/snapshot/1", "not json")
    monitor = OOBMonitor(store, 0, 3, _config(hang=60.0, poll=0.05), ProgressBeacon(), on_report=print)
    started = time.monotonic()
    monitor.poll()                                # rank 1 malformed, rank 2 missing
    monitor.poll()
    assert time.monotonic() - started < 0.5


# -------------------------------------------------------------------------------- instrumentation


def test_instrumented_dataloader_behaves_like_the_loader():
    beacon = ProgressBeacon()
    loader = DataLoader(list(range(10)), batch_size=4)
    wrapped = instrument_dataloader(loader, beacon, name="val")
    assert isinstance(wrapped, InstrumentedDataLoader) and not isinstance(wrapped, DataLoader)
    assert wrapped.dataloader is loader and len(wrapped) == 3
    assert wrapped.batch_size == 4 and wrapped.dataset is loader.dataset
    assert [b.tolist() for b in wrapped] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    snap = beacon.snapshot()
    assert snap["completed"] == 4 and snap["last_op"] == "dataloader:val"  # 3 batches + StopIteration
    assert instrument_dataloader(wrapped, beacon, name="val") is wrapped
    assert instrument_dataloader(loader, None) is loader
    with pytest.raises(ValueError, match="name"):
        instrument_dataloader(loader, beacon, name="")


@pytest.fixture
def single_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _namespaces():
    return {(mod.__name__, name): mod.__dict__.get(name) for mod in (dist, c10d) for name in COLLECTIVE_OPS}


def test_trace_collectives_marks_calls_and_restores_originals(single_rank_group):
    before = _namespaces()
    beacon = ProgressBeacon()
    handle = trace_collectives(beacon)
    try:
        assert dist.all_reduce is not before[("torch.distributed", "all_reduce")]
        assert dist.all_reduce is c10d.all_reduce and dist.barrier is c10d.barrier
        assert {"all_reduce", "barrier", "broadcast", "send", "recv", "isend"} <= set(handle.names)
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        dist.broadcast(tensor, src=0)
        sub = dist.new_group([0])
        dist.all_reduce(tensor, group=sub)
        assert beacon.snapshot()["last_op"] == "all_reduce(group=[0])"
        dist.barrier()
        out = [None]
        dist.all_gather_object(out, {"a": 1})    # nested: all_gather_object -> all_gather
        snap = beacon.snapshot()
        assert snap["collectives"] >= 5 and snap["last_op"] == "all_gather_object" and snap["active"] == []
    finally:
        handle.remove()
    assert _namespaces() == before
    handle.remove()                               # idempotent
    assert _namespaces() == before
    completed = beacon.snapshot()["completed"]
    dist.all_reduce(torch.ones(1))
    assert beacon.snapshot()["completed"] == completed


def test_trace_collectives_does_not_clobber_a_later_wrapper(single_rank_group):
    before = _namespaces()
    beacon = ProgressBeacon()
    handle = trace_collectives(beacon)
    ours = dist.all_reduce
    calls = []

    def theirs(*args, **kwargs):
        calls.append(1)
        return ours(*args, **kwargs)

    dist.all_reduce = theirs
    try:
        handle.remove()
        assert dist.all_reduce is theirs          # left in place
        assert c10d.all_reduce is before[("torch.distributed.distributed_c10d", "all_reduce")]
        completed = beacon.snapshot()["completed"]
        dist.all_reduce(torch.ones(1))           # our wrapper inside theirs is now a pass-through
        assert calls == [1] and beacon.snapshot()["completed"] == completed
    finally:
        dist.all_reduce = before[("torch.distributed", "all_reduce")]
    assert _namespaces() == before


def test_two_traces_removed_out_of_order_restore_the_originals(single_rank_group):
    before = _namespaces()
    first, second = ProgressBeacon(), ProgressBeacon()
    h1 = trace_collectives(first)
    h2 = trace_collectives(second, names=["all_reduce", "barrier"])
    dist.all_reduce(torch.ones(1))
    assert first.snapshot()["completed"] == 1 and second.snapshot()["completed"] == 1
    h1.remove()
    dist.all_reduce(torch.ones(1))
    assert first.snapshot()["completed"] == 1 and second.snapshot()["completed"] == 2
    h2.remove()
    assert _namespaces() == before
    with pytest.raises(ValueError, match="unknown"):
        trace_collectives(first, names=["all_reduce", "not_a_collective"])
    assert _namespaces() == before
