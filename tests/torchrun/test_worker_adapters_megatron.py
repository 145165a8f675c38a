"""MegatronWorkerAdapter on a real Megatron Core GPT (parallel_state, Megatron DDP,
get_megatron_optimizer, OptimizerParamScheduler) over gloo with the CPU fixture of
tests/frameworks/megatron_cpu.py, the bootstrap driven as the shim drives it: attach at
get_megatron_optimizer()'s return, exact recovery of the selected step (the scheduler built
afterwards included, and required), and one optimizer per worker."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("megatron.core")

from tests.distributed.gemini_workloads import assert_same  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.torchrun.megatron_worker_workloads import (megatron_refused, megatron_train,  # noqa: E402
                                                      megatron_without_scheduler)

pytestmark = pytest.mark.timeout(240, func_only=True)


def test_fresh_start_then_the_selected_step_recovered_bitwise_with_its_scheduler(tmp_path):
    directory = str(tmp_path)
    first = run_ranks(megatron_train, 3, directory, 6, timeout=200)
    for count, source, _ in first:
        assert (count, source) == (6, None)
    second = run_ranks(megatron_train, 3, directory, 6, 4, timeout=200)
    for rank in range(3):
        count, source, state = second[rank]
        assert (count, source) == (6, "gemini")
        assert state["scheduler"]["num_steps"] == 6
        assert_same(state, first[rank][2])
    for result in run_ranks(megatron_without_scheduler, 3, directory, 4, timeout=200):
        assert result == ("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: GEMINI recovered step 4 with "
                          "OptimizerParamScheduler state, and no OptimizerParamScheduler was built over this "
                          "optimizer before its first step; build the scheduler as in the run that captured it")


def test_a_second_get_megatron_optimizer_fails_closed(tmp_path):
    for result in run_ranks(megatron_refused, 2, str(tmp_path), "second optimizer", timeout=200):
        assert result == ("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: get_megatron_optimizer() was "
                          "called a second time; the built-in Megatron Core adapter attaches to the one optimizer of "
                          "a worker. Set adapter = \"package.module:factory\" for several optimizers")


def test_megatron_lm_on_one_rank_fails_closed_on_every_rank_before_attaching(tmp_path):
    for result in run_ranks(megatron_refused, 2, str(tmp_path), "megatron-lm", timeout=200):
        assert result.startswith("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: not attaching (every "
                                 "rank must build its model chunks and optimizer with get_megatron_optimizer()): "
                                 "rank 1: Megatron-LM's megatron.training is imported, and its "
                                 "setup_model_and_optimizer() loads its own checkpoint")
        assert "rank 0" not in result
    assert not any(name.startswith("worker-") for name in os.listdir(tmp_path))
