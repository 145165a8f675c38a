"""Expert replay: a `ReplayWorkload` replayed among the peers that hold the same experts.

An expert sees only the tokens routed to it, so the dense replay among data-parallel peers never
compares it. Expert-data-parallel peers (equal expert-parallel and expert-TP coordinates) hold
bitwise-equal copies of the same experts: the check's source captures the expert stage's
invocation in training, materializes the check's recipe from it, and every peer replays that
same invocation and votes, exactly as the dense replay does (`ReplayDetector`, whose capture,
exchange, vote and tie-break this reuses). Each check replays one recipe; K checks make a cycle.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from lm_resiliency._torch_compat import root_mesh
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.moe_workload import MaterializationError, ReplayWorkload, recipe_label
from lm_resiliency.scout.peers import (
    DATA_PARALLEL_DIMS,
    UnknownLayoutError,
    dense_peer_groups,
    explicit_peer_groups,
    mesh_peer_groups,
    peer_groups_from_topology,
)
from lm_resiliency.scout.replay import ReplayDetector, _Capture

logger = logging.getLogger(__name__)

EXPERT_CHECK = "expert"
EXPERT_PARALLEL_DIMS = frozenset({"ep", "expert_parallel"})
EXPERT_TP_DIMS = frozenset({"etp", "expert_tp", "tp", "tensor_parallel"})
EXPERT_DATA_PARALLEL_DIMS = frozenset({"edp", "expert_dp", "expert_data_parallel"}) | DATA_PARALLEL_DIMS


def _mesh_triple(mesh: Any) -> Tuple[List[int], List[str], List[int]]:
    root = root_mesh(mesh) if hasattr(mesh, "_get_root_mesh") else mesh
    return list(root.shape), list(root.mesh_dim_names or []), root.mesh.flatten().tolist()


def expert_peer_groups(mesh: Optional[Tuple[Sequence[int], Sequence[str], Sequence[int]]],
                       descriptor: Dict[str, Any], world_size: int) -> List[List[int]]:
    """Expert-data-parallel peer groups: ranks at the same expert-parallel and expert-TP
    coordinates, varying along the expert-data-parallel dimensions.

    From a device mesh `(shape, dim names, ranks in mesh order)` whose dimensions are all named
    (EP: "ep"; expert TP: "etp"/"tp"; expert DP: "edp" or a data-parallel name), else from the
    topology descriptor's `ep` (and `etp`) degrees with expert TP innermost, then EP (Megatron's
    layout), unless the descriptor carries the framework's own `expert_peer_groups` (the Megatron
    adapter's). Raises `UnknownLayoutError` rather than guess."""
    if mesh is not None:
        shape, names, ranks = list(mesh[0]), list(mesh[1] or ()), list(mesh[2])
        if sorted(ranks) != list(range(world_size)):
            raise UnknownLayoutError(f"the expert device mesh holds ranks {sorted(ranks)}, not the whole job "
                                     f"(0..{world_size - 1})")
        known = EXPERT_PARALLEL_DIMS | EXPERT_TP_DIMS | EXPERT_DATA_PARALLEL_DIMS
        if len(names) != len(shape) or any(n not in known for n in names):
            raise UnknownLayoutError(f"expert replay needs every device mesh dimension named: expert parallel "
                                     f"{sorted(EXPERT_PARALLEL_DIMS)}, expert TP {sorted(EXPERT_TP_DIMS)} or expert "
                                     f"data parallel {sorted(EXPERT_DATA_PARALLEL_DIMS)}; got {names or shape}")
        return mesh_peer_groups(shape, names, ranks, [n for n in names if n in EXPERT_DATA_PARALLEL_DIMS])
    if descriptor.get("expert_peer_groups") is not None:  # read from the framework (Megatron's expert-DP groups)
        return explicit_peer_groups(descriptor["expert_peer_groups"], world_size)
    ep = descriptor.get("ep", descriptor.get("expert_parallel_size"))
    if ep is None:
        raise UnknownLayoutError("expert replay needs the expert-parallel layout: pass ReplayWorkload(device_mesh=...) "
                                 "with an 'ep' dimension, or a topology with an 'ep' degree")
    etp = descriptor.get("etp", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (ep, etp)):
        raise UnknownLayoutError(f"topology ep={ep!r}, etp={etp!r}: degrees must be positive ints")
    try:
        return dense_peer_groups(world_size, ep * etp)
    except ValueError as exc:
        raise UnknownLayoutError(f"topology ep={ep}, etp={etp}: {exc}") from exc


def workload_peer_groups(workload: ReplayWorkload, descriptor: Dict[str, Any], world_size: int,
                         parameter_mesh: Optional[tuple]) -> List[List[int]]:
    """The peer groups a workload replays among (every rank computes the same list)."""
    if workload.peer_role == "dense":
        return peer_groups_from_topology(descriptor, world_size, parameter_mesh)
    mesh = _mesh_triple(workload.device_mesh) if workload.device_mesh is not None else None
    if mesh is None and parameter_mesh is not None and EXPERT_PARALLEL_DIMS & set(parameter_mesh[1] or ()):
        mesh = parameter_mesh
    return expert_peer_groups(mesh, descriptor, world_size)


class WorkloadReplayDetector(ReplayDetector):
    """A `ReplayDetector` whose one check class, "expert", replays the workload's modules at its
    recipes: recipe `round % K` at each check, the module rotating when `rotate_layers`. The
    check's label is `"<module path>[<recipe>]"`, so the vote, the reference tie-break and the
    reports name the regime. No backward or live-output comparison: a materialized invocation
    is not the one training ran."""

    def __init__(self, model: nn.Module, optimizer: Any, config: ReplayHarnessConfig, workload: ReplayWorkload, *,
                 group: Any, group_ranks: Sequence[int]) -> None:
        self.workload = workload
        self._labels: Tuple[Tuple[str, nn.Module, int], ...] = ()   # (label, module, recipe index)
        self._entries: Tuple[Tuple[str, nn.Module], ...] = ()
        super().__init__(model, optimizer, config, group=group, group_ranks=group_ranks)
        paths = {id(m): path or "(root)" for path, m in self._root.named_modules()}
        missing = [type(m).__name__ for m in workload.replay_modules if id(m) not in paths]
        if missing:
            raise ValueError(f"ReplayWorkload.replay_modules: {missing} are not modules of the model")
        self._labels = tuple((f"{paths[id(m)]}[{recipe_label(r)}]", m, i)
                             for m in workload.replay_modules for i, r in enumerate(workload.recipes))
        self._entries = tuple((label, m) for label, m, _ in self._labels)
        self._backward = set()

    @property
    def cycle_length(self) -> int:
        """Checks in one complete catalog cycle (the number of recipes)."""
        return len(self.workload.recipes)

    def _candidates(self, check: str) -> Tuple[Tuple[str, nn.Module], ...]:
        return self._entries if check == EXPERT_CHECK else ()

    def _available(self, check: str) -> bool:
        return check == EXPERT_CHECK and bool(self._entries)

    def checks_due(self, step: int) -> List[str]:
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"step must be a positive int (optimizer steps counted from 1), got {step!r}")
        interval = self.config.check_interval   # 0: periodic replay off
        return [EXPERT_CHECK] if interval > 0 and step % interval == 0 and self._entries else []

    def _round(self, check: str, step: int) -> int:
        return step // self.config.check_interval

    def recipe_index(self, step: int) -> int:
        """The catalog recipe checked at `step` (0-based)."""
        return (self._round(EXPERT_CHECK, step) - 1) % len(self.workload.recipes)

    def _target(self, check: str, step: int) -> Tuple[str, nn.Module]:
        k = self._round(check, step) - 1
        recipes = len(self.workload.recipes)
        modules = len(self.workload.replay_modules)
        # All recipes of one module form a cycle; rotate_layers moves to the next module per cycle.
        module = (k // recipes) % modules if self.config.rotate_layers else 0
        label, m, _ = self._labels[module * recipes + k % recipes]
        return label, m

    def _encode_capture(self, check: str, path: str, step: int,
                        capture: Optional[_Capture]) -> Tuple[dict, List[torch.Tensor]]:
        if capture is not None and capture.done:
            recipe = self.workload.recipes[next(i for label, _, i in self._labels if label == path)]
            capture.live = None  # the live call ran the training regime, not this recipe
            try:
                capture.args, capture.kwargs = self.workload.materializer.materialize(
                    tuple(capture.args), dict(capture.kwargs), recipe)
            except MaterializationError as exc:
                return {"ok": False, "step": step, "check": check, "module": path,
                        "reason": f"recipe {recipe_label(recipe)} cannot be materialized from the captured call of "
                                  f"{path!r}: {exc}"}, []
        return super()._encode_capture(check, path, step, capture)
