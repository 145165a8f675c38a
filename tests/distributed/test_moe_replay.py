"""Expert replay and AllToAll replay on a small expert-parallel MoE over real gloo processes
(tests/distributed/moe_workloads.py: tokens dispatched with all_to_all_single, EP x expert-DP)."""

import pytest

from tests.distributed import moe_workloads as W
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(600)


def test_clean_moe_run_reports_nothing():
    # EP=2 x EDP=2, expert replay of both recipes and the AllToAll replay at every check.
    assert run_ranks(W.clean, 4, 2, timeout=300) == [[], [], [], []]


def test_expert_fault_two_replicas_names_the_expert_pair():
    # Two expert-DP replicas cannot say which one is right: the pair holding the faulty expert
    # (ranks 1 and 3, EP coordinate 1) is named at every check, the other pair stays clean.
    results = run_ranks(W.expert_fault, 4, 2, 1, timeout=300)
    assert results[0] == [] and results[2] == []
    for rank in (1, 3):
        assert results[rank] == [
            (2, [("expert", "moe.experts[n_exec=2]", "peer_group", [], [1, 3])], []),
            (4, [("expert", "moe.experts[n_exec=3]", "peer_group", [], [1, 3])], []),
        ]


def test_expert_fault_three_replicas_localizes_the_rank():
    # EP=2 x EDP=3: expert peers [1, 3, 5]; a corrupted expert output on rank 3 is named exactly.
    results = run_ranks(W.expert_fault, 6, 2, 3, timeout=400)
    for rank in (0, 2, 4):
        assert results[rank] == []
    for rank in (1, 3, 5):
        assert results[rank] == [
            (2, [("expert", "moe.experts[n_exec=2]", "sdc", [3], [1, 3, 5])], []),
            (4, [("expert", "moe.experts[n_exec=3]", "sdc", [3], [1, 3, 5])], []),
        ]
