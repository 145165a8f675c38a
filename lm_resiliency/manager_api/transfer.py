"""Checkpoint transfer: move one flushed GEMINI shard between two endpoints.

`make_transfer(backend, ...)` returns a `CheckpointTransfer`. A manager relaunching a rank on a
new node calls `receive` there and `send` on the rank whose node-local directory holds that
state (the rank itself for its own shard, its replica holder for the peer copy); GEMINI's
`find_latest()`/`load()` then recover from the received file like from any flushed shard.

What a transfer guarantees: it is keyed by (run, step, source rank) and by its two endpoints;
every wait is bounded by `timeout_s`; the receiver checks endpoints, topology, tensor layout,
byte count and every chunk's CRC-32 before it writes anything, and publishes the shard only
whole (temporary file, fsync, rename). A refused transfer leaves nothing behind and the sender
gets the receiver's reason. What it does not do: authenticate the peer (a CRC detects accidental
corruption only), or move the status sidecar (trust state stays with each rank).
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from lm_resiliency import wire
from lm_resiliency._values import is_int
from lm_resiliency.checksum import tensor_crc32
from lm_resiliency.errors import ResiliencyError
from lm_resiliency.gemini.storage import NodeLocalStore, Shard, ShardKey
from lm_resiliency.manager_api.transfer_metadata import (
    TransferKey,
    TransferMetadataStore,
    TransferRecord,
    TransferRefused,
    check_offer,
    check_timeout,
    chunk_bounds,
    metadata_crc,
)

logger = logging.getLogger(__name__)

BACKENDS = ("torch_dist", "nixl")
DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024


class TransferBackendUnavailable(ResiliencyError, RuntimeError):
    """The requested transfer backend cannot run here and no fallback was allowed."""


@dataclass(frozen=True)
class TransferReceipt:
    """One completed transfer: the file it read (sender) or published (receiver)."""

    key: TransferKey
    sender: int
    receiver: int
    path: str
    total_bytes: int
    chunks: int


class CheckpointTransfer(ABC):
    """The contract every backend keeps (see the module docstring)."""

    backend: str
    rank: int
    timeout_s: float

    @abstractmethod
    def send(self, key: TransferKey, source: NodeLocalStore, *, to_rank: int) -> TransferReceipt:
        """Send the shard of `key` that `source` holds (its own shard when `source.rank` is
        `key.source_rank`, else the peer replica) to `to_rank`; returns once the receiver has
        published it. TransferRefused with the receiver's reason if it refused."""

    @abstractmethod
    def receive(self, key: TransferKey, destination: NodeLocalStore, *, from_rank: int) -> TransferReceipt:
        """Receive the shard of `key` from `from_rank` and publish it in `destination` (as its own
        shard when `destination.rank` is `key.source_rank`, else as the peer replica)."""


def _shard_key(key: TransferKey, store: NodeLocalStore) -> ShardKey:
    return ShardKey("own" if store.rank == key.source_rank else "peer", key.source_rank, key.step)


def build_offer(key: TransferKey, shard: Shard, sender: int, receiver: int, topology: str,
                chunk_size: int) -> TransferRecord:
    """The offer a sender publishes for `shard`: its metadata and one CRC-32 per chunk."""
    payload, layout = shard.payload, shard.layout.to_json()
    bounds = chunk_bounds(payload.numel(), chunk_size)
    return TransferRecord(key, sender, receiver, secrets.token_hex(8), topology, layout, shard.structure,
                          shard.extra, payload.numel(), chunk_size,
                          tuple(tensor_crc32(payload[o:o + n]) for o, n in bounds),
                          metadata_crc(layout, shard.structure, shard.extra))


class _Pair:
    """Point-to-point sends and receives with the other endpoint, each bounded by `timeout_s`."""

    def __init__(self, group: dist.ProcessGroup, peer: int, timeout_s: float) -> None:
        self.group, self.peer, self.timeout_s = group, peer, timeout_s

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        if tensor.numel():
            wire.wait(self.group.send([tensor], self.peer, tag), self.timeout_s)

    def recv(self, tensor: torch.Tensor, tag: int) -> None:
        if tensor.numel():
            wire.wait(self.group.recv([tensor], self.peer, tag), self.timeout_s)


class TorchDistTransfer(CheckpointTransfer):
    """Two-sided transfer over a dedicated gloo pair: both endpoints must call (`send` on one,
    `receive` on the other). Metadata goes through the c10d `store`; chunks over gloo.

    Without `process_group`, each transfer builds its own two-rank gloo group on a store prefix
    unique to that offer, so no other rank of the job takes part. With `process_group`, it must be
    a dedicated gloo group of exactly the two endpoints (e.g. `dist.new_group([a, b],
    backend="gloo")`, created by every rank in the same order), also when training uses NCCL."""

    backend = "torch_dist"

    def __init__(self, store: dist.Store, rank: int, *, timeout_s: float = 300.0,
                 chunk_size: int = DEFAULT_CHUNK_BYTES, process_group: Optional[dist.ProcessGroup] = None,
                 max_bytes: Optional[int] = None) -> None:
        if not is_int(rank) or rank < 0:
            raise ValueError(f"TorchDistTransfer: rank must be a non-negative int, got {rank!r}")
        if not is_int(chunk_size) or chunk_size <= 0:
            raise ValueError(f"TorchDistTransfer: chunk_size must be a positive int, got {chunk_size!r}")
        if max_bytes is not None and (not is_int(max_bytes) or max_bytes < 0):
            raise ValueError(f"TorchDistTransfer: max_bytes must be None or a non-negative int, got {max_bytes!r}")
        self.rank = rank
        self.timeout_s = check_timeout("TorchDistTransfer", timeout_s)
        self.chunk_size = chunk_size
        self.max_bytes = max_bytes
        self.metadata = TransferMetadataStore(store, self.timeout_s)
        self.process_group = process_group
        if process_group is not None:
            _check_pair_group(process_group, rank)

    # ---------------------------------------------------------------- sender

    def send(self, key: TransferKey, source: NodeLocalStore, *, to_rank: int) -> TransferReceipt:
        self._check_call(key, source, to_rank, "send")
        shard_key = _shard_key(key, source)
        shard = source.read_shard(shard_key)  # validated (identity, layout, CRC with verify_integrity)
        payload = shard.payload
        bounds = chunk_bounds(payload.numel(), self.chunk_size)
        record = build_offer(key, shard, self.rank, to_rank, source.topology, self.chunk_size)
        self.metadata.publish(record)
        refusal = self.metadata.wait_answer(record, "accept")
        if refusal is not None:
            raise TransferRefused(refusal)
        pair = self._connect(record)
        for tag, chunk in self.outgoing_chunks(payload, bounds):
            pair.send(chunk, tag)
        refusal = self.metadata.wait_answer(record, "done")
        if refusal is not None:
            raise TransferRefused(refusal)
        logger.info("checkpoint transfer: rank %d sent %s (%d bytes) to rank %d", self.rank, key,
                    payload.numel(), to_rank)
        return TransferReceipt(key, self.rank, to_rank, os.path.join(source.directory, shard_key.file_name),
                               payload.numel(), len(bounds))

    def outgoing_chunks(self, payload: torch.Tensor, bounds: Tuple[Tuple[int, int], ...]
                        ) -> Iterator[Tuple[int, torch.Tensor]]:
        """(tag, chunk) in sending order: chunk i is payload[offset_i : offset_i + length_i]."""
        for tag, (offset, length) in enumerate(bounds):
            yield tag, payload[offset:offset + length]

    # -------------------------------------------------------------- receiver

    def receive(self, key: TransferKey, destination: NodeLocalStore, *, from_rank: int) -> TransferReceipt:
        self._check_call(key, destination, from_rank, "receive")
        record = self.metadata.fetch(key, from_rank, self.rank)
        try:
            bound, limit = ((self.max_bytes, f"max_bytes={self.max_bytes}") if self.max_bytes is not None
                            else host_capacity(destination.directory))
            layout = check_offer(record, key, from_rank, self.rank, destination.topology, bound, limit)
        except TransferRefused as exc:
            self.metadata.answer(key, from_rank, self.rank, record.nonce, "accept", str(exc))
            raise
        self.metadata.answer(key, from_rank, self.rank, record.nonce, "accept", None)
        bad = []
        try:
            # Allocated only now, and answered if it fails: the sender never waits out its timeout.
            payload = torch.empty(record.total_bytes, dtype=torch.uint8)
            bounds = chunk_bounds(record.total_bytes, record.chunk_size)  # as many as its checked checksums
            pair = self._connect(record)
            for tag, (offset, length) in enumerate(bounds):
                view = payload[offset:offset + length]
                pair.recv(view, tag)
                if tensor_crc32(view) != record.chunk_crc32[tag]:
                    bad.append(tag)  # keep receiving: the sender's chunks are all sent regardless
            if bad:
                raise TransferRefused(f"rank {self.rank} refuses the transfer of {key} from rank {from_rank}: "
                                      f"chunk(s) {bad} of {len(bounds)} failed their CRC-32 (corrupted in "
                                      "transit); nothing is written")
            shard_key = _shard_key(key, destination)
            path = destination.write_shard(shard_key, layout, record.structure, payload, extra=record.extra)
        except BaseException as exc:
            self._answer_failure(record, exc)
            raise
        self.metadata.answer(key, from_rank, self.rank, record.nonce, "done", None)
        logger.info("checkpoint transfer: rank %d received %s (%d bytes) from rank %d into %s", self.rank,
                    key, record.total_bytes, from_rank, path)
        return TransferReceipt(key, from_rank, self.rank, path, record.total_bytes, len(bounds))

    def _answer_failure(self, record: TransferRecord, exc: BaseException) -> None:
        try:
            self.metadata.answer(record.key, record.sender, record.receiver, record.nonce, "done",
                                 f"{type(exc).__name__}: {exc}")
        except RuntimeError as answer_error:  # the store itself failed: the sender times out instead
            logger.warning("checkpoint transfer: could not tell rank %d why the transfer failed: %s",
                           record.sender, answer_error)

    # --------------------------------------------------------------- helpers

    def _check_call(self, key: TransferKey, store: NodeLocalStore, peer: int, what: str) -> None:
        if not isinstance(key, TransferKey):
            raise TypeError(f"{what}: key must be a TransferKey, got {type(key).__name__}")
        if not isinstance(store, NodeLocalStore):
            raise TypeError(f"{what}: expected GEMINI's NodeLocalStore (InMemoryCheckpointManager.store), "
                            f"got {type(store).__name__}")
        if store.run_id != key.run_id:
            raise ValueError(f"{what}: the store belongs to run {store.run_id!r}, the key to run {key.run_id!r}")
        if not is_int(peer) or peer < 0 or peer == self.rank:
            raise ValueError(f"{what}: the other endpoint must be a non-negative rank other than this "
                             f"endpoint's rank {self.rank}, got {peer!r}")
        if self.process_group is not None:
            _check_pair_group(self.process_group, self.rank, peer)

    def _connect(self, record: TransferRecord) -> _Pair:
        """The dedicated gloo pair of one offer: the caller's group, or a two-rank group built on
        the offer's own store prefix (the sender is its rank 0)."""
        peer = record.receiver if self.rank == record.sender else record.sender
        if self.process_group is not None:
            return _Pair(self.process_group, dist.get_group_rank(self.process_group, peer), self.timeout_s)
        store = dist.PrefixStore(self.metadata.pair_prefix(record), self.metadata.store)
        try:
            group = dist.ProcessGroupGloo(store, 0 if self.rank == record.sender else 1, 2,
                                          timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise TimeoutError(f"checkpoint transfer of {record.key}: could not connect to rank {peer} within "
                               f"{self.timeout_s}s (it failed or gave up on the transfer): {exc}") from exc
        return _Pair(group, 1 if self.rank == record.sender else 0, self.timeout_s)


def host_capacity(directory: str) -> Tuple[int, str]:
    """The most payload bytes a receiver on this host can take into `directory`, and why: the
    payload is assembled in memory (physical memory) and then written there (free disk space)."""
    free = shutil.disk_usage(directory).free
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): the disk alone bounds it
        return free, f"this host can take ({free} bytes free under {directory}; pass max_bytes= to set another bound)"
    return min(memory, free), (f"this host can take ({memory} bytes of physical memory, {free} bytes free "
                               f"under {directory}; pass max_bytes= to set another bound)")


def _check_pair_group(group: dist.ProcessGroup, rank: int, peer: Optional[int] = None) -> None:
    """Refuse a group that is not a dedicated gloo pair holding this endpoint (and `peer`)."""
    try:
        backend = dist.get_backend(group)
        size = dist.get_world_size(group)
        members = dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"TorchDistTransfer: process_group is not a process group of this job ({exc})") from exc
    if backend != "gloo":
        raise ValueError(f"TorchDistTransfer: process_group uses the {backend!r} backend; checkpoint transfer "
                         "needs a dedicated gloo group (also when training uses NCCL): "
                         "dist.new_group([sender, receiver], backend='gloo')")
    if size != 2 or rank not in members or (peer is not None and peer not in members):
        raise ValueError(f"TorchDistTransfer: process_group holds ranks {members}; it must be a dedicated pair "
                         f"of exactly the two endpoints (this rank {rank}"
                         + (f" and rank {peer})" if peer is not None else ")"))


def _nixl_importable() -> bool:
    try:
        importlib.import_module("nixl")
    except ImportError:
        return False
    return True


def make_transfer(backend: str, *, store: dist.Store, rank: int, timeout_s: float = 300.0,
                  chunk_size: int = DEFAULT_CHUNK_BYTES, process_group: Optional[dist.ProcessGroup] = None,
                  allow_backend_fallback: bool = False, max_bytes: Optional[int] = None) -> CheckpointTransfer:
    """A `CheckpointTransfer` for `backend` ("torch_dist" or "nixl") at endpoint `rank`.

    "nixl" is one-sided; this release has no NIXL implementation, so it raises
    TransferBackendUnavailable unless `allow_backend_fallback=True`, which returns the two-sided
    torch_dist transfer instead: then both endpoints must call it (`send` and `receive`)."""
    if backend not in BACKENDS:
        raise ValueError(f"make_transfer: unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if not isinstance(allow_backend_fallback, bool):
        raise TypeError(f"make_transfer: allow_backend_fallback must be a bool, got {allow_backend_fallback!r}")
    if backend == "nixl":
        why = ("NIXL is importable, but this release has no NIXL transfer implementation" if _nixl_importable()
               else "NIXL is not importable here (the 'nixl' package is not installed)")
        if not allow_backend_fallback:
            raise TransferBackendUnavailable(
                f"make_transfer('nixl'): {why}. Use make_transfer('torch_dist', ...), or pass "
                "allow_backend_fallback=True after arranging the two-sided protocol (the receiving endpoint "
                "calls receive() while the sending one calls send()): NIXL is one-sided, torch_dist is not")
        logger.warning("make_transfer('nixl'): %s; falling back to the two-sided torch_dist transfer "
                       "(allow_backend_fallback=True): both endpoints must call send()/receive()", why)
    return TorchDistTransfer(store, rank, timeout_s=timeout_s, chunk_size=chunk_size,
                             process_group=process_group, max_bytes=max_bytes)
