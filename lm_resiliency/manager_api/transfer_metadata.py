"""The keyed metadata of a checkpoint transfer, exchanged over a c10d store.

A sender publishes one `TransferRecord` (its offer) under the transfer's key and endpoints; the
receiver reads it with a bounded wait, checks it (`check_offer`) before it allocates or writes
anything, and answers twice: once whether it accepts the offer, once whether every chunk arrived
intact and the shard was published. Records are strict JSON, never pickle; a record that does
not parse, or whose fields are not exactly the schema, is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional, Tuple

import torch.distributed as dist

from lm_resiliency._values import is_int
from lm_resiliency.checksum import crc32
from lm_resiliency.codec import Layout, StateSchemaError, check_structure
from lm_resiliency.files import (Field, RecordRejected, RecordSchema, any_json, array, boolean, check_record,
                                 decode_record, encode_record, integer, text)
from lm_resiliency.wire import MAX_JSON_BYTES

RECORD_VERSION = 1
_PREFIX = "lm_resiliency/transfer/v1"
_NONCE = re.compile(r"[0-9a-f]{1,64}")
_CRC = integer(0, 2 ** 32 - 1)
_OBJECT = Field(types=(dict,))
# A sender's offer (`TransferRecord.to_json`) and a receiver's answer, as they travel in the store.
RECORD_SCHEMA = RecordSchema(what="checkpoint transfer record", identity=("version", RECORD_VERSION),
                             max_bytes=MAX_JSON_BYTES, fields={
                                 "run_id": text(max_length=None), "step": integer(0), "source_rank": integer(0),
                                 "sender": integer(0), "receiver": integer(0), "nonce": text(max_length=64),
                                 "topology": text(max_length=None), "layout": _OBJECT, "structure": any_json(),
                                 "extra": _OBJECT, "total_bytes": integer(0), "chunk_size": integer(0),
                                 "chunk_crc32": array(_CRC, max_length=None), "metadata_crc32": _CRC})
VERDICT_SCHEMA = RecordSchema(what="checkpoint transfer answer",
                              fields={"ok": boolean(), "reason": text(nonempty=False, max_length=None)})


class TransferRefused(RuntimeError, RecordRejected):
    """A transfer was refused (bad offer, corrupt chunk, wrong endpoint); nothing was published."""


def _non_negative(name: str, value: Any) -> None:
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def check_timeout(name: str, timeout_s: Any) -> float:
    if (not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool)
            or not math.isfinite(timeout_s) or timeout_s <= 0):
        raise ValueError(f"{name}: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


@dataclass(frozen=True)
class TransferKey:
    """What is transferred: the flushed state of `source_rank` at `step` of run `run_id`."""

    run_id: str
    step: int
    source_rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id:
            raise ValueError(f"TransferKey.run_id must be a non-empty str, got {self.run_id!r}")
        _non_negative("TransferKey.step", self.step)
        _non_negative("TransferKey.source_rank", self.source_rank)

    def __str__(self) -> str:
        return f"step {self.step} of rank {self.source_rank} (run {self.run_id!r})"


def chunk_count(total_bytes: int, chunk_size: int) -> int:
    """How many chunks `chunk_bounds` makes, in constant time: what a claimed size is checked by."""
    return max(1, -(-total_bytes // chunk_size))


def chunk_bounds(total_bytes: int, chunk_size: int) -> Tuple[Tuple[int, int], ...]:
    """(offset, length) of each chunk; an empty payload is one empty chunk. Linear in the chunk
    count: build it only for an offer whose checksum list has that many entries."""
    if total_bytes == 0:
        return ((0, 0),)
    return tuple((offset, min(chunk_size, total_bytes - offset)) for offset in range(0, total_bytes, chunk_size))


def metadata_crc(layout: dict, structure: Any, extra: dict) -> int:
    canonical = json.dumps([layout, structure, extra], sort_keys=True, allow_nan=False, separators=(",", ":"))
    return crc32(canonical.encode("utf-8"))


@dataclass(frozen=True)
class TransferRecord:
    """A sender's offer: endpoints, the shard's identity and layout, byte count, chunk checksums.

    `nonce` is drawn per offer: the answers and the pair group of one offer never meet those of
    an earlier offer of the same key."""

    key: TransferKey
    sender: int
    receiver: int
    nonce: str
    topology: str
    layout: dict
    structure: Any
    extra: dict
    total_bytes: int
    chunk_size: int
    chunk_crc32: Tuple[int, ...]
    metadata_crc32: int

    def to_json(self) -> dict:
        return {"version": RECORD_VERSION, "run_id": self.key.run_id, "step": self.key.step,
                "source_rank": self.key.source_rank, "sender": self.sender, "receiver": self.receiver,
                "nonce": self.nonce, "topology": self.topology, "layout": self.layout,
                "structure": self.structure, "extra": self.extra, "total_bytes": self.total_bytes,
                "chunk_size": self.chunk_size, "chunk_crc32": list(self.chunk_crc32),
                "metadata_crc32": self.metadata_crc32}

    @staticmethod
    def from_json(doc: Any) -> "TransferRecord":
        """The record in `doc`; TransferRefused when its fields are not exactly the schema."""
        check_record(doc, RECORD_SCHEMA, "transfer record", error=TransferRefused)
        if not _NONCE.fullmatch(doc["nonce"]):
            raise TransferRefused(f"transfer record nonce {doc['nonce']!r} is not 1 to 64 lowercase hex digits")
        crcs = doc["chunk_crc32"]
        key = TransferKey(doc["run_id"], doc["step"], doc["source_rank"])
        return TransferRecord(key, doc["sender"], doc["receiver"], doc["nonce"], doc["topology"], doc["layout"],
                              doc["structure"], doc["extra"], doc["total_bytes"], doc["chunk_size"],
                              tuple(crcs), doc["metadata_crc32"])


def check_offer(record: TransferRecord, key: TransferKey, sender: int, receiver: int, topology: str,
                max_bytes: Optional[int], limit: Optional[str] = None) -> Layout:
    """The offer's layout when `record` is the transfer the receiver expects; TransferRefused,
    naming the field, otherwise. Runs before anything is allocated or written, in time and memory
    bounded by the record's own size whatever byte count it claims. `limit` says where
    `max_bytes` comes from (default: "max_bytes=<n>")."""
    def refuse(why: str) -> TransferRefused:
        return TransferRefused(f"rank {receiver} refuses the transfer of {key} from rank {sender}: {why}; "
                               "nothing is written")

    if record.key != key:
        raise refuse(f"the offer is for {record.key}")
    if (record.sender, record.receiver) != (sender, receiver):
        raise refuse(f"the offer names sender {record.sender} and receiver {record.receiver}")
    if record.topology != topology:
        raise refuse(f"the offer is for topology {record.topology!r}, this store holds {topology!r} "
                     "(a different job layout)")
    try:
        layout = Layout.from_json(record.layout)
    except StateSchemaError as exc:
        raise refuse(f"invalid tensor layout ({exc})") from exc
    if record.total_bytes != layout.total_bytes:
        raise refuse(f"it announces {record.total_bytes} bytes, its layout holds {layout.total_bytes}")
    if max_bytes is not None and record.total_bytes > max_bytes:
        raise refuse(f"it announces {record.total_bytes} bytes, more than {limit or f'max_bytes={max_bytes}'}")
    if record.chunk_size <= 0:
        raise refuse(f"chunk size {record.chunk_size} is not positive")
    expected = chunk_count(record.total_bytes, record.chunk_size)
    if len(record.chunk_crc32) != expected:
        raise refuse(f"it carries {len(record.chunk_crc32)} chunk checksums, {record.total_bytes} bytes in "
                     f"{record.chunk_size}-byte chunks make {expected}")
    if metadata_crc(record.layout, record.structure, record.extra) != record.metadata_crc32:
        raise refuse("its metadata checksum does not match its layout, structure and extra")
    try:  # a shard published from it would be refused by every reader
        check_structure(record.structure, layout)
    except StateSchemaError as exc:
        raise refuse(f"its structure does not match its layout ({exc})") from exc
    return layout


class TransferMetadataStore:
    """Offers and answers of checkpoint transfers on a c10d `store`, every wait bounded by
    `timeout_s`. Keys are namespaced by a hash of the run id, the step, the source rank and the
    two endpoints, so transfers of other runs or pairs sharing the store never meet."""

    def __init__(self, store: dist.Store, timeout_s: float = 300.0, *, max_record_bytes: int = MAX_JSON_BYTES) -> None:
        if not isinstance(store, dist.Store):
            raise TypeError(f"TransferMetadataStore: store must be a torch.distributed.Store, "
                            f"got {type(store).__name__}")
        self.store = store
        self.timeout_s = check_timeout("TransferMetadataStore", timeout_s)
        self._max_record_bytes = max_record_bytes

    @staticmethod
    def prefix(key: TransferKey, sender: int, receiver: int) -> str:
        run = hashlib.sha256(key.run_id.encode("utf-8")).hexdigest()[:24]
        return f"{_PREFIX}/{run}/step-{key.step}/rank-{key.source_rank}/{sender}-to-{receiver}"

    def publish(self, record: TransferRecord) -> None:
        self.store.set(self.prefix(record.key, record.sender, record.receiver) + "/offer",
                       encode_record(record.to_json(), RECORD_SCHEMA))

    def fetch(self, key: TransferKey, sender: int, receiver: int) -> TransferRecord:
        """The offer of `key` from `sender` to `receiver`, waiting at most `timeout_s` for it.
        TimeoutError when it never appears; TransferRefused when it is not a valid record."""
        name = self.prefix(key, sender, receiver) + "/offer"
        raw = self._wait_get(name, f"rank {sender} to offer {key} to rank {receiver}")
        doc = self._decode(raw, f"the offer of {key} from rank {sender}", RECORD_SCHEMA)
        try:
            record = TransferRecord.from_json(doc)
        except TransferRefused as exc:
            nonce = doc.get("nonce") if isinstance(doc, dict) else None
            if isinstance(nonce, str) and _NONCE.fullmatch(nonce):  # tell the sender, who waits on it
                self.answer(key, sender, receiver, nonce, "accept", str(exc))
            raise
        try:
            self.store.delete_key(name)  # consumed: a later receive of this key waits for a new offer
        except RuntimeError:
            pass  # a store without deletion: the nonce still keeps the two transfers apart
        return record

    def answer(self, key: TransferKey, sender: int, receiver: int, nonce: str, stage: str,
               reason: Optional[str]) -> None:
        """The receiver's answer at `stage` ("accept" or "done") to the offer `nonce` it found
        under (key, sender, receiver): None = fine, else why not."""
        self._set_answer(f"{self.prefix(key, sender, receiver)}/{nonce}/{stage}", reason)

    def _set_answer(self, name: str, reason: Optional[str]) -> None:
        self.store.set(name, encode_record({"ok": reason is None, "reason": reason or ""}, VERDICT_SCHEMA))

    def wait_answer(self, record: TransferRecord, stage: str) -> Optional[str]:
        """The receiver's answer at `stage`: None when it is fine, else its reason."""
        raw = self._wait_get(f"{self.prefix(record.key, record.sender, record.receiver)}/{record.nonce}/{stage}",
                             f"rank {record.receiver} to {'accept' if stage == 'accept' else 'confirm'} "
                             f"the transfer of {record.key}")
        doc = self._decode(raw, f"rank {record.receiver}'s answer to the transfer of {record.key}", VERDICT_SCHEMA)
        doc = check_record(doc, VERDICT_SCHEMA, f"rank {record.receiver}'s answer to the transfer of {record.key}",
                           error=TransferRefused)
        return None if doc["ok"] else doc["reason"] or "no reason given"

    def pair_prefix(self, record: TransferRecord) -> str:
        return f"{self.prefix(record.key, record.sender, record.receiver)}/{record.nonce}/pair/"

    def _wait_get(self, name: str, what: str) -> bytes:
        try:
            self.store.wait([name], timedelta(seconds=self.timeout_s))
            return self.store.get(name)
        except RuntimeError as exc:  # DistStoreError on timeout, or a lost store connection
            raise TimeoutError(f"checkpoint transfer: waited {self.timeout_s}s for {what}; the peer failed, "
                               f"has not reached the transfer, or uses another key or store ({exc})") from exc

    def _decode(self, raw: bytes, what: str, schema: RecordSchema) -> Any:
        """The strict JSON in `raw` (size-bounded), not yet checked: an offer that fails its schema
        is still answered (its nonce tells the waiting sender why)."""
        return decode_record(raw, dataclasses.replace(schema, max_bytes=self._max_record_bytes), what,
                             error=TransferRefused)
