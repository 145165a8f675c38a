"""Replaying FSDP2 / HSDP / tensor-parallel modules on the parameters their peers share.

FSDP shard peers hold different shards of one parameter, so a replay must run, and a parameter
signature must be taken, on the *unsharded* parameters. `unsharded(modules)` all-gathers them
with FSDP's own `FSDPModule.unshard()` (one all-gather per FSDP parameter group, over the FSDP
mesh) and puts each module back exactly as it was afterwards: groups that were sharded are
resharded (`reshard()` frees the unsharded storage and re-registers the same sharded DTensors
the optimizer holds); groups that were already unsharded are left alone. Every rank of the FSDP
mesh must enter it at the same point: SCOUT guarantees that by running the same replay plan at
the same step on every rank.

Why unshard()/reshard() and not `DTensor.full_tensor()` + `functional_call`: the sampled hidden
layer is usually an FSDP module itself (one `fully_shard` per block), so calling it runs FSDP's
forward hooks either way, and under TP `full_tensor()` would also gather the TP dimension that the
module's own TP hooks expect to stay sharded. FSDP's forward hooks are not replay-safe (they
record the module in the backward prefetch order, may make it the iteration's root and prefetch
other modules), so while unsharded each module's FSDP forward hooks are swapped, in place, for
just their dtype casts (`MixedPrecisionPolicy`): the replay computes what training computed and
leaves FSDP's iteration state untouched. Test-side and user hooks keep running. A grouped
`fully_shard([a, b])` (TorchTitan groups the final norm with the output head) is one FSDP state
with hooks on each of its modules: all of them are swapped, and the group unsharded once.

Tensor parallelism needs nothing here: TP modules keep their DTensor parameters and their TP
hooks, whose collectives line up because every rank of the TP group replays the same module at
the same step; signatures read the local TP shards, which are equal across data-parallel peers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Sequence, Tuple

from torch import nn

from lm_resiliency._torch_compat import (
    fsdp_cast_hook,
    fsdp_forward_hook_slots,
    fsdp_grouped_modules,
    fsdp_param_groups,
    fsdp_state,
)
from lm_resiliency.errors import ResiliencyError


class ShardedReplayError(ResiliencyError, ValueError):
    """An FSDP layout that cannot be unsharded and restored exactly for a replay."""


def _fsdp_module_type() -> Any:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    return FSDPModule


def is_fsdp_module(module: nn.Module) -> bool:
    cls = _fsdp_module_type()
    return cls is not None and isinstance(module, cls)


def fsdp_modules_for(root: nn.Module, path: str) -> List[nn.Module]:
    """The FSDP modules whose parameters a forward of `root`'s submodule `path` reads: its nearest
    FSDP ancestor-or-self and every FSDP module below it, in `named_modules` order (the same
    order on every rank, so the all-gathers line up)."""
    module = root if path == "(root)" else root.get_submodule(path)
    owners: List[nn.Module] = []
    prefix = "" if path == "(root)" else path
    parts = prefix.split(".") if prefix else []
    for depth in range(len(parts), -1, -1):
        candidate = root.get_submodule(".".join(parts[:depth])) if depth else root
        if is_fsdp_module(candidate):
            owners.append(candidate)
            break
    owners += [m for m in module.modules() if m is not module and is_fsdp_module(m)]
    return owners


def _shard_calls(modules: Sequence[nn.Module]) -> List[nn.Module]:
    """One module per `fully_shard` call among `modules` (a grouped `fully_shard([a, b])`
    covers several with one FSDP state)."""
    calls: dict = {}
    for module in modules:
        calls.setdefault(id(fsdp_state(module)), module)
    return list(calls.values())


def check_replayable(modules: Sequence[nn.Module], path: str) -> None:
    """Raise ShardedReplayError for FSDP layouts `unsharded` cannot restore exactly."""
    for module in _shard_calls(modules):
        covered = len(fsdp_grouped_modules(module))
        slots = fsdp_forward_hook_slots(module)
        if len(slots) != 2 * covered:
            raise ShardedReplayError(f"{path!r}: FSDP's forward hooks of its {covered} module(s) were "
                                     f"not found where fully_shard registers them ({len(slots)} of "
                                     f"{2 * covered}); SCOUT cannot replay it without them firing")


@contextlib.contextmanager
def unsharded(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every FSDP module in `modules` unsharded, with its FSDP forward hooks reduced to their
    dtype casts; restored exactly on exit (see the module docstring). Collective over each
    module's FSDP mesh."""
    calls = _shard_calls(modules)
    groups = [group for module in calls for group in fsdp_param_groups(module)]
    post_forward = [g for g in groups if g.is_sharded_post_forward]
    if post_forward:
        raise ShardedReplayError("an FSDP parameter group is in its post-forward resharded state (replay must run "
                                 "after backward, before optimizer.step())")
    was_sharded = [g.is_sharded for g in groups]
    swapped: List[Tuple[dict, int, Any]] = []
    try:
        for module in calls:
            module.unshard()
        for module in calls:
            for hooks, hook_id, kind in fsdp_forward_hook_slots(module):
                swapped.append((hooks, hook_id, hooks[hook_id]))
                hooks[hook_id] = fsdp_cast_hook(module, kind)
        yield
    finally:
        for hooks, hook_id, original in swapped:
            hooks[hook_id] = original
        for group, sharded in zip(groups, was_sharded):
            if sharded and not group.is_sharded:
                group.reshard()
