"""SlotPair: double buffering, reader pinning, bounded waits, buffer reuse."""

import threading

import pytest
import torch

from lm_resiliency.codec import Layout
from lm_resiliency.gemini.slots import SlotPair


class CountingAllocator:
    def __init__(self):
        self.calls = []

    def __call__(self, name, nbytes):
        self.calls.append((name, nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)


def layout_of(n_floats):
    return Layout.for_tensors([torch.zeros(n_floats)])


def make_pair(timeout_s=5.0):
    allocator = CountingAllocator()
    return SlotPair("own", allocator, timeout_s), allocator


def test_begin_write_returns_the_non_current_buffer_and_publish_swaps_roles():
    pair, _ = make_pair()
    assert pair.ready_slots() == []
    first = pair.begin_write(layout_of(4))
    assert first is pair.previous and first is not pair.current
    pair.publish(first, 10, {"s": 10}, owner_rank=3, extra={"k": 1})
    assert pair.current is first
    assert (first.step, first.structure, first.owner_rank, first.extra, first.ready) == \
        (10, {"s": 10}, 3, {"k": 1}, True)

    second = pair.begin_write(layout_of(4))
    assert second is not first and second is pair.previous
    assert pair.current is first and first.ready  # the completed copy stays intact while writing
    pair.publish(second, 20, {"s": 20}, owner_rank=3)
    assert pair.current is second and pair.previous is first
    assert pair.ready_slots() == [second, first]

    third = pair.begin_write(layout_of(4))
    assert third is first
    assert not first.ready  # being rewritten: no longer a loadable copy
    assert pair.ready_slots() == [second]


def test_ready_slots_newest_first_and_discard():
    pair, _ = make_pair()
    for step in (5, 7):
        pair.publish(pair.begin_write(layout_of(1)), step, None, owner_rank=0)
    assert [s.step for s in pair.ready_slots()] == [7, 5]
    pair.discard()
    assert pair.ready_slots() == []


def test_publish_copies_extra():
    pair, _ = make_pair()
    extra = {"crc": 1}
    slot = pair.begin_write(layout_of(1))
    pair.publish(slot, 1, None, owner_rank=0, extra=extra)
    extra["crc"] = 2
    assert slot.extra == {"crc": 1}


def test_payload_is_the_layout_prefix_of_the_buffer():
    pair, _ = make_pair()
    big = pair.begin_write(layout_of(100))
    pair.publish(big, 1, None, owner_rank=0)
    pair.publish(pair.begin_write(layout_of(100)), 2, None, owner_rank=0)
    small_layout = layout_of(4)
    slot = pair.begin_write(small_layout)
    assert slot is big
    assert slot.payload().numel() == small_layout.total_bytes
    assert slot.payload().data_ptr() == slot.buffer.data_ptr()


def _begin_write_in_thread(pair, layout):
    result = {}

    def target():
        try:
            result["slot"] = pair.begin_write(layout)
        except BaseException as exc:  # surfaced by the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def test_pinned_slot_is_not_handed_out_until_released():
    pair, _ = make_pair(timeout_s=30.0)
    a = pair.begin_write(layout_of(4))
    pair.publish(a, 1, None, owner_rank=0)
    b = pair.begin_write(layout_of(4))
    pair.publish(b, 2, None, owner_rank=0)
    # `a` is now previous, i.e. the next write target; a replication send is reading it.
    pair.acquire(a)
    pair.acquire(a)
    thread, result = _begin_write_in_thread(pair, layout_of(4))
    thread.join(timeout=0.2)
    assert thread.is_alive() and result == {}
    assert a.ready  # untouched while pinned

    pair.release(a)
    thread.join(timeout=0.2)
    assert thread.is_alive() and result == {}  # one reader is still left

    pair.release(a)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert result == {"slot": a}
    assert a.readers == 0 and not a.ready


def test_pinning_the_current_slot_does_not_block_writes():
    pair, _ = make_pair(timeout_s=0.05)
    a = pair.begin_write(layout_of(4))
    pair.publish(a, 1, None, owner_rank=0)
    pair.acquire(a)  # a disk flush reads the current copy
    b = pair.begin_write(layout_of(4))
    assert b is not a


def test_begin_write_times_out_with_a_clear_message():
    pair, _ = make_pair(timeout_s=0.05)
    a = pair.begin_write(layout_of(4))
    pair.publish(a, 1, None, owner_rank=0)
    b = pair.begin_write(layout_of(4))
    pair.publish(b, 2, None, owner_rank=0)
    pair.acquire(a)
    with pytest.raises(TimeoutError) as info:
        pair.begin_write(layout_of(4))
    message = str(info.value)
    assert a.name in message
    assert "timeout_s" in message
    assert a.ready and a.readers == 1  # the pinned copy was left as it was


def test_buffer_reused_when_large_enough_and_reallocated_when_layout_grows():
    pair, allocator = make_pair()
    small, large = layout_of(4), layout_of(1000)

    a = pair.begin_write(small)
    pair.publish(a, 1, None, owner_rank=0)
    b = pair.begin_write(small)
    pair.publish(b, 2, None, owner_rank=0)
    # One allocation per physical buffer.
    assert allocator.calls == [(a.name, small.total_bytes), (b.name, small.total_bytes)]

    buffer_a = a.buffer
    assert pair.begin_write(small) is a
    assert len(allocator.calls) == 2 and a.buffer is buffer_a  # reused

    pair.publish(a, 3, None, owner_rank=0)
    assert pair.begin_write(large) is b
    assert len(allocator.calls) == 3 and allocator.calls[-1] == (b.name, large.total_bytes)
    assert b.buffer.numel() >= large.total_bytes and b.layout == large

    pair.publish(b, 4, None, owner_rank=0)
    assert pair.begin_write(small) is a  # shrinking never reallocates
    assert len(allocator.calls) == 3 and a.buffer is buffer_a and a.layout == small
