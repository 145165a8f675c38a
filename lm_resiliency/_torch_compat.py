"""Private torch API used outside the DDP bucket pin (all of it is here; the pin's own is in
`adapters/_ddp_compat.py`).

Each checked against torch 2.13.0 (tests/unit/test_torch_compat.py fails when one changes):
- `DeviceMesh._get_root_mesh()`: the mesh a TP-only or FSDP-only submesh was sliced from, so a
  topology is described whole (the PyTorch adapter, SCOUT's peer groups).
- `torch.distributed.distributed_c10d._get_default_store()`: the default group's store, where
  SCOUT's out-of-band monitor keeps its heartbeats (no second rendezvous to configure).
- FSDP2 (`FSDPModule._get_fsdp_state()`): `_modules`, `_fsdp_param_groups`,
  `_pre_forward_hook_handle`/`_post_forward_hook_handle` (their `.id` keys the module's
  `_forward_pre_hooks`/`_forward_hooks` dicts), `_cast_forward_inputs`, `_cast_output_dtype`:
  SCOUT unshards a module for a replay and runs it with only FSDP's dtype casts.
- DDP: `_comm_hooks` (the Python comm hooks already registered), `_get_ddp_logging_data()
  ["comm_hook"]` (the name of any hook, C++ built-ins included) and `_use_python_reducer`
  (compiled autograd's reducer, which calls hooks per parameter, not per bucket): SCOUT's
  gradient-bucket trace. If a later torch drops one, these answer UNKNOWN / True and the trace is
  not installed rather than risking a second registration or the wrong hook signature.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Tuple

import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

TORCH_CHECKED = "2.13.0"
UNKNOWN = "unknown"


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


def registered_hook_name(ddp: Any) -> Optional[str]:
    """The name of the comm hook already registered on `ddp`; None when there is none; UNKNOWN
    when this torch does not expose it (treated as registered: DDP accepts only one hook)."""
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks:
        return getattr(hooks[-1][0], "__qualname__", repr(hooks[-1][0]))
    try:
        name = ddp._get_ddp_logging_data().get("comm_hook")
    except Exception as exc:  # noqa: BLE001 - a torch without the logging data: fail closed
        logger.debug("DDP logging data unavailable: %r", exc)
        return UNKNOWN
    if hooks is None:
        return UNKNOWN
    return name or None


def uses_python_reducer(ddp: Any) -> bool:
    """True when DDP reduces through its Python reducer (compiled autograd), whose hooks receive
    (grad, param) pairs, not buckets; also True when this torch does not say (fail closed)."""
    return bool(getattr(ddp, "_use_python_reducer", True))
