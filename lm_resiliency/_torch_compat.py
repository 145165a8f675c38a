"""Private torch API used outside the DDP bucket pin (all of it is here; the pin's own is in
`adapters/_ddp_compat.py`, SCOUT's DDP comm-hook reads in `scout/_ddp_hooks_torch213.py`).

Each checked against torch 2.13.0 (tests/unit/test_torch_compat.py fails when one changes):
- `DeviceMesh._get_root_mesh()`: the mesh a TP-only or FSDP-only submesh was sliced from, so a
  topology is described whole (the PyTorch adapter, SCOUT's peer groups).
- `torch.distributed.distributed_c10d._get_default_store()`: the default group's store, where
  SCOUT's out-of-band monitor keeps its heartbeats (no second rendezvous to configure).
- FSDP2 (`FSDPModule._get_fsdp_state()`): `_modules`, `_fsdp_param_groups`,
  `_pre_forward_hook_handle`/`_post_forward_hook_handle` (their `.id` keys the module's
  `_forward_pre_hooks`/`_forward_hooks` dicts), `_cast_forward_inputs`, `_cast_output_dtype`:
  SCOUT unshards a module for a replay and runs it with only FSDP's dtype casts.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch.distributed as dist
from torch import nn

TORCH_CHECKED = "2.13.0"


def root_mesh(mesh: Any) -> Any:
    """The root DeviceMesh `mesh` was sliced from (itself when it is the root)."""
    return mesh._get_root_mesh()


def default_store() -> dist.Store:
    """The default process group's store."""
    return dist.distributed_c10d._get_default_store()


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state of a `fully_shard`ed module."""
    return module._get_fsdp_state()


def fsdp_grouped_modules(module: nn.Module) -> Tuple[nn.Module, ...]:
    """The modules one `fully_shard` call covers together with `module`."""
    return tuple(fsdp_state(module)._modules)


def fsdp_param_groups(module: nn.Module) -> List[Any]:
    """The FSDP parameter groups (`unshard`/`reshard`, `is_sharded`) of `module`."""
    return list(fsdp_state(module)._fsdp_param_groups)


def swap_fsdp_forward_hooks(module: nn.Module, pre: Callable[..., Any] | None = None,
                            post: Callable[..., Any] | None = None) -> Tuple[Any, Any]:
    """Put `pre`/`post` in the places of FSDP's forward pre-/post-hook on `module` (None: FSDP's
    dtype casts only, without its iteration bookkeeping). Returns the hooks replaced, to put back
    with a second call."""
    state = fsdp_state(module)
    pre_id, post_id = state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id
    replaced = (module._forward_pre_hooks[pre_id], module._forward_hooks[post_id])
    module._forward_pre_hooks[pre_id] = pre if pre is not None else _cast_inputs(state)
    module._forward_hooks[post_id] = post if post is not None else _cast_output(state)
    return replaced


def _cast_inputs(state: Any) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        return state._cast_forward_inputs(args, kwargs)
    return hook


def _cast_output(state: Any) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return state._cast_output_dtype(output)
    return hook
