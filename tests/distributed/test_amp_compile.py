"""AMP (GradScaler) and torch.compile on 3 real DDP ranks: SIGKILL, resume, bitwise equal to an
uninterrupted run (3 ranks: a changed gradient summation order would show)."""

import signal

import pytest

from tests.distributed.amp_workloads import train
from tests.distributed.gemini_workloads import assert_same
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(400)

WORLD = 3


def _kill_and_resume(tmp_path, compile_mode, use_scaler, overflow, resume_compile_mode=None, steps=9, kill_after=7):
    options = (compile_mode, use_scaler, overflow)
    baseline = run_ranks(train, WORLD, str(tmp_path / "baseline"), steps, None, *options, timeout=200)
    folder = str(tmp_path / "managed")
    outcomes = run_ranks(train, WORLD, folder, steps, kill_after, *options, timeout=200, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * WORLD, [o.error for o in outcomes]
    resumed = run_ranks(train, WORLD, folder, steps, None, resume_compile_mode or compile_mode, use_scaler,
                        overflow, timeout=200)
    for rank in range(WORLD):
        assert baseline[rank][0] == 0
        assert resumed[rank][0] == 6  # interval 2: the last capture before the kill after step 7
        for counters in (baseline[rank][1], resumed[rank][1]):
            assert all(loop == count for loop, count in counters), counters
        assert_same(resumed[rank][2], baseline[rank][2])
    return baseline


def test_gradscaler_skipped_steps_and_kill_resume_bitwise(tmp_path):
    # Step 3 overflows on rank 1 before the kill, step 8 on rank 2 after the resume; DDP's
    # all-reduce spreads the inf, so every rank skips both.
    baseline = _kill_and_resume(tmp_path, None, True, ((2, 1), (7, 2)))
    assert len({b[2]["scaler"]["scale"] for b in baseline}) == 1


@pytest.mark.parametrize("compile_mode,resume_compile_mode", [("ddp_of_compiled", "compiled_ddp"),
                                                              ("compiled_ddp", "ddp_of_compiled")])
def test_compiled_ddp_kill_resume_bitwise(tmp_path, compile_mode, resume_compile_mode):
    # Resumed with the other wrapping order: the capture is keyed by the user's module, whatever
    # wraps it. (The eager backend runs the same kernels, so the result is bitwise comparable.)
    _kill_and_resume(tmp_path, compile_mode, False, (), resume_compile_mode)
