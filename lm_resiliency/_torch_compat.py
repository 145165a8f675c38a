"""Private torch API, all of it (tests/unit/test_torch_compat.py and tests/unit/test_ddp_compat.py
fail when one changes). Two parts: reads used across the library, and the DDP bucket pin, which is
nothing but private calls.

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

The DDP bucket pin (`pin_bucket_layout`): one gradient-bucket layout for every DDP run, fresh or
resumed. Why: DDP's reducer starts from one layout (all parameters in one bucket; with
`find_unused_parameters=True`, buckets in reverse registration order) and, after its first
backward, rebuilds its buckets once in the order gradients arrived. A ring all-reduce (gloo, NCCL)
splits a bucket by position, so with 3 or more ranks the order in which a float's per-rank values
are summed depends on where it sits in its bucket. A restarted process spends its first iteration
in the initial layout while the run it continues already uses the rebuilt one, so the first
resumed step differs in the last bits and the difference carries forward.

What `pin_bucket_layout` does, once, at attach and before the first training iteration: it
rebuilds the reducer the way DDP's constructor does, over the same parameters in reverse
registration order, and makes it rebuild its buckets immediately, in that order, with DDP's own
size limits (`bucket_cap_mb`, after a small first bucket when that is left at its default). The
reducer then never rebuilds again.
Reverse registration order is the gradient order DDP assumes for a model registered in forward
order, so buckets still fill and all-reduce while backward runs. The cost is one rank-0
broadcast of the layout at attach; a training step runs exactly DDP's code.

Private torch API, each checked against torch 2.13.0:
- `DistributedDataParallel._build_params_for_reducer()`, `._build_debug_param_to_name_mapping()`,
  `._ddp_init_helper(parameters, expect_sparse_gradient, param_to_name_mapping, static_graph)`:
  the constructor's own path to a reducer (`__setstate__` uses it too).
- `Reducer._set_static_graph()`, `Logger._set_static_graph()`: re-applied to the new reducer, as
  `__setstate__` does.
- `Reducer._push_all_rebuilt_params()` then `Reducer._rebuild_buckets()`: the Join hook's way to
  rebuild without a backward pass (pushes parameters in reducer index order; rank 0 broadcasts).
- `DistributedDataParallel._comm_hooks` (the (hook, state) pairs `register_comm_hook` recorded):
  cleared and registered again, through the public `register_comm_hook`, on the new reducer.
- `DistributedDataParallel._has_rebuilt_buckets`, `._use_python_reducer`, `.mixed_precision`,
  `.reducer`, `.logger`, `._get_ddp_logging_data()["comm_hook"]`: to refuse what this cannot pin.
- `Reducer._get_zeros_like_grad_buckets()`: reads the layout (`bucket_layout`).
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any, Callable, List, Optional, Set, Tuple

import torch
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


# ------------------------------------------------------------------ the DDP bucket pin

# Tests switch this off to show what the pin prevents; users never need to.
_ENABLED = True


_PINNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def pin_bucket_layout(ddp: nn.Module) -> bool:
    """Give `ddp` (a DistributedDataParallel) its final bucket layout now. Collective over the
    DDP process group: every rank calls it at the same point. Returns True when the layout is
    fixed for the rest of the run (pinned now, or never rebuilt by DDP); logs a warning and
    returns False when it cannot be pinned."""
    if not _ENABLED:
        return False
    if ddp in _PINNED:
        return True
    reason = _unpinnable(ddp)
    if reason is not None:
        logger.warning("DDP bucket layout not pinned: %s. The model trains normally, but a resumed "
                       "run can differ from an uninterrupted one in the last bits of its gradient "
                       "sums (docs/frameworks.md, \"DDP and bitwise resume\").", reason)
        return False
    if ddp.find_unused_parameters and not ddp.static_graph:
        # DDP never rebuilds here: its constructor's layout (reverse registration order) stays.
        _PINNED.add(ddp)
        return True
    parameters, expect_sparse = ddp._build_params_for_reducer()
    parameters.reverse()
    expect_sparse.reverse()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    hooks = list(ddp._comm_hooks)
    ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    ddp._comm_hooks.clear()
    for hook, state in hooks:  # the new reducer carries the communication hooks the old one had
        ddp.register_comm_hook(state, hook)
    ddp.reducer._push_all_rebuilt_params()
    if not ddp.reducer._rebuild_buckets():
        raise RuntimeError(f"DDP's reducer did not rebuild its buckets when asked (torch "
                           f"{torch.__version__}; lm-resiliency checked {TORCH_CHECKED}); report it")
    _PINNED.add(ddp)
    logger.debug("DDP bucket layout pinned: %d bucket(s)", len(bucket_layout(ddp)))
    return True


def _unpinnable(ddp: nn.Module) -> str | None:
    if getattr(ddp, "reducer", None) is None:
        return "this DDP has no reducer (every parameter is all-reduced by a delayed hook)"
    if uses_python_reducer(ddp):
        return "this DDP uses the Python reducer (compiled autograd)"
    if ddp._has_rebuilt_buckets or any(p.grad is not None for p in ddp.module.parameters()):
        return ("DDP already ran a backward pass before lm-resiliency attached; attach "
                "(enable_resiliency, or the framework callback) before the first training step")
    if getattr(ddp, "mixed_precision", None) is not None:
        return "this DDP uses the experimental mixed_precision option"
    if not ddp._comm_hooks and "comm_hook" in ddp._get_ddp_logging_data():
        return ("a built-in DDP communication hook is registered (_register_builtin_comm_hook); "
                "register it after lm-resiliency attaches, so it lands on the pinned reducer")
    return None


def find_wrapper(module: nn.Module) -> Optional[nn.Module]:
    """The DistributedDataParallel wrapping `module`, if one exists (Accelerate keeps only the inner
    module and hands the wrapper to the caller). Follows the garbage collector's referrers from the
    module to the wrapper's `_modules` dict, its instance dict, and the wrapper; no torch internals."""
    from torch.nn.parallel import DistributedDataParallel

    for children in gc.get_referrers(module):
        if not (isinstance(children, dict) and children.get("module") is module):
            continue
        for state in gc.get_referrers(children):
            if not (isinstance(state, dict) and state.get("_modules") is children):
                continue
            for owner in gc.get_referrers(state):
                if isinstance(owner, DistributedDataParallel) and owner.module is module:
                    return owner
    return None


def bucket_layout(ddp: nn.Module) -> List[List[str]]:
    """Parameter names per bucket, in the order DDP all-reduces the buckets."""
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    return [[names[id(p)] for p in bucket.parameters()]
            for bucket in ddp.reducer._get_zeros_like_grad_buckets()]
