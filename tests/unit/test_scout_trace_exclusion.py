"""trace_collectives leaves lm-resiliency's own traffic unmarked: excluded groups, untraced sections."""

import threading

import pytest
import torch
import torch.distributed as dist

from lm_resiliency.scout.instrument import trace_collectives
from lm_resiliency.scout.monitor import ProgressBeacon


@pytest.fixture
def traced():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    beacon = ProgressBeacon()
    handle = trace_collectives(beacon)
    try:
        yield beacon, handle
    finally:
        handle.remove()
        dist.destroy_process_group()


def test_calls_on_an_excluded_group_are_not_marked(traced):
    beacon, handle = traced
    own, training = dist.new_group([0]), dist.new_group([0])
    dist.all_reduce(torch.ones(1), group=own)          # cached as a traced group first
    assert beacon.snapshot()["last_op"] == "all_reduce(group=[0])"
    handle.exclude(own, None)
    before = beacon.snapshot()
    dist.all_reduce(torch.ones(1), group=own)
    dist.barrier(group=own)
    dist.all_reduce(torch.ones(1), group=own, async_op=True).wait()
    assert (beacon.snapshot()["completed"], beacon.snapshot()["collectives"]) == \
        (before["completed"], before["collectives"])
    dist.all_reduce(torch.ones(1), group=training)     # another group of the same ranks still counts
    dist.all_reduce(torch.ones(1))
    snap = beacon.snapshot()
    assert snap["collectives"] == before["collectives"] + 2 and snap["last_op"] == "all_reduce"


def test_an_untraced_section_hides_only_its_own_threads_calls(traced):
    beacon, handle = traced
    seen = []
    with handle.untraced():
        dist.all_reduce(torch.ones(1))
        dist.all_gather_object([None], {"nested": True})  # all_gather inside: unmarked too
        with handle.untraced():
            dist.barrier()
        dist.broadcast(torch.ones(1), src=0)            # still inside after the nested section ends
        seen.append(beacon.snapshot()["collectives"])
        other = threading.Thread(target=dist.all_reduce, args=(torch.ones(1),))
        other.start()
        other.join()
        seen.append(beacon.snapshot()["collectives"])
    dist.barrier()
    seen.append(beacon.snapshot()["collectives"])
    assert seen == [0, 1, 2]
    assert beacon.snapshot()["last_op"] == "barrier"
