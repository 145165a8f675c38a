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
- `nn.Module._non_persistent_buffers_set`: the buffers a module's state_dict leaves out, which
  adapters capturing module by module leave out too (`wrappers.persistent_buffers`).
- DDP: `_comm_hooks` (the Python comm hooks already registered), `_get_ddp_logging_data()
  ["comm_hook"]` (the name of any hook, C++ built-ins included) and `_use_python_reducer`
  (compiled autograd's reducer, which calls hooks per parameter, not per bucket): SCOUT's
  gradient-bucket trace. If a later torch drops one, these answer UNKNOWN / True and the trace is
  not installed rather than risking a second registration or the wrong hook signature.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Set, Tuple

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


def non_persistent_buffer_names(module: nn.Module) -> Set[str]:
    """Names of `module`'s own buffers registered with `persistent=False`."""
    return set(module._non_persistent_buffers_set)


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state of a `fully_shard`ed module."""
    return module._get_fsdp_state()


def fsdp_grouped_modules(module: nn.Module) -> Tuple[nn.Module, ...]:
    """The modules one `fully_shard` call covers together with `module`."""
    return tuple(fsdp_state(module)._modules)


def fsdp_param_groups(module: nn.Module) -> List[Any]:
    """The FSDP parameter groups (`unshard`/`reshard`, `is_sharded`) of `module`."""
    return list(fsdp_state(module)._fsdp_param_groups)


HookSlot = Tuple[dict, int, str]


def fsdp_forward_hook_slots(module: nn.Module) -> List[HookSlot]:
    """(hooks dict, hook id, "pre" or "post") of FSDP's forward hooks for the `fully_shard` call
    covering `module`, on each module it covers: one pair for `fully_shard(module)`, one per module
    for a grouped `fully_shard([...])` (whose handle is a `_MultiHandle`)."""
    state = fsdp_state(module)
    slots = []
    for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
        for single in getattr(handle, "handles", (handle,)):
            for covered in state._modules:  # hook ids are unique: each is in one dict at most
                if single.id in covered._forward_pre_hooks:
                    slots.append((covered._forward_pre_hooks, single.id, "pre"))
                if single.id in covered._forward_hooks:
                    slots.append((covered._forward_hooks, single.id, "post"))
    return list({(id(hooks), hook_id): (hooks, hook_id, kind) for hooks, hook_id, kind in slots}.values())


def fsdp_cast_hook(module: nn.Module, kind: str) -> Callable[..., Any]:
    """FSDP's dtype cast alone, without its iteration bookkeeping: the forward pre-hook ("pre")
    or post-hook ("post") of the `fully_shard` call covering `module`."""
    state = fsdp_state(module)
    return _cast_inputs(state) if kind == "pre" else _cast_output(state)


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
