"""DDP with lm-resiliency attached (GEMINI and SCOUT on) is numerically invisible: killed and
relaunched, it ends bitwise equal to the same loop run uninterrupted without lm-resiliency.

Two things could make it differ, both with 3 or more ranks only (a 2-rank sum `a + b` commutes):
DDP's gradient-bucket layout (the reducer starts from one bucket and rebuilds once after its first
backward, in gradient arrival order; a restarted process would spend its first iteration in the
initial layout) and the arithmetic of SCOUT's gradient trace (a comm hook; torch's `allreduce_hook`
divides where DDP's reducer multiplies). lm-resiliency leaves DDP to rebuild as it would, records
the layout with each capture and restores exactly that layout on resume; the trace averages as the
reducer does (lm_resiliency/_torch_compat.py). Each case stops after step 7 (a non-capture step:
interval 2) and resumes at step 6. `test_resume_without_layout_restore_differs` (slow) is the
evidence that the cases exercise the restore.
"""

import os
import signal

import pytest

from tests.distributed.gemini_workloads import assert_same
from tests.distributed.session_workloads import train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(400)

WORLD, STEPS, STOP_AFTER = 4, 9, 7
SMALL_BUCKETS = {"bucket_cap_mb": 0.005}  # about 5 KB: the four 32x32 layers and the head span 3 buckets


def _options(ddp=None, **kw):
    return dict(ddp=dict(SMALL_BUCKETS, **(ddp or {})), replication_jump=2, **kw)


def _plain(tmp_path, options, world=WORLD):
    return run_ranks(train, world, "ddp_forward", str(tmp_path / "plain"), STEPS, None, None,
                     dict(options, plain=True), timeout=200)


def _stop_and_resume(tmp_path, options, stop, expect_killed, world=WORLD):
    folder = str(tmp_path / f"run-{stop}")
    outcomes = run_ranks(train, world, "ddp_forward", folder, STEPS, STOP_AFTER, None,
                         dict(options, stop=stop), timeout=200, check=False)
    assert [o.killed_by for o in outcomes] == expect_killed, [o.error for o in outcomes]
    return run_ranks(train, world, "ddp_forward", folder, STEPS, None, None, options, timeout=200)


def _assert_resumed_equal(resumed, plain):
    for rank in range(len(plain)):
        assert resumed[rank][0] == 6 and plain[rank][0] == 0
        assert_same(resumed[rank][1], plain[rank][1], f"rank {rank}")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _plain(tmp_path_factory.mktemp("plain"), _options())


def test_uninterrupted_run_equals_plain_ddp(tmp_path, plain):
    resilient = run_ranks(train, WORLD, "ddp_forward", str(tmp_path), STEPS, None, None, _options(), timeout=200)
    for rank in range(WORLD):
        assert_same(resilient[rank][1], plain[rank][1], f"rank {rank}")


def test_graceful_flush_for_restart(tmp_path, plain):
    resumed = _stop_and_resume(tmp_path, _options(), "graceful", [None] * WORLD)
    _assert_resumed_equal(resumed, plain)


def test_one_rank_sigkilled(tmp_path, plain):
    resumed = _stop_and_resume(tmp_path, _options(), "kill_one", [None, signal.SIGKILL, None, None])
    _assert_resumed_equal(resumed, plain)


def test_every_rank_sigkilled_shared_memory_without_disk(tmp_path, plain):
    options = _options(shm_only=True)
    resumed = _stop_and_resume(tmp_path, options, "kill_all", [signal.SIGKILL] * WORLD)
    # Recovered from the shared-memory slots: no checkpoint was ever written to disk.
    assert not [f for _, _, files in os.walk(tmp_path / "run-kill_all") for f in files if f.endswith(".gemini")]
    _assert_resumed_equal(resumed, plain)


def test_three_ranks_one_bucket_scout_on(tmp_path):
    """DDP's default bucket size (the whole model in one bucket, whose order the rebuild changes),
    3 ranks, SCOUT's replay checks and gradient trace on (enable_resiliency's default)."""
    options = {"replication_jump": 1}
    plain = _plain(tmp_path, options, world=3)
    resumed = _stop_and_resume(tmp_path, options, "kill_all", [signal.SIGKILL] * 3, world=3)
    _assert_resumed_equal(resumed, plain)
    # SCOUT was on: its gradient trace reduced every bucket, and it replayed at step 8 after the resume.
    assert [r[2] for r in resumed] == [{"trace": True, "checked": 8}] * 3


@pytest.mark.parametrize("variant", [
    pytest.param({"ddp": {"static_graph": True}}, id="static_graph"),
    pytest.param({"ddp": {"gradient_as_bucket_view": True}}, id="gradient_as_bucket_view"),
    pytest.param({"ddp": {"gradient_as_bucket_view": True}, "set_to_none": False},
                 id="gradient_as_bucket_view_zeroed_in_place"),
    pytest.param({"accumulate": 2}, id="no_sync_accumulation"),
    pytest.param({"ddp": {"find_unused_parameters": True}}, id="find_unused_parameters",
                 marks=pytest.mark.slow),
    pytest.param({"ddp": {"batched_grad_copy": True}}, id="batched_grad_copy", marks=pytest.mark.slow),
])
def test_ddp_variants(tmp_path, variant):
    options = _options(**variant)
    plain = _plain(tmp_path, options)
    resumed = _stop_and_resume(tmp_path, options, "kill_all", [signal.SIGKILL] * WORLD)
    _assert_resumed_equal(resumed, plain)


@pytest.mark.slow
def test_resume_without_layout_restore_differs(tmp_path, plain):
    """The evidence that the cases above test the layout restore: without it the same resume is not exact."""
    resumed = _stop_and_resume(tmp_path, _options(restore_layout=False), "kill_all", [signal.SIGKILL] * WORLD)
    with pytest.raises(AssertionError):
        _assert_resumed_equal(resumed, plain)
