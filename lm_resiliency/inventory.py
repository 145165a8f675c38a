"""What GEMINI state a node holds, read without loading any of it: every run in a node-local folder
and in the shared-memory directory, and which step a relaunch of a run would resume from and why
not a newer one.

Used by `lm-resiliency inspect` and by the session's "started fresh" hints. Only names, sizes,
times and the small JSON documents are read (event logs, status sidecars, shared-memory slot
sidecars), each through its one reader; shard bytes are neither read nor checked (recovery does
that), so a step listed here can still be refused at load (corrupt, another timeline). The resume
choice is GEMINI's own selection (`gemini.selection.choose_plan`) over the copies found here;
on a multi-node job each node's disk holds only its own ranks, and ranks without a directory here
are reported as such.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from lm_resiliency.events import EventLogRejected, read_events
from lm_resiliency.gemini import timeline
from lm_resiliency.gemini.selection import choose_plan, missing_owners
from lm_resiliency.gemini.shm import (NAMESPACE_RE, SLOT_NAMES, SegmentRejected, default_shared_memory_dir,
                                      read_owner, read_sidecar, shared_namespace_of)
from lm_resiliency.gemini.storage import StatusRejected, process_alive, read_status_document, shard_key_of, temp_scope
from lm_resiliency.trust.errors import CertificationError
from lm_resiliency.trust.rules import parse_trust

_DISK_NAMESPACE_RE = re.compile(r"gemini-[0-9a-f]{24}")
_DISK_RANK_RE = re.compile(r"rank-(\d{5})")
_SHM_RANK_RE = re.compile(r"rank-(?P<rank>\d{5})\.(?P<scope>[0-9a-f]+)")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
DISK = "disk"
SHARED = "shared-memory"


@dataclass(frozen=True, kw_only=True, slots=True)
class Copy:
    """One copy of one rank's state at one step: its own (holder == owner) or a peer replica."""

    owner_rank: int
    holder_rank: int
    step: int
    tier: str  # DISK or SHARED
    nbytes: int
    written_at: float
    lineage: Optional[str] = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RankView:
    """What one rank left on this node: its copies, its trust sidecar, its shared-memory owner."""

    rank: int
    directory: Optional[str]
    copies: Tuple[Copy, ...]
    disk_bytes: int
    verified_steps: Tuple[int, ...] = ()
    sdc_pending: bool = False
    shm_directory: Optional[str] = None
    shm_owner_pid: Optional[int] = None
    shm_owner_alive: Optional[bool] = None
    problems: Tuple[str, ...] = ()

    @property
    def newest_own_step(self) -> Optional[int]:
        steps = [c.step for c in self.copies if c.owner_rank == self.rank and c.holder_rank == self.rank]
        return max(steps) if steps else None

    @property
    def verified_step(self) -> Optional[int]:
        return self.verified_steps[0] if self.verified_steps else None


@dataclass(frozen=True, kw_only=True, slots=True)
class RunView:
    """One run and topology (one GEMINI namespace) on this node."""

    namespace: str
    directory: Optional[str]
    shm_directory: Optional[str]
    run_id: Optional[str]
    topology: Optional[str]
    world_size: Optional[int]
    framework: Optional[str]
    jump: Optional[int]
    starts: int
    last_written: float
    ranks: Tuple[RankView, ...]
    problems: Tuple[str, ...] = ()

    @property
    def newest_step(self) -> Optional[int]:
        steps = [c.step for rank in self.ranks for c in rank.copies]
        return max(steps) if steps else None

    @property
    def ranks_known(self) -> int:
        """The world size, or (no event log) at least the ranks seen here."""
        return self.world_size or max((r.rank for r in self.ranks), default=-1) + 1

    def describe(self) -> str:
        ranks = f"{self.world_size} ranks" if self.world_size else f"at least {self.ranks_known} ranks"
        return f"{ranks}{', ' + self.framework if self.framework else ''}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeChoice:
    """Which step a relaunch of a run on this node would load, from where, and why not newer ones."""

    step: Optional[int]
    trust: str  # "latest" or "recovery_verified"
    reason: str
    sources: Dict[int, str] = field(default_factory=dict)  # owner rank -> where its state would come from
    newer: Tuple[Tuple[int, str], ...] = ()  # (step, why it is not chosen), newest first


@dataclass(frozen=True, kw_only=True, slots=True)
class Inventory:
    """Every run found under one disk folder (and its shared-memory state), plus shared-memory
    namespaces that belong to no run of this folder."""

    disk_folder: str
    shared_memory_dir: str
    runs: Tuple[RunView, ...]
    other_shared: Tuple[RunView, ...]
    problems: Tuple[str, ...] = ()

    def matching(self, run_id: str, world_size: Optional[int] = None) -> List[RunView]:
        return [run for run in self.runs if run.run_id == run_id
                and (world_size is None or run.world_size in (None, world_size))]


def scan(disk_folder: str, shared_memory_dir: Optional[str] = None) -> Inventory:
    """Read what GEMINI keeps under `disk_folder` and `shared_memory_dir` (default
    /dev/shm/lm-resiliency-<uid>); nothing is created, changed or loaded."""
    folder = os.path.abspath(disk_folder)
    shm_root = os.path.abspath(shared_memory_dir or default_shared_memory_dir())
    problems: List[str] = []
    names = _private_entries(folder, _DISK_NAMESPACE_RE, problems)
    shm_names = set(_private_entries(shm_root, NAMESPACE_RE, problems))
    runs = []
    for name in names:
        shm_name = shared_namespace_of(name, folder)
        shm_names.discard(shm_name)
        runs.append(_run(name, os.path.join(folder, name), os.path.join(shm_root, shm_name)))
    others = [_run(name, None, os.path.join(shm_root, name)) for name in sorted(shm_names)]
    runs.sort(key=lambda r: (-r.last_written, r.namespace))
    return Inventory(disk_folder=folder, shared_memory_dir=shm_root, runs=tuple(runs),
                     other_shared=tuple(o for o in others if o.ranks), problems=tuple(problems))


def _private_entries(root: str, pattern: "re.Pattern[str]", problems: List[str]) -> List[str]:
    if not os.path.lexists(root):
        return []
    if os.path.islink(root) or not os.path.isdir(root):
        problems.append(f"{root}: not a directory (or a symbolic link); not read")
        return []
    try:
        return sorted(e.name for e in os.scandir(root) if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    except OSError as exc:
        problems.append(f"{root}: cannot list it: {exc}")
        return []


def _run(namespace: str, directory: Optional[str], shm_directory: str) -> RunView:
    ranks: Dict[int, Dict[str, Any]] = {}
    identity: Dict[str, Any] = {"run_id": None, "topology": None, "world_size": None, "framework": None,
                                "jump": None, "starts": 0}
    problems: List[str] = []
    newest = 0.0
    for rank, path in _rank_dirs(directory, _DISK_RANK_RE):
        view = ranks.setdefault(rank, _blank(rank))
        view["directory"] = path
        try:
            newest = max(newest, _read_disk_rank(rank, path, view, identity))
        except OSError as exc:
            view["problems"].append(f"{path}: cannot read it: {exc}")
    if os.path.isdir(shm_directory) and not os.path.islink(shm_directory):
        for rank, path in _rank_dirs(shm_directory, _SHM_RANK_RE):
            view = ranks.setdefault(rank, _blank(rank))
            newest = max(newest, _read_shm_rank(rank, path, view, identity))
    for view in ranks.values():
        problems += [f"rank {view['rank']}: {p}" for p in view["problems"]]
        identity["starts"] = max(identity["starts"], view["starts"])
    rank_views = tuple(RankView(rank=v["rank"], directory=v["directory"], copies=tuple(sorted(
        v["copies"], key=lambda c: (-c.step, c.owner_rank, c.tier))), disk_bytes=v["disk_bytes"],
        verified_steps=v["verified_steps"], sdc_pending=v["sdc_pending"], shm_directory=v["shm_directory"],
        shm_owner_pid=v["shm_owner_pid"], shm_owner_alive=v["shm_owner_alive"], problems=tuple(v["problems"]))
        for _, v in sorted(ranks.items()))
    return RunView(namespace=namespace, directory=directory,
                   shm_directory=shm_directory if os.path.isdir(shm_directory) else None, last_written=newest,
                   ranks=rank_views, problems=tuple(problems), **identity)


def _blank(rank: int) -> Dict[str, Any]:
    return {"rank": rank, "directory": None, "copies": [], "disk_bytes": 0, "verified_steps": (),
            "sdc_pending": False, "shm_directory": None, "shm_owner_pid": None, "shm_owner_alive": None,
            "problems": [], "starts": 0}


def _rank_dirs(directory: Optional[str], pattern: "re.Pattern[str]") -> List[Tuple[int, str]]:
    if directory is None:
        return []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return []
    return [(int(m.group(1)), e.path) for e in entries
            if (m := pattern.fullmatch(e.name)) and e.is_dir(follow_symlinks=False)]


def _note_identity(identity: Dict[str, Any], run_id: Any, topology: Any) -> None:
    if identity["run_id"] is None and isinstance(run_id, str):
        identity["run_id"] = run_id
    if identity["topology"] is None and isinstance(topology, str):
        identity["topology"] = topology


def _read_disk_rank(rank: int, path: str, view: Dict[str, Any], identity: Dict[str, Any]) -> float:
    newest = os.lstat(path).st_mtime
    for entry in os.scandir(path):
        if not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        view["disk_bytes"] += st.st_size
        newest = max(newest, st.st_mtime)
        key = shard_key_of(entry.name, rank)
        if key is not None:
            view["copies"].append(Copy(owner_rank=key.owner_rank, holder_rank=rank, step=key.step, tier=DISK,
                                       nbytes=st.st_size, written_at=st.st_mtime))
    try:
        doc = read_status_document(os.path.join(path, "status.json"))
        if doc is not None:
            _note_identity(identity, doc["run_id"], doc["topology"])
            if "trust" in doc["status"]:
                trust = parse_trust(doc["status"]["trust"])
                view["verified_steps"] = tuple(e["step"] for e in trust["verified_history"])
                view["sdc_pending"] = trust["sdc_pending"]
    except (StatusRejected, CertificationError, OSError) as exc:
        view["problems"].append(str(exc))
    try:
        events = read_events(path)
    except (EventLogRejected, OSError) as exc:
        view["problems"].append(str(exc))
        return newest
    if events.refused_lines:
        view["problems"].append(f"{events.refused_lines} event log line(s) refused (torn or not an event)")
    for event in events.events:
        _note_identity(identity, event["run_id"], event.get("topology"))
        if event["event"] == "start":
            view["starts"] += 1
            identity["world_size"] = event["world_size"]
            identity["framework"] = event.get("framework") if isinstance(event.get("framework"), str) else None
            identity["jump"] = event.get("jump") if isinstance(event.get("jump"), int) else None
    return newest


def _read_shm_rank(rank: int, path: str, view: Dict[str, Any], identity: Dict[str, Any]) -> float:
    view["shm_directory"] = path
    match = _SHM_RANK_RE.fullmatch(os.path.basename(path))
    foreign = match is not None and match.group("scope") != temp_scope()
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        view["problems"].append(f"{path}: cannot open it: {exc}")
        return 0.0
    newest = 0.0
    try:
        uid = os.geteuid()
        owner = read_owner(fd, path, uid)
        if owner is not None:
            view["shm_owner_pid"] = owner["pid"]
            view["shm_owner_alive"] = not foreign and process_alive(owner["pid"], owner["start_time"])
        if foreign:
            view["problems"].append(f"{path}: written in another boot or PID namespace; a relaunch here does not "
                                    "adopt it")
            return os.fstat(fd).st_mtime
        for slot in SLOT_NAMES:
            try:
                doc = read_sidecar(fd, f"{slot}.json", path, uid)
            except (SegmentRejected, OSError) as exc:
                view["problems"].append(str(exc))
                continue
            if doc is None:
                continue
            _note_identity(identity, doc["run_id"], doc["topology"])
            written = os.stat(f"{slot}.json", dir_fd=fd, follow_symlinks=False).st_mtime
            newest = max(newest, written)
            view["copies"].append(Copy(owner_rank=doc["owner_rank"], holder_rank=doc["holder_rank"], step=doc["step"],
                                       tier=SHARED, nbytes=doc["segment"]["size"], written_at=written,
                                       lineage=timeline.lineage_of(doc["extra"])))
    finally:
        os.close(fd)
    return newest


# ---------------------------------------------------------------------------- the resume choice


def resume_choice(run: RunView) -> ResumeChoice:
    """The step a relaunch of `run` (same run id and topology) on this node would resume from."""
    world = run.ranks_known
    by_rank = {r.rank: r for r in run.ranks}
    if world == 0:
        return ResumeChoice(step=None, trust="latest", reason="no rank left any state here")
    usable = {r.rank: [c for c in r.copies if c.tier == DISK or r.shm_owner_alive is False] for r in run.ranks}
    reports = []
    for rank in range(world):
        own = [_entry(c) for c in usable.get(rank, []) if c.owner_rank == rank]
        held: Dict[str, list] = {}
        for c in usable.get(rank, []):
            if c.owner_rank != rank:
                held.setdefault(str(c.owner_rank), []).append(_entry(c))
        reports.append({"own": own, "held": held})
    verified_only = any(r.sdc_pending for r in run.ranks)
    allowed = None
    if verified_only:
        sets = [set(r.verified_steps) for r in run.ranks if r.directory is not None]
        allowed = set.intersection(*sets) if sets else set()
    plan = choose_plan(reports, allowed_steps=allowed)
    trust = "recovery_verified" if verified_only else "latest"
    all_steps = sorted({c.step for cs in usable.values() for c in cs}, reverse=True)
    chosen = plan.step if plan is not None else None
    newer = tuple((step, _why_not(step, reports, allowed, by_rank))
                  for step in all_steps if chosen is None or step > chosen)
    if plan is None:
        reason = ("no step that every rank can load" if all_steps else "no captured state")
        return ResumeChoice(step=None, trust=trust, reason=reason, newer=newer)
    sources = {owner: _source(owner, holder, plan.step, usable) for owner, holder in sorted(plan.sources.items())}
    reason = (f"the newest RECOVERY_VERIFIED step every rank holds (SCOUT found SDC; "
              f"verified steps {sorted(allowed or (), reverse=True)})" if verified_only
              else "the newest step every rank can load")
    return ResumeChoice(step=plan.step, trust=trust, reason=reason, sources=sources, newer=newer)


def _entry(copy: Copy) -> Any:
    return [copy.step, copy.lineage] if copy.lineage is not None else copy.step


def _why_not(step: int, reports: List[dict], allowed: Optional[Iterable[int]], by_rank: Dict[int, RankView]) -> str:
    if allowed is not None and step not in set(allowed):
        return "not RECOVERY_VERIFIED on every rank (SCOUT found SDC; only verified steps may be loaded)"
    missing = missing_owners(reports, step)
    if not missing:
        return "every rank has a copy, but not on one timeline"
    absent = [r for r in missing if r not in by_rank]
    text = f"no copy of {_ranks(missing)}'s state at this step (neither its own nor its peer's replica)"
    if absent:
        text += f"; {_ranks(absent)} left nothing on this node"
    return text


def _ranks(ranks: List[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _source(owner: int, holder: int, step: int, usable: Dict[int, List[Copy]]) -> str:
    def tiers(rank: int) -> set:
        return {c.tier for c in usable.get(rank, []) if c.owner_rank == owner and c.step == step}

    if SHARED in tiers(owner):
        return "its shared memory"
    if holder != owner and SHARED in tiers(holder):
        return f"rank {holder}'s shared memory (replica)"
    if DISK in tiers(owner):
        return "its node-local disk"
    return f"rank {holder}'s node-local disk (replica)"


# ------------------------------------------------------------------------------ session hints


def fresh_start_hint(disk_folder: str, shared_memory_dir: Optional[str], *, run_id: str, topology: str,
                     world_size: int, framework: str, stable: bool) -> str:
    """Why a start that found no state of its own run may have missed some: the same run's state
    for another topology, or (a run id new for this launch) another run's state that could be
    resumed. "" when there is nothing to say."""
    inventory = scan(disk_folder, shared_memory_dir)
    hints = []
    for run in inventory.runs:
        if run.run_id != run_id or run.topology == topology or run.newest_step is None:
            continue
        step = newest_resumable_step(run)
        if run.world_size is not None and run.world_size != world_size:
            hints.append(f"state of run {run_id!r} exists for another topology ({run.world_size} ranks, step {step}) "
                         f"and cannot be loaded by {world_size} ranks")
        else:
            hints.append(f"state of run {run_id!r} exists for another topology ({run.describe()}, step {step}) and "
                         f"cannot be loaded by this one ({world_size} ranks, {framework})")
    if not stable:
        for run in inventory.runs:
            if run.run_id in (None, run_id) or run.newest_step is None or run.world_size not in (None, world_size):
                continue
            hints.append(f"this folder holds run {run.run_id!r}'s state (newest step {newest_resumable_step(run)}); "
                         f"pass run_id={run.run_id!r} to resume it")
    return "; ".join(hints[:3])


def newest_resumable_step(run: RunView) -> int:
    """The step a relaunch of `run` would resume from, else its newest copy's step (0: none)."""
    choice = resume_choice(run)
    return choice.step if choice.step is not None else run.newest_step or 0


def age_text(written_at: float, now: Optional[float] = None) -> str:
    """'42 s', '7 min', '3.2 h', '2.0 d' ago."""
    age = max(0.0, (time.time() if now is None else now) - written_at)
    if age < 120:
        return f"{age:.0f} s"
    if age < 7200:
        return f"{age / 60:.0f} min"
    if age < 172800:
        return f"{age / 3600:.1f} h"
    return f"{age / 86400:.1f} d"
