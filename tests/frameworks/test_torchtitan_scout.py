"""SCOUT under TorchTitan: replay peers from `ParallelDims`, and a corruption found in a real Trainer run.

TorchTitan builds every mesh from one flat `world` mesh, so the adapter names the dense layout
(`adapters.torchtitan.peer_layout`) instead of SCOUT reading the parameters' root mesh.
"""

import pytest

pytest.importorskip("torchtitan")

from tests.harness import run_ranks  # noqa: E402


@pytest.mark.timeout(300)
def test_peer_groups_from_real_parallel_dims_on_four_ranks():
    """Layouts of one 4-rank job, meshes built by TorchTitan over gloo: FSDP2 over a 1-D mesh and
    HSDP 2 x 2 replay the unsharded module on all four ranks; DP 2 x TP 2 replays among the
    data-parallel ranks at one TP coordinate, exactly the ranks of TorchTitan's own "batch" mesh,
    none of them in this rank's TP group; CP, EP and PP turn replay off with the reason."""
    from tests.frameworks.torchtitan_workloads import mesh_peers

    layouts = [{}, {"dp_replicate": 2}, {"tp": 2}, {"cp": 2}, {"ep": 2}, {"pp": 2}]
    for rank, (fsdp, hsdp, dp_tp, cp, ep, pp) in enumerate(run_ranks(mesh_peers, 4, layouts, timeout=240)):
        for out in (fsdp, hsdp):
            assert out["groups"] == [[0, 1, 2, 3]] and out["mine"] == out["batch"] == [0, 1, 2, 3], (rank, out)
        assert dp_tp["groups"] == [[0, 2], [1, 3]], (rank, dp_tp)
        assert dp_tp["mine"] == dp_tp["batch"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert set(dp_tp["tp"]) & set(dp_tp["mine"]) == {rank}
        assert cp.startswith("context parallelism (cp=2)"), cp
        assert ep.startswith("expert parallelism (ep=2)"), ep
        assert pp == "pipeline parallelism (pp=2)", pp


@pytest.mark.slow  # three TorchTitan processes: ~6 minutes on 2 loaded cores
@pytest.mark.timeout(600)
def test_trainer_with_scout_names_the_rank_whose_embedding_is_corrupted(tmp_path):
    """The real Trainer, FSDP2 over 3 gloo ranks, SCOUT switched on from the command line: the fault
    kit sign-flips rank 2's token-embedding output; the replay check at step 2 outvotes rank 2.
    Replay runs at all only because the peers come from ParallelDims and TorchTitan's grouped
    fully_shard([norm, lm_head]) is replayable (before: "replay checks disabled")."""
    from tests.frameworks.test_torchtitan import _env
    from tests.frameworks.torchtitan_workloads import scout_finds_corruption

    outs = run_ranks(scout_finds_corruption, 3, str(tmp_path), 2, timeout=540, init=False, env=_env())
    for rank, out in enumerate(outs):
        assert out["peers"] == [0, 1, 2] and out["step"] == 2, (rank, out)
        assert ("sdc", "embedding:tok_embeddings", [2]) in out["reports"], (rank, out)


def test_a_malformed_peer_layout_turns_replay_off_instead_of_guessing():
    from lm_resiliency.scout.peers import UnknownLayoutError, peer_groups_from_topology

    with pytest.raises(UnknownLayoutError, match=r"peer_layout \[2, 2\] does not cover the 8 ranks"):
        peer_groups_from_topology({"peer_layout": {"shape": [2, 2], "names": ["dp_shard", "tp"]}}, 8)
    with pytest.raises(UnknownLayoutError, match="is not"):
        peer_groups_from_topology({"peer_layout": "dp_shard"}, 4)
    with pytest.raises(UnknownLayoutError, match=r"^expert parallelism$"):
        peer_groups_from_topology({"peer_layout": {"unsupported": "expert parallelism"}}, 4)
    # The declared layout wins over the parameters' root mesh (TorchTitan's flat "world").
    assert peer_groups_from_topology({"peer_layout": {"shape": [2, 2], "names": ["dp_shard", "tp"]}}, 4,
                                     ([4], ["world"], [0, 1, 2, 3])) == [[0, 2], [1, 3]]
