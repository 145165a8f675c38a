"""DeepSpeed MoE engines (`deepspeed.moe.layer.MoE`, ep_size=2 on 4 ranks over gloo): the adapter
reads DeepSpeed's expert-data-parallel groups into the topology, SCOUT's expert replay runs among
those peers, and GEMINI resumes an MoE engine bitwise. Ranks fork from the DeepSpeed zygote
(tests/frameworks/conftest.py)."""

import importlib.util
import signal

import pytest

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

from tests.distributed.gemini_workloads import assert_same

pytestmark = pytest.mark.timeout(150, func_only=True)

W = "tests.frameworks.deepspeed_moe_workloads:"
LABEL = "moe.deepspeed_moe.experts[n_exec=2]"


@pytest.fixture
def zygote(deepspeed_zygote):
    return deepspeed_zygote


def test_topology_holds_deepspeed_expert_groups(zygote):
    # DeepSpeed's default layout (expert parallel before data parallel): EP groups [0, 1], [2, 3],
    # expert-data-parallel groups [0, 2], [1, 3]. Every rank's descriptor holds the whole partition.
    for rank, out in enumerate(zygote.run(W + "topology", 4, 2, timeout=120)):
        assert out["own_ep"] == [[0, 1], [2, 3]][rank // 2] and out["own_edp"] == [[0, 2], [1, 3]][rank % 2]
        assert out["descriptor"] == {
            "ep": 2, "expert_peer_groups": [[0, 2], [1, 3]],
            "expert_groups": {"ep_size_2": {"ep": 2, "expert_dp_groups": [[0, 2], [1, 3]]}},
            "expert_modules": ["moe.deepspeed_moe.experts"], "dp_world_size": 4}


@pytest.mark.parametrize("stage", [1, 2])
def test_clean_moe_engine_replays_experts_among_expert_peers(zygote, stage):
    # Dense replay among all 4 data-parallel ranks leaves the experts out (they differ across EP
    # ranks); expert replay compares them among the adapter's expert peers. Nothing is reported.
    for rank, (found, (dense, expert, rotated)) in enumerate(zygote.run(W + "expert_replay", 4, 2, stage, None,
                                                                       timeout=120)):
        assert found == [], (rank, found)
        assert dense == [0, 1, 2, 3] and expert == [[0, 2], [1, 3]][rank % 2]
        assert not any(path.startswith("moe.deepspeed_moe.experts") for path in rotated)


def test_corrupted_expert_with_two_replicas_names_its_expert_pair(zygote):
    # Rank 1's expert output is bit-flipped. Its expert peers are [1, 3]: two replicas disagree and
    # cannot say which one is right, so the pair is named (peer_group, no faulty rank) at both
    # checks; the other pair and dense replay stay clean.
    results = zygote.run(W + "expert_replay", 4, 2, 1, 1, timeout=120)
    assert results[0][0] == [] and results[2][0] == []
    for rank in (1, 3):
        assert results[rank][0] == [(2, "expert", LABEL, "peer_group", [], [1, 3]),
                                    (4, "expert", LABEL, "peer_group", [], [1, 3])]


def test_corrupted_expert_with_three_replicas_is_localized_to_its_rank(zygote):
    # ep_size=2 on 6 ranks: expert peers [0, 2, 4] and [1, 3, 5]; rank 3's corrupted expert is
    # outvoted by its two equal peers and named exactly.
    results = zygote.run(W + "expert_replay", 6, 2, 1, 3, timeout=140)
    for rank in (0, 2, 4):
        assert results[rank][0] == []
    for rank in (1, 3, 5):
        assert results[rank][1][1] == [1, 3, 5]
        assert results[rank][0] == [(2, "expert", LABEL, "sdc", [3], [1, 3, 5]),
                                    (4, "expert", LABEL, "sdc", [3], [1, 3, 5])]


def test_killed_moe_engine_resumes_bitwise_equal(zygote, tmp_path):
    # ZeRO-2 over the MoE parameter groups (experts partitioned over their expert-DP group):
    # killed after step 5, resumed from the step-4 capture, equal to an uninterrupted run.
    baseline = zygote.run(W + "gemini", 4, 2, 2, None, 7, timeout=120)
    folder = str(tmp_path / "gemini")
    outcomes = zygote.run(W + "gemini", 4, 2, 2, folder, 7, 5, timeout=120, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 4, [o.error for o in outcomes]
    resumed = zygote.run(W + "gemini", 4, 2, 2, folder, 7, timeout=120)
    for rank in range(4):
        start, state = resumed[rank]
        assert start == 4
        assert state["engine"][0] == 7
        assert_same(state, baseline[rank][1])
    # The experts differ across expert-parallel ranks and agree across expert-data-parallel ones.
    experts = [{n: p for n, p in s["params"].items() if ".experts." in n} for _, s in resumed]
    assert all(a.equal(b) for a, b in zip(experts[0].values(), experts[2].values()))
    assert not all(a.equal(b) for a, b in zip(experts[0].values(), experts[1].values()))
