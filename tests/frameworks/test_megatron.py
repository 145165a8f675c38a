"""Megatron Core surface: real parallel_state, GPTModel, Megatron DDP, get_megatron_optimizer and
OptimizerParamScheduler over gloo, with the CPU fixture of megatron_cpu.py (Megatron's CUDA calls
replaced by CPU equivalents; the adapter and surface under test are not patched)."""

from __future__ import annotations

import re
import signal

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.harness import run_ranks  # noqa: E402


def test_arguments_are_checked_before_any_collective():
    """Wrong objects and options raise TypeError naming what was expected, with no process group."""
    from lm_resiliency import enable_resiliency

    module = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="must be the MegatronOptimizer"):
        enable_resiliency([module], torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="needs the MegatronOptimizer as the second argument"):
        enable_resiliency([module])
    with pytest.raises(TypeError, match=r"does not accept \['scheduler'\]"):
        enable_resiliency([module], object(), scheduler=None)
    with pytest.raises(TypeError, match=r"iteration=\.\.\.\): expected args.iteration"):
        enable_resiliency([module], object(), iteration=-1)


def test_explicit_peer_groups_must_partition_the_job():
    from lm_resiliency.scout.peers import UnknownLayoutError, peer_groups_from_topology

    assert peer_groups_from_topology({"tp": 2, "peer_groups": [[3, 1], [0, 2]]}, 4) == [[0, 2], [1, 3]]
    with pytest.raises(UnknownLayoutError, match="do not partition the 4 ranks"):
        peer_groups_from_topology({"peer_groups": [[0, 2], [1, 2]]}, 4)
    with pytest.raises(UnknownLayoutError, match="not a list of non-empty rank lists"):
        peer_groups_from_topology({"peer_groups": [[0, 1], []]}, 2)


@pytest.mark.timeout(900)
def test_tp2_dp2_topology_and_dense_peer_groups():
    """4 ranks, TP2 x DP2 (Megatron's tp-innermost order): TP groups [0,1],[2,3], so SCOUT's dense
    peers, the data-parallel groups at equal TP/PP/CP coordinates, are [0,2] and [1,3]; SCOUT's
    replay checks run in exactly those groups (TP layers replayed with their TP collectives) and
    healthy peers agree."""
    from tests.frameworks.megatron_workloads import topology

    results = run_ranks(topology, 4, 2, timeout=600)
    for rank, (descriptor, groups, step_count, described, checks, faults) in enumerate(results):
        assert groups == [[0, 2], [1, 3]]
        assert descriptor["peer_groups"] == [[0, 2], [1, 3]]
        assert descriptor["expert_peer_groups"] == [[0, 2], [1, 3]]  # EP1, expert-TP = TP
        assert {k: descriptor[k] for k in ("kind", "world_size", "tp", "pp", "vpp", "model_chunks", "cp", "dp",
                                           "dp_cp", "ep", "expert_tp", "expert_dp")} == {
            "kind": "megatron", "world_size": 4, "tp": 2, "pp": 1, "vpp": 1, "model_chunks": 1, "cp": 1, "dp": 2,
            "dp_cp": 2, "ep": 1, "expert_tp": 2, "expert_dp": 2}
        assert descriptor["coordinate"] == {"tp": rank % 2, "pp": 0, "cp": 0, "dp": rank // 2, "ep": 0,
                                            "expert_tp": rank % 2, "expert_dp": rank // 2}
        assert descriptor["distributed_optimizer"] is True
        assert step_count == 6  # iteration=4 (Megatron's own checkpoint), then two steps
        assert described == "megatron/tp2-pp1-vpp1-cp1-dp2-ep1"
        # SCOUT replayed among exactly those peers, and two healthy peers agree.
        assert checks and all(group == tuple(groups[rank % 2]) for _, _, group in checks), checks
        assert all(verdict == "clean" for _, verdict, _ in checks) and faults == 0, checks


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_sigkill_one_rank_resumes_bitwise(tmp_path, distributed_optimizer):
    """3 data-parallel ranks: train 5 iterations, flush, SIGKILL rank 1; a relaunch resumes at
    the last capture (iteration 4) and trains to 7. Model, fp32 main parameters, optimizer state,
    learning rates and scheduler equal an uninterrupted 7-iteration run bitwise. With and without
    the distributed optimizer (sharded state vs the fp32 optimizer). Slow: three launches of three
    ranks, each importing Megatron Core."""
    from tests.frameworks.megatron_workloads import kill_resume

    folder, base = str(tmp_path / "run"), str(tmp_path / "base")
    killed = run_ranks(kill_resume, 3, folder, 1, distributed_optimizer, 7, 5, timeout=600, check=False)
    assert killed[1].killed_by == signal.SIGKILL, [o.error for o in killed]
    assert [o.error for o in killed] == [None] * 3
    resumed = run_ranks(kill_resume, 3, folder, 1, distributed_optimizer, 7, timeout=600)
    baseline = run_ranks(kill_resume, 3, base, 1, distributed_optimizer, 7, timeout=600)
    for rank in range(3):
        assert resumed[rank][0] == 4 and baseline[rank][0] == 0
        assert resumed[rank][2] == baseline[rank][2] == 14
        _assert_same(resumed[rank][1], baseline[rank][1], f"rank {rank}")
    if distributed_optimizer:
        # A Megatron checkpoint of iteration 8 was loaded, and GEMINI's newest is step 6: refused.
        refused = run_ranks(kill_resume, 3, folder, 1, True, 9, None, None, 8, timeout=600, check=False)
        for outcome in refused:
            assert re.search(r"RuntimeError: lm-resiliency: GEMINI's newest state is step 6, older than the "
                             r"Megatron checkpoint setup_model_and_optimizer\(\) loaded \(iteration 8\)",
                             outcome.error or ""), outcome.error


@pytest.mark.gpu
@pytest.mark.timeout(1800)
def test_cuda_bf16_distributed_optimizer_resumes_bitwise(tmp_path):
    """What the CPU fixture cannot show: bf16 parameters with fp32 main parameters under the
    distributed optimizer, on CUDA without any patch. One rank: train 5 iterations, flush,
    SIGKILL; a relaunch resumes at iteration 4 and trains to 7, bitwise equal to an
    uninterrupted run."""
    from tests.frameworks.megatron_workloads import kill_resume

    folder, base = str(tmp_path / "run"), str(tmp_path / "base")
    def launch(out, kill_after, store, check=True):
        return run_ranks(kill_resume, 1, out, 1, True, 7, kill_after, str(tmp_path / store), timeout=600,
                         init=False, check=check)

    killed = launch(folder, 5, "store-killed", check=False)
    assert killed[0].killed_by == signal.SIGKILL, killed[0].error
    (resumed_step, resumed, samples), = launch(folder, None, "store-resumed")
    (base_step, baseline, base_samples), = launch(base, None, "store-baseline")
    assert (resumed_step, base_step, samples, base_samples) == (4, 0, 14, 14)
    assert any(p.dtype == torch.bfloat16 for p in baseline["model"].values())
    assert all(p.dtype == torch.float32 for p in baseline["main_params"])
    _assert_same(resumed, baseline)
