"""SCOUT on FSDP2, HSDP and DP x TP models, 4 real gloo ranks through enable_resiliency."""

import pytest

from lm_resiliency.scout.peers import UnknownLayoutError, peer_groups_from_topology
from lm_resiliency.scout.reports import SCOPE_PEER_GROUP, SCOPE_RANK, SDC, SDC_PEER_GROUP
from tests.distributed import scout_sharded_workloads as sw
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def _checks(result, check):
    return [c for c in result.checks if c.check == check]


@pytest.mark.parametrize("kind,fault_rank", [("fsdp2", 2), ("hsdp", 1)])
def test_hidden_sign_flip_localized_to_exactly_that_rank(tmp_path, kind, fault_rank):
    outs = run_ranks(sw.sharded_run, 4, kind, str(tmp_path), 4, fault_rank, 4, timeout=240)
    for rank, out in enumerate(outs):
        # FSDP shard peers (and HSDP replicas) all replay the unsharded module: one group of 4.
        assert out["group_ranks"] == (0, 1, 2, 3)
        assert sorted(out["results"]) == [2, 4]
        assert out["results"][2][1] == [] and out["results"][2][0].healthy
        result, reports = out["results"][4]
        hidden = _checks(result, "hidden")
        assert len(hidden) == 1 and (hidden[0].verdict, hidden[0].faulty) == ("sdc", (fault_rank,)), (rank, hidden)
        assert all(c.verdict == "clean" for c in result.checks if c.check != "hidden"), result.checks
        assert [(r.kind, r.scope, r.ranks, r.resource) for r in reports] == \
            [(SDC, SCOPE_RANK, (fault_rank,), f"hidden:{hidden[0].module_path}")]
        # The replays left parameters, gradients, FSDP state and the RNG exactly as they were.
        assert out["unchanged"] == [2, 4]
        assert out["certified"] == [2]  # the SDC at step 4 vetoed that capture


@pytest.mark.parametrize("kind,fault_rank", [("fsdp2", 0), ("hsdp", 3)])
def test_backward_only_fault_localized_on_the_unsharded_module(tmp_path, kind, fault_rank):
    outs = run_ranks(sw.sharded_run, 4, kind, str(tmp_path), 4, fault_rank, 4, "backward_sign_flip", timeout=240)
    for out in outs:
        result, reports = out["results"][4]
        hidden = _checks(result, "hidden")[0]
        assert hidden.verdict == "clean"  # the forward is healthy
        backward = [c for c in _checks(result, "backward") if c.verdict != "clean"]
        assert [(c.module_path, c.verdict, c.faulty) for c in backward] == [(hidden.module_path, "sdc", (fault_rank,))]
        assert [(r.kind, r.scope, r.ranks, r.resource) for r in reports] == \
            [(SDC, SCOPE_RANK, (fault_rank,), f"backward:{hidden.module_path}")]
        assert out["unchanged"] == [2, 4]


@pytest.mark.parametrize("kind", ["fsdp2", "hsdp"])
def test_ten_clean_checks_report_nothing_and_training_is_bitwise_unchanged(tmp_path, kind):
    outs = run_ranks(sw.sharded_run, 4, kind, str(tmp_path), 20, timeout=280)
    for out in outs:
        assert sorted(out["results"]) == list(range(2, 21, 2))
        for step, (result, reports) in out["results"].items():
            assert reports == [] and result.healthy, (step, result)
            assert {c.check for c in result.checks} == {"embedding", "hidden", "output", "optimizer", "parameters",
                                                        "backward"}
        optimizer = [c for r, _ in out["results"].values() for c in _checks(r, "optimizer")]
        # Sharded parameters: every peer steps the source's own shard slice.
        assert all("[local shard of rank " in c.module_path for c in optimizer) and len(optimizer) == 10
        assert out["unchanged"] == list(range(2, 21, 2))
        assert out["bitwise_equal_to_plain"] is True
        assert out["certified"] and max(out["certified"]) == 20  # certification is on for sharded models


@pytest.mark.parametrize("kind,fault_rank", [("fsdp2", 3), ("tp", 1)])
def test_faulty_optimizer_step_on_a_sharded_parameter_is_caught(tmp_path, kind, fault_rank):
    outs = run_ranks(sw.faulty_shadow_step, 4, kind, str(tmp_path), fault_rank, timeout=240)
    for rank, out in enumerate(outs):
        result, reports = out["results"][2]
        optimizer = _checks(result, "optimizer")
        assert len(optimizer) == 1
        # FSDP2: a sharded parameter, stepped on the source's shard slice; TP: the first parameter is the
        # replicated embedding, stepped by each peer on its own copy.
        assert ("[local shard of rank " in optimizer[0].module_path) == (kind == "fsdp2")
        assert all(c.verdict == "clean" for c in result.checks if c.check != "optimizer"), result.checks
        peers = out["group_ranks"]
        if fault_rank not in peers:
            assert optimizer[0].verdict == "clean" and reports == []
        elif len(peers) >= 3:
            assert (optimizer[0].verdict, optimizer[0].faulty) == ("sdc", (fault_rank,))
            assert [(r.kind, r.scope, r.ranks) for r in reports] == [(SDC, SCOPE_RANK, (fault_rank,))]
        else:
            assert [(r.kind, r.scope, r.ranks) for r in reports] == [(SDC_PEER_GROUP, SCOPE_PEER_GROUP, peers)]


def test_dp2_tp2_groups_and_peer_group_scope_report(tmp_path):
    outs = run_ranks(sw.sharded_run, 4, "tp", str(tmp_path), 4, 2, 4, timeout=240)
    assert [out["group_ranks"] for out in outs] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [(out["topology"]["kind"], out["topology"]["tp"], out["topology"]["dp_replicate"]) for out in outs] \
        == [("dp_tp", 2, 2)] * 4
    for rank, out in enumerate(outs):
        result, reports = out["results"][4]
        if rank in (0, 2):
            hidden = _checks(result, "hidden")
            assert (hidden[0].verdict, hidden[0].faulty, hidden[0].group_ranks) == ("peer_group", (), (0, 2))
            assert [(r.kind, r.scope, r.ranks) for r in reports] == [(SDC_PEER_GROUP, SCOPE_PEER_GROUP, (0, 2))]
        else:
            assert reports == [] and result.healthy, result.checks
        assert out["unchanged"] == [2, 4]


def test_dp2_tp2_clean_run_reports_nothing_and_is_bitwise_unchanged(tmp_path):
    outs = run_ranks(sw.sharded_run, 4, "tp", str(tmp_path), 12, timeout=240)
    for out in outs:
        assert sorted(out["results"]) == list(range(2, 13, 2))
        assert all(reports == [] and result.healthy for result, reports in out["results"].values())
        assert out["unchanged"] == list(range(2, 13, 2))
        assert out["bitwise_equal_to_plain"] is True


def test_peer_groups_from_topology():
    dp_tp = ([2, 2], ["dp", "tp"], [0, 1, 2, 3])
    assert peer_groups_from_topology({}, 4, dp_tp) == [[0, 2], [1, 3]]
    assert peer_groups_from_topology({}, 4, ([2, 2], ["tp", "dp"], [0, 1, 2, 3])) == [[0, 1], [2, 3]]
    lightning = ([2, 2], ["data_parallel", "tensor_parallel"], [0, 1, 2, 3])
    assert peer_groups_from_topology({"tp": 2}, 4, lightning) == [[0, 2], [1, 3]]
    # FSDP (1-D) and HSDP (2-D) meshes, named or not: every rank replays the unsharded module.
    assert peer_groups_from_topology({}, 4, ([4], [], [0, 1, 2, 3])) == [[0, 1, 2, 3]]
    assert peer_groups_from_topology({}, 4, ([2, 2], ["dp_replicate", "dp_shard"], [0, 1, 2, 3])) == [[0, 1, 2, 3]]
    # A mesh laid out over ranks in another order maps mesh positions to those ranks.
    assert peer_groups_from_topology({}, 4, ([2, 2], ["dp", "tp"], [3, 2, 1, 0])) == [[0, 2], [1, 3]]
    assert peer_groups_from_topology({}, 2, ([2], ["tp"], [0, 1])) == [[0], [1]]
    assert peer_groups_from_topology({"kind": "ddp"}, 3) == [[0, 1, 2]]


@pytest.mark.parametrize("descriptor,mesh,message", [
    ({}, ([2, 2], ["dp", "pp"], [0, 1, 2, 3]), "neither data-parallel"),
    ({}, ([2], ["dp"], [0, 1]), "not the whole job"),
    ({}, ([2, 1, 2], [], [0, 1, 2, 3]), "unnamed 3-D"),
    ({"tp": 2}, None, "no DTensor parameters"),
    ({"kind": "deepspeed", "mp_world_size": 2}, None, "model parallelism"),
])
def test_unknown_layouts_are_refused_not_guessed(descriptor, mesh, message):
    with pytest.raises(UnknownLayoutError, match=message):
        peer_groups_from_topology(descriptor, 4, mesh)


def test_unknown_mesh_turns_replay_off_with_a_warning(tmp_path):
    for out in run_ranks(sw.unknown_layout, 4, str(tmp_path), timeout=120):
        assert (out["detector"], out["ledger"], out["monitor"]) == (False, False, True)
        assert any("replay checks" in m and "['pp']" in m for m in out["warnings"]), out["warnings"]
