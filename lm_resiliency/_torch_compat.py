"""Private torch API, all of it (tests/unit/test_torch_compat.py and tests/unit/test_ddp_compat.py
fail when one changes). Two parts: reads used across the library, and DDP's reducer internals
(its bucket layout, kept across a restart or pinned, and its gradient average), which are nothing
but private calls.

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

DDP's bucket layout. DDP's reducer starts from one layout (all parameters in one bucket; with
`find_unused_parameters=True`, buckets in reverse registration order) and, after its first
backward, rebuilds its buckets once in the order gradients arrived. A ring all-reduce (gloo, NCCL)
splits a bucket by position, so with 3 or more ranks the order in which a float's per-rank values
are summed depends on where it sits in its bucket. A restarted process spends its first iteration
in the initial layout while the run it continues already uses the rebuilt one, so the first
resumed step would differ in the last bits and the difference carries forward. Two answers:

- Kept across a restart (the PyTorch adapter): DDP lays out and rebuilds its buckets as it does
  without lm-resiliency; `settled_bucket_layout` reads the layout it settled on for each capture
  (running DDP's pending rebuild at a capture right after step 1, as its next forward would), and
  `restore_bucket_layout` gives a resumed process's DDP exactly that layout before its first
  iteration: a new reducer over the parameters in the recorded order, rebuilt at once from that
  order with DDP's own size limits, checked against the record. A run is bitwise equal to the same
  script without lm-resiliency.
- Pinned (`pin_bucket_layout`, the Lightning callback and Accelerate plugin): once, at attach and
  before the first training iteration, the same rebuild over the parameters in reverse registration
  order, the gradient order DDP assumes for a model registered in forward order. Fresh and resumed
  runs share one layout from step 1; the same script without lm-resiliency does not.
Either way the reducer never rebuilds again, and a training step runs exactly DDP's code.

DDP's gradient average (`ReducerAverage`, SCOUT's gradient trace): DDP's C++ reducer averages each
gradient as it copies it into its bucket (see the class); a communication hook must do the same
to leave training untouched, which torch's `allreduce_hook` does not on 3 or more ranks.

Private torch API, each checked against torch 2.13.0:
- `DistributedDataParallel._build_params_for_reducer()`, `._build_debug_param_to_name_mapping()`,
  `._ddp_init_helper(parameters, expect_sparse_gradient, param_to_name_mapping, static_graph)`:
  the constructor's own path to a reducer (`__setstate__` uses it too).
- `Reducer._set_static_graph()`, `Logger._set_static_graph()`: re-applied to the new reducer, as
  `__setstate__` does.
- `Reducer._push_all_rebuilt_params()` then `Reducer._rebuild_buckets()`: the Join hook's way to
  rebuild without a backward pass (pushes parameters in reducer index order; rank 0 broadcasts);
  `Reducer._rebuild_buckets()` alone: the rebuild DDP's forward runs (`_pre_forward`).
- `DistributedDataParallel._comm_hooks` (the (hook, state) pairs `register_comm_hook` recorded):
  cleared and registered again, through the class's `register_comm_hook`, on the new reducer.
- `DistributedDataParallel._has_rebuilt_buckets` (set, as `_pre_forward` sets it),
  `._use_python_reducer`, `.mixed_precision`, `.reducer`, `.logger`, `.static_graph`,
  `.find_unused_parameters`, `._get_ddp_logging_data()["comm_hook"]`: to refuse what cannot be
  rebuilt, and whether DDP rebuilds at all.
- `Reducer._get_zeros_like_grad_buckets()`: reads the layout (`bucket_layout`; it allocates zeros
  like every bucket, so `settled_bucket_layout` reads it once per reducer).
- `.gradient_as_bucket_view`, `.batched_grad_copy`, `._join_config`,
  `._divide_by_initial_world_size` and the C++ reducer's arithmetic (`mark_variable_ready_dense`,
  `flush_deferred_copies`): `ReducerAverage`.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

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
    _rebuild_reducer(ddp, parameters, expect_sparse)
    _PINNED.add(ddp)
    logger.debug("DDP bucket layout pinned")
    return True


def _rebuild_reducer(ddp: nn.Module, parameters: List[torch.Tensor], expect_sparse: List[bool]) -> None:
    """A new reducer over `parameters` in this order (as DDP's constructor builds one), which then
    rebuilds its buckets at once from that order with DDP's own size limits, and never again."""
    from torch.nn.parallel import DistributedDataParallel

    names = ddp._build_debug_param_to_name_mapping(parameters)
    hooks = list(ddp._comm_hooks)
    ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    ddp._comm_hooks.clear()
    for hook, state in hooks:  # the new reducer carries the communication hooks the old one had
        # The class's method: SCOUT's gradient trace replaces the instance's to compose user hooks.
        DistributedDataParallel.register_comm_hook(ddp, state, hook)
    ddp.reducer._push_all_rebuilt_params()
    if not ddp.reducer._rebuild_buckets():
        raise RuntimeError(f"DDP's reducer did not rebuild its buckets when asked (torch "
                           f"{torch.__version__}; lm-resiliency checked {TORCH_CHECKED}); report it")
    ddp._has_rebuilt_buckets = True


def _unsupported(ddp: nn.Module) -> str | None:
    """Why the reducer of `ddp` cannot be rebuilt in place; None when it can."""
    if getattr(ddp, "reducer", None) is None:
        return "this DDP has no reducer (every parameter is all-reduced by a delayed hook)"
    if uses_python_reducer(ddp):
        return "this DDP uses the Python reducer (compiled autograd)"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "this DDP uses the experimental mixed_precision option"
    if not ddp._comm_hooks and "comm_hook" in ddp._get_ddp_logging_data():
        return ("a built-in DDP communication hook is registered (_register_builtin_comm_hook); "
                "register it after lm-resiliency attaches, so it lands on the rebuilt reducer")
    return None


def _unpinnable(ddp: nn.Module) -> str | None:
    if getattr(ddp, "reducer", None) is not None and (
            ddp._has_rebuilt_buckets or any(p.grad is not None for p in ddp.module.parameters())):
        return ("DDP already ran a backward pass before lm-resiliency attached; attach "
                "(enable_resiliency, or the framework callback) before the first training step")
    return _unsupported(ddp)


# ------------------------------------------------------------------ DDP's own layout, kept across a restart

def _rebuilds(ddp: nn.Module) -> bool:
    """Whether DDP rebuilds its buckets once (the reducer's `should_rebuild_buckets`, before it did)."""
    return bool(ddp.static_graph or not ddp.find_unused_parameters)


# (id of the reducer, its layout): read once per reducer, since reading allocates (see below).
_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, Tuple[int, List[List[int]]]]" = weakref.WeakKeyDictionary()


def settled_bucket_layout(ddp: nn.Module, module: Optional[nn.Module] = None) -> Optional[List[List[str]]]:
    """The gradient-bucket layout `ddp` settled on, for a capture: parameter names per bucket (as in
    `module`, default the module DDP wraps: pass the user's own module so that a `torch.compile`
    wrapper inside or outside DDP names them alike), in the order DDP reduces them. None when there
    is none to keep: DDP never rebuilds
    (`find_unused_parameters=True` without `static_graph`, no C++ reducer), or has not yet (its
    first iteration under `static_graph`).

    Collective over DDP's group while DDP's one rebuild is pending: the rebuild runs now, as DDP's
    next forward would run it (from the same gradient arrival order, with the same broadcast from
    rank 0), so a capture right after step 1 already holds the final layout. Reading a layout
    allocates zeros like each bucket once per reducer, at the point where DDP's own rebuild
    allocates as much (before a forward)."""
    if getattr(ddp, "reducer", None) is None or uses_python_reducer(ddp) or not _rebuilds(ddp):
        return None
    if not ddp._has_rebuilt_buckets and ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True
    if not ddp._has_rebuilt_buckets:
        return None
    cached = _LAYOUTS.get(ddp)
    if cached is None or cached[0] != id(ddp.reducer):
        cached = (id(ddp.reducer), _bucket_ids(ddp))
        _LAYOUTS[ddp] = cached
    return _named(cached[1], module if module is not None else ddp.module)


def restore_bucket_layout(ddp: nn.Module, layout: List[List[str]], module: Optional[nn.Module] = None) -> bool:
    """Collective over DDP's group, before the first training iteration: give `ddp` exactly the
    bucket layout `layout` (from `settled_bucket_layout` in the run it resumes) and mark its buckets
    rebuilt, so DDP never rebuilds them. The reducer is built again over the parameters in the
    layout's order and rebuilds from that order with DDP's own size limits, which reproduces each
    bucket (every bucket of one dtype and device is a run of that order). ValueError when `layout`
    does not name each of this DDP's parameters once; False, with a warning, when it cannot be
    applied (the resumed run then trains on, but its gradient sums can differ in the last bits)."""
    if not (isinstance(layout, list) and all(isinstance(b, list) and all(isinstance(n, str) for n in b)
                                             for b in layout)):
        raise ValueError(f"the recovered DDP bucket layout is not a list of lists of parameter names: {layout!r:.200}")
    parameters, expect_sparse = ddp._build_params_for_reducer()
    names = {id(p): n for n, p in (module if module is not None else ddp.module).named_parameters()}
    by_name = {names[id(p)]: (p, sparse) for p, sparse in zip(parameters, expect_sparse)}
    flat = [name for bucket in layout for name in bucket]
    if sorted(flat) != sorted(by_name):
        problems = {"missing": sorted(set(by_name) - set(flat)), "unexpected": sorted(set(flat) - set(by_name)),
                    "repeated": sorted({n for n in flat if flat.count(n) > 1})}
        raise ValueError("the recovered DDP bucket layout does not match this model's parameters (was the model "
                         "changed?): " + ", ".join(f"{kind} {found[:8]}" for kind, found in problems.items() if found))
    reason = _unsupported(ddp)
    if reason is None and not _rebuilds(ddp):
        reason = "this DDP never rebuilds its buckets (find_unused_parameters=True without static_graph)"
    if reason is None and (ddp._has_rebuilt_buckets or any(p.grad is not None for p in parameters)):
        reason = "DDP already ran a backward pass before the state was restored"
    if reason is not None:
        _warn_layout(reason)
        return False
    ordered = [by_name[name] for name in flat]
    _rebuild_reducer(ddp, [p for p, _ in ordered], [sparse for _, sparse in ordered])
    ids = _bucket_ids(ddp)
    _LAYOUTS[ddp] = (id(ddp.reducer), ids)
    got = _named(ids, module if module is not None else ddp.module)
    # Buckets are compared as sets: their order changes when they are reduced, not what they sum.
    if sorted(map(tuple, got)) != sorted(map(tuple, layout)):
        _warn_layout(f"DDP rebuilt {len(got)} bucket(s) from the recovered order, not the {len(layout)} recorded "
                     "(was bucket_cap_mb or DDP_SET_LAST_BUCKET_CAP changed?)")
        return False
    return True


def _warn_layout(reason: str) -> None:
    logger.warning("DDP bucket layout of the interrupted run not restored: %s. The model trains normally, but "
                   "the resumed run can differ from an uninterrupted one in the last bits of its gradient sums "
                   "(docs/frameworks.md, \"DDP and bitwise resume\").", reason)


# ------------------------------------------------------------------ DDP's own gradient average

class ReducerAverage:
    """A DDP communication hook that averages a bucket with the arithmetic DDP's C++ reducer uses
    when no hook is registered, bit for bit; `hook(state, bucket)` (the state is unused).

    Without a hook the reducer averages each gradient while copying it into its bucket, then sums
    the bucket (`Reducer::mark_variable_ready_dense`, torch 2.13): a gradient copied in is multiplied
    by `1. / world_size` (`at::mul_out`); one that already is its bucket view
    (`gradient_as_bucket_view=True`, kept across `zero_grad(set_to_none=False)`) is divided in place
    (`div_`); with `batched_grad_copy=True`, and for sparse gradients, the whole bucket is divided
    (`div_`). With a hook registered the reducer copies the raw gradient in and leaves the average
    to the hook. torch's own `allreduce_hook` divides every bucket: on 3 or more ranks that rounds
    differently from the multiply, so a run whose gradients pass through it drifts from plain DDP.

    Which gradients already were bucket views is seen as they are accumulated (a post-accumulate
    hook per parameter, only with `gradient_as_bucket_view=True`), before the reducer copies them.
    Not reproduced: `Join(..., divide_by_initial_world_size=False)`, where the reducer divides by
    the ranks not yet joined, which no hook can know; this hook divides by the whole group, like
    every DDP communication hook (warned once)."""

    def __init__(self, ddp: nn.Module) -> None:
        self._ddp = weakref.ref(ddp)
        self.process_group = ddp.process_group
        self._divides = bool(getattr(ddp, "batched_grad_copy", False))
        self._views = bool(ddp.gradient_as_bucket_view) and not self._divides
        self._storage: Dict[int, Optional[int]] = {}  # id(parameter) -> its gradient's storage when accumulated
        self._warned = False
        if self._views:
            for param in ddp.module.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param: torch.Tensor) -> None:
        grad = param.grad
        self._storage[id(param)] = grad.untyped_storage().data_ptr() if grad is not None else None

    # No annotations: DDP compares a hook's annotations with the real types.
    def __call__(self, _state, bucket):
        buffer = bucket.buffer()
        world = self.process_group.size()
        self._check_join()
        if self._divides or buffer.is_sparse:
            buffer.div_(world)
        elif not self._views:
            buffer.mul_(1.0 / world)
        else:
            base = buffer.untyped_storage().data_ptr()
            for param, view in zip(bucket.parameters(), bucket.gradients()):
                seen = self._storage.pop(id(param), _UNSEEN)
                if seen is _UNSEEN:  # not accumulated in this backward: as it is now
                    seen = param.grad.untyped_storage().data_ptr() if param.grad is not None else None
                if seen == base:
                    view.div_(world)
                else:
                    view.mul_(1.0 / world)
        return (dist.all_reduce(buffer, group=self.process_group, async_op=True).get_future()
                .then(lambda fut: fut.value()[0]))

    def _check_join(self) -> None:
        ddp = self._ddp()
        if self._warned or ddp is None or not ddp._join_config.enable \
                or getattr(ddp, "_divide_by_initial_world_size", True):
            return
        self._warned = True
        logger.warning("DDP under Join(divide_by_initial_world_size=False): SCOUT's gradient trace divides each "
                       "gradient sum by the whole group, as every DDP communication hook does, not by the ranks "
                       "that have not joined as DDP without a hook would")


_UNSEEN = object()


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


def bucket_layout(ddp: nn.Module, module: Optional[nn.Module] = None) -> List[List[str]]:
    """Parameter names per bucket, in the order DDP all-reduces the buckets; named as in `module`
    (default: the module DDP wraps)."""
    return _named(_bucket_ids(ddp), module if module is not None else ddp.module)


def _bucket_ids(ddp: nn.Module) -> List[List[int]]:
    return [[id(p) for p in bucket.parameters()] for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def _named(buckets: List[List[int]], module: nn.Module) -> List[List[str]]:
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[i] for i in bucket] for bucket in buckets]
