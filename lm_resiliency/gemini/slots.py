"""Host slots: `own_current`/`own_previous` and `peer_current`/`peer_previous`.

A `SlotPair` holds two physical buffers. A new copy always goes into the buffer that is not
current, so the completed current copy stays intact while the next one is written; the
roles swap only when the new copy is complete. A buffer that a replication send or a disk
flush is reading is pinned by a reader count and is never handed out for writing until
those readers release it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from lm_resiliency.gemini.codec import Layout

Allocator = Callable[[str, int], torch.Tensor]


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

    def payload(self) -> torch.Tensor:
        assert self.buffer is not None and self.layout is not None
        return self.buffer[: self.layout.total_bytes]


class SlotPair:
    """Current/previous pair over two buffers with reader pinning. Thread-safe."""

    def __init__(self, role: str, allocator: Allocator, timeout_s: float) -> None:
        self.role = role
        self._slots = (HostSlot(f"{role}_a"), HostSlot(f"{role}_b"))
        self._current = 0
        self._allocator = allocator
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
            if target.buffer is None or target.buffer.numel() < layout.total_bytes:
                target.buffer = None
                target.buffer = self._allocator(target.name, layout.total_bytes)
            target.layout = layout
            return target

    def publish(self, slot: HostSlot, step: int, structure: Any, owner_rank: int,
                extra: Optional[dict] = None) -> None:
        """Mark a fully written slot complete; it becomes current."""
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

    def discard(self) -> None:
        """Forget contents (buffers are kept for reuse)."""
        with self._cond:
            for slot in self._slots:
                slot.ready = False


def heap_allocator(pin_memory: bool) -> Allocator:
    from lm_resiliency.gemini.device import allocate_host_buffer

    return lambda name, nbytes: allocate_host_buffer(nbytes, pin_memory)
