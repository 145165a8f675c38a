"""The built-in worker adapters on real gloo ranks, the bootstrap driven as the shim drives it:
native PyTorch (FSDP2 outermost root, single-process root module), the fail-closed cases, and
the refusal of a second, explicit attach."""

from __future__ import annotations

import json
import os
import socket
import uuid

import pytest
import torch

from tests.harness import run_ranks

W = "tests.torchrun.worker_workloads"
KEEP = {"LM_RESILIENCY_KEEP_SHARED_MEMORY": "1"}  # slots outlive the workers, as under a restarting supervisor


def _workload(name):
    import importlib

    return getattr(importlib.import_module(W), name)


def test_fsdp2_worker_recovers_exactly_the_selected_step_bitwise(tmp_path):
    # Generation 0: layers sharded first, then the root; captures at 2, 4 and 6.
    first = run_ranks(_workload("fsdp_train"), 3, str(tmp_path), 6, timeout=300, env=KEEP)
    assert [(count, source) for count, source, _ in first] == [(6, None)] * 3
    # The next generation is told to load step 4 (not the newer 6), replays 5 and 6, and ends
    # bitwise equal, shard by shard, optimizer state and RNG included.
    second = run_ranks(_workload("fsdp_train"), 3, str(tmp_path), 6, 4, timeout=300, env=KEEP)
    assert [(count, source) for count, source, _ in second] == [(6, "gemini")] * 3
    for rank in range(3):
        before, after = first[rank][2], second[rank][2]
        assert before.keys() == after.keys() and len(before) == 33
        different = [name for name in before if not torch.equal(before[name], after[name])]
        assert not different, f"rank {rank} differs after recovering step 4: {different}"
    with open(tmp_path / "worker-0.json") as f:
        assert json.load(f)["step"] == 4  # step 6's capture completes at close, after the last record


def test_single_process_attaches_at_the_root_module_with_a_later_optimizer_subclass(tmp_path):
    assert run_ranks(_workload("single_process"), 1, str(tmp_path), 5, timeout=120) == [(5, "ScaledSGD", True)]
    with open(tmp_path / "worker-0.json") as f:
        assert json.load(f)["step"] == 4


def test_sharded_layers_under_an_unsharded_root_fail_closed_on_every_rank(tmp_path):
    for result in run_ranks(_workload("refused"), 2, str(tmp_path), "unsharded root", timeout=120):
        assert result.startswith("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: not attaching")
        assert all(f"rank {r}: Stack holds FSDP2-sharded submodules but is not sharded itself" in result
                   for r in range(2))


def test_a_ddp_model_without_an_optimizer_fails_closed_naming_what_is_missing(tmp_path):
    for result in run_ranks(_workload("refused"), 2, str(tmp_path), "no optimizer", timeout=120):
        assert "not attaching (every rank must own exactly one DistributedDataParallel model" in result
        assert "rank 0: 0 optimizers exist" in result and "rank 1: 0 optimizers exist" in result


def test_a_distributed_step_without_a_recognized_boundary_fails_closed(tmp_path):
    for result in run_ranks(_workload("refused"), 2, str(tmp_path), "no boundary", timeout=120):
        assert result.startswith("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: SGD.step() ran "
                                 "before the DistributedDataParallel, FSDP2/HSDP root forward")


def test_an_explicit_enable_resiliency_is_refused_before_the_worker_adapter_attached(tmp_path):
    for refusal, step in run_ranks(_workload("double_attach"), 2, str(tmp_path), True, timeout=180):
        assert refusal.startswith("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: this worker runs "
                                  "under the worker policy worker.toml")
        assert step == 3  # the worker adapter still attached, once


def test_an_explicit_enable_resiliency_is_refused_after_the_worker_adapter_attached(tmp_path):
    for refusal, step in run_ranks(_workload("double_attach"), 2, str(tmp_path), False, timeout=180):
        assert "an explicit enable_resiliency(), ResiliencyCallback or plugin would attach a second session" in refusal
        assert step == 3


@pytest.mark.slow  # two real torchrun runs of 3 workers (a few minutes on 2 busy cores)
def test_fsdp2_module_under_torchrun_restarts_on_the_last_capture_bitwise(tmp_path):
    """One agent, 3 FSDP2 workers of a module that never imports lm_resiliency; rank 1 SIGKILLed
    after step 7 (captures every 2): the next generation resumes at 6 and ends bitwise equal, shard
    by shard, to an uninterrupted run."""
    from tests.torchrun.test_torchrun_recovery import _run

    base = str(tmp_path)
    outs = {name: os.path.join(base, name) for name in ("killed", "clean")}
    for out in outs.values():
        os.makedirs(out)
    killed = _run(base, "killed", 500, run_id=f"fsdp-kill-{uuid.uuid4().hex[:8]}", max_restarts=2,
                  module="tests.torchrun.fsdp_module", args=[outs["killed"], "10", "1", "7"])
    assert killed.returncode == 0, killed.stdout[-8000:]
    assert "at step 6 from memory (pytorch/fsdp2)" in killed.stdout
    clean = _run(base, "clean", 400, run_id=f"fsdp-clean-{uuid.uuid4().hex[:8]}",
                 module="tests.torchrun.fsdp_module", args=[outs["clean"], "10"])
    assert clean.returncode == 0, clean.stdout[-8000:]
    for rank in range(3):
        with open(os.path.join(outs["killed"], f"final-1-{rank}.json")) as f:
            resumed = json.load(f)
        with open(os.path.join(outs["clean"], f"final-0-{rank}.json")) as f:
            baseline = json.load(f)
        assert (resumed["start"], baseline["start"]) == (6, 0)
        assert resumed["tensors"].keys() == baseline["tensors"].keys() and len(baseline["tensors"]) == 16
        different = [n for n in baseline["tensors"] if resumed["tensors"][n] != baseline["tensors"][n]]
        assert not different, f"rank {rank} not bitwise equal after the restart: {different}"


def test_ranks_that_inferred_different_frameworks_fail_closed_when_the_group_initializes(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.getsockname()[1])}
    for result in run_ranks(_workload("frameworks_differ"), 2, str(tmp_path), timeout=120, init=False, env=env):
        assert result == ("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: the ranks inferred different "
                          "training frameworks when the default process group initialized (rank 0: native PyTorch; "
                          "rank 1: TorchTitan). Every worker must import the same framework before "
                          "init_process_group()")
