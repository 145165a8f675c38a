"""Each rank's own work per step and where non-finite values first appear, without DDP's comm hook.

`ddp_trace.py` reads both from DDP's gradient buckets. This module covers the other loops:

* Python collectives (a loop that all-reduces its gradients itself, FSDP2's all-gathers and
  reduce-scatters): `trace_collectives` calls `entering` / `left` around every training
  collective. A rank's own work in step k is the wall time since its release at step k-1 minus
  the time it spent inside synchronous training collectives (waiting for its peers there is not
  its work), so the rank that makes the job wait stands out, whatever part of its step is slow.
  The tensor a rank contributes (all_reduce's tensor, the input of an all-gather or a
  reduce-scatter) is checked for NaN/Inf before it is sent.
* DDP with a comm hook registered before SCOUT (which DDP lets nobody wrap): a post-accumulate
  gradient hook on every parameter checks each local gradient before DDP reduces it and records
  when the last one was ready (the rank's arrival at the all-reduce). From the first ready
  gradient until the step boundary the rank is marked as inside DDP's gradient all-reduce.

Each check is one `aminmax` per tensor, kept on the device and read once per step. The first
non-finite observation is keyed (step, position in the step's sequence of collectives or gradients),
and the peers compare keys at the next SCOUT check: the ranks with the earliest key are where the
values first appeared (`harness._rank_work_round`). Every loop is SPMD, so positions line up.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from lm_resiliency.scout.monitor import COMMUNICATION_OP_PREFIX, ProgressBeacon

logger = logging.getLogger(__name__)

GRADIENT_OP = COMMUNICATION_OP_PREFIX + "ddp_grad_bucket"
_WARMUP_STEPS = 2   # lazy init, DDP's bucket rebuild: every rank waits for the slowest there
_MAX_NAMES = 32
# The tensor a rank contributes to a collective: (positional index, keyword name).
_CONTRIBUTED = {
    "all_reduce": (0, "tensor"),
    "all_gather_single": (1, "input_tensor"), "all_gather_into_tensor": (1, "input_tensor"),
    "_all_gather_base": (1, "input_tensor"),
    "reduce_scatter_single": (1, "input"), "reduce_scatter_tensor": (1, "input"),
    "_reduce_scatter_base": (1, "input"),
}


@dataclass(frozen=True)
class LocalStep:
    """One step boundary's observations on this rank (see `LocalWorkTrace.boundary`)."""

    own_work_s: Optional[float]
    first_non_finite: Optional[Tuple[int, int]]   # (step, position) of this rank's first non-finite value
    what: Tuple[str, ...]                         # the collectives or parameters that held it


class LocalWorkTrace:
    """Build it with `install_local_trace`; the harness calls `boundary(step)` at every optimizer
    step boundary (before SCOUT's own checks) and `released()` after SCOUT's own collectives."""

    def __init__(self, beacon: ProgressBeacon) -> None:
        self.beacon = beacon
        self._lock = threading.Lock()
        self._depth = threading.local()
        self._pending: List[Tuple[int, torch.Tensor, str]] = []   # (position, [min, max], what)
        self._position = 0
        self._inside_s = 0.0
        self._release: Optional[float] = None
        self._ready: Optional[float] = None      # DDP hook path: the last local gradient's time
        self._in_gradient_op = False
        self._handles: List[Any] = []
        self._steps = 0
        self.first_non_finite: Optional[Tuple[int, int]] = None
        self.first_what: Tuple[str, ...] = ()

    # Python collectives --------------------------------------------------------------------------

    def entering(self, name: str, args: tuple, kwargs: dict) -> Optional[float]:
        """A training collective starts on this thread: check what this rank contributes. Returns
        the start time for `left` (None for a nested call, counted by the outer one)."""
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        if depth:
            return None
        index, keyword = _CONTRIBUTED.get(name, (None, None))
        tensor = kwargs.get(keyword) if index is None or len(args) <= index else args[index]
        with self._lock:
            position, self._position = self._position, self._position + 1
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
            self._note(position, tensor, name)
        return time.monotonic()

    def left(self, started: Optional[float], async_op: bool) -> None:
        self._depth.n -= 1
        if started is not None and not async_op:   # an async call's wait happens elsewhere, untimed
            with self._lock:
                self._inside_s += time.monotonic() - started

    # DDP gradients (a user hook came first) ------------------------------------------------------

    def watch_gradients(self, module: torch.nn.Module) -> None:
        """Check each local gradient as it is accumulated, before DDP reduces it."""
        for name, param in module.named_parameters():
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._gradient_hook(name)))

    def _gradient_hook(self, name: str) -> Any:
        def ready(param: torch.Tensor) -> None:
            if param.grad is not None and param.grad.numel():
                self._note(0, param.grad, name)
            with self._lock:
                self._ready = time.monotonic()
                enter, self._in_gradient_op = not self._in_gradient_op, True
            if enter:
                self.beacon.enter(GRADIENT_OP, on_training_thread=True)
        return ready

    def leave_gradient_op(self) -> None:
        with self._lock:
            was, self._in_gradient_op = self._in_gradient_op, False
        if was:
            self.beacon.exit(GRADIENT_OP)

    # step boundary -------------------------------------------------------------------------------

    def _note(self, position: int, tensor: torch.Tensor, what: str) -> None:
        # min and max are NaN or infinite exactly when some element is: one pass, no sync here.
        try:
            extremes = torch.stack(torch.aminmax(tensor.detach().reshape(-1)))
        except RuntimeError as exc:   # a dtype aminmax lacks: unchecked, never a failed collective
            logger.debug("SCOUT: %s's tensor (%s) not checked for NaN/Inf: %s", what, tensor.dtype, exc)
            return
        with self._lock:
            self._pending.append((position, extremes, what))

    def released(self) -> None:
        """SCOUT's own synchronizing section just ended: this rank's own work restarts here."""
        with self._lock:
            self._release, self._inside_s = time.monotonic(), 0.0

    def skip(self) -> None:
        """The optimizer skipped this step (a GradScaler found inf/NaN): what was sent is the
        scaler's business, not an origin, and the step is not timed."""
        self.leave_gradient_op()
        with self._lock:
            self._pending, self._position, self._ready = [], 0, None
            self._release, self._inside_s = time.monotonic(), 0.0

    def boundary(self, step: int) -> LocalStep:
        """Close step `step`: its own-work time (None in the warm-up steps) and this rank's first
        non-finite observation so far."""
        self.leave_gradient_op()
        now = time.monotonic()
        with self._lock:
            pending, self._pending = self._pending, []
            release, inside, ready = self._release, self._inside_s, self._ready
            self._release, self._inside_s, self._ready, self._position = now, 0.0, None, 0
        self._steps += 1
        own = None
        if self._steps > _WARMUP_STEPS and release is not None:
            end = ready if ready is not None else now
            own = max(end - release - inside, 0.0)
        if pending and self.first_non_finite is None:
            finite = torch.isfinite(torch.stack([e for _, e, _ in pending]).float()).all(dim=1).cpu().tolist()
            bad = [(position, what) for (position, _, what), ok in zip(pending, finite) if not ok]
            if bad:
                first = min(position for position, _ in bad)
                self.first_non_finite = (step, first)
                self.first_what = tuple(dict.fromkeys(what for _, what in bad))[:_MAX_NAMES]
        return LocalStep(own, self.first_non_finite, self.first_what)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.leave_gradient_op()


def non_finite_origins(keys: Dict[int, Optional[List[int]]]) -> Tuple[int, ...]:
    """The ranks where non-finite values appeared first, from every peer's first (step, position);
    empty when none appeared or when every peer saw them at the same point (a job-wide divergence,
    not a device)."""
    seen = {rank: tuple(key) for rank, key in keys.items() if key is not None}
    if not seen:
        return ()
    earliest = min(seen.values())
    origins = tuple(sorted(rank for rank, key in seen.items() if key == earliest))
    return () if len(origins) == len(keys) else origins
