"""SCOUT signatures, peer groups, the vote, module sampling and single-process replay."""

import pytest
import torch
from torch import nn

from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.peers import dense_peer_groups, group_of, peer_groups_from_mesh, vote
from lm_resiliency.scout.replay import ModuleCatalog, ReplayDetector
from lm_resiliency.scout.reports import replay_fault_reports
from lm_resiliency.scout.signature import structure_signature, tensor_signature
from tests.distributed.scout_workloads import TinyLM, make_model

# -- signatures ---------------------------------------------------------------------------------


def test_signature_is_16_hex_chars_and_equal_for_equal_tensors():
    a = torch.randn(5, 7)
    sig = tensor_signature(a)
    assert len(sig) == 16 and int(sig, 16) >= 0
    assert tensor_signature(a.clone()) == sig
    assert tensor_signature(a.t().contiguous().t()) == sig  # same values, other strides
    assert tensor_signature(a.requires_grad_()) == sig


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
                                   torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_every_single_bit_flip_changes_the_signature(dtype):
    t = (torch.randn(3, 5) * 4).to(dtype)
    base = tensor_signature(t)
    raw = t.reshape(-1).view(torch.uint8)
    seen = {base}
    for byte in range(raw.numel()):
        for bit in range(8):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            sig = tensor_signature(flipped.view(dtype).view(t.shape))
            assert sig != base, (dtype, byte, bit)
            seen.add(sig)
    assert len(seen) == raw.numel() * 8 + 1  # and no two flips collide


def test_lowest_mantissa_bit_via_int32_view_changes_it():
    t = torch.randn(16)
    u = t.clone()
    u.view(torch.int32)[3] ^= 1
    assert not torch.equal(t.view(torch.int32), u.view(torch.int32))
    assert tensor_signature(t) != tensor_signature(u)
    assert tensor_signature(torch.tensor([0.0])) != tensor_signature(torch.tensor([-0.0]))


def test_dtype_and_shape_are_part_of_the_signature():
    t = torch.zeros(4, 6)
    assert tensor_signature(t) != tensor_signature(t.reshape(6, 4))
    assert tensor_signature(t) != tensor_signature(t.reshape(24))
    assert tensor_signature(t) != tensor_signature(t.view(torch.int32))  # same bytes, other dtype
    assert tensor_signature(torch.zeros(2, dtype=torch.int16)) != tensor_signature(torch.zeros(1, dtype=torch.int32))
    assert tensor_signature(torch.zeros(0)) != tensor_signature(torch.zeros(0, 3))


def test_views_and_non_contiguous_tensors_sign_their_values():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert tensor_signature(base[:, 1]) == tensor_signature(base[:, 1].contiguous())
    assert tensor_signature(base[1:3]) == tensor_signature(torch.arange(6, 18, dtype=torch.float32).reshape(2, 6))
    assert tensor_signature(torch.tensor(3.0)) == tensor_signature(torch.tensor(3.0))
    assert tensor_signature(torch.tensor(3.0)) != tensor_signature(torch.tensor([3.0]))


def test_structure_signature_covers_order_count_and_none():
    a, b = torch.ones(3), torch.zeros(3)
    assert structure_signature([a, b]) == structure_signature([a.clone(), b.clone()])
    assert structure_signature([a, b]) != structure_signature([b, a])
    assert structure_signature([a]) != structure_signature([a, None])
    assert structure_signature([]) != structure_signature([None])
    changed = b.clone()
    changed.view(torch.int32)[0] ^= 1
    assert structure_signature([a, b]) != structure_signature([a, changed])


def test_signature_rejects_non_tensors_and_sparse():
    with pytest.raises(TypeError):
        tensor_signature([1, 2])
    with pytest.raises(TypeError):
        tensor_signature(torch.eye(3).to_sparse())


# -- the vote -----------------------------------------------------------------------------------


def test_vote_all_equal_is_clean():
    assert vote({0: "a", 1: "a", 2: "a", 3: "a"}) == ("clean", ())
    assert vote({5: "a"}) == ("clean", ())
    assert vote({0: "a", 1: "a"}) == ("clean", ())


def test_vote_strict_majority_blames_the_minority():
    assert vote({0: "a", 1: "a", 2: "b", 3: "a"}) == ("sdc", (2,))
    assert vote({0: "a", 1: "b", 2: "a"}) == ("sdc", (1,))
    assert vote({0: "x", 1: "a", 2: "a", 3: "a", 4: "y"}) == ("sdc", (0, 4))
    assert vote({10: "a", 12: "b", 14: "a", 16: "a"}) == ("sdc", (12,))


def test_vote_two_peers_disagreeing_never_guess_a_rank():
    assert vote({0: "a", 1: "b"}) == ("peer_group", ())
    assert vote({3: "b", 7: "a"}) == ("peer_group", ())


def test_vote_without_strict_majority_is_inconclusive():
    assert vote({0: "a", 1: "a", 2: "b", 3: "b"}) == ("inconclusive", ())  # 2 vs 2
    assert vote({0: "a", 1: "b", 2: "c", 3: "a"}) == ("inconclusive", ())  # 3 signatures among 4
    assert vote({0: "a", 1: "b", 2: "c"}) == ("inconclusive", ())
    with pytest.raises(ValueError):
        vote({})


# -- peer groups --------------------------------------------------------------------------------


def test_dense_peer_groups_share_model_parallel_coordinates():
    assert dense_peer_groups(4) == [[0, 1, 2, 3]]
    assert dense_peer_groups(8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dense_peer_groups(8, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dense_peer_groups(4, 4) == [[0], [1], [2], [3]]
    assert group_of(5, dense_peer_groups(8, 2)) == [1, 3, 5, 7]
    for bad in [(6, 4), (0, 1), (4, 0), (4.0, 1), (True, 1)]:
        with pytest.raises(ValueError):
            dense_peer_groups(*bad)


def test_hsdp_peers_are_same_shard_coordinate_across_replicas():
    names = ("dp_replicate", "dp_shard")
    assert peer_groups_from_mesh((2, 4), names, "dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert peer_groups_from_mesh((4, 2), names, "dp_replicate") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # Pure FSDP: the shard peers replay the unsharded module.
    assert peer_groups_from_mesh((4,), ("dp_shard",), "dp_shard") == [[0, 1, 2, 3]]
    # HSDP x TP: peers keep both the shard and the tp coordinate.
    groups = peer_groups_from_mesh((3, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    assert groups == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]
    assert peer_groups_from_mesh((2, 2, 2), ("dp_replicate", "dp_shard", "tp"), ("dp_replicate", "dp_shard")) \
        == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="replicate_dim"):
        peer_groups_from_mesh((2, 2), names, "cp")
    with pytest.raises(ValueError):
        peer_groups_from_mesh((2, 2), ("a",), "a")
    with pytest.raises(ValueError):
        group_of(12, groups)


# -- module sampling and single-process replay ------------------------------------------------


def test_catalog_picks_embedding_hidden_stack_and_output():
    catalog = ModuleCatalog.of(TinyLM())
    assert catalog.embedding[0] == "emb"
    assert [p for p, _ in catalog.hidden] == ["layers.0", "layers.1", "layers.2"]
    assert catalog.output[0] == "head"
    seq = ModuleCatalog.of(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    assert seq.embedding[0] == "0" and seq.output[0] == "4"
    assert [p for p, _ in seq.hidden] == ["0", "2", "4"]
    assert ModuleCatalog.of(nn.Linear(3, 3)).hidden == ()
    assert ModuleCatalog.of(nn.Linear(3, 3)).output[0] == "(root)"


def test_checks_due_follow_per_class_intervals_and_rotation():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ReplayHarnessConfig(check_interval=2, output_check_interval=3, optimizer_check_interval=4)
    detector = ReplayDetector(model, optimizer, config, group=None, group_ranks=[0])
    assert detector.checks_due(1) == []
    assert detector.checks_due(2) == ["embedding", "hidden"]
    assert detector.checks_due(3) == ["output"]
    assert detector.checks_due(4) == ["embedding", "hidden", "optimizer"]
    assert [detector.sampled("hidden", s)[0] for s in (2, 4, 6, 8)] == ["layers.0", "layers.1", "layers.2",
                                                                         "layers.0"]
    assert detector.sampled("optimizer", 4)[0] == "emb.weight[0:800]"
    fixed = ReplayDetector(model, optimizer, ReplayHarnessConfig(check_interval=1, rotate_layers=False),
                           group=None, group_ranks=[0])
    assert {fixed.sampled("hidden", s)[0] for s in range(1, 7)} == {"layers.0"}
    with pytest.raises(ValueError):
        detector.checks_due(0)
    with pytest.raises(ValueError, match="group_ranks"):
        ReplayDetector(model, optimizer, config, group=None, group_ranks=[0, 1])


def test_optimizer_slices_rotate_and_are_bounded():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    config = ReplayHarnessConfig(check_interval=1, optimizer_check_max_elements=300)
    detector = ReplayDetector(model, optimizer, config, group=None, group_ranks=[0])
    n = len(list(model.parameters()))
    labels = [detector.sampled("optimizer", s)[0] for s in (1, 1 + n, 1 + 2 * n, 1 + 3 * n)]
    assert labels == ["emb.weight[0:300]", "emb.weight[300:600]", "emb.weight[500:800]", "emb.weight[100:400]"]


def test_single_process_replay_is_clean_and_side_effect_free():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    detector = ReplayDetector(model, optimizer, ReplayHarnessConfig(check_interval=1), group=None, group_ranks=[0])
    for step in range(1, 5):
        detector.arm(step)
        model(torch.randint(0, 50, (8,))).pow(2).mean().backward()
        before = (structure_signature(list(model.parameters())),
                  structure_signature([p.grad for p in model.parameters()]), tensor_signature(torch.get_rng_state()))
        result = detector.run(step)
        after = (structure_signature(list(model.parameters())),
                 structure_signature([p.grad for p in model.parameters()]), tensor_signature(torch.get_rng_state()))
        assert before == after
        assert result.healthy and replay_fault_reports(result) == []
        assert {c.check for c in result.checks} == {"embedding", "hidden", "output", "optimizer", "parameters"}
        assert all(c.group_ranks == (0,) and c.verdict == "clean" for c in result.checks)
        optimizer.step()
        optimizer.zero_grad()
    # No hook is left behind after run() or close().
    assert all(not m._forward_pre_hooks for m in model.modules())
    detector.arm(5)
    detector.close()
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_replay_is_repeatable_with_dropout_and_sees_forward_hooks():
    """Two detectors replaying the same step agree bitwise; a hook on the module changes the output."""
    def one(corrupt):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        detector = ReplayDetector(model, optimizer, ReplayHarnessConfig(check_interval=1), group=None,
                                  group_ranks=[0])
        if corrupt:
            model.layers[0].register_forward_hook(lambda m, a, o: o * (1 + 1e-6))
        detector.arm(1)
        model(torch.arange(8)).sum().backward()
        torch.manual_seed(12345)  # the live RNG state must not matter
        return {(c.check, c.module_path): c.signatures[0] for c in detector.run(1).checks}

    clean, again, corrupted = one(False), one(False), one(True)
    assert clean == again
    assert corrupted[("hidden", "layers.0")] != clean[("hidden", "layers.0")]


def test_skipped_when_module_not_called_and_no_capture_without_arm():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    detector = ReplayDetector(model, optimizer, ReplayHarnessConfig(check_interval=1), group=None, group_ranks=[0])
    model(torch.arange(8)).sum().backward()
    result = detector.run(1)  # never armed: activation checks are skipped, parameters still compared
    assert {c.check for c in result.checks} == {"parameters", "optimizer"}
    assert result.healthy
