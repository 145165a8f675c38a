"""The fault kit binds to each framework's own training objects, and its clock follows that
framework's step: Megatron Core model chunks (a skipped update does not count), a DeepSpeed engine
alone (micro-steps that leave global_steps unchanged do not count), a TorchTitan Trainer alone (it
follows trainer.step, also when train() loads a checkpoint)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.harness import run_ranks


@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_megatron_chunks_and_optimizer_skipped_updates_do_not_count():
    from tests.frameworks.fault_binding_workloads import megatron_clock

    [out] = run_ranks(megatron_clock, 1, timeout=500)
    assert out["framework"] == "megatron"
    assert out["applied"] == [True, True, False, True, True]      # Megatron skipped loop iteration 2
    assert out["iterations"] == [2, 3, 3, 4, 5]                   # the skip did not advance the clock
    # Tick 3 met the first try of iteration 3 (loop iteration 2, whose update was then skipped);
    # tick 4 is loop iteration 4: counting the skipped update would have put it at loop iteration 3.
    assert out["calls"] == [(3, 2), (4, 4)]


@pytest.mark.timeout(600)
def test_deepspeed_engine_alone_follows_global_steps(deepspeed_zygote):
    for rank, out in enumerate(deepspeed_zygote.run("tests.frameworks.fault_binding_workloads:deepspeed_clock",
                                                    2, 1, timeout=300)):
        assert out["framework"] == "deepspeed" and out["wrapped"] and out["unwrapped"]
        # Two engine.step() calls per optimizer step; only the one that moves global_steps counts.
        assert out["trace"] == [(2, 1), (3, 2), (4, 3), (5, 4)], rank
        if rank == 0:
            assert out["calls"] == [(3, 2)]                       # during global step 3 (2 completed)


@pytest.mark.timeout(900)
def test_torchtitan_trainer_alone_follows_trainer_step(tmp_path):
    from tests.frameworks.fault_binding_workloads import torchtitan_clock
    from tests.frameworks.test_torchtitan import _env

    folder = str(tmp_path)
    run_ranks(torchtitan_clock, 2, folder, "save", timeout=600, init=False, env=_env())
    for rank, out in enumerate(run_ranks(torchtitan_clock, 2, folder, "resume", timeout=600, init=False,
                                         env=_env())):
        assert out["framework"] == "torchtitan" and out["steps"] == 13
        # train() loaded step 10: the first forward is trainer.step 11, and the kit counts it as 11.
        assert out["seen"] == [(11, 11), (12, 12), (13, 13)], rank
        assert out["final_iteration"] == 14
        if rank == 0:
            assert out["calls"] == [(12, 12)]                     # tick 12 in trainer.step 12; tick 3 was skipped over
            assert out["records"] == [("slow@12", 12, "injected")]
