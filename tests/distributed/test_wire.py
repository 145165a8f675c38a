"""JSON collectives over real gloo processes: small documents in one round, large ones in two."""

import torch.distributed as dist

from lm_resiliency import wire
from tests.harness import run_ranks


def _gather_docs(rank, world, sizes):
    doc = {"rank": rank, "text": "x" * sizes[rank]}
    subgroup = dist.new_group([1, 2], backend="gloo")
    in_subgroup = wire.all_gather_json(doc, group=subgroup) if rank in (1, 2) else None
    return wire.all_gather_json(doc), in_subgroup


def test_documents_below_and_above_the_first_round_frame_arrive_whole():
    # Rank 2's document exceeds the one-round frame, so every rank takes the second round.
    sizes = [0, 100, wire._FIRST_ROUND_BYTES + 5, wire._FIRST_ROUND_BYTES - 20]
    outs = run_ranks(_gather_docs, 4, sizes, timeout=60)
    expected = [{"rank": r, "text": "x" * n} for r, n in enumerate(sizes)]
    for rank, (everyone, subgroup) in enumerate(outs):
        assert everyone == expected
        assert subgroup == (expected[1:3] if rank in (1, 2) else None)


def test_small_documents_only():
    outs = run_ranks(_gather_docs, 3, [3, 0, 7], timeout=60)
    assert all(everyone == [{"rank": r, "text": "x" * n} for r, n in enumerate([3, 0, 7])]
               for everyone, _ in outs)
