"""Equivalent-peer groups from topology, and the majority vote over their signatures.

Equivalent peers hold bitwise-identical copies of the replayed computation: the same parameters
(data-parallel replicas after gradient all-reduce), at the same model-parallel coordinates. A
replay of the same input on every peer must give the same bytes, so a peer whose signature
differs from a strict majority is the faulty one. Exact localization needs at least three peers;
two peers that disagree localize the fault to the pair, never to a guessed rank.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from lm_resiliency._values import is_int
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.scout.reports import CheckOutcome

logger = logging.getLogger(__name__)

CLEAN, SDC, PEER_GROUP, INCONCLUSIVE = "clean", "sdc", "peer_group", "inconclusive"
ERROR = "error"  # the check itself failed on every peer: no evidence either way


def _positive_int(value: object) -> bool:
    return is_int(value) and value >= 1


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

    The vote sees only signatures: ranks that are faulty *alike* and form a strict majority are
    indistinguishable from a healthy majority, so "sdc" assumes a strict healthy majority. Every
    outcome that is not clean carries the full split (`split`) so an operator can judge.
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


def split(signatures: Mapping[int, str]) -> Dict[str, List[int]]:
    """Ranks by signature, largest group first (ties: by signature): who agrees with whom."""
    groups: Dict[str, List[int]] = {}
    for rank in sorted(signatures):
        groups.setdefault(signatures[rank], []).append(rank)
    return dict(sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])))


def voted_outcome(check: str, path: str, ranks: Sequence[int], signatures: Dict[int, str], where: str, *,
                  hosts: Optional[Mapping[int, str]] = None,
                  timings: Optional[Mapping[int, float]] = None) -> CheckOutcome:
    """The vote on one check's signatures as a `CheckOutcome`; a verdict other than clean is
    logged with the signatures (`where` names the replay: a step's check, or the sweep)."""
    verdict, faulty = vote(signatures)
    if verdict != CLEAN:
        logger.warning("SCOUT %s, %s of %s: %s, faulty=%s, ranks by signature=%s", where, check, path, verdict,
                       list(faulty), split(signatures))
    return CheckOutcome(check=check, module_path=path, group_ranks=tuple(ranks), signatures=signatures,
                        verdict=verdict, faulty=faulty, hosts=dict(hosts or {}), timings_s=dict(timings or {}))


# Mesh dimension names (PyTorch's, Lightning's, torchtitan's) along which replicas or FSDP shard
# peers run the same computation on the same (unsharded) parameters, and those that split it.
DATA_PARALLEL_DIMS = frozenset({"dp", "dp_replicate", "dp_shard", "data_parallel", "replicate", "shard"})
MODEL_PARALLEL_DIMS = frozenset({"tp", "tensor_parallel"})


class UnknownLayoutError(ResiliencyError, ValueError):
    """The parallel layout does not say which ranks compute the same thing; SCOUT will not guess."""


def explicit_peer_groups(groups: object, world_size: int) -> List[List[int]]:
    """A descriptor's own `peer_groups` (an adapter that reads them from its framework, e.g.
    Megatron's data-parallel groups): used as given once they partition the job's ranks."""
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and g and all(_positive_int(r) or r == 0 for r in g) for g in groups):
        raise UnknownLayoutError(f"the topology's peer_groups {groups!r} is not a list of non-empty rank lists")
    if sorted(r for g in groups for r in g) != list(range(world_size)):
        raise UnknownLayoutError(f"the topology's peer_groups {list(map(list, groups))} do not partition the "
                                 f"{world_size} ranks of the job")
    return sorted(sorted(int(r) for r in g) for g in groups)


def _declared_layout(layout: object, world_size: int) -> Tuple[List[int], List[str], List[int]]:
    """An adapter's own reading of its framework's layout (TorchTitan's ParallelDims, whose root mesh
    is one flat `world` dimension): `{"shape", "names"}` row-major over ranks 0..world_size-1, or
    `{"unsupported": reason}`."""
    if isinstance(layout, dict) and "unsupported" in layout:
        raise UnknownLayoutError(str(layout["unsupported"]))
    if not isinstance(layout, dict) or not isinstance(layout.get("shape"), list) or \
            not isinstance(layout.get("names"), list):
        raise UnknownLayoutError(f"the adapter's peer_layout {layout!r} is not {{'shape': [...], 'names': [...]}}")
    if math.prod(layout["shape"]) != world_size:
        raise UnknownLayoutError(f"the adapter's peer_layout {layout['shape']} does not cover the {world_size} ranks")
    return layout["shape"], layout["names"], list(range(world_size))


def peer_groups_from_topology(descriptor: Dict[str, object], world_size: int,
                              mesh: Optional[Tuple[Sequence[int], Sequence[str], Sequence[int]]] = None
                              ) -> List[List[int]]:
    """Equivalent-peer groups for an adapter's `Topology.descriptor` and, when the model has
    DTensor parameters, their root device mesh `(shape, dim names, ranks in mesh order)`.

    Peers share every model-parallel (TP) coordinate and vary along every data-parallel one
    (`dp_replicate` and `dp_shard`: FSDP shard peers replay the unsharded module). An unnamed
    mesh is read the way the PyTorch adapter reads it: 1-D is FSDP, 2-D is HSDP. A descriptor
    that carries its own `peer_groups` (the Megatron adapter's) is taken as given; its
    `peer_layout` (TorchTitan's, see `_declared_layout`) takes the place of the parameters' mesh.
    Raises `UnknownLayoutError` for anything else rather than returning groups that could be wrong."""
    if not _positive_int(world_size):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if descriptor.get("peer_groups") is not None:
        return explicit_peer_groups(descriptor["peer_groups"], world_size)
    if "peer_layout" in descriptor:
        mesh = _declared_layout(descriptor["peer_layout"], world_size)
    if mesh is None:
        tp = descriptor.get("tp", descriptor.get("mp_world_size", 1))  # mp_world_size: DeepSpeed's
        if tp not in (None, 1):
            raise UnknownLayoutError(f"the topology has model parallelism (tp={tp}) but no DTensor parameters; "
                                     "SCOUT derives model-parallel coordinates from the parameters' device mesh")
        return dense_peer_groups(world_size)
    shape, names, ranks = tuple(mesh[0]), tuple(mesh[1] or ()), list(mesh[2])
    if sorted(ranks) != list(range(world_size)):
        raise UnknownLayoutError(f"the parameters' device mesh holds ranks {sorted(ranks)}, not the whole job "
                                 f"(0..{world_size - 1}); ranks outside it have an unknown role")
    if not names:
        if len(shape) > 2:
            raise UnknownLayoutError(f"an unnamed {len(shape)}-D device mesh {list(shape)}; name its dimensions "
                                     f"(data-parallel: {sorted(DATA_PARALLEL_DIMS)}, model-parallel: "
                                     f"{sorted(MODEL_PARALLEL_DIMS)})")
        names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    unknown = [n for n in names if n not in DATA_PARALLEL_DIMS | MODEL_PARALLEL_DIMS]
    if unknown:
        raise UnknownLayoutError(f"device mesh dimensions {unknown} are neither data-parallel "
                                 f"{sorted(DATA_PARALLEL_DIMS)} nor model-parallel {sorted(MODEL_PARALLEL_DIMS)}")
    return mesh_peer_groups(shape, names, ranks, [n for n in names if n in DATA_PARALLEL_DIMS])


def mesh_peer_groups(shape: Sequence[int], names: Sequence[str], ranks: Sequence[int],
                     varying: Sequence[str]) -> List[List[int]]:
    """Peer groups (global ranks) of a mesh holding `ranks` in mesh order: ranks varying along the
    `varying` dimensions only; every rank alone when there is none."""
    if not varying:
        return [[rank] for rank in sorted(ranks)]
    positions = peer_groups_from_mesh(shape, names, replicate_dim=list(varying))
    return sorted(sorted(ranks[p] for p in group) for group in positions)
