"""Bitwise 64-bit signatures of tensors, computed where the tensor lives.

A signature is 16 hex characters. Guarantees:

- equal bytes, dtype and shape give equal signatures, on every rank and device (integer
  arithmetic modulo 2**64 is exact, so the order of a reduction cannot matter);
- any change confined to one aligned 8-byte word (every single-bit flip among them) changes the
  signature, always: see the construction below;
- a change of dtype or shape with the same bytes changes it (unless two 8-byte BLAKE2b digests
  of the dtype/shape headers collide);
- any other change (reordered elements, several corrupted words) changes it except with a
  chance of about 2**-64.

Construction. The tensor's bytes, in logical (row-major) order, are read as little-endian
64-bit words w_i (the last one zero-padded). Position i = b * BLOCK_WORDS + j gets an odd
multiplier m_j and an offset c_j + b * K (fixed pseudo-random tables, K odd), and

    data = sum_i fmix64(w_i * m_j + c_j + b * K)   (mod 2**64)
    signature = fmix64(data XOR blake2b64(dtype, shape))

fmix64 (MurmurHash3's finalizer) is a bijection of 64-bit words, and so are multiplying by an
odd number and adding a constant. Each term is therefore a bijection of its own word: changing
one word changes exactly one term, so the sum changes and cannot cancel. The linear part alone
(sum of w_i * m_i) would not do: flipping the top bit of two words adds 2**63 * odd twice,
which is 0 mod 2**64; fmix64 spreads every input bit over the whole term first. The final
fmix64 is again a bijection of `data`, so the header cannot undo a data change.

Cost: about fifteen elementwise integer passes over the tensor's words with torch ops on the
tensor's own device, in chunks (two work buffers of at most CPU_CHUNK_WORDS or
DEVICE_CHUNK_WORDS words), then one 8-byte result per tensor copied to the host
(`structure_signature`: one copy for all of its tensors on a device). Works for every dense
dtype (bfloat16, bool and the float8 types included: the bytes are read through a `uint8`
view), 0-d, empty and non-contiguous tensors. A DTensor is signed by its local shard.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

SIGNATURE_BYTES = 8
BLOCK_WORDS = 1 << 16           # positions repeat their table entry every block, with a new offset
CPU_CHUNK_WORDS = BLOCK_WORDS   # 512 KiB work buffers stay in a CPU core's cache
DEVICE_CHUNK_WORDS = 32 * BLOCK_WORDS  # 16 MiB work buffers: few kernel launches on accelerators

_MASK64 = (1 << 64) - 1
_BLOCK_KEY = 0x9E3779B97F4A7C15  # odd
_FMIX_C1 = 0xFF51AFD7ED558CCD
_FMIX_C2 = 0xC4CEB9FE1A85EC53
_TABLES: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}


def _signed(value: int) -> int:
    """`value` mod 2**64 as a two's-complement int64 (torch int64 arithmetic wraps mod 2**64)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _fmix64_host(value: int) -> int:
    value &= _MASK64
    value ^= value >> 33
    value = (value * _FMIX_C1) & _MASK64
    value ^= value >> 33
    value = (value * _FMIX_C2) & _MASK64
    return value ^ (value >> 33)


def _fmix64_(x: torch.Tensor, scratch: torch.Tensor) -> None:
    """fmix64 in place on int64 words; `scratch` is a buffer of x's shape."""
    low31 = (1 << 31) - 1
    for multiplier in (_FMIX_C1, _FMIX_C2, None):
        # Logical shift: the arithmetic shift's sign copies land in the bits the mask clears.
        torch.bitwise_right_shift(x, 33, out=scratch)
        scratch.bitwise_and_(low31)
        x.bitwise_xor_(scratch)
        if multiplier is not None:
            x.mul_(_signed(multiplier))


def _tables(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(odd multipliers m_j, offsets c_j) for the positions of one block, on `device`."""
    tables = _TABLES.get(device)
    if tables is None:
        positions = torch.arange(BLOCK_WORDS, dtype=torch.int64)
        multipliers = positions * _signed(0xD6E8FEB86659FD93) + _signed(0x2545F4914F6CDD1D)
        offsets = positions * _signed(0xA0761D6478BD642F) + _signed(0xE7037ED1A0B428DB)
        scratch = torch.empty_like(positions)
        _fmix64_(multipliers, scratch)
        _fmix64_(offsets, scratch)
        tables = (multipliers.bitwise_or_(1).to(device), offsets.to(device))
        _TABLES[device] = tables
    return tables


def _local(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_signature needs a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"only dense (strided) tensors can be signed, got layout {t.layout}")
    if type(t).__name__ == "DTensor" and hasattr(t, "to_local"):
        t = t.to_local()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _byte_pieces(t: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """`t`'s bytes in logical order as flat uint8 tensors; copies at most `max_bytes` at a time."""
    if t.numel() == 0:
        return
    if t.is_contiguous():
        yield t.reshape(-1).view(torch.uint8)
        return
    row_bytes = t[0].numel() * t.element_size()
    if row_bytes > max_bytes:
        for row in t:
            yield from _byte_pieces(row, max_bytes)
        return
    rows = max(1, max_bytes // row_bytes)
    for start in range(0, t.shape[0], rows):
        yield t[start:start + rows].contiguous().reshape(-1).view(torch.uint8)


def _mix_words(total: torch.Tensor, words: torch.Tensor, scratch: torch.Tensor, first_block: int) -> None:
    """Add sum_i fmix64(w_i * m_j + c_j + b * K) over `words` (starting at block `first_block`) to `total`."""
    multipliers, offsets = _tables(words.device)
    full = words.numel() // BLOCK_WORDS * BLOCK_WORDS
    for start, stop in ((0, full), (full, words.numel())):
        if stop == start:
            continue
        width = min(stop - start, BLOCK_WORDS)
        rows = words[start:stop].view(-1, width)
        rows.mul_(multipliers[:width]).add_(offsets[:width])
        block = first_block + start // BLOCK_WORDS
        if rows.shape[0] == 1:
            rows.add_(_signed(block * _BLOCK_KEY))
        else:
            keys = torch.arange(block, block + rows.shape[0], dtype=torch.int64, device=words.device)
            rows.add_(keys.mul_(_signed(_BLOCK_KEY)).unsqueeze(1))
    _fmix64_(words, scratch)
    total.add_(words.sum())


def _data_digest(t: torch.Tensor) -> torch.Tensor:
    """The data part of the signature as a 0-d int64 tensor on `t`'s device (no host sync)."""
    chunk_words = CPU_CHUNK_WORDS if t.device.type == "cpu" else DEVICE_CHUNK_WORDS
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return total
    words = torch.empty(min(chunk_words, -(-nbytes // 8)), dtype=torch.int64, device=t.device)
    scratch = torch.empty_like(words)
    window = words.view(torch.uint8)
    filled, block = 0, 0
    for piece in _byte_pieces(t, chunk_words * 8):
        taken = 0
        while taken < piece.numel():
            n = min(piece.numel() - taken, window.numel() - filled)
            window[filled:filled + n].copy_(piece[taken:taken + n])
            filled, taken = filled + n, taken + n
            if filled == window.numel():
                _mix_words(total, words, scratch, block)
                block += words.numel() // BLOCK_WORDS
                filled = 0
    if filled:
        used = -(-filled // 8)
        window[filled:used * 8].zero_()
        _mix_words(total, words[:used], scratch[:used], block)
    return total


def _header_key(t: torch.Tensor) -> int:
    header = f"{str(t.dtype).removeprefix('torch.')}|{tuple(int(d) for d in t.shape)}|".encode("ascii")
    return int.from_bytes(hashlib.blake2b(header, digest_size=SIGNATURE_BYTES).digest(), "little")


def _finish(data: int, key: int) -> str:
    return f"{_fmix64_host((data & _MASK64) ^ key):016x}"


def tensor_signature(t: torch.Tensor) -> str:
    """A bitwise 64-bit signature (16 hex chars) of `t`'s bytes, dtype and shape."""
    t = _local(t)
    return _finish(int(_data_digest(t).item()), _header_key(t))


def structure_signature(tensors: Iterable[Optional[torch.Tensor]]) -> str:
    """One signature of an ordered collection of tensors (None entries allowed and counted).

    Order matters: the same tensors in a different order sign differently. The digests of all
    tensors on one device reach the host in a single copy."""
    entries: List[Optional[Tuple[torch.Tensor, int]]] = []
    for t in tensors:
        if t is None:
            entries.append(None)
            continue
        t = _local(t)
        entries.append((_data_digest(t), _header_key(t)))
    by_device: Dict[torch.device, List[int]] = {}
    for index, entry in enumerate(entries):
        if entry is not None:
            by_device.setdefault(entry[0].device, []).append(index)
    data: Dict[int, int] = {}
    for indices in by_device.values():
        values = torch.stack([entries[i][0] for i in indices]).cpu().tolist()
        data.update(zip(indices, values))
    h = hashlib.blake2b(digest_size=SIGNATURE_BYTES)
    for index, entry in enumerate(entries):
        h.update(b"none;" if entry is None else _finish(data[index], entry[1]).encode("ascii") + b";")
    h.update(f"#{len(entries)}".encode("ascii"))
    return h.hexdigest()
