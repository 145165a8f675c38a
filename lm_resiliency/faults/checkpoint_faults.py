"""Destroy GEMINI node-local shard files on purpose: flip bytes, truncate, remove.

Only files named like GEMINI shards (``own-<step>.gemini``, ``peer-<owner>-<step>.gemini``)
inside ``<disk_folder>/gemini-*/rank-<rank>/`` of the target rank are touched; symbolic links
are never followed. Every effect is verified by reading the file system back.
"""

from __future__ import annotations

import os
import random
import re
import stat
import struct
import zipfile
from typing import Any, Dict, List, Optional, Tuple

from lm_resiliency.files import fsync_dir, open_owned

_OWN_RE = re.compile(r"own-(\d{12,})\.gemini")
_PEER_RE = re.compile(r"peer-(\d{5,})-(\d{12,})\.gemini")
_RANK_DIR_RE = re.compile(r"rank-(\d+)")


def _entries(directory: str) -> List[str]:
    try:
        return sorted(os.listdir(directory))
    except FileNotFoundError:
        return []


def list_shards(disk_folder: str, rank: int) -> List[Tuple[str, str, int, int]]:
    """(path, kind, owner_rank, step) of every shard file of `rank` under `disk_folder`."""
    found = []
    for namespace in _entries(disk_folder):
        ns_dir = os.path.join(disk_folder, namespace)
        if not namespace.startswith("gemini-") or not stat.S_ISDIR(os.lstat(ns_dir).st_mode):
            continue
        for rank_name in _entries(ns_dir):
            match = _RANK_DIR_RE.fullmatch(rank_name)
            rank_dir = os.path.join(ns_dir, rank_name)
            if not match or int(match.group(1)) != rank or not stat.S_ISDIR(os.lstat(rank_dir).st_mode):
                continue
            for name in _entries(rank_dir):
                path = os.path.join(rank_dir, name)
                if not stat.S_ISREG(os.lstat(path).st_mode):
                    continue
                own = _OWN_RE.fullmatch(name)
                if own:
                    found.append((path, "own", rank, int(own.group(1))))
                    continue
                peer = _PEER_RE.fullmatch(name)
                if peer:
                    found.append((path, "peer", int(peer.group(1)), int(peer.group(2))))
    return found


def select_shard(disk_folder: str, rank: int, *, kind: str = "own", step: Optional[int] = None,
                 owner_rank: Optional[int] = None) -> Optional[str]:
    """The newest matching shard file (or the one at `step`), None if there is none."""
    candidates = [(s, os.lstat(p).st_mtime_ns, p) for p, k, owner, s in list_shards(disk_folder, rank)
                  if k == kind and (step is None or s == step)
                  and (owner_rank is None or owner == owner_rank)]
    if not candidates:
        return None
    return max(candidates)[2]


def payload_region(path: str) -> Optional[Tuple[int, int, str]]:
    """(start, length, member) of the largest stored member of a torch zip file (the tensor
    payload of a GEMINI shard), or None if the file is not a readable zip."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if m.compress_type == zipfile.ZIP_STORED]
            if not members:
                return None
            biggest = max(members, key=lambda m: m.compress_size)
        with open(path, "rb") as f:
            f.seek(biggest.header_offset)
            header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04" or biggest.compress_size == 0:
            return None
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return biggest.header_offset + 30 + name_len + extra_len, biggest.compress_size, biggest.filename
    except (OSError, zipfile.BadZipFile, ValueError):
        return None


def _open_shard(path: str) -> int:
    """The shard open for writing; never through a link, only a regular file this user owns."""
    fd = open_owned(path, "GEMINI file", PermissionError, flags=os.O_RDWR)
    if fd is None:
        raise FileNotFoundError(f"{path}: no such GEMINI file to corrupt")
    return fd


def flip_bytes(path: str, *, seed: int, offset: Optional[int] = None, count: int = 1) -> Dict[str, Any]:
    """XOR `count` bytes at `offset` with 0xFF, in place, fsynced.

    Default offset: a seeded position inside the tensor payload (the largest zip member), the
    bytes that bit rot or a bad DMA would hit; GEMINI detects it only with verify_integrity
    (CRC-32), exactly as in production. A non-zip file gets a seeded position anywhere."""
    region = payload_region(path) if offset is None else None
    fd = _open_shard(path)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"{path} is empty; there is no byte to flip")
        if offset is None:
            start, length = (region[0], region[1]) if region is not None else (0, size)
            offset = start + random.Random(seed).randrange(length)
        if offset >= size:
            raise ValueError(f"offset {offset} is beyond the end of {path} ({size} bytes)")
        count = min(count, size - offset)
        before = os.pread(fd, count, offset)
        after = bytes(b ^ 0xFF for b in before)
        os.pwrite(fd, after, offset)
        os.fsync(fd)
        verify = os.pread(fd, count, offset)
    finally:
        os.close(fd)
    if verify != after:
        raise OSError(f"{path}: flipped bytes did not persist")
    return {"path": path, "size": size, "offset": offset, "bytes": count,
            "region": region[2] if region is not None else None,
            "before": before.hex(), "after": after.hex()}


def truncate(path: str, *, keep_fraction: Optional[float] = None,
             keep_bytes: Optional[int] = None) -> Dict[str, Any]:
    """Cut the file to `keep_bytes` (or `keep_fraction` of its size, default half), fsynced."""
    size = os.lstat(path).st_size
    if keep_bytes is None:
        keep_bytes = int(size * (0.5 if keep_fraction is None else keep_fraction))
    if keep_bytes >= size:
        raise ValueError(f"{path} has {size} bytes; truncating to {keep_bytes} would not shorten it")
    fd = _open_shard(path)
    try:
        os.ftruncate(fd, keep_bytes)
        os.fsync(fd)
        new_size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if new_size != keep_bytes:
        raise OSError(f"{path}: truncation to {keep_bytes} bytes left {new_size}")
    return {"path": path, "size": size, "new_size": new_size}


def remove(path: str) -> Dict[str, Any]:
    size = os.lstat(path).st_size
    os.unlink(path)
    fsync_dir(os.path.dirname(path))
    if os.path.lexists(path):
        raise OSError(f"{path}: still present after removal")
    return {"path": path, "size": size, "removed": True}


__all__ = ["flip_bytes", "list_shards", "remove", "select_shard", "truncate"]
