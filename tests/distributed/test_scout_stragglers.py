"""Straggler detection on 4 real gloo ranks.

Slowness is injected with sleeps (the CI machine may have 2 cores for 4 processes, so CPU-bound
slowness would be drowned in scheduling noise); margins are tens of milliseconds.
"""

import contextlib
import time

import torch
import torch.distributed as dist

from lm_resiliency import enable_resiliency, wire
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.probes import CollectiveProbe, default_probe_groups, time_compute
from lm_resiliency.scout.reports import ReplayResult, replay_fault_reports
from lm_resiliency.scout.stragglers import CommunicationStragglerLocalizer, ComputeStragglerDetector
from tests.distributed.scout_workloads import make_model
from tests.harness import run_ranks

WORLD = 4
CONFIRM = 2
KERNEL_DEVICE_S = 0.05      # stand-in for device time inside the "compute kernel"
COMM_DELAY_S = 0.03         # added before each of the slow rank's all_reduces in the probe


def _config():
    return ReplayHarnessConfig(straggler_confirmation_rounds=CONFIRM, straggler_min_margin_s=0.015)


def _hosts(rank):
    # One synthetic host per rank, agreed through the wire like a real job would.
    return {r: h for r, h in enumerate(wire.all_gather_json(f"host-{rank}"))}


def _kernel(a, b, device_s):
    c = a
    for _ in range(3):
        c = torch.tanh(c @ b)
    time.sleep(device_s)
    return c


@contextlib.contextmanager
def _delayed_all_reduce(delay_s):
    """Test-only fault: this process's all_reduce sleeps `delay_s` before calling through."""
    if not delay_s:
        yield
        return
    original = dist.all_reduce

    def slow_all_reduce(*args, **kwargs):
        time.sleep(delay_s)
        return original(*args, **kwargs)

    dist.all_reduce = slow_all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def _report_docs(step, findings):
    docs = []
    for report in replay_fault_reports(ReplayResult(step, stragglers=tuple(findings))):
        doc = report.to_json()
        doc.pop("detected_at")
        docs.append(doc)
    return docs


def _compute_rank(rank, world, slow_rank, rounds, slow_from=0):
    torch.manual_seed(0)
    a, b = torch.randn(96, 96), torch.randn(96, 96) / 10
    detector = ComputeStragglerDetector(_config(), range(world), _hosts(rank))
    history = []
    for step in range(rounds):
        device_s = KERNEL_DEVICE_S * (3 if rank == slow_rank and step >= slow_from else 1)
        seconds = time_compute(lambda: _kernel(a, b, device_s), repeat=5)
        timings = dict(enumerate(wire.all_gather_json(seconds)))
        findings = detector.observe(timings)
        history.append({"timings": timings,
                        "findings": [[list(f.ranks), f.confirmed, f.evidence["onset"]] for f in findings],
                        "reports": _report_docs(step, findings)})
    return history


def _comm_rank(rank, world, slow_rank, rounds):
    localizer = CommunicationStragglerLocalizer(_config(), _hosts(rank))
    history = []
    with CollectiveProbe(default_probe_groups(world), rounds=5) as probe:
        for step in range(rounds):
            with _delayed_all_reduce(COMM_DELAY_S if rank == slow_rank else 0):
                latencies = probe.measure()
            findings = localizer.observe(latencies)
            history.append({"latencies": {",".join(map(str, g)): t for g, t in latencies.items()},
                            "findings": [[list(f.ranks), f.confirmed] for f in findings],
                            "reports": _report_docs(step, findings)})
    return history


def _assert_same_on_every_rank(results):
    for rank, result in enumerate(results[1:], start=1):
        assert result == results[0], f"rank {rank} reached a different verdict than rank 0"


def test_compute_straggler_confirmed_on_every_rank():
    # rank 2 is healthy for two rounds, then 3x slower for three
    results = run_ranks(_compute_rank, WORLD, 2, 5, 2, timeout=60)
    _assert_same_on_every_rank(results)
    history = results[0]
    for record in history[:2]:
        assert record["reports"] == [] and not any(f[1] for f in record["findings"]), record
    for slow_round, record in enumerate(history[2:], start=1):
        assert [f[0] for f in record["findings"]] == [[2]], record
        assert record["findings"][0][1] is (slow_round >= CONFIRM), record   # not before CONFIRM rounds
    assert history[2]["reports"] == []
    (report,) = history[-1]["reports"]
    assert (report["kind"], report["scope"], report["ranks"], report["hosts"]) == \
        ("compute_straggler", "rank", [2], ["host-2"])
    evidence = report["evidence"]
    assert evidence["slowdown"] > 2
    # rank 2 was seen healthy first: its own baseline is recorded next to the slow time
    assert evidence["baseline_rounds"] >= 1 and evidence["current_s"] > 1.5 * evidence["baseline_s"]


def test_communication_straggler_localized_by_cross_pg_intersection():
    results = run_ranks(_comm_rank, WORLD, 1, 3, timeout=60)
    _assert_same_on_every_rank(results)
    history = results[0]
    for step, record in enumerate(history):
        assert record["findings"] == [[[1], step + 1 >= CONFIRM]], record
    assert history[0]["reports"] == []
    (report,) = history[CONFIRM - 1]["reports"]
    assert (report["kind"], report["scope"], report["ranks"], report["hosts"]) == \
        ("communication_straggler", "node", [1], ["host-1"])
    evidence = report["evidence"]
    assert evidence["endpoint_rank"] == 1 and evidence["endpoint_host"] == "host-1"
    assert sorted(g["ranks"] for g in evidence["supporting_groups"]) == [[0, 1], [1, 2], [1, 3]]
    assert evidence["contradicting_groups"] == []
    assert 0 < report["confidence"] <= 1


def _healthy_rank(rank, world, rounds):
    return {"compute": _compute_rank(rank, world, None, rounds), "comm": _comm_rank(rank, world, None, rounds)}


def test_healthy_run_confirms_nothing():
    results = run_ranks(_healthy_rank, WORLD, 5, timeout=60)
    _assert_same_on_every_rank(results)
    for kind in ("compute", "comm"):
        for record in results[0][kind]:
            assert record["reports"] == [], (kind, record)
            assert not any(confirmed for _, confirmed, *_ in record["findings"]), (kind, record)


def _session_comm_rank(rank, world, slow_rank, steps, probe_interval):
    """enable_resiliency with a check every step and the probe every `probe_interval` steps;
    rank `slow_rank`'s Python all_reduces (the probe's; DDP's buckets are C++) are delayed."""
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = ReplayHarnessConfig(check_interval=1, communication_probe_interval=probe_interval,
                                 straggler_confirmation_rounds=CONFIRM, straggler_min_margin_s=0.015)
    session = enable_resiliency(ddp, optimizer, replay=config, enable_checkpoint=False, interval=1)
    history = {}
    with _delayed_all_reduce(COMM_DELAY_S if rank == slow_rank else 0):
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(100 * rank + step))
            ddp(tokens).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            result = session.last_replay_result
            assert result is not None and result.step == step
            history[step] = [[f.kind, list(f.ranks), f.confirmed] for f in result.stragglers
                             if f.kind == "communication"]
    session.close()
    return history


def test_session_probes_on_its_own_cadence_and_confirms_the_slow_endpoint():
    # Checks run at every step, the probe at steps 3 and 6 only: rank 2 is a suspect at step 3
    # and confirmed at step 6 (CONFIRM = 2 probe rounds), with nothing in between.
    results = run_ranks(_session_comm_rank, WORLD, 2, 6, 3, timeout=120)
    _assert_same_on_every_rank(results)
    history = results[0]
    assert {step: findings for step, findings in history.items() if step % 3} == {1: [], 2: [], 4: [], 5: []}
    assert history[3] == [["communication", [2], False]]
    assert history[6] == [["communication", [2], True]]
