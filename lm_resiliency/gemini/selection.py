"""Rank-consistent recovery-step selection (a pure function of every rank's availability report).

Each rank reports the steps of its own state it can load (memory or node-local disk) and,
per owner rank, the steps of replicas it holds. A step is eligible only when every rank's
state is available at that rank or at that rank's replica holder; a newer step that only
part of the job has is never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional


@dataclass(frozen=True)
class RecoveryPlan:
    step: int
    sources: Dict[int, int]  # owner rank -> rank that provides its state (itself or its holder)

    def transfers(self) -> List[tuple]:
        """(holder, owner) pairs whose state must travel over the network, in a global order."""
        return sorted((src, owner) for owner, src in self.sources.items() if src != owner)


def availability_report(own_steps, held: Dict[int, list]) -> dict:
    return {"own": sorted(set(own_steps)), "held": {str(o): sorted(set(s)) for o, s in held.items()}}


def choose_plan(reports: List[dict], holder_of: Optional[Callable[[int], int]],
                exact_step: Optional[int] = None,
                allowed_steps: Optional[Iterable[int]] = None) -> Optional[RecoveryPlan]:
    """The newest step every rank can load, preferring each rank's own copy over its replica."""
    world = len(reports)
    own = [set(r["own"]) for r in reports]
    held = [{int(o): set(s) for o, s in r["held"].items()} for r in reports]
    candidates = set().union(*own, *(s for h in held for s in h.values()))
    if exact_step is not None:
        candidates &= {exact_step}
    if allowed_steps is not None:
        candidates &= set(allowed_steps)
    for step in sorted(candidates, reverse=True):
        sources = {}
        for rank in range(world):
            if step in own[rank]:
                sources[rank] = rank
                continue
            holder = holder_of(rank) if holder_of is not None else None
            if holder is not None and step in held[holder].get(rank, ()):
                sources[rank] = holder
                continue
            break
        else:
            return RecoveryPlan(step, sources)
    return None
