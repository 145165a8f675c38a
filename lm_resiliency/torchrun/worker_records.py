"""Worker records: `worker-<local rank>.json` in the restart-context directory, each worker's
newest completely captured step and newest RECOVERY_VERIFIED step, bound to the run, launch,
generation, node and topology it was written in. The agent's input for the next generation.

A record of the running launch from an earlier generation is what the node holds now. A record of
an earlier launch of the same run on this node, with the same topology, is where a relaunch (a
requeued job) resumes from; the agent can check that only when it knows its own
--nproc-per-node. Every other record is ignored with a line naming the file and why. A worker that
could not load the step its generation selected rewrites its record with what every rank can load
(`refused_steps`: the steps generations could not load since the last capture), so no selection
repeats a step that failed."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from lm_resiliency.files import (PRIVATE, RecordRejected, RecordSchema, atomic_write, encode_record, integer,
                                 read_record)
from lm_resiliency.torchrun.binding import RoundBinding, foreign
from lm_resiliency.torchrun.context import ID, RUN_ID, STEPS

RECORD_SCHEMA = "lm-resiliency-torchrun-worker/3"
_NAME = re.compile(r"worker-(\d{1,6})\.json")

WORKER_RECORD = RecordSchema(what="worker record", identity=("schema", RECORD_SCHEMA), fields={
    "run_id": RUN_ID, "launch_id": ID, "node_id": ID, "generation": integer(0), "slot": integer(0),
    "nodes": integer(1), "local_rank": integer(0), "local_world_size": integer(1), "world_size": integer(1),
    "step": integer(-1), "verified_step": integer(-1), "refused_steps": STEPS})


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerRecord:
    """What one worker recorded, and the generation and topology it recorded it in."""

    binding: RoundBinding
    """The worker's run, launch, node, generation, node count and LOCAL_WORLD_SIZE."""
    slot: int
    local_rank: int
    step: int
    """Newest step captured completely (-1: none it can load)."""
    verified_step: int
    """Newest RECOVERY_VERIFIED step (-1: none)."""
    refused_steps: Tuple[int, ...] = ()
    """Steps generations were told to load and could not, since this worker's last capture."""

    def to_json(self) -> dict:
        b = self.binding
        lws = b.nproc_per_node or 1
        return {"schema": RECORD_SCHEMA, "run_id": b.run_id, "launch_id": b.launch_id, "node_id": b.node_id,
                "generation": b.generation, "slot": self.slot, "nodes": b.nodes, "local_rank": self.local_rank,
                "local_world_size": lws, "world_size": b.nodes * lws, "step": self.step,
                "verified_step": self.verified_step, "refused_steps": sorted(set(self.refused_steps))}


def record_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"worker-{local_rank}.json")


def write_worker_record(directory: str, record: WorkerRecord) -> None:
    atomic_write(record_path(directory, record.local_rank), encode_record(record.to_json(), WORKER_RECORD))


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSteps:
    """What a node's workers recorded: the newest step all of them captured, the newest
    RECOVERY_VERIFIED step all of them hold (-1: some worker knows none), the steps generations
    could not load, and each record ignored, with why."""

    latest: int
    verified: int
    refused: Tuple[int, ...] = ()
    ignored: Tuple[str, ...] = ()
    inherited_from: Optional[str] = None
    """The earlier launch whose records these are (a relaunch resuming), or None."""


def _stale(doc: dict, binding: RoundBinding, local_rank: int) -> Optional[str]:
    why = foreign(doc, binding)
    if why is not None:
        return why
    if doc["local_rank"] != local_rank:
        return f"it names local rank {doc['local_rank']}"
    if doc["world_size"] != doc["nodes"] * doc["local_world_size"] or doc["local_rank"] >= doc["local_world_size"]:
        return (f"its topology is inconsistent (world size {doc['world_size']}, {doc['nodes']} nodes x "
                f"{doc['local_world_size']}, local rank {doc['local_rank']})")
    if binding.nodes and doc["nodes"] != binding.nodes:
        return f"it was recorded with {doc['nodes']} nodes; this round has {binding.nodes}"
    lws = binding.nproc_per_node
    if lws is not None and doc["local_world_size"] != lws:
        return (f"it was recorded with LOCAL_WORLD_SIZE {doc['local_world_size']} (--nproc-per-node); this launch "
                f"runs {lws}")
    if lws is not None and local_rank >= lws:
        return f"local rank {local_rank} does not exist with --nproc-per-node {lws}"
    if doc["launch_id"] == binding.launch_id:
        if doc["generation"] >= binding.generation:
            return (f"it claims generation {doc['generation']} of this launch, which has not run yet (this round is "
                    f"{binding.generation})")
        return None
    if lws is None:
        return (f"it was left by launch {doc['launch_id'][:12]}, and this agent could not learn its own "
                "--nproc-per-node to check that launch's topology")
    return None


def node_steps(directory: str, binding: RoundBinding) -> NodeSteps:
    """The newest steps every local worker recorded for `binding` (min over the records that are
    bound to it), or latest -1 when none is."""
    accepted: List[dict] = []
    ignored: List[str] = []
    for name in sorted(os.listdir(directory)):
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        try:
            doc = read_record(path, WORKER_RECORD, trust=PRIVATE)
        except RecordRejected as exc:
            ignored.append(f"worker record {exc}")
            continue
        if doc is None:  # removed since the listing
            continue
        why = _stale(doc, binding, int(match.group(1)))
        if why is not None:
            ignored.append(f"worker record {path}: {why}")
            continue
        accepted.append(doc)
    if not accepted:
        return NodeSteps(latest=-1, verified=-1, ignored=tuple(ignored))
    launches = {doc["launch_id"] for doc in accepted}
    earlier = sorted(launches - {binding.launch_id})
    return NodeSteps(latest=min(d["step"] for d in accepted), verified=min(d["verified_step"] for d in accepted),
                     refused=tuple(sorted({s for d in accepted for s in d["refused_steps"]})), ignored=tuple(ignored),
                     inherited_from=", ".join(e[:12] for e in earlier) if earlier else None)
