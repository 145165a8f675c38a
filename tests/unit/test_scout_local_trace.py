"""LocalWorkTrace (scout/local_trace.py) on one process: own work leaves out time inside
synchronous collectives, and the first non-finite value a rank sends is keyed (step, position)."""

import time

import torch

from lm_resiliency.scout.local_trace import LocalWorkTrace, non_finite_origins
from lm_resiliency.scout.monitor import ProgressBeacon


def test_the_earliest_ranks_are_origins_and_a_job_wide_divergence_names_none():
    assert non_finite_origins({0: None, 1: [6, 2], 2: [7, 0], 3: [7, 0]}) == (1,)
    assert non_finite_origins({0: [5, 1], 1: [5, 1], 2: None, 3: [6, 0]}) == (0, 1)
    assert non_finite_origins({0: [5, 1], 1: [5, 1], 2: [5, 1], 3: [5, 1]}) == ()
    assert non_finite_origins({0: None, 1: None, 2: None}) == ()


def _collective(trace, name, args, seconds, async_op=False):
    started = trace.entering(name, args, {})
    time.sleep(seconds)
    trace.left(started, async_op)


def test_own_work_excludes_synchronous_collectives_and_keys_the_first_non_finite_send():
    trace = LocalWorkTrace(ProgressBeacon())
    for step in (1, 2):   # warm-up: not timed
        assert trace.boundary(step).own_work_s is None
    time.sleep(0.05)
    _collective(trace, "all_reduce", (torch.ones(3),), 0.2)
    # A nested call is counted by the outer one; an async call's wait is not timed.
    outer = trace.entering("all_gather_into_tensor", (torch.empty(6), torch.ones(3)), {})
    _collective(trace, "all_gather_single", (torch.empty(6), torch.ones(3)), 0.0)
    trace.left(outer, False)
    _collective(trace, "reduce_scatter_single", (torch.empty(1), torch.tensor([1.0, float("nan")])), 0.0,
                async_op=True)
    observed = trace.boundary(3)
    assert 0.04 <= observed.own_work_s < 0.15, observed
    # Positions: all_reduce 0, the outer all-gather 1 (its nested call is not a new position), the reduce-scatter 2.
    assert observed.first_non_finite == (3, 2) and observed.what == ("reduce_scatter_single",)
    _collective(trace, "all_reduce", (torch.tensor([float("inf")]),), 0.0)
    assert trace.boundary(4).first_non_finite == (3, 2)   # the first one is kept


def test_gradient_hooks_check_each_local_gradient_and_mark_the_reduction():
    beacon = ProgressBeacon()
    trace = LocalWorkTrace(beacon)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    trace.watch_gradients(model)
    model(torch.tensor([[1.0, float("nan")]])).sum().backward()
    assert trace._in_gradient_op
    observed = trace.boundary(1)
    assert not trace._in_gradient_op
    assert observed.first_non_finite == (1, 0) and "0.weight" in observed.what and "1.bias" not in observed.what
    trace.remove()
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    assert not trace._in_gradient_op and trace._pending == []


def test_a_step_the_optimizer_skipped_is_neither_an_origin_nor_timed():
    trace = LocalWorkTrace(ProgressBeacon())
    for step in (1, 2, 3):
        trace.boundary(step)
    _collective(trace, "all_reduce", (torch.tensor([float("inf")]),), 0.0)   # a GradScaler overflow
    time.sleep(0.2)
    trace.skip()
    _collective(trace, "all_reduce", (torch.ones(2),), 0.0)
    observed = trace.boundary(5)
    assert observed.first_non_finite is None and observed.own_work_s < 0.15, observed
