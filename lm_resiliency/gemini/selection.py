"""Rank-consistent recovery-step selection (a pure function of every rank's availability report).

Each rank reports the steps of its own state it can load (memory or node-local disk) and,
per owner rank, the steps of replicas it holds. An entry is a step (lineage not known without
reading the file: node-local disk) or ``[step, lineage]`` (memory slots, see timeline.py). A
(step, lineage) is eligible only when every rank's state is available at that rank or at that
rank's replica holder on that same lineage, and no known timeline abandoned it; a newer step
that only part of the job has is never chosen. Entries of unknown lineage may stand in for any
lineage: the manager checks the lineage when it reads them and never mixes two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple

from lm_resiliency.gemini.timeline import abandoned

Entry = Tuple[int, Optional[str]]


@dataclass(frozen=True)
class RecoveryPlan:
    step: int
    sources: Dict[int, int]  # owner rank -> rank that provides its state (itself or its holder)
    lineage: Optional[str] = None  # None: not known before the shards are read

    def transfers(self) -> List[tuple]:
        """(holder, owner) pairs whose state must travel over the network, in a global order."""
        return sorted((src, owner) for owner, src in self.sources.items() if src != owner)


def _entry(item) -> Entry:
    return (item, None) if isinstance(item, int) else (int(item[0]), item[1])


def _json(entry: Entry):
    return entry[0] if entry[1] is None else [entry[0], entry[1]]


def _sorted(items) -> list:
    entries = sorted({_entry(i) for i in items}, key=lambda e: (e[0], e[1] or ""))
    return [_json(e) for e in entries]


def availability_report(own_steps, held: Dict[int, list], timelines: Optional[dict] = None) -> dict:
    """`own_steps` and `held` values: steps, or (step, lineage) pairs. `timelines` maps each lineage
    this rank knows to its ancestry (see timeline.py)."""
    report = {"own": _sorted(own_steps), "held": {str(o): _sorted(s) for o, s in held.items()}}
    if timelines:
        report["timelines"] = {k: [list(a) for a in v] for k, v in sorted(timelines.items())}
    return report


def entries(values) -> Set[Entry]:
    return {_entry(v) for v in values}


def has(values, step: int, lineage: Optional[str]) -> bool:
    """Whether a report list offers `step` on `lineage` (an entry of unknown lineage offers any)."""
    return any(s == step and (x is None or lineage is None or x == lineage) for s, x in entries(values))


def choose_plan(reports: List[dict], holder_of: Optional[Callable[[int], int]],
                exact_step: Optional[int] = None,
                allowed_steps: Optional[Iterable[int]] = None) -> Optional[RecoveryPlan]:
    """The newest (step, lineage) every rank can load, preferring each rank's own copy over its
    replica. Within a step, known lineages are tried in a fixed order."""
    world = len(reports)
    own = [r["own"] for r in reports]
    held = [{int(o): s for o, s in r["held"].items()} for r in reports]
    known = [a for r in reports for a in r.get("timelines", {}).values()]
    candidates = set().union(*(entries(o) for o in own), *(entries(s) for h in held for s in h.values()))
    steps = {s for s, _ in candidates}
    if exact_step is not None:
        steps &= {exact_step}
    if allowed_steps is not None:
        steps &= set(allowed_steps)
    for step in sorted(steps, reverse=True):
        # Unknown lineage (None) is a candidate only where no lineage is known: it must never
        # join two known lineages.
        lineages = sorted({x for s, x in candidates if s == step and x is not None}) or [None]
        for lineage in lineages:
            if abandoned(lineage, step, known):
                continue
            sources = {}
            for rank in range(world):
                if has(own[rank], step, lineage):
                    sources[rank] = rank
                    continue
                holder = holder_of(rank) if holder_of is not None else None
                if holder is not None and has(held[holder].get(rank, ()), step, lineage):
                    sources[rank] = holder
                    continue
                break
            else:
                return RecoveryPlan(step, sources, lineage)
    return None
