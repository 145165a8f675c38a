"""Every example runs on CPU and demonstrates kill-and-resume (each has a --self-test mode)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("example", ["pytorch_single.py", "pytorch_ddp.py", "pytorch_fsdp2.py"])
def test_example_self_test(example):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", example), "--self-test"],
                          capture_output=True, text=True, timeout=380, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.timeout(600)
def test_gemini_demo_recovers_bitwise(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gemini_kill_recover.py"),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[gen 1] resumed from GEMINI step 6" in done.stdout
    assert "OK: the run that lost a rank finished bitwise equal to the uninterrupted run." in done.stdout


@pytest.mark.timeout(600)
def test_nanogpt_ported_resumes_bitwise_after_a_worker_sigkill():
    # Three torchrun launches of 3 ranks (fp16 autocast with a GradScaler): uninterrupted, and rank 1
    # SIGKILLed after iteration 10, side by side; then the relaunch, which must resume from the newest
    # capture (interval 4) and save final parameters bitwise equal to the uninterrupted launch's.
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "nanogpt_ported.py"), "--self-test"],
                          capture_output=True, text=True, timeout=580, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # 8, or 4 when rank 1 died before its step-8 capture reached its node-local disk.
    assert re.search(r"^resumed at iter [48] from gemini$", done.stdout, re.MULTILINE), done.stdout[-3000:]
    assert "OK: the relaunched run finished bitwise equal to the uninterrupted run" in done.stdout


@pytest.mark.slow  # three torchrun launches of 3 ranks (about 3 minutes on 2 busy cores)
@pytest.mark.timeout(900)
def test_the_ported_ddp_tutorial_resumes_mid_epoch_bitwise():
    # docs/porting.md, "Epochs over a DataLoader": killed mid-epoch, relaunched, equal to an uninterrupted run.
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ddp_epochs.py"), "--self-test"],
                          capture_output=True, text=True, timeout=880, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "starting at step 10 (epoch 2, batch 2)" in done.stdout
