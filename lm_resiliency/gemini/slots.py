"""Host slots: `own_current`/`own_previous` and `peer_current`/`peer_previous`.

A `SlotPair` holds two physical buffers. A new copy always goes into the buffer that is not
current, so the completed current copy stays intact while the next one is written; the
roles swap only when the new copy is complete. A buffer that a replication send or a disk
flush is reading is pinned by a reader count and is never handed out for writing until
those readers release it.

An optional `SlotMirror` (the node-owned shared-memory arena, see shm.py) makes a slot's
READY state visible to a successor process: `retract` runs before a buffer is rewritten,
`publish` after it is completely written. A predecessor's READY slots enter a pair through
`adopt`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Protocol

import torch

from lm_resiliency.codec import Layout

Allocator = Callable[[str, int], torch.Tensor]


class SlotMirror(Protocol):
    """Out-of-process READY state of host slots (implemented by `shm.SharedSlotArena`)."""

    def retract(self, name: str) -> None:
        """Called before the slot's buffer is overwritten; must not return before it is un-READY."""

    def publish(self, slot: "HostSlot", step: int, structure: Any, owner_rank: int,
                extra: Optional[dict]) -> None:
        """Called once the slot's payload is completely written, before it becomes current."""


@dataclass
class HostSlot:
    """One physical host buffer plus what it currently holds."""

    name: str
    buffer: Optional[torch.Tensor] = None
    layout: Optional[Layout] = None
    structure: Any = None
    step: int = -1
    owner_rank: int = -1
    extra: dict = field(default_factory=dict)
    ready: bool = False
    readers: int = 0
    crc32: Optional[int] = None
    # PID of the dead predecessor process whose shared slot this is (None: written here).
    adopted_from: Optional[int] = None
    # The buffer's pages are also mapped copy-on-write into state handed to the caller: the
    # next write must go to a fresh buffer, never into these pages.
    lent: bool = False
    # Typed views of `buffer` for `layout`, reused while both stay the same (thousands of
    # tensors make rebuilding them a visible cost on the training thread).
    _views: Optional[tuple] = field(default=None, repr=False)

    def written_buffer(self) -> torch.Tensor:
        """The buffer `SlotPair.begin_write` allocated for this slot."""
        if self.buffer is None:
            raise RuntimeError(f"GEMINI slot {self.name} has no buffer: SlotPair.begin_write allocates it "
                               "before anything is written into the slot")
        return self.buffer

    def written_layout(self) -> Layout:
        """The layout `SlotPair.begin_write` sized this slot for."""
        if self.layout is None:
            raise RuntimeError(f"GEMINI slot {self.name} has no layout: SlotPair.begin_write sizes it "
                               "before anything is written into the slot")
        return self.layout

    def payload(self) -> torch.Tensor:
        return self.written_buffer()[: self.written_layout().total_bytes]

    def views(self) -> List[torch.Tensor]:
        buffer, layout = self.written_buffer(), self.written_layout()
        cached = self._views
        if cached is None or cached[0] is not buffer or cached[1] is not layout:
            cached = (buffer, layout, layout.views(buffer))
            self._views = cached
        return cached[2]


class SlotPair:
    """Current/previous pair over two buffers with reader pinning. Thread-safe."""

    def __init__(self, role: str, allocator: Allocator, timeout_s: float,
                 mirror: Optional[SlotMirror] = None) -> None:
        self.role = role
        self._slots = (HostSlot(f"{role}_a"), HostSlot(f"{role}_b"))
        self._current = 0
        self._allocator = allocator
        self._mirror = mirror
        self._timeout_s = timeout_s
        # Re-entrant: the SIGTERM flush may run on the main thread while it is inside this lock.
        self._cond = threading.Condition(threading.RLock())

    @property
    def current(self) -> HostSlot:
        return self._slots[self._current]

    @property
    def previous(self) -> HostSlot:
        return self._slots[1 - self._current]

    def ready_slots(self) -> list:
        """Complete slots, newest first."""
        with self._cond:
            return sorted((s for s in self._slots if s.ready), key=lambda s: -s.step)

    def begin_write(self, layout: Layout) -> HostSlot:
        """The non-current buffer, emptied and sized for `layout`; waits for its readers."""
        with self._cond:
            target = self.previous
            deadline = time.monotonic() + self._timeout_s
            while target.readers:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"GEMINI slot {target.name} is still read by a replication send or disk flush "
                        f"after {self._timeout_s}s; the next capture cannot reuse it. Check the peer "
                        "rank and disk, or raise InMemoryCkptConfig.timeout_s.")
                self._cond.wait(remaining)
            target.ready = False
            target.adopted_from = None
            target.crc32 = None
            if self._mirror is not None:
                self._mirror.retract(target.name)  # un-READY for successors before any byte changes
            if target.lent or target.buffer is None or target.buffer.numel() < layout.total_bytes:
                target.lent = False
                target.buffer = None
                target.buffer = self._allocator(target.name, layout.total_bytes)
            target.layout = layout
            return target

    def publish(self, slot: HostSlot, step: int, structure: Any, owner_rank: int,
                extra: Optional[dict] = None) -> None:
        """Mark a fully written slot complete; it becomes current."""
        if self._mirror is not None:
            # Outside the lock (it may checksum the payload): the slot is not ready and has no
            # readers, and the single writer of this pair publishes before its next begin_write.
            self._mirror.publish(slot, step, structure, owner_rank, extra)
        with self._cond:
            slot.step, slot.structure, slot.owner_rank = step, structure, owner_rank
            slot.extra = dict(extra or {})
            slot.ready = True
            self._current = self._slots.index(slot)
            self._cond.notify_all()

    def acquire(self, slot: HostSlot) -> None:
        with self._cond:
            slot.readers += 1

    def release(self, slot: HostSlot) -> None:
        with self._cond:
            if slot.readers <= 0:
                raise RuntimeError(f"GEMINI slot {slot.name} released more often than acquired")
            slot.readers -= 1
            self._cond.notify_all()

    def adopt(self, name: str, buffer: torch.Tensor, layout: Layout, structure: Any, step: int,
              owner_rank: int, extra: dict, crc32: Optional[int], predecessor_pid: int) -> HostSlot:
        """Install a predecessor process's complete slot `name`; the newest ready slot is current."""
        with self._cond:
            slot = next((s for s in self._slots if s.name == name), None)
            if slot is None:
                raise ValueError(f"GEMINI slot pair {self.role!r} has no slot {name!r}")
            if slot.readers:
                raise RuntimeError(f"GEMINI slot {name} is being read; it cannot adopt another buffer")
            slot.buffer, slot.layout, slot.structure = buffer, layout, structure
            slot.step, slot.owner_rank, slot.extra = step, owner_rank, dict(extra)
            slot.crc32, slot.adopted_from, slot.ready, slot.lent = crc32, predecessor_pid, True, False
            ready = [s for s in self._slots if s.ready]
            self._current = self._slots.index(max(ready, key=lambda s: s.step))
            self._cond.notify_all()
            return slot

    def lend(self, slot: HostSlot) -> None:
        """The slot's pages were handed out (copy-on-write); its next write reallocates."""
        with self._cond:
            slot.lent = True

    def invalidate(self, slot: HostSlot) -> None:
        """Never use this slot's contents again (corrupt, or of an abandoned timeline). A reader
        that holds it keeps its buffer. The next write goes into it, not over the other slot."""
        with self._cond:
            slot.ready = False
            index = self._slots.index(slot)
            if index == self._current and self._slots[1 - index].ready:
                self._current = 1 - index
            if self._mirror is not None:
                self._mirror.retract(slot.name)

    def discard(self) -> None:
        """Forget contents (buffers are kept for reuse)."""
        with self._cond:
            for slot in self._slots:
                slot.ready = False
                if self._mirror is not None:
                    self._mirror.retract(slot.name)

    def drop_buffers(self) -> None:
        """Forget contents and drop the buffers of unread slots (at close: frees the memory)."""
        with self._cond:
            for slot in self._slots:
                if not slot.readers:
                    slot.ready = False
                    slot.buffer = None


def heap_allocator(pin_memory: bool) -> Allocator:
    from lm_resiliency.gemini.device import allocate_host_buffer

    return lambda name, nbytes: allocate_host_buffer(nbytes, pin_memory)
