"""DeepSpeedWorkerAdapter on real DeepSpeed ZeRO engines (gloo, CPU), the bootstrap driven as the
shim drives it: attach at deepspeed.initialize()'s return, exact recovery of the selected step,
and the engine.load_checkpoint() rules. Ranks fork from one process that imported DeepSpeed."""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

from tests.distributed.gemini_workloads import assert_same

pytestmark = pytest.mark.timeout(120, func_only=True)
W = "tests.torchrun.worker_workloads:"


@pytest.fixture(scope="module")
def zygote():
    from tests.frameworks.deepspeed_workloads import DeepSpeedZygote

    process = DeepSpeedZygote()
    yield process
    process.close()


def test_zero2_worker_recovers_the_selected_step_bitwise_and_refuses_a_later_load(zygote, tmp_path):
    directory = str(tmp_path)
    first = zygote.run(W + "ds_train", 3, directory, 6, timeout=100)
    for count, source, steps, refusal, _ in first:
        assert (count, source, steps, refusal) == (6, None, 6, "")
    second = zygote.run(W + "ds_train", 3, directory, 6, 4, timeout=100)
    for rank in range(3):
        count, source, steps, refusal, state = second[rank]
        assert (count, source, steps) == (6, "gemini", 6)
        assert refusal.startswith("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: "
                                  "engine.load_checkpoint() refused: this generation recovered GEMINI step 4")
        assert_same(state, first[rank][4])


def test_generation_zero_load_seeds_the_step_count_from_global_steps(zygote, tmp_path):
    saved = str(tmp_path / "ds-checkpoint")
    zygote.run(W + "ds_train", 3, str(tmp_path / "a"), 3, -1, "", saved, timeout=100)
    for count, source, steps, refusal, _ in zygote.run(W + "ds_train", 3, str(tmp_path / "b"), 5, -1, saved,
                                                       timeout=100):
        assert (count, source, steps, refusal) == (5, None, 5, "")
    assert sorted(os.listdir(tmp_path / "b")) == ["disk", "shm", "worker-0.json", "worker-1.json", "worker-2.json"]


def test_an_engine_without_an_optimizer_fails_closed_on_every_rank(zygote, tmp_path):
    for result in zygote.run(W + "ds_without_optimizer", 2, str(tmp_path), timeout=100):
        assert result == ("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: not attaching (every rank must "
                          "return a training engine from deepspeed.initialize()): rank 0: the DeepSpeed object bundle "
                          "is incomplete: no optimizer (engine.optimizer is None); rank 1: the DeepSpeed object "
                          "bundle is incomplete: no optimizer (engine.optimizer is None)")
