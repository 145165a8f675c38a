"""Peer replication over a dedicated gloo group: a JSON header, then fixed-size byte chunks.

Rank r sends its captures to `(r + jump) % world` and holds the replica of
`(r - jump) % world`. Every rank sends and receives in the same round, so each chunk is
posted as a send/receive pair and waited before the next (bounded in-flight bytes).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lm_resiliency import wire
from lm_resiliency.config import ConfigError
from lm_resiliency.codec import Layout
from lm_resiliency.gemini.slots import HostSlot

logger = logging.getLogger(__name__)

_CHUNKS_IN_FLIGHT = 2


@dataclass(frozen=True)
class Pairing:
    jump: int
    send_to: int
    recv_from: int

    @staticmethod
    def for_rank(rank: int, world_size: int, jump: int) -> "Pairing":
        return Pairing(jump, (rank + jump) % world_size, (rank - jump) % world_size)

    def holder_of(self, owner: int, world_size: int) -> int:
        """The rank that holds `owner`'s replica."""
        return (owner + self.jump) % world_size


def resolve_jump(configured: int, world_size: int) -> int:
    """The replication distance. `-1` means one node width: the visible GPU count, or on CPU
    LOCAL_WORLD_SIZE. When the whole job fits on one node there is no other host, so the
    distance falls back to half the world (still a different rank) with a warning."""
    if world_size < 2:
        raise ConfigError("InMemoryCkptConfig.replication_jump: peer replication needs >= 2 ranks")
    if configured != -1:
        if not 1 <= configured < world_size:
            raise ConfigError(
                f"InMemoryCkptConfig.replication_jump: {configured} is not a valid rank distance for "
                f"world size {world_size}; use 1..{world_size - 1} (ranks one node apart) or -1")
        return configured
    if torch.cuda.is_available():
        width = torch.cuda.device_count()
    else:
        width = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if 1 <= width < world_size:
        return width
    logger.warning("GEMINI: all %d ranks appear to share one node; replicating to rank + %d, which "
                   "protects against a process crash but not against losing the node",
                   world_size, world_size // 2)
    return world_size // 2


class PeerReplicator:
    """Sends our completed own slot and receives the peer's into a slot we choose."""

    def __init__(self, group: dist.ProcessGroup, rank: int, pairing: Pairing, chunk_size: int,
                 timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.pairing = pairing
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s

    def exchange(self, source: HostSlot, receive_into: Callable[[Layout], HostSlot]) -> tuple:
        """Send `source`, receive the peer's capture. Returns (slot, header) of what was received."""
        header = {
            "step": source.step,
            "owner_rank": self.rank,
            "layout": source.layout.to_json(),
            "structure": source.structure,
            "extra": source.extra,
        }
        peer_header = self._exchange_json(header)
        layout = Layout.from_json(peer_header["layout"])
        if peer_header["owner_rank"] != self.pairing.recv_from:
            raise RuntimeError(f"GEMINI replication: expected a replica from rank {self.pairing.recv_from}, "
                               f"got one from rank {peer_header['owner_rank']}")
        target = receive_into(layout)
        self._exchange_bytes(source.payload(), target.buffer[: layout.total_bytes])
        return target, peer_header

    def _exchange_json(self, value: Any) -> Any:
        payload = wire.encode_json(value)
        their_size = torch.zeros(1, dtype=torch.int64)
        self._pair(torch.tensor([payload.numel()], dtype=torch.int64), their_size)
        theirs = torch.empty(int(their_size.item()), dtype=torch.uint8)
        self._pair(payload, theirs)
        return wire.decode_json(theirs)

    def _exchange_bytes(self, outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
        """At most `_CHUNKS_IN_FLIGHT` chunk pairs are posted at once: enough to keep the link busy
        between chunks, few enough to bound interference with training traffic."""
        size = self.chunk_size
        chunks = max(-(-outgoing.numel() // size), -(-incoming.numel() // size))
        in_flight: deque = deque()
        for i in range(chunks):
            out = outgoing[i * size: (i + 1) * size]
            into = incoming[i * size: (i + 1) * size]
            in_flight.append(self._post(out if out.numel() else None, into if into.numel() else None))
            if len(in_flight) >= _CHUNKS_IN_FLIGHT:
                self._wait(in_flight.popleft())
        while in_flight:
            self._wait(in_flight.popleft())

    def _pair(self, outgoing: Optional[torch.Tensor], incoming: Optional[torch.Tensor]) -> None:
        self._wait(self._post(outgoing, incoming))

    def _post(self, outgoing: Optional[torch.Tensor], incoming: Optional[torch.Tensor]) -> list:
        works = []
        if outgoing is not None:
            works.append(dist.isend(outgoing, self.pairing.send_to, group=self.group))
        if incoming is not None:
            works.append(dist.irecv(incoming, self.pairing.recv_from, group=self.group))
        return works

    def _wait(self, works: list) -> None:
        for work in works:
            wire.wait(work, self.timeout_s)
