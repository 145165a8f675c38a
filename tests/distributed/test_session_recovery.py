"""enable_resiliency on real DDP / FSDP2 / HSDP ranks: kill, resume, bitwise equal to uninterrupted."""

import os
import signal

import pytest

from tests.distributed.gemini_workloads import assert_same
from tests.distributed.session_workloads import train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def _kill_and_resume(tmp_path, kind, world, steps=9, kill_after=7):
    baseline = run_ranks(train, world, kind, str(tmp_path / "baseline"), steps, timeout=150)
    folder = str(tmp_path / "managed")
    outcomes = run_ranks(train, world, kind, folder, steps, kill_after, timeout=150, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * world, [o.error for o in outcomes]
    resumed = run_ranks(train, world, kind, folder, steps, timeout=150)
    for rank in range(world):
        # Steps 1..7 ran; interval 2 -> the last capture is step 6, flushed before the kill.
        assert resumed[rank][0] == 6
        assert baseline[rank][0] == 0
        assert_same(resumed[rank][1], baseline[rank][1])


def test_ddp_four_ranks_resume_bitwise_equal(tmp_path):
    _kill_and_resume(tmp_path, "ddp", 4)


def test_fsdp2_two_ranks_resume_bitwise_equal(tmp_path):
    _kill_and_resume(tmp_path, "fsdp2", 2)


def test_hsdp_two_by_two_resume_bitwise_equal(tmp_path):
    _kill_and_resume(tmp_path, "hsdp", 4)


def test_load_fallback_called_only_without_gemini_state(tmp_path):
    log = str(tmp_path / "fallback")
    run_ranks(train, 2, "ddp", str(tmp_path / "ckpt"), 4, None, log, timeout=120)
    assert all(open(f"{log}.{r}").read() == "called\n" for r in range(2))
    for r in range(2):
        os.remove(f"{log}.{r}")
    resumed = run_ranks(train, 2, "ddp", str(tmp_path / "ckpt"), 6, None, log, timeout=120)
    assert [r[0] for r in resumed] == [4, 4]
    assert not any(os.path.exists(f"{log}.{r}") for r in range(2))
