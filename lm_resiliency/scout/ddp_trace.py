"""SCOUT's view of DDP's gradient all-reduce, through DDP's communication-hook seam.

DDP reduces gradients from C++, so `trace_collectives` (Python-level) cannot see it. This module
registers one comm hook on the `DistributedDataParallel` object; it runs the user's hook (or
`ReducerAverage`, DDP's own averaging without a hook, bit for bit: torch's `allreduce_hook`
rounds differently on 3 or more ranks) and around it:

* marks each bucket's reduction as the beacon op "comm:ddp_grad_bucket" on the training thread,
  from the hook call until the bucket's future completes. A rank blocked before its backward is
  then "outside any collective" while its peers wait inside one, and the hang rule names it.
* records when this rank handed its last bucket to the all-reduce (every local gradient ready)
  and when its last bucket came back: a rank's own work in step k is the time from its release
  at step k-1 to its arrival at step k (`take_step`), whichever part of the step is slow.
* checks each bucket for non-finite values before it is reduced (one `aminmax` reduction per
  bucket, kept on the device; read once per step) and each reduced bucket after (one `sum`), so
  the rank where a NaN/Inf first appears is told apart from the ranks it spread to.

Composition: DDP accepts one comm hook. A hook the user registers later (`register_comm_hook`,
or the built-in ALLREDUCE / FP16_COMPRESS types) replaces the inner hook of the trace instead;
a hook already registered before SCOUT cannot be wrapped (DDP offers no way to replace it), so
the trace is not installed and SCOUT watches the parameters' gradients instead (local_trace.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lm_resiliency._torch_compat import ReducerAverage, registered_hook_name, uses_python_reducer
from lm_resiliency.scout.monitor import COMMUNICATION_OP_PREFIX, ProgressBeacon
from lm_resiliency.wrappers import find_ddp

logger = logging.getLogger(__name__)

BUCKET_OP = COMMUNICATION_OP_PREFIX + "ddp_grad_bucket"
_MAX_NAMES = 32


@dataclass(frozen=True)
class StepTrace:
    """What one step's buckets showed on this rank (see `GradientBucketTrace.take_step`)."""

    own_work_s: Optional[float]          # release at the previous step -> last bucket handed over
    non_finite_buckets: Tuple[int, ...]  # buckets non-finite before reduction (this rank's own values)
    non_finite_parameters: Tuple[str, ...]
    reduced_non_finite: bool             # some reduced bucket was non-finite (identical on every rank)
    origin: bool                         # non-finite here first: the job was finite before this step


class GradientBucketTrace:
    """The comm hook installed on one DDP object; `remove()` restores DDP's hook-registration methods.

    Build it with `install_ddp_trace`. `take_step(skipped)` is called once per optimizer step
    boundary from the training thread."""

    def __init__(self, ddp: Any, beacon: ProgressBeacon) -> None:
        self.ddp = ddp
        self.beacon = beacon
        self._inner: Tuple[Any, Callable] = (ddp.process_group, ReducerAverage(ddp))
        self._names: Dict[int, str] = {id(p): n for n, p in ddp.module.named_parameters()}
        self._lock = threading.Lock()
        self._local: List[Tuple[int, torch.Tensor, List[torch.Tensor]]] = []   # (index, [min, max], params)
        self._reduced: List[torch.Tensor] = []
        self._arrival: Optional[float] = None
        self._release: Optional[float] = None
        self._previous_release: Optional[float] = None
        self._contaminated = False
        self._patched: Dict[str, Any] = {}
        self._user_registered = False
        self._active = True
        self._steps = 0

    # composition --------------------------------------------------------------------------------

    def _install(self) -> None:
        self.ddp.register_comm_hook(None, self._hook)
        for name, replacement in (("register_comm_hook", self._user_hook),
                                  ("_register_builtin_comm_hook", self._user_builtin_hook)):
            self._patched[name] = replacement
            setattr(self.ddp, name, replacement)

    def _user_hook(self, state: object, hook: Callable) -> None:
        """A user's later `ddp.register_comm_hook(state, hook)`: it becomes the inner hook."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        with self._lock:
            if self._user_registered:
                raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
            self._inner, self._user_registered = (state, hook), True
        logger.info("SCOUT: DDP comm hook %s runs inside SCOUT's gradient-bucket trace",
                    getattr(hook, "__qualname__", hook))

    def _user_builtin_hook(self, comm_hook_type: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in hooks:
            raise RuntimeError(f"SCOUT traces DDP's gradient buckets and cannot compose built-in hook "
                               f"{comm_hook_type}; register its Python equivalent with register_comm_hook")
        self._user_hook(self.ddp.process_group, hooks[comm_hook_type])

    def remove(self) -> None:
        """Stop tracing and give DDP its registration methods back. The hook stays registered (DDP
        cannot drop one) and keeps running the inner hook only."""
        self._active = False
        for name, replacement in self._patched.items():
            if self.ddp.__dict__.get(name) is replacement:
                delattr(self.ddp, name)
        self._patched = {}

    # hot path -----------------------------------------------------------------------------------

    # No annotations: DDP compares them with the real types, and this module's are strings.
    def _hook(self, _state, bucket):
        if not self._active:  # after close DDP keeps the hook, which then only reduces
            state, inner = self._inner
            return inner(state, bucket)
        # min and max are NaN or infinite exactly when some element is: one pass, no temporary,
        # about 10x cheaper than isfinite().all() on CPU. Read once per step, so no sync here.
        extremes = torch.stack(torch.aminmax(bucket.buffer()))
        with self._lock:
            self._local.append((bucket.index(), extremes, bucket.parameters()))
            self._arrival = time.monotonic()
            state, inner = self._inner
        self.beacon.enter(BUCKET_OP, on_training_thread=True)
        try:
            future = inner(state, bucket)
        except BaseException:
            self.beacon.exit(BUCKET_OP)
            raise
        return future.then(self._done)

    def _done(self, future: torch.futures.Future) -> Any:
        try:
            value = future.value()
            if isinstance(value, torch.Tensor) and value.numel():
                # A sum is non-finite when any element is (or, rarely, when it overflows, which
                # only withholds an origin report at the next step): half the cost of aminmax.
                reduced = value.sum(dtype=torch.float32 if value.element_size() < 4 else None).reshape(1)
                with self._lock:
                    self._reduced.append(reduced)
            return value
        finally:
            self._release = time.monotonic()
            self.beacon.exit(BUCKET_OP)

    # step boundary ------------------------------------------------------------------------------

    def released(self) -> None:
        """This rank was just released from a synchronizing section of SCOUT's own (a check's
        collectives): its own work restarts here, not at the earlier bucket completion."""
        with self._lock:
            self._release = time.monotonic()

    def take_step(self, skipped: bool = False) -> Optional[StepTrace]:
        """This step's observations, then a fresh step; None when no bucket was reduced (a `no_sync`
        micro-step, or DDP found nothing to reduce). `skipped`: the optimizer did not apply the
        gradients (a GradScaler overflow), so non-finite local values were handled, not spread."""
        with self._lock:
            local, self._local = self._local, []
            reduced, self._reduced = self._reduced, []
            arrival, release = self._arrival, self._release
            self._arrival = None
        if not local:
            return None
        values = torch.cat([extremes.float() for _, extremes, _ in local] + [r.float() for r in reduced])
        finite = torch.isfinite(values).cpu().tolist()
        bad = [i for i in range(len(local)) if not (finite[2 * i] and finite[2 * i + 1])]
        reduced_bad = not all(finite[2 * len(local):])
        names: List[str] = []
        for i in bad:
            names += [self._names.get(id(p), f"<bucket {local[i][0]} parameter {j}>")
                      for j, p in enumerate(local[i][2])]
        origin = bool(bad) and not self._contaminated and not skipped
        if not skipped:
            # Applied non-finite gradients make every replica non-finite from the next step on:
            # local non-finite values then spread from elsewhere and are not an origin.
            self._contaminated = reduced_bad
        self._steps += 1
        own = None
        # Step 2 is left out: DDP rebuilds its buckets in the second forward, with a broadcast that
        # makes every rank wait for the slowest (a sync point this trace cannot see).
        if self._steps > 2 and arrival is not None and self._previous_release is not None \
                and arrival >= self._previous_release:
            own = arrival - self._previous_release
        self._previous_release = release
        return StepTrace(own_work_s=own, non_finite_buckets=tuple(local[i][0] for i in bad),
                         non_finite_parameters=tuple(names[:_MAX_NAMES]), reduced_non_finite=reduced_bad,
                         origin=origin)


def install_ddp_trace(model: Any, beacon: ProgressBeacon) -> Optional[GradientBucketTrace]:
    """Install the gradient-bucket trace on the DDP object `model` is (or wraps); None when there is
    no DDP object, DDP reduces through its Python reducer, or a comm hook is already registered."""
    ddp = find_ddp(model)
    if ddp is None:
        return None
    if uses_python_reducer(ddp):
        logger.warning("SCOUT: DDP reduces through its Python reducer (compiled autograd); SCOUT's gradient-"
                       "bucket trace is off: hangs inside DDP's all-reduce are not pinned on a rank, "
                       "rank-level stragglers and the non-finite origin check are off")
        return None
    existing = registered_hook_name(ddp)
    if existing is not None:
        logger.info("SCOUT: DDP already has comm hook %r, which DDP lets nobody wrap; it runs unchanged and "
                    "SCOUT watches each parameter's local gradient instead (local_trace.py): a non-finite "
                    "origin is named at the next check rather than at its step", existing)
        return None
    trace = GradientBucketTrace(ddp, beacon)
    trace._install()
    return trace
