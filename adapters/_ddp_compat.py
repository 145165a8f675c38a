"""One gradient-bucket layout for every DDP run, fresh or resumed (all private torch use is here).

Why: DDP's reducer starts from one layout (all parameters in one bucket; with
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

Private torch API, each checked against torch 2.13.0 (tests/unit/test_ddp_compat.py fails when
one changes):
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
from typing import List, Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Tests switch this off to show what the pin prevents; users never need to.
_ENABLED = True

TORCH_CHECKED = "2.13.0"

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
    if ddp._use_python_reducer:
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
