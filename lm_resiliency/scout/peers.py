"""Equivalent-peer groups from topology, and the majority vote over their signatures.

Equivalent peers hold bitwise-identical copies of the replayed computation: the same parameters
(data-parallel replicas after gradient all-reduce), at the same model-parallel coordinates. A
replay of the same input on every peer must give the same bytes, so a peer whose signature
differs from a strict majority is the faulty one. Exact localization needs at least three peers;
two peers that disagree localize the fault to the pair, never to a guessed rank.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Dict, List, Sequence, Tuple, Union

CLEAN, SDC, PEER_GROUP, INCONCLUSIVE = "clean", "sdc", "peer_group", "inconclusive"


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def dense_peer_groups(world_size: int, model_parallel_size: int = 1) -> List[List[int]]:
    """Data-parallel peer groups: ranks that share every model-parallel coordinate.

    Model-parallel ranks are assumed contiguous (the usual TP-innermost layout), so rank r sits at
    model-parallel coordinate `r % model_parallel_size` and its peers are every rank with that
    coordinate. `dense_peer_groups(8, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]`."""
    if not _positive_int(world_size):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not _positive_int(model_parallel_size):
        raise ValueError(f"model_parallel_size must be a positive integer, got {model_parallel_size!r}")
    if world_size % model_parallel_size:
        raise ValueError(f"world_size {world_size} is not a multiple of model_parallel_size {model_parallel_size}")
    return [list(range(coordinate, world_size, model_parallel_size)) for coordinate in range(model_parallel_size)]


def peer_groups_from_mesh(mesh_shape: Sequence[int], dim_names: Sequence[str],
                          replicate_dim: Union[str, Sequence[str]] = "dp_replicate") -> List[List[int]]:
    """Peer groups of a device mesh laid out row-major over ranks `0..prod(mesh_shape)-1`
    (what `init_device_mesh` builds): ranks at the same coordinate on every dimension except
    `replicate_dim`, which they vary along.

    HSDP over `("dp_replicate", "dp_shard")`: ranks at the same shard coordinate across
    `dp_replicate`. Pure FSDP with no natural replicas: pass `replicate_dim="dp_shard"` (shard
    peers replay the unsharded module). Several names make peers vary along all of them."""
    shape = tuple(mesh_shape)
    names = tuple(dim_names)
    if not shape or not all(_positive_int(d) for d in shape):
        raise ValueError(f"mesh_shape must be a non-empty sequence of positive integers, got {mesh_shape!r}")
    if len(names) != len(shape) or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"dim_names {dim_names!r} must be {len(shape)} distinct strings, one per mesh dimension")
    replicate = (replicate_dim,) if isinstance(replicate_dim, str) else tuple(replicate_dim)
    missing = [d for d in replicate if d not in names]
    if not replicate or missing:
        raise ValueError(f"replicate_dim {replicate_dim!r} is not among mesh dimensions {names}")
    varying = [names.index(d) for d in replicate]
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    groups: Dict[Tuple[int, ...], List[int]] = {}
    for rank in range(math.prod(shape)):
        coords = [(rank // strides[i]) % shape[i] for i in range(len(shape))]
        key = tuple(c for i, c in enumerate(coords) if i not in varying)
        groups.setdefault(key, []).append(rank)
    return [groups[key] for key in sorted(groups)]


def group_of(rank: int, groups: Sequence[Sequence[int]]) -> List[int]:
    """The peer group holding `rank`."""
    for group in groups:
        if rank in group:
            return list(group)
    raise ValueError(f"rank {rank} is in none of the peer groups {list(map(list, groups))}")


def vote(signatures: Dict[int, str]) -> Tuple[str, Tuple[int, ...]]:
    """Majority vote over one check's per-rank signatures -> (verdict, faulty ranks).

    - all equal                                   -> ("clean", ())
    - >= 3 peers and a strict majority (> n/2)    -> ("sdc", ranks outside the majority)
    - 2 peers disagreeing                         -> ("peer_group", ())  (never blame a guessed rank)
    - otherwise (no strict majority)              -> ("inconclusive", ())
    """
    if not signatures:
        raise ValueError("vote needs at least one signature")
    counts = Counter(signatures.values())
    if len(counts) == 1:
        return CLEAN, ()
    n = len(signatures)
    if n == 2:
        return PEER_GROUP, ()
    majority, votes = counts.most_common(1)[0]
    if votes * 2 > n:
        return SDC, tuple(sorted(rank for rank, sig in signatures.items() if sig != majority))
    return INCONCLUSIVE, ()
