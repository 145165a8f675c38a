"""Timelines: a step number is not an identity.

Every capture is tagged with the lineage (timeline) it belongs to. Each manager starts a new
lineage, drawn by rank 0 of GEMINI's group and broadcast, and every recovery of (lineage L,
step s) forks a new lineage whose parent is (L, s): from then on, state of L after s is
abandoned. The record travels in the slot/replica/shard `extra` under ``"timeline"``:
``{"lineage": id, "ancestry": [[parent, fork_step], [grandparent, fork_step], ...]}``.

State (L, s) belongs to a timeline T when L is T's lineage, or when T's ancestry names L
with a fork step >= s.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Tuple

import torch.distributed as dist

from lm_resiliency import wire

TIMELINE_KEY = "timeline"
# Ancestors kept in a record; older forks are rarely needed and must not grow the metadata forever.
MAX_ANCESTRY = 32


@dataclass(frozen=True)
class Timeline:
    lineage: str
    ancestry: Tuple[Tuple[Optional[str], int], ...] = ()

    def record(self) -> dict:
        return {"lineage": self.lineage, "ancestry": [list(a) for a in self.ancestry]}

    def contains(self, lineage: Optional[str], step: int) -> bool:
        """Whether state (lineage, step) lies on this timeline."""
        if lineage == self.lineage:
            return True
        return any(parent == lineage and step <= fork for parent, fork in self.ancestry)

    def fork(self, lineage: Optional[str], ancestry: Iterable, step: int, new_id: str) -> "Timeline":
        """The timeline that continues from recovered state (lineage, step)."""
        chain = ((lineage, step),) + tuple((a[0], a[1]) for a in ancestry)
        return Timeline(new_id, chain[:MAX_ANCESTRY])


def parse(extra: Optional[dict]) -> Optional[Tuple[str, tuple]]:
    """(lineage, ancestry) recorded in a slot/shard `extra`, or None (written before timelines)."""
    record = (extra or {}).get(TIMELINE_KEY)
    if (not isinstance(record, dict) or set(record) != {"lineage", "ancestry"}
            or not isinstance(record["lineage"], str) or not isinstance(record["ancestry"], list)):
        return None
    ancestry = []
    for item in record["ancestry"]:
        if (not isinstance(item, list) or len(item) != 2 or not (item[0] is None or isinstance(item[0], str))
                or not isinstance(item[1], int) or isinstance(item[1], bool)):
            return None
        ancestry.append((item[0], item[1]))
    return record["lineage"], tuple(ancestry)


def lineage_of(extra: Optional[dict]) -> Optional[str]:
    parsed = parse(extra)
    return parsed[0] if parsed else None


def abandoned(lineage: Optional[str], step: int, known: Iterable[Any]) -> bool:
    """State (lineage, step) is abandoned when some known timeline forked from `lineage` before
    `step` (a recovery to an earlier step of that lineage happened)."""
    if lineage is None:
        return False
    for ancestry in known:
        if any(parent == lineage and fork < step for parent, fork in ancestry):
            return True
    return False


def draw_lineage(group: Optional[dist.ProcessGroup]) -> str:
    """A fresh lineage id, the same on every rank (rank 0 of `group` draws it). Collective."""
    token = secrets.token_hex(8)
    if group is None:
        return token
    return wire.broadcast_json(token, src=dist.get_global_rank(group, 0), group=group)
