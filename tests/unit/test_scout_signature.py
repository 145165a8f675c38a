"""SCOUT signatures, peer groups, the vote, module sampling and single-process replay."""

import pytest
import torch
from torch import nn

from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.peers import dense_peer_groups, group_of, peer_groups_from_mesh, vote
from lm_resiliency.scout.replay import ModuleCatalog, ReplayDetector
from lm_resiliency.scout.reports import replay_fault_reports
from lm_resiliency import tensor_bytes
from lm_resiliency.scout import signature
from lm_resiliency.scout.signature import integer_signature, structure_signature, tensor_signature
from tests.distributed.scout_workloads import TinyLM, make_model
from tests.harness import run_ranks

# -- signatures ---------------------------------------------------------------------------------

_MASK = (1 << 64) - 1


def _mix(x):
    x ^= x >> 32
    x = (x * 0xFF51AFD7ED558CCD) & _MASK
    x ^= x >> 32
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK
    return x ^ (x >> 32)


def _reference_signature(t):
    """The construction in signature.py's docstring, in plain Python integers."""
    import hashlib

    n = signature.BLOCK_WORDS
    offsets = [_mix((j * 0xA0761D6478BD642F + 0xE7037ED1A0B428DB) & _MASK) for j in range(n)]
    raw = bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
    raw += bytes(-len(raw) % 8)
    data = 0
    for i in range(len(raw) // 8):
        word = int.from_bytes(raw[8 * i:8 * i + 8], "little")
        b, j = divmod(i, n)
        data += _mix((word + offsets[j] + b * 0x9E3779B97F4A7C15) & _MASK)
    header = f"{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode("ascii")
    key = int.from_bytes(hashlib.blake2b(header, digest_size=8).digest(), "little")
    return f"{_mix((data & _MASK) ^ key):016x}"


@pytest.fixture(params=["host", "integer"])
def sign(request):
    """Both constructions: the host's (XXH3, every CPU tensor) and the accelerators' integer one,
    which runs on CPU tensors too through `integer_signature`."""
    return tensor_signature if request.param == "host" else integer_signature


def _flip(t, byte, bit):
    raw = t.reshape(-1).view(torch.uint8).clone()
    raw[byte] ^= 1 << bit
    return raw.view(t.dtype).view(t.shape)


def test_signature_is_16_hex_chars_and_equal_for_equal_tensors(sign):
    a = torch.randn(5, 7)
    sig = sign(a)
    assert len(sig) == 16 and int(sig, 16) >= 0
    assert sign(a.clone()) == sig
    assert sign(a.t().contiguous().t()) == sig  # same values, other strides
    assert sign(a.requires_grad_()) == sig


def test_signature_follows_the_documented_construction():
    # Known answers pin both constructions (every rank and release must agree), and the reference
    # implementations check the documented formulas, across a block boundary and a padded tail.
    import xxhash

    assert tensor_signature(torch.arange(10, dtype=torch.int64)) == "efcb2543e42b3a30"
    assert integer_signature(torch.arange(10, dtype=torch.int64)) == "cdaeac00ad6998e2"
    gen = torch.Generator().manual_seed(1)
    for t in (torch.randint(-2**31, 2**31, (signature.BLOCK_WORDS * 2 + 3,), dtype=torch.int32, generator=gen),
              torch.tensor(7, dtype=torch.uint8), torch.randn(3, 3, dtype=torch.float16, generator=gen)):
        assert integer_signature(t) == _reference_signature(t)
        header = f"{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode("ascii")
        raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
        assert tensor_signature(t) == xxhash.xxh3_64(header + raw).hexdigest()


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_changes_the_signature(dtype, sign):
    t = (torch.randn(3, 5) * 4).to(dtype)
    base = sign(t)
    nbytes = t.numel() * t.element_size()
    seen = {base}
    for byte in range(nbytes):
        for bit in range(8):
            sig = sign(_flip(t, byte, bit))
            assert sig != base, (dtype, byte, bit)
            seen.add(sig)
    assert len(seen) == nbytes * 8 + 1  # and no two flips collide


@pytest.mark.parametrize("shape,dtype", [((3,), torch.uint8), ((5,), torch.float16), ((7,), torch.bool),
                                         ((3, 3), torch.bfloat16), ((), torch.float32), ((1, 1, 1), torch.int8)])
def test_odd_byte_lengths_and_0d_tensors_detect_every_bit_flip(shape, dtype, sign):
    t = (torch.randn(shape) * 4).to(dtype)
    base = sign(t)
    flips = {sign(_flip(t, byte, bit)) for byte in range(t.numel() * t.element_size())
             for bit in range(8)}
    assert base not in flips and len(flips) == t.numel() * t.element_size() * 8


def test_random_bit_flips_in_a_large_tensor_spanning_chunks(sign):
    # 2.5 CPU chunks plus a 12-byte tail: flips land in every chunk, at chunk edges, in the padded word.
    t = torch.randn(signature.CPU_CHUNK_WORDS * 5 + 3, generator=torch.Generator().manual_seed(2))
    base = sign(t)
    nbytes = t.numel() * 4
    gen = torch.Generator().manual_seed(3)
    flips = {(int(byte), int(bit)) for byte, bit in zip(torch.randint(0, nbytes, (60,), generator=gen),
                                                         torch.randint(0, 8, (60,), generator=gen))}
    flips |= {(0, 0), (nbytes - 1, 7), (signature.CPU_CHUNK_WORDS * 8, 0), (signature.CPU_CHUNK_WORDS * 8 - 1, 7)}
    seen = {base}
    for byte, bit in flips:
        sig = sign(_flip(t, byte, bit))
        assert sig != base, (byte, bit)
        seen.add(sig)
    assert len(seen) == len(flips) + 1


def test_two_sign_flips_that_cancel_in_a_linear_hash_change_it(sign):
    # Flipping the top bit of two 64-bit words adds 2**63 * odd twice (0 mod 2**64) to a purely
    # linear word hash; the per-word mix makes every such pair visible.
    t = torch.randn(64, dtype=torch.float64)
    base = sign(t)
    seen = set()
    for i in range(0, 64, 3):
        for j in range(i + 1, 64, 5):
            u = t.clone()
            u[i], u[j] = -u[i], -u[j]
            seen.add(sign(u))
    assert base not in seen and len(seen) == sum(len(range(i + 1, 64, 5)) for i in range(0, 64, 3))


def test_reordered_elements_change_it(sign):
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        t = (torch.randn(4, 33, generator=gen) * 50).to(dtype)
        base = sign(t)
        flat = t.reshape(-1)
        perms = [torch.randperm(flat.numel(), generator=gen) for _ in range(20)]
        sigs = {sign(flat[p].reshape(t.shape)) for p in perms}
        assert base not in sigs and len(sigs) == 20
        assert sign(t.flip(0)) != base and sign(t.roll(1, 1)) != base
        a, b = (0, 1) if flat[0] != flat[1] else (0, int((flat != flat[0]).nonzero()[0]))
        swapped = flat.clone()
        swapped[a], swapped[b] = flat[b], flat[a]  # two elements inside one 8-byte word
        assert sign(swapped.reshape(t.shape)) != base


def test_lowest_mantissa_bit_via_int32_view_changes_it(sign):
    t = torch.randn(16)
    u = t.clone()
    u.view(torch.int32)[3] ^= 1
    assert not torch.equal(t.view(torch.int32), u.view(torch.int32))
    assert sign(t) != sign(u)
    assert sign(torch.tensor([0.0])) != sign(torch.tensor([-0.0]))


def test_dtype_and_shape_are_part_of_the_signature(sign):
    t = torch.zeros(4, 6)
    assert sign(t) != sign(t.reshape(6, 4))
    assert sign(t) != sign(t.reshape(24))
    assert sign(t) != sign(t.view(torch.int32))  # same bytes, other dtype
    assert sign(t) != sign(t.view(torch.uint8))
    assert sign(torch.zeros(2, dtype=torch.int16)) != sign(torch.zeros(1, dtype=torch.int32))
    assert sign(torch.zeros(0)) != sign(torch.zeros(0, 3))
    assert sign(torch.zeros(0)) != sign(torch.zeros(0, dtype=torch.int8))
    assert sign(torch.tensor(0.0)) != sign(torch.zeros(1))
    r = torch.randn(8)
    assert sign(r.to(torch.bfloat16)) != sign(r.to(torch.float16))


def test_views_and_non_contiguous_tensors_sign_their_values(sign):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    assert sign(base[:, 1]) == sign(base[:, 1].contiguous())
    assert sign(base[1:3]) == sign(torch.arange(6, 18, dtype=torch.float32).reshape(2, 6))
    assert sign(base[:, 1:]) == sign(base[:, 1:].contiguous())
    assert sign(torch.tensor(3.0)) == sign(torch.tensor(3.0))
    assert sign(torch.tensor(3.0)) != sign(torch.tensor([3.0]))
    assert sign(torch.ones(3, 1).expand(3, 5)) == sign(torch.ones(3, 5))
    c = torch.randn(4, dtype=torch.complex64)
    assert sign(c.conj()) == sign(c.conj().resolve_conj()) != sign(c)


def test_large_non_contiguous_tensors_are_copied_in_bounded_pieces(sign):
    gen = torch.Generator().manual_seed(5)
    tall = torch.randn(signature.CPU_CHUNK_WORDS, 3, generator=gen)
    wide = tall.t()                  # rows of 512 KiB, each a strided view: signed row by row
    assert not wide.is_contiguous()
    assert sign(wide) == sign(wide.contiguous())
    odd = torch.randn(1001, 7, generator=gen, dtype=torch.float64).to(torch.float16)[:, ::2]
    assert sign(odd) == sign(odd.contiguous())  # 6-byte rows straddle words


def test_chunk_size_does_not_change_the_signature(monkeypatch, sign):
    # CPU and accelerators chunk differently, and the host copies strided tensors in pieces; the
    # result must not depend on either.
    t = torch.randn(signature.BLOCK_WORDS * 6 + 12, generator=torch.Generator().manual_seed(6))
    expected = sign(t)
    strided = sign(t.reshape(-1, 3)[:, :2].contiguous())
    for words in (signature.BLOCK_WORDS * 2, signature.BLOCK_WORDS * 64):
        monkeypatch.setattr(signature, "CPU_CHUNK_WORDS", words)
        monkeypatch.setattr(signature, "HOST_PIECE_BYTES", words * 8)
        assert sign(t) == expected
        assert sign(t.reshape(-1, 3)[:, :2]) == strided


def test_host_hashing_through_power_of_two_windows_reads_every_byte(monkeypatch):
    # CPU memory is read in windows of at most tensor_bytes.WINDOW_BYTES, the tail split into powers
    # of two (ctypes keeps one array type per length forever); the digest must equal XXH3 of all bytes.
    import xxhash

    monkeypatch.setattr(tensor_bytes, "WINDOW_BYTES", 64)
    gen = torch.Generator().manual_seed(8)
    for n in (1, 63, 64, 65, 64 * 5 + 37, 4099):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        expected = xxhash.xxh3_64(f"uint8|({n},)|".encode("ascii") + bytes(t.tolist())).hexdigest()
        assert tensor_signature(t) == expected, n
        assert tensor_signature(t[1:]) != expected


def test_structure_signature_covers_order_count_and_none():
    a, b = torch.ones(3), torch.zeros(3)
    assert structure_signature([a, b]) == structure_signature([a.clone(), b.clone()])
    assert structure_signature([a, b]) != structure_signature([b, a])
    assert structure_signature([a]) != structure_signature([a, None])
    assert structure_signature([]) != structure_signature([None])
    changed = b.clone()
    changed.view(torch.int32)[0] ^= 1
    assert structure_signature([a, b]) != structure_signature([a, changed])
    # One host copy per device for all digests; same value as signing one by one.
    assert structure_signature([a, None, b]) == structure_signature(iter([a, None, b]))


def test_signature_rejects_non_tensors_and_sparse():
    with pytest.raises(TypeError):
        tensor_signature([1, 2])
    with pytest.raises(TypeError):
        tensor_signature(torch.eye(3).to_sparse())
    with pytest.raises(TypeError):
        structure_signature([torch.ones(1), "x"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_sign_on_the_device_with_the_integer_construction():
    gen = torch.Generator().manual_seed(7)
    for t in (torch.randn(signature.DEVICE_CHUNK_WORDS * 2 + 5, generator=gen), torch.randn(3, 5).to(torch.bfloat16),
              torch.ones(7, dtype=torch.bool), torch.tensor(2.5), torch.zeros(0, 4),
              torch.randn(64, 48, generator=gen).t()):
        assert tensor_signature(t.cuda()) == integer_signature(t)
    a, b = torch.randn(9), torch.randn(4, 4)
    mixed = structure_signature([a.cuda(), None, b.cuda(), b])
    assert structure_signature([a.clone().cuda(), None, b.cuda(), b.clone()]) == mixed
    flipped = _flip(a, 5, 3).cuda()
    assert tensor_signature(flipped) != tensor_signature(a.cuda())
    assert structure_signature([flipped, None, b.cuda(), b]) != mixed


def _dtensor_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    replicated = distribute_tensor(full, mesh, [Replicate()])
    return (tensor_signature(sharded) == tensor_signature(sharded.to_local()),
            tensor_signature(replicated) == tensor_signature(full), tensor_signature(sharded))


def test_dtensor_is_signed_by_its_local_shard():
    results = run_ranks(_dtensor_rank, 2, timeout=60)
    assert [r[:2] for r in results] == [(True, True), (True, True)]
    assert results[0][2] != results[1][2]  # different shards, different signatures


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
        # Adam has state to sign from the second step on.
        assert {c.check for c in result.checks} == {"embedding", "hidden", "output", "optimizer", "parameters",
                                                    "backward"} | ({"optimizer_state"} if step > 1 else set())
        assert all(c.group_ranks == (0,) and c.verdict == "clean" for c in result.checks)
        optimizer.step()
        optimizer.zero_grad()
    # No hook is left behind after run() or close().
    assert all(not m._forward_pre_hooks for m in model.modules())
    detector.arm(5)
    detector.close()
    assert all(not m._forward_pre_hooks for m in model.modules())


class _NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        return self.norm(self.lin(x))


def test_replay_restores_the_buffers_it_changed():
    # BatchNorm in training mode updates its running statistics in every forward, the replay's too.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 6), nn.ModuleList([_NormBlock(), _NormBlock()]), nn.Linear(6, 20))
    model.forward = lambda tokens: model[2](model[1][1](model[1][0](model[0](tokens))))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    detector = ReplayDetector(model, optimizer, ReplayHarnessConfig(check_interval=1), group=None, group_ranks=[0])
    for step in (1, 2):
        detector.arm(step)
        model(torch.randint(0, 20, (8,))).pow(2).mean().backward()
        before = structure_signature(list(model.buffers()))
        result = detector.run(step)
        assert structure_signature(list(model.buffers())) == before
        assert result.healthy and {"hidden", "backward"} <= {c.check for c in result.checks}
        optimizer.step()
        optimizer.zero_grad()


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
