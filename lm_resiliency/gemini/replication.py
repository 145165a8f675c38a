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
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from lm_resiliency import wire
from lm_resiliency.config import ConfigError
from lm_resiliency.codec import Layout
from lm_resiliency.files import Field, RecordRejected, RecordSchema, any_json, check_record, integer, nullable, text
from lm_resiliency.gemini.abandon import close_links
from lm_resiliency.gemini.slots import HostSlot
from lm_resiliency.tensor_bytes import tensor_bytes

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


_warned_one_node = False


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
    global _warned_one_node
    if not _warned_one_node and (not dist.is_initialized() or dist.get_rank() == 0):
        _warned_one_node = True  # once per process, from rank 0: it is the same fact on every rank
        logger.warning("GEMINI: all %d ranks appear to share one node; replicating to rank + %d, which "
                       "protects against a process crash but not against losing the node",
                       world_size, world_size // 2)
    return world_size // 2


_TAG_SPAN = 1 << 30


def message_tag(count: int, recovery: bool = False) -> int:
    """The gloo tag of the `count`-th replication exchange (1 .. 2**30) or recovery load
    (2**30 + 1 .. 2**31 - 1) of a manager: both ranks of a pair count alike, so every transfer
    has a tag no other transfer of the next 2**30 uses."""
    if recovery:
        return _TAG_SPAN + 1 + count % (_TAG_SPAN - 1)
    return 1 + count % _TAG_SPAN


def agree_on_pairing(jump: int, chunk_size: int, group: Optional[dist.ProcessGroup]) -> None:
    """Every rank must replicate with the same distance and chunk size (0: no replication):
    different values pair ranks that never meet, or post receives shorter than the peer's
    chunks, which aborts gloo. Collective over GEMINI's group."""
    mine = {"jump": jump, "chunk_size": chunk_size}
    everyone = wire.all_gather_json(mine, group)
    if any(other != mine for other in everyone):
        per_rank = ", ".join(f"rank {r}: jump {d['jump']}, chunk {d['chunk_size']}"
                             for r, d in enumerate(everyone))
        raise ConfigError(
            "InMemoryCkptConfig.replication_jump / replication_chunk_size: ranks resolved different "
            f"values ({per_rank}; jump 0 means no replication, e.g. HSDP). Nodes of different sizes "
            "give different one-node distances with replication_jump=-1: set the same explicit "
            "replication_jump and replication_chunk_size on every rank.")


def chunk_tails(payload: torch.Tensor, chunk_size: int) -> str:
    """Hex of the final byte of each `chunk_size` piece of `payload`: what the receiver checks
    to know that every chunk arrived whole."""
    tails = payload[chunk_size - 1:: chunk_size]
    if payload.numel() % chunk_size:
        tails = torch.cat([tails, payload[-1:]])
    return tensor_bytes(tails.contiguous()).hex()


# What a rank sends its partner before the replica's bytes (`PeerReplicator.exchange`).
REPLICA_HEADER_SCHEMA = RecordSchema(what="GEMINI replica header", fields={
    "step": integer(0), "owner_rank": integer(0), "layout": Field(types=(dict,)), "structure": any_json(),
    "extra": nullable(Field(types=(dict,))), "tails": text(nonempty=False, max_length=None)})


class ReplicaHeaderRejected(RuntimeError, RecordRejected):
    """A partner's replica header is malformed or names another owner; nothing is received."""


class PeerReplicator:
    """Sends our completed own slot and receives the peer's into a slot we choose.

    Each exchange has its own message tag (both ranks of a pair count exchanges), so messages
    left behind by an exchange that failed on one side are never matched by a later one, and
    every receive is posted with exactly the length the peer announced."""

    def __init__(self, group: dist.ProcessGroup, rank: int, pairing: Pairing, chunk_size: int,
                 timeout_s: float, on_failure: Optional[Callable[[str], None]] = None) -> None:
        self.group = group
        # Called with what failed, on the first failure of an exchange: closes the group's links
        # (the manager also tells the partners why).
        self._on_failure = on_failure or (lambda why: close_links(self.group, self.pairing.recv_from))
        self.rank = rank
        self.pairing = pairing
        self.chunk_size = chunk_size
        self.timeout_s = timeout_s
        self._exchanges = 0
        self._tag = 1
        self._step = -1

    def exchange(self, source: HostSlot, receive_into: Callable[[Layout], HostSlot]) -> tuple:
        """Send `source`, receive the peer's capture. Returns (slot, header) of what was received."""
        self._tag = message_tag(self._exchanges)
        self._exchanges += 1
        self._step = source.step
        header = {
            "step": source.step,
            "owner_rank": self.rank,
            "layout": source.written_layout().to_json(),
            "structure": source.structure,
            "extra": source.extra,
            "tails": chunk_tails(source.payload(), self.chunk_size),
        }
        peer_header = self._exchange_json(header)
        layout, tails = self._check_header(peer_header)
        target = receive_into(layout)
        self._exchange_bytes(source.payload(), target.written_buffer()[: layout.total_bytes], tails)
        return target, peer_header

    def _check_header(self, header: Any) -> tuple:
        """(layout, expected chunk tails) of the peer's header, or a clear error before anything
        is allocated or received."""
        src = self.pairing.recv_from
        check_record(header, REPLICA_HEADER_SCHEMA, f"GEMINI replication: the header from rank {src}",
                     error=ReplicaHeaderRejected)
        if header["owner_rank"] != src:
            raise RuntimeError(f"GEMINI replication: expected a replica from rank {src}, "
                               f"got one from rank {header['owner_rank']}")
        layout = Layout.from_json(header["layout"])
        chunks = -(-layout.total_bytes // self.chunk_size)
        tails = header["tails"]
        if not isinstance(tails, str) or len(tails) != 2 * chunks:
            raise RuntimeError(f"GEMINI replication: rank {src} announced {layout.total_bytes} bytes "
                               f"but not one final byte per {self.chunk_size}-byte chunk")
        return layout, bytes.fromhex(tails)

    def _exchange_json(self, value: Any) -> Any:
        payload = wire.encode_json(value)
        their_frame = wire.empty_frame()
        self._pair(wire.frame(payload), (their_frame, None))
        length, last = wire.read_frame(their_frame, self.pairing.recv_from, wire.MAX_JSON_BYTES)
        theirs = torch.empty(length, dtype=torch.uint8)
        self._pair(payload, (theirs, last))
        return wire.decode_json(theirs)

    def _exchange_bytes(self, outgoing: torch.Tensor, incoming: torch.Tensor, tails: bytes) -> None:
        """At most `_CHUNKS_IN_FLIGHT` chunk pairs are posted at once: enough to keep the link busy
        between chunks, few enough to bound interference with training traffic."""
        size = self.chunk_size
        chunks = max(-(-outgoing.numel() // size), -(-incoming.numel() // size))
        in_flight: deque = deque()
        try:
            for i in range(chunks):
                out = outgoing[i * size: (i + 1) * size]
                into = incoming[i * size: (i + 1) * size]
                in_flight.append(self._post(out if out.numel() else None,
                                            (into, tails[i]) if into.numel() else None))
                if len(in_flight) >= _CHUNKS_IN_FLIGHT:
                    self._wait(in_flight.popleft())
            while in_flight:
                self._wait(in_flight.popleft())
        finally:
            self._settle(in_flight)

    def _settle(self, in_flight: Iterable[list]) -> None:
        """After a failure, wait out what is still posted (bounded) so no receive outlives the
        exchange and writes into a buffer that is reused later."""
        for works in in_flight:
            try:
                self._wait(works)
            except (RuntimeError, TimeoutError) as exc:
                logger.debug("GEMINI replication: in-flight chunk after a failure: %s", exc)

    def _pair(self, outgoing: Optional[torch.Tensor], incoming: Optional[tuple]) -> None:
        self._wait(self._post(outgoing, incoming))

    def _post(self, outgoing: Optional[torch.Tensor], incoming: Optional[tuple]) -> list:
        """Post a send of `outgoing` and a receive into `incoming` = (buffer, its final byte, or
        None for a control frame, which checks itself)."""
        works: list = []
        try:
            if outgoing is not None:
                works.append(dist.isend(outgoing, self.pairing.send_to, group=self.group, tag=self._tag))
            if incoming is not None:
                buffer, last = incoming
                receive = wire.Receive(buffer, 0 if last is None else last, self.pairing.recv_from,
                                       self.group, self._tag)
                works.append(receive.work if last is None else receive)
        except RuntimeError as exc:  # a link already closed refuses the post itself
            self._settle([works])
            raise RuntimeError(self._where(exc)) from exc
        return works

    def _wait(self, works: list) -> None:
        """Wait for every handle (each bounded), then raise the first failure. After a failure
        the group's links are closed, so the other handles (a receive from a partner that is
        alive but stuck elsewhere) fail at once instead of each waiting `timeout_s`."""
        first: Optional[BaseException] = None
        for work in works:
            try:
                if isinstance(work, wire.Receive):
                    work.wait(self.timeout_s)
                else:
                    wire.wait(work, self.timeout_s)
            except (RuntimeError, TimeoutError) as exc:
                if first is None and self.group is not None:
                    self._on_failure(self._where(exc))
                first = first or exc
        if first is not None:
            raise type(first)(self._where(first)) from first

    def _where(self, error: BaseException) -> str:
        return (f"step {self._step}, sending to rank {self.pairing.send_to} and receiving from rank "
                f"{self.pairing.recv_from}: {error}")
