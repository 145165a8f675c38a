"""Rank-consistent recovery-step selection (a pure function of every rank's availability report).

Each rank reports, *by owner rank*, the copies it can provide: `own` for its own rank's state,
`held` for any other rank's (the replica it holds for its peer, and whatever this host keeps in
the directories of ranks that ran here before: ranks move between hosts when a standby replaces
a lost one), `memory` for the subset it holds in memory, and `host` (an opaque key of its host).
An entry is a step (lineage not known without reading the file: node-local disk) or
``[step, lineage]`` (memory slots, see timeline.py). A (step, lineage) is eligible only when
every owner rank's state is available on that same lineage at some rank, and no known timeline
abandoned it; a newer step that only part of the job has is never chosen. Entries of unknown
lineage may stand in for any lineage: the manager checks the lineage when it reads them and never
mixes two.

Within the chosen step each owner's provider is picked deterministically: the owner itself from
memory, another rank's memory on the owner's host, another host's memory (over the network), the
owner's own disk, a disk on the owner's host, another host's disk; the lowest rank among equals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from lm_resiliency.gemini.timeline import abandoned

Entry = Tuple[int, Optional[str]]


@dataclass(frozen=True)
class RecoveryPlan:
    step: int
    sources: Dict[int, int]  # owner rank -> rank that provides its state (itself or another rank)
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


def availability_report(own_steps, held: Mapping[int, Iterable], timelines: Optional[dict] = None) -> dict:
    """`own_steps` and `held` values: steps, or (step, lineage) pairs. `timelines` maps each lineage
    this rank knows to its ancestry (see timeline.py)."""
    report: dict = {"own": _sorted(own_steps), "held": {str(o): _sorted(s) for o, s in held.items()}}
    if timelines:
        report["timelines"] = {k: [list(a) for a in v] for k, v in sorted(timelines.items())}
    return report


def entries(values) -> Set[Entry]:
    return {_entry(v) for v in values}


def has(values, step: int, lineage: Optional[str]) -> bool:
    """Whether a report list offers `step` on `lineage` (an entry of unknown lineage offers any)."""
    return any(s == step and (x is None or lineage is None or x == lineage) for s, x in entries(values))


def _provider_preference(owner: int, provider: int, in_memory: bool, hosts: List[Optional[str]]) -> int:
    same_host = hosts[provider] is not None and hosts[provider] == hosts[owner]
    if in_memory:
        return 0 if provider == owner else 1 if same_host else 2
    return 3 if provider == owner else 4 if same_host else 5


def _offers(report: dict, rank: int) -> Dict[int, list]:
    """Owner rank -> entries of one part of a report (`own` is the reporting rank's)."""
    offers = {int(o): s for o, s in report["held"].items()}
    offers[rank] = report["own"]
    return offers


def choose_plan(reports: List[dict], exact_step: Optional[int] = None,
                allowed_steps: Optional[Iterable[int]] = None) -> Optional[RecoveryPlan]:
    """The newest (step, lineage) for which every owner rank's state is at some rank, with each
    owner's provider chosen as the module says. Within a step, known lineages are tried in a
    fixed order."""
    world = len(reports)
    offers = [_offers(r, rank) for rank, r in enumerate(reports)]
    memory = [_offers(r.get("memory", r), rank) for rank, r in enumerate(reports)]
    hosts = [r.get("host") for r in reports]
    known = [a for r in reports for a in r.get("timelines", {}).values()]
    candidates: Set[Entry] = set()
    for per_owner in offers:
        for values in per_owner.values():
            candidates |= entries(values)
    steps = {s for s, _ in candidates}
    if exact_step is not None:
        steps &= {exact_step}
    if allowed_steps is not None:
        steps &= set(allowed_steps)
    for step in sorted(steps, reverse=True):
        # Unknown lineage (None) is a candidate only where no lineage is known: it must never
        # join two known lineages.
        lineages: Sequence[Optional[str]] = sorted({x for s, x in candidates if s == step and x is not None}) or [None]
        for lineage in lineages:
            if abandoned(lineage, step, known):
                continue
            best: Dict[int, Tuple[int, int]] = {}
            for provider, per_owner in enumerate(offers):
                for owner, values in per_owner.items():
                    if not 0 <= owner < world or not has(values, step, lineage):
                        continue
                    in_memory = has(memory[provider].get(owner, ()), step, lineage)
                    key = (_provider_preference(owner, provider, in_memory, hosts), provider)
                    if owner not in best or key < best[owner]:
                        best[owner] = key
            if len(best) == world:
                return RecoveryPlan(step, {owner: best[owner][1] for owner in range(world)}, lineage)
    return None


def missing_owners(reports: List[dict], step: int) -> List[int]:
    """Owner ranks of which no rank reports any copy of `step` (what a failed exact recovery
    names)."""
    offers = [_offers(r, rank) for rank, r in enumerate(reports)]
    covered = {owner for per_owner in offers for owner, values in per_owner.items() if has(values, step, None)}
    return [owner for owner in range(len(reports)) if owner not in covered]
