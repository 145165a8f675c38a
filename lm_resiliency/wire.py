"""JSON over torch.distributed: agreement messages never use pickle (no *_object collectives)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from lm_resiliency.files import MAX_JSON_DEPTH, json_nesting
from lm_resiliency.tensor_bytes import tensor_bytes


def encode_json(value: Any) -> torch.Tensor:
    raw = json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_json(data: torch.Tensor) -> Any:
    """The JSON document in `data`; ValueError if it is not UTF-8 JSON or nests deeper than
    `files.MAX_JSON_DEPTH` (a peer's document never crashes the parser with RecursionError)."""
    text = tensor_bytes(data).decode("utf-8")
    depth = json_nesting(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"received JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
    return json.loads(text)


_FIRST_ROUND_BYTES = 16384  # most agreement documents fit: one collective instead of two


def all_gather_json(value: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Every rank's JSON value, ordered by group rank. Single-process: `[value]`.

    One all-gather of a fixed-size frame (length + document); a second, exactly sized round
    only when some rank's document did not fit."""
    if not dist.is_initialized():
        return [json.loads(json.dumps(value, allow_nan=False))]
    world = dist.get_world_size(group)
    payload = encode_json(value)
    frame = torch.zeros(8 + _FIRST_ROUND_BYTES, dtype=torch.uint8)
    frame[:8].view(torch.int64)[0] = payload.numel()
    head = payload[:_FIRST_ROUND_BYTES]
    frame[8:8 + head.numel()] = head
    frames = [torch.empty_like(frame) for _ in range(world)]
    dist.all_gather(frames, frame, group=group)
    sizes = [int(f[:8].view(torch.int64)[0]) for f in frames]
    longest = max(sizes)
    if longest <= _FIRST_ROUND_BYTES:
        return [decode_json(f[8:8 + n]) for f, n in zip(frames, sizes)]
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [decode_json(g[:n]) for g, n in zip(gathered, sizes)]


def broadcast_json(value: Any, src: int, group: Optional[dist.ProcessGroup] = None) -> Any:
    """`value` from global rank `src` on every rank."""
    if not dist.is_initialized():
        return json.loads(json.dumps(value, allow_nan=False))
    is_src = dist.get_rank() == src
    payload = encode_json(value) if is_src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buffer = payload if is_src else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return decode_json(buffer)


def send_json(value: Any, dst: int, group: dist.ProcessGroup, timeout_s: float) -> None:
    payload = encode_json(value)
    wait(dist.isend(torch.tensor([payload.numel()], dtype=torch.int64), dst, group=group), timeout_s)
    wait(dist.isend(payload, dst, group=group), timeout_s)


def recv_json(src: int, group: dist.ProcessGroup, timeout_s: float) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    wait(dist.irecv(size, src, group=group), timeout_s)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    wait(dist.irecv(buffer, src, group=group), timeout_s)
    return decode_json(buffer)


def wait(work: dist.Work, timeout_s: float) -> None:
    """Wait for a p2p/collective handle, failing with a clear error after `timeout_s`."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise TimeoutError(f"distributed operation did not complete within {timeout_s}s: {exc}") from exc
