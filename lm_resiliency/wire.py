"""JSON over torch.distributed: agreement messages never use pickle (no *_object collectives)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from lm_resiliency.errors import ResiliencyError
from lm_resiliency.files import json_copy, loads_strict_json
from lm_resiliency.tensor_bytes import tensor_bytes


def encode_json(value: Any) -> torch.Tensor:
    raw = json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_json(data: torch.Tensor) -> Any:
    """The JSON document in `data`; ValueError if it is not UTF-8 strict JSON (no NaN, no duplicate
    keys) or nests deeper than `files.MAX_JSON_DEPTH` (a peer's document never crashes the parser
    with RecursionError). What it holds is checked by its reader (a RecordSchema or the protocol)."""
    return loads_strict_json(tensor_bytes(data).decode("utf-8"))


_FIRST_ROUND_BYTES = 16384  # most agreement documents fit: one collective instead of two


def all_gather_json(value: Any, group: Optional[dist.ProcessGroup] = None,
                    timeout_s: Optional[float] = None) -> List[Any]:
    """Every rank's JSON value, ordered by group rank. Single-process: `[value]`.

    One all-gather of a fixed-size frame (length + document); a second, exactly sized round
    only when some rank's document did not fit. `timeout_s` bounds each round (default: the
    group's own timeout)."""
    if not dist.is_initialized():
        return [json_copy(value)]
    world = dist.get_world_size(group)
    payload = encode_json(value)
    frame = torch.zeros(8 + _FIRST_ROUND_BYTES, dtype=torch.uint8)
    frame[:8].view(torch.int64)[0] = payload.numel()
    head = payload[:_FIRST_ROUND_BYTES]
    frame[8:8 + head.numel()] = head
    frames = [torch.empty_like(frame) for _ in range(world)]
    _all_gather(frames, frame, group, timeout_s)
    sizes = [int(f[:8].view(torch.int64)[0]) for f in frames]
    longest = max(sizes)
    if longest <= _FIRST_ROUND_BYTES:
        return [decode_json(f[8:8 + n]) for f, n in zip(frames, sizes)]
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    _all_gather(gathered, padded, group, timeout_s)
    return [decode_json(g[:n]) for g, n in zip(gathered, sizes)]


def _all_gather(outputs: List[torch.Tensor], tensor: torch.Tensor, group: Optional[dist.ProcessGroup],
                timeout_s: Optional[float]) -> None:
    if timeout_s is None:
        dist.all_gather(outputs, tensor, group=group)
    else:
        wait(dist.all_gather(outputs, tensor, group=group, async_op=True), timeout_s)


def broadcast_json(value: Any, src: int, group: Optional[dist.ProcessGroup] = None) -> Any:
    """`value` from global rank `src` on every rank."""
    if not dist.is_initialized():
        return json_copy(value)
    is_src = dist.get_rank() == src
    payload = encode_json(value) if is_src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buffer = payload if is_src else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return decode_json(buffer)


class ShortMessage(ResiliencyError, RuntimeError):
    """A point-to-point message ended before the length its sender announced."""


# A control frame is three int64s: payload length, payload's final byte, this constant. Gloo
# accepts a shorter message into a longer receive without telling, so a frame that arrives
# whole ends with the constant, and a payload that arrives whole ends with the announced byte
# (its receive buffer is pre-set to a different value). A longer message aborts gloo's I/O
# thread, so receives are only ever posted with the length the peer announced.
_FRAME_MAGIC = 0x4C4D522D5752  # "LMR-WR"
MAX_JSON_BYTES = 256 * 1024 * 1024


def frame(payload: torch.Tensor) -> torch.Tensor:
    """The control frame announcing `payload` (a flat uint8 tensor)."""
    last = int(payload[-1]) if payload.numel() else 0
    return torch.tensor([payload.numel(), last, _FRAME_MAGIC], dtype=torch.int64)


def empty_frame() -> torch.Tensor:
    return torch.zeros(3, dtype=torch.int64)


def read_frame(received: torch.Tensor, src: int, limit: int) -> tuple:
    """(length, final byte) from a received frame; ShortMessage when it did not arrive whole."""
    length, last, magic = (int(v) for v in received.tolist())
    if magic != _FRAME_MAGIC:
        raise ShortMessage(f"the control frame from rank {src} arrived truncated or garbled "
                           "(a protocol mismatch or a failed peer); nothing of it is used")
    if not 0 <= length <= limit or not 0 <= last <= 255:
        raise ShortMessage(f"rank {src} announced a {length}-byte message; at most {limit} bytes "
                           "are accepted here")
    return length, last


class Receive:
    """A posted receive of exactly `buffer.numel()` bytes whose final byte must be `last`."""

    def __init__(self, buffer: torch.Tensor, last: int, src: int, group: dist.ProcessGroup,
                 tag: int = 0) -> None:
        self.buffer, self.last, self.src = buffer, last, src
        if buffer.numel():
            buffer[-1] = last ^ 0xFF  # any other value: overwritten only by a complete message
        self.work = dist.irecv(buffer, src, group=group, tag=tag) if buffer.numel() else None

    def wait(self, timeout_s: float) -> None:
        if self.work is None:
            return
        wait(self.work, timeout_s)
        if int(self.buffer[-1]) != self.last:
            raise ShortMessage(f"rank {self.src} sent fewer than the {self.buffer.numel()} bytes it "
                               "announced; the partial data is discarded")


def send_bytes(payload: torch.Tensor, dst: int, group: dist.ProcessGroup, timeout_s: float,
               tag: int = 0) -> None:
    """Send a flat uint8 tensor, announced by a control frame (see `recv_bytes`)."""
    sends = [dist.isend(frame(payload), dst, group=group, tag=tag)]
    if payload.numel():
        sends.append(dist.isend(payload, dst, group=group, tag=tag))
    for work in sends:
        wait(work, timeout_s)


def recv_bytes(src: int, group: dist.ProcessGroup, timeout_s: float, tag: int = 0, *,
               expected: Optional[int] = None, limit: int = MAX_JSON_BYTES) -> torch.Tensor:
    """What `send_bytes` sent: the announced length must be `expected` (when given) and at most
    `limit`, checked before anything is allocated, and the data must arrive whole."""
    head = empty_frame()
    wait(dist.irecv(head, src, group=group, tag=tag), timeout_s)
    length, last = read_frame(head, src, limit if expected is None else expected)
    if expected is not None and length != expected:
        raise ShortMessage(f"rank {src} announced {length} bytes where {expected} were agreed")
    body = Receive(torch.empty(length, dtype=torch.uint8), last, src, group, tag)
    body.wait(timeout_s)
    return body.buffer


def send_json(value: Any, dst: int, group: dist.ProcessGroup, timeout_s: float, tag: int = 0) -> None:
    send_bytes(encode_json(value), dst, group, timeout_s, tag)


def recv_json(src: int, group: dist.ProcessGroup, timeout_s: float, tag: int = 0,
              limit: int = MAX_JSON_BYTES) -> Any:
    """One JSON document from `send_json`, checked to have arrived whole and at most `limit` bytes."""
    return decode_json(recv_bytes(src, group, timeout_s, tag, limit=limit))


def new_group(ranks: Optional[Sequence[int]], timeout_s: float, purpose: str) -> dist.ProcessGroup:
    """A gloo group whose creation (and every later operation without its own timeout) gives up
    after `timeout_s`, with an error naming `purpose`. torch's default would wait 30 minutes."""
    try:
        return dist.new_group(list(ranks) if ranks is not None else None, backend="gloo",
                              timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        members = "all ranks" if ranks is None else f"ranks {list(ranks)}"
        raise TimeoutError(
            f"creating {purpose} (a gloo group of {members}) did not complete within {timeout_s}s: "
            "every rank of the job creates it together at this point, so another rank failed, "
            f"restarted alone or has not reached it ({exc})") from exc


def wait(work: dist.Work, timeout_s: float) -> None:
    """Wait for a p2p/collective handle, failing with a clear error after `timeout_s`."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(f"distributed operation did not complete within {timeout_s}s (the peer "
                           f"failed, or the link was closed after an earlier failure): {exc}") from exc
