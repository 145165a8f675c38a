"""Bitwise 64-bit signatures of tensors, computed where the tensor lives.

A signature is 16 hex characters. Two constructions, chosen by where the tensor lives, because
the cheapest exact hash differs: a CPU core hashes bytes an order of magnitude faster with XXH3
than with elementwise torch passes, while an accelerator would need a device-to-host copy of
every byte to use XXH3 and instead runs the integer construction below at memory bandwidth.
Signatures are compared among equivalent peers, whose tensors live on the same kind of device,
so each construction is only ever compared with itself. Guarantees of both:

- equal bytes, dtype and shape give equal signatures, on every rank (integer arithmetic modulo
  2**64 is exact, so the order of a reduction cannot matter; XXH3 is a byte-stream hash);
- a change of dtype or shape with the same bytes changes it (the dtype and shape are hashed
  with the bytes on the host, and through an 8-byte BLAKE2b key on devices);
- any other change (a flipped bit, reordered elements, several corrupted words) changes it
  except with a chance of about 2**-64;
- on accelerators, any change confined to one aligned 8-byte word (every single-bit flip among
  them) changes the signature always: see the construction below.

Host (CPU tensors): XXH3-64 of an ASCII dtype/shape header followed by the tensor's bytes in
logical (row-major) order; about 15 GB/s per core, read in place for contiguous tensors.

Device (other tensors). The tensor's bytes, in logical order, are read as little-endian 64-bit
words w_i (the last one zero-padded). Position i = b * BLOCK_WORDS + j gets the offset
c_j + b * K (c_j: a fixed table of pseudo-random words, K odd), and

    data = sum_i mix(w_i + c_j + b * K)   (mod 2**64)
    signature = mix(data XOR blake2b64(dtype, shape))

where mix is MurmurHash3's 64-bit finalizer with 32-bit shifts (x ^= x >> 32; x *= C1;
x ^= x >> 32; x *= C2; x ^= x >> 32). Each step is a bijection of 64-bit words (a right
xorshift, a multiplication by an odd constant, adding a constant), so each term is a bijection
of its own word: changing one word changes exactly one term, hence the sum, which cannot
cancel. The offsets make the terms position-dependent (moved elements land in other terms).
A linear position hash alone (sum of w_i * odd_i) would not do: flipping the top bit of two
words adds 2**63 * odd twice, which is 0 mod 2**64; mix spreads every input bit over the whole
term first. The final mix is again a bijection of `data`, so the header cannot undo a data
change. Cost: about ten elementwise integer passes over the words with torch ops on the
tensor's device, in chunks of at most DEVICE_CHUNK_WORDS words, then one 8-byte result per
tensor copied to the host (`structure_signature`: one copy for all of its tensors on a device).
`integer_signature` computes this construction for a tensor on any device, the CPU included.

Both work for every dense dtype (bfloat16, bool and the float8 types included: the bytes are
read through a `uint8` view), 0-d, empty and non-contiguous tensors. A DTensor is signed by its
local shard. Words are little-endian, the byte order of every supported host and accelerator.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import xxhash

from lm_resiliency.tensor_bytes import byte_windows

SIGNATURE_BYTES = 8
BLOCK_WORDS = 1 << 16           # positions repeat their table entry every block, with a new offset
CPU_CHUNK_WORDS = BLOCK_WORDS   # 512 KiB work buffers stay in a CPU core's cache
DEVICE_CHUNK_WORDS = 32 * BLOCK_WORDS  # 16 MiB work buffers: few kernel launches on accelerators
HOST_PIECE_BYTES = 1 << 22      # a non-contiguous CPU tensor is copied 4 MiB at a time for hashing

_MASK64 = (1 << 64) - 1
_BLOCK_KEY = 0x9E3779B97F4A7C15  # odd
_FMIX_C1 = 0xFF51AFD7ED558CCD
_FMIX_C2 = 0xC4CEB9FE1A85EC53
_OFFSETS: Dict[torch.device, torch.Tensor] = {}


def _signed(value: int) -> int:
    """`value` mod 2**64 as a two's-complement int64 (torch int64 arithmetic wraps mod 2**64)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _mix_host(value: int) -> int:
    value &= _MASK64
    value ^= value >> 32
    value = (value * _FMIX_C1) & _MASK64
    value ^= value >> 32
    value = (value * _FMIX_C2) & _MASK64
    return value ^ (value >> 32)


def _mix_(x: torch.Tensor) -> None:
    """`mix` in place on a contiguous int64 tensor."""
    halves = x.view(torch.int32)
    low, high = halves[0::2], halves[1::2]  # little-endian: x >> 32 (logical) is the high half
    for multiplier in (_FMIX_C1, _FMIX_C2, None):
        low.bitwise_xor_(high)
        if multiplier is not None:
            x.mul_(_signed(multiplier))


def _offsets(device: torch.device) -> torch.Tensor:
    """The offsets c_j of the positions of one block, on `device`."""
    offsets = _OFFSETS.get(device)
    if offsets is None:
        offsets = torch.arange(BLOCK_WORDS, dtype=torch.int64).mul_(_signed(0xA0761D6478BD642F))
        offsets.add_(_signed(0xE7037ED1A0B428DB))
        _mix_(offsets)
        offsets = _OFFSETS[device] = offsets.to(device)
    return offsets


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


def _mix_words(words: torch.Tensor, first_block: int) -> torch.Tensor:
    """sum_i mix(w_i + c_j + b * K) over `words` (starting at block `first_block`), 0-d, on their device."""
    offsets = _offsets(words.device)
    full = words.numel() // BLOCK_WORDS * BLOCK_WORDS
    for start, stop in ((0, full), (full, words.numel())):
        if stop == start:
            continue
        width = min(stop - start, BLOCK_WORDS)
        rows = words[start:stop].view(-1, width)
        rows.add_(offsets[:width])
        block = first_block + start // BLOCK_WORDS
        if rows.shape[0] > 1:
            keys = torch.arange(block, block + rows.shape[0], dtype=torch.int64, device=words.device)
            rows.add_(keys.mul_(_signed(_BLOCK_KEY)).unsqueeze(1))
        elif block:
            rows.add_(_signed(block * _BLOCK_KEY))
    _mix_(words)
    return words.sum()


def _data_digest(t: torch.Tensor) -> torch.Tensor:
    """The data part of the signature as a 0-d int64 tensor on `t`'s device (no host sync)."""
    chunk_words = CPU_CHUNK_WORDS if t.device.type == "cpu" else DEVICE_CHUNK_WORDS
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    sums = []
    words = torch.empty(min(chunk_words, -(-nbytes // 8)), dtype=torch.int64, device=t.device)
    window = words.view(torch.uint8)
    filled, block = 0, 0
    for piece in _byte_pieces(t, chunk_words * 8):
        taken = 0
        while taken < piece.numel():
            n = min(piece.numel() - taken, window.numel() - filled)
            window[filled:filled + n].copy_(piece[taken:taken + n])
            filled, taken = filled + n, taken + n
            if filled == window.numel():
                sums.append(_mix_words(words, block))
                block += words.numel() // BLOCK_WORDS
                filled = 0
    if filled:
        used = -(-filled // 8)
        window[filled:used * 8].zero_()
        sums.append(_mix_words(words[:used], block))
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


def _header(t: torch.Tensor) -> bytes:
    return f"{str(t.dtype).removeprefix('torch.')}|{tuple(int(d) for d in t.shape)}|".encode("ascii")


def _header_key(t: torch.Tensor) -> int:
    return int.from_bytes(hashlib.blake2b(_header(t), digest_size=SIGNATURE_BYTES).digest(), "little")


def _finish(data: int, key: int) -> str:
    return f"{_mix_host((data & _MASK64) ^ key):016x}"


def _host_signature(t: torch.Tensor) -> str:
    """XXH3-64 of the header and the bytes of a CPU tensor, read in place where contiguous."""
    h = xxhash.xxh3_64(_header(t))
    for piece in _byte_pieces(t, HOST_PIECE_BYTES):
        for window in byte_windows(piece):  # `piece` stays referenced while XXH3 reads its memory
            h.update(window)
    return f"{h.intdigest():016x}"


def integer_signature(t: torch.Tensor) -> str:
    """The device construction of `t`'s signature, computed on `t`'s own device (any device)."""
    t = _local(t)
    return _finish(int(_data_digest(t).item()), _header_key(t))


def tensor_signature(t: torch.Tensor) -> str:
    """A bitwise 64-bit signature (16 hex chars) of `t`'s bytes, dtype and shape."""
    t = _local(t)
    return _host_signature(t) if t.device.type == "cpu" else integer_signature(t)


def structure_signature(tensors: Iterable[Optional[torch.Tensor]]) -> str:
    """One signature of an ordered collection of tensors (None entries allowed and counted).

    Order matters: the same tensors in a different order sign differently. The digests of all
    tensors on one accelerator reach the host in a single copy."""
    signed: List[Optional[str]] = []
    pending: Dict[torch.device, List[Tuple[int, torch.Tensor, int]]] = {}
    for t in tensors:
        if t is None:
            signed.append(None)
            continue
        t = _local(t)
        if t.device.type == "cpu":
            signed.append(_host_signature(t))
            continue
        pending.setdefault(t.device, []).append((len(signed), _data_digest(t), _header_key(t)))
        signed.append(None)
    for entries in pending.values():
        values = torch.stack([digest for _, digest, _ in entries]).cpu().tolist()
        for (index, _, key), data in zip(entries, values):
            signed[index] = _finish(data, key)
    h = hashlib.blake2b(digest_size=SIGNATURE_BYTES)
    for value in signed:
        h.update(b"none;" if value is None else value.encode("ascii") + b";")
    h.update(f"#{len(signed)}".encode("ascii"))
    return h.hexdigest()
