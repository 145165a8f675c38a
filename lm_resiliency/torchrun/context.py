"""The restart context: a node-local, owner-only directory that the torchrun agent and its
workers share, and `context.json` in it: who one worker generation is (run, launch, node,
generation, slot, topology) and which checkpoint step it must load. The agent writes it before it
starts the generation's workers and exports what they check it against (the launch, node and
generation, and a digest of the exact bytes) in the environment they inherit, so a worker never
trusts the file alone. Every record here is read through the record layer (files.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from lm_resiliency.files import (PRIVATE, RecordRejected, RecordSchema, array, atomic_write, check_private_dir,
                                 check_record, encode_record, ensure_private_dir, integer, nullable, parse_record,
                                 read_file_bytes, text)

# What the agent hands its workers (they inherit its environment).
CONTEXT_ENV = "LM_RESILIENCY_TORCHRUN_CONTEXT"
POLICY_ENV = "LM_RESILIENCY_TORCHRUN_POLICY"
POLICY_DIGEST_ENV = "LM_RESILIENCY_TORCHRUN_POLICY_DIGEST"
LAUNCH_ENV = "LM_RESILIENCY_TORCHRUN_LAUNCH_ID"
NODE_ENV = "LM_RESILIENCY_TORCHRUN_NODE_ID"
GENERATION_ENV = "LM_RESILIENCY_TORCHRUN_GENERATION"
CONTEXT_DIGEST_ENV = "LM_RESILIENCY_TORCHRUN_CONTEXT_DIGEST"
CONTEXT_SCHEMA = "lm-resiliency-torchrun-context/3"
CONTEXT_DIR = "restart-context directory"
# What a generation's checkpoint step was selected from (GEMINI guide, recovery trust).
TRUST_LATEST = "latest"
TRUST_VERIFIED = "recovery_verified"
SOURCES = ("none", "gemini")
DECISIONS = ("fresh", "same-node restart", "replacement")
MAX_STEPS_LISTED = 1024

ID = text(max_length=64)
RUN_ID = text(max_length=1024)
STEPS = array(integer(0), max_length=MAX_STEPS_LISTED)

CONTEXT_RECORD = RecordSchema(what="restart context", identity=("schema", CONTEXT_SCHEMA), fields={
    "run_id": RUN_ID, "launch_id": ID, "node_id": ID, "generation": integer(0), "slot": integer(0),
    "nodes": integer(1), "nproc_per_node": nullable(integer(1)), "topology_digest": ID,
    "policy_digest": nullable(ID), "checkpoint_step": integer(0), "checkpoint_source": text(choices=SOURCES),
    "decision": text(choices=DECISIONS), "trust": text(choices=(TRUST_LATEST, TRUST_VERIFIED)),
    "reason": text(nonempty=False, max_length=16384), "refused_steps": STEPS})


def topology_digest(run_id: str, nodes: int) -> str:
    """The digest of the node-level topology a generation runs on (run identity and width)."""
    text = json.dumps({"run_id": run_id, "nodes": nodes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ContextError(RecordRejected):
    """The restart context or a record beside it is missing, unsafe, corrupt, or of another run,
    launch, node, generation or topology."""


def ensure_context_dir(directory: str) -> None:
    """The restart-context directory, created owner-only, or an existing one only when it is safe."""
    ensure_private_dir(directory, CONTEXT_DIR, error=ContextError)


def check_context_dir(directory: str) -> None:
    """Before trusting anything inside: the directory is still this user's and owner-only."""
    check_private_dir(directory, CONTEXT_DIR, error=ContextError)


@dataclass(frozen=True, kw_only=True, slots=True)
class RestartContext:
    """What one worker generation runs as (written by the agent, read by the worker bootstrap)."""

    run_id: str
    """The run (`--rdzv-id`)."""
    launch_id: str
    """The launch of the run the agents agreed on (new for every torchrun launch)."""
    node_id: str
    """The hashed node identity of the agent that wrote it."""
    generation: int
    """The rendezvous round (restarts at 0 in every launch)."""
    slot: int
    """This node's slot (torchrun's GROUP_RANK) in the round."""
    nodes: int
    """How many nodes train in the round."""
    nproc_per_node: Optional[int]
    """The agent's --nproc-per-node (LOCAL_WORLD_SIZE); None when the agent could not learn it."""
    topology_digest: str
    """`topology_digest(run_id, nodes)`."""
    policy_digest: Optional[str]
    """SHA-256 of the worker policy bytes agreed at rendezvous (None: no policy)."""
    checkpoint_step: int
    """The step to load exactly (0 with source "none")."""
    checkpoint_source: str
    """"none" (start fresh) or "gemini"."""
    decision: str
    """This node's part: "fresh", "same-node restart" or "replacement"."""
    trust: str = TRUST_LATEST
    """"latest" capture, or "recovery_verified" (after SDC or a hang SCOUT localized)."""
    reason: str = ""
    """Why this step, in words (which fault, which slot retired, who selected it, what was ignored)."""
    refused_steps: Tuple[int, ...] = ()
    """Steps an earlier generation of this run was told to load and could not: never selected again
    until a new capture is recorded."""

    def to_json(self) -> Dict[str, Any]:
        return dict(dataclasses.asdict(self), refused_steps=list(self.refused_steps), schema=CONTEXT_SCHEMA)

    @classmethod
    def from_json(cls, data: Any, where: str) -> "RestartContext":
        doc = check_record(data, CONTEXT_RECORD, where, error=ContextError)
        if doc["slot"] >= doc["nodes"]:
            raise ContextError(f"{where}: slot {doc['slot']} is not below nodes {doc['nodes']}")
        if doc["checkpoint_source"] == "none" and doc["checkpoint_step"] != 0:
            raise ContextError(f"{where}: checkpoint_source 'none' (fresh) with checkpoint_step "
                               f"{doc['checkpoint_step']}")
        values = {k: v for k, v in doc.items() if k != "schema"}
        return cls(**dict(values, refused_steps=tuple(values["refused_steps"])))


def context_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_context(path: str, context: RestartContext) -> str:
    """Publish `context` at `path` (0600, atomic); the digest of the bytes written."""
    data = encode_record(context.to_json(), CONTEXT_RECORD)
    atomic_write(path, data)
    return context_digest(data)


def read_context(path: str) -> Tuple[RestartContext, str]:
    """The context at `path` and the digest of its bytes, after the file checks (a regular file
    this user owns with no group/other access, never through a link)."""
    data = read_file_bytes(path, "restart context", max_bytes=CONTEXT_RECORD.max_bytes, trust=PRIVATE,
                           error=ContextError)
    if data is None:
        raise ContextError(f"{path}: the restart context does not exist (the agent writes it before it starts "
                           "the workers)")
    doc = parse_record(data, CONTEXT_RECORD, path, error=ContextError)
    return RestartContext.from_json(doc, path), context_digest(data)


def context_environment(context: RestartContext, digest: str) -> Mapping[str, str]:
    """What the agent exports for the generation's workers to check the file against."""
    return {LAUNCH_ENV: context.launch_id, NODE_ENV: context.node_id, GENERATION_ENV: str(context.generation),
            CONTEXT_DIGEST_ENV: digest}


def checked_context(path: str, env: Mapping[str, str]) -> RestartContext:
    """The worker's side: the context at `path` only when its directory and file are safe and it is
    exactly what this worker's agent wrote for this worker's run, launch, node, generation, slot and
    topology (from the environment torchrun and the agent gave the worker). ContextError otherwise."""
    check_context_dir(os.path.dirname(os.path.abspath(path)))
    context, digest = read_context(path)
    expected = {"run_id": env.get("TORCHELASTIC_RUN_ID"), "launch_id": env.get(LAUNCH_ENV),
                "node_id": env.get(NODE_ENV), "generation": env.get(GENERATION_ENV)}
    names = {"run_id": "TORCHELASTIC_RUN_ID", "launch_id": LAUNCH_ENV, "node_id": NODE_ENV,
             "generation": GENERATION_ENV}
    for field, value in expected.items():
        if value is None:
            raise ContextError(f"{names[field]} is not set: this worker was not started by an lm_resiliency "
                               "rendezvous agent of this version")
        held = getattr(context, field)
        if str(held) != value:
            raise ContextError(f"restart context {path} is for {field.replace('_', ' ')} {held!r}, but this worker "
                               f"belongs to {value!r} ({names[field]}): a stale or copied context; not using it")
    if context.topology_digest != topology_digest(context.run_id, context.nodes):
        raise ContextError(f"restart context {path}: topology digest does not match its run and width")
    if env.get(CONTEXT_DIGEST_ENV) != digest:
        raise ContextError(f"restart context {path} is not the one the agent wrote for generation "
                           f"{context.generation} (its bytes changed since: digest {digest[:12]}, the agent's "
                           f"{str(env.get(CONTEXT_DIGEST_ENV))[:12]}); not using it")
    return context
