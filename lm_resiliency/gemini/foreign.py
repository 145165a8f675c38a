"""What this host keeps in the directories of *other* ranks of this run and topology.

GEMINI's shared-memory slots and node-local shards live in directories named for the rank that
wrote them. Global ranks move between hosts: torch assigns node slots by sorting the
rendezvous participants, so when a standby replaces a lost host the surviving hosts may shift to
other slots, and so to other global ranks. A host then still holds, under its former ranks'
names, its former ranks' own state and the replicas they held, which recovery offers by *owner
rank* like any other copy (selection.py):

- a shared-memory rank directory whose owner process is dead is *claimed* as a
  `SharedSlotArena` of that rank and its READY slots adopted, with every check an own slot's
  adoption makes (run, topology, holder and owner rank, size, checksum). The takeover is atomic
  between the processes of a host (shm.py), so where several nodes share one /dev/shm two
  processes never map one slot: a directory of a live rank, or one another process claimed
  first, is left alone. The slot pairs it fills are never written;
- a node-local rank directory is opened as a `NodeLocalStore` of that rank, to list and read
  its shards (reading is not exclusive), unless that rank's own directory is on the same disk now
  (a disk folder several nodes share): that rank reports it itself.

Claiming happens after every rank of the job opened its own shared-memory directory (the
manager's barrier), so a rank's own slots always go to that rank's process when it runs here.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import torch

from lm_resiliency.gemini.shm import SharedSlotArena, default_shared_memory_dir, open_arena, shared_namespace
from lm_resiliency.gemini.slots import SlotPair
from lm_resiliency.gemini.storage import NodeLocalStore, boot_id, run_namespace, temp_scope

logger = logging.getLogger(__name__)

_SHARED_RANK_DIR_RE = re.compile(r"rank-(?P<rank>\d{5})\.(?P<scope>[0-9a-f]+)")
_DISK_RANK_DIR_RE = re.compile(r"rank-(?P<rank>\d{5})")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class ForeignMemory:
    """A claimed shared-memory directory of rank `rank`: its arena and the slot pairs holding
    its adopted slots (`own`: rank `rank`'s state; `peer`: the replica it held)."""

    rank: int
    arena: SharedSlotArena
    pairs: Tuple[SlotPair, ...]

    def close(self, keep: bool) -> None:
        for pair in self.pairs:
            pair.drop_buffers()
        self.arena.close(keep=keep)


def host_key() -> str:
    """An opaque key that ranks on one host share (boot, host name, /dev/shm), for preferring a
    provider on the owner's own host. Only a preference: a wrong key never changes what loads."""
    boot = boot_id()
    try:
        shm = os.stat("/dev/shm").st_dev
    except OSError:
        shm = -1
    return hashlib.sha256(f"{boot}\0{socket.gethostname()}\0{shm}".encode()).hexdigest()[:16]


def _never_written(name: str, nbytes: int) -> torch.Tensor:
    raise RuntimeError(f"GEMINI: slot {name} of another rank's directory is never written")


def _listed(path: str, pattern: re.Pattern) -> List[re.Match]:
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    found = []
    for name in sorted(names):
        match = pattern.fullmatch(name)
        full = os.path.join(path, name)
        if match is not None and os.path.isdir(full) and not os.path.islink(full):
            found.append(match)
    return found


def claim_memory(root: Optional[str], run_id: str, topology: str, *, series: str, rank: int, world_size: int,
                 jump: int, verify_integrity: bool, pin_memory: bool, reap_other_runs_after_s: float,
                 timeout_s: float) -> List[ForeignMemory]:
    """Claim every shared-memory directory of another rank of this run, topology and checkpoint
    series on this host whose owner is dead, and adopt its READY slots. Directories that hold no
    usable slot are removed. `jump` is the replication distance (0: none)."""
    root = root or default_shared_memory_dir()
    namespace = os.path.join(root, shared_namespace(run_id, topology, series))
    scope = temp_scope()
    claimed = []
    for match in _listed(namespace, _SHARED_RANK_DIR_RE):
        other = int(match.group("rank"))
        if other == rank or other >= world_size or match.group("scope") != scope:
            continue
        arena, reason = open_arena(root, run_id, topology, other, series=series, verify_integrity=verify_integrity,
                                   pin_memory=pin_memory, peer_owner=(other - jump) % world_size if jump else None,
                                   reap_other_runs_after_s=reap_other_runs_after_s)
        if arena is None:
            logger.debug("GEMINI: rank %d leaves rank %d's shared memory alone: %s", rank, other, reason)
            continue
        adopted = arena.adopt()
        if not adopted:
            arena.close(keep=False)
            continue
        own = SlotPair("own", _never_written, timeout_s, mirror=arena)
        peer = SlotPair("peer", _never_written, timeout_s, mirror=arena)
        for slot in adopted:
            (own if slot.name.startswith("own") else peer).adopt(
                slot.name, slot.buffer, slot.layout, slot.structure, slot.step, slot.owner_rank, slot.extra,
                slot.crc32, slot.predecessor_pid)
        claimed.append(ForeignMemory(rank=other, arena=arena, pairs=(own, peer)))
        logger.info("GEMINI: rank %d claimed rank %d's shared-memory slots left on this host (%s)", rank, other,
                    ", ".join(f"{s.name}: rank {s.owner_rank} step {s.step}" for s in adopted))
    return claimed


def disk_identity(root: str, run_id: str, topology: str) -> str:
    """Which disk this run's node-local directories are on (device and inode of its namespace
    directory): ranks that report the same identity share the disk and read their own directories
    themselves."""
    st = os.stat(os.path.join(root, run_namespace(run_id, topology)))
    return f"{host_key()}:{st.st_dev}:{st.st_ino}"


def open_disks(root: str, run_id: str, topology: str, *, rank: int, world_size: int, verify_integrity: bool,
               timeout_s: float, sharing: Set[int]) -> List[NodeLocalStore]:
    """A store for every node-local directory on this host's disk of another rank of this run
    and topology, except the ranks in `sharing` (those whose own directory is on this disk now)."""
    namespace = os.path.join(root, run_namespace(run_id, topology))
    stores = []
    for match in _listed(namespace, _DISK_RANK_DIR_RE):
        other = int(match.group("rank"))
        if other == rank or other >= world_size or other in sharing:
            continue
        try:
            stores.append(NodeLocalStore(root, run_id, topology, other, verify_integrity=verify_integrity,
                                         timeout_s=timeout_s))
        except OSError as exc:
            logger.warning("GEMINI: rank %d cannot read rank %d's node-local directory on this host: %s", rank,
                           other, exc)
    return stores
