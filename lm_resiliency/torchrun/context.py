"""The restart context: a node-local, owner-only directory that the torchrun agent and its
workers share. The agent writes `context.json` (who this generation is and which checkpoint step
it must load) before it starts workers; each worker writes `worker-<local rank>.json` (the newest
step it has captured completely) while it trains. Everything is schema-checked JSON written by
atomic rename; anything else fails closed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from lm_resiliency._values import is_int
from lm_resiliency.files import atomic_write, loads_strict_json

# What the agent hands its workers (they inherit its environment).
CONTEXT_ENV = "LM_RESILIENCY_TORCHRUN_CONTEXT"
POLICY_ENV = "LM_RESILIENCY_TORCHRUN_POLICY"
POLICY_DIGEST_ENV = "LM_RESILIENCY_TORCHRUN_POLICY_DIGEST"
CONTEXT_SCHEMA = "lm-resiliency-torchrun-context/2"
RECORD_SCHEMA = "lm-resiliency-torchrun-worker/2"
# What a generation's checkpoint step was selected from (GEMINI guide, recovery trust).
TRUST_LATEST = "latest"
TRUST_VERIFIED = "recovery_verified"
_MAX_BYTES = 64 * 1024


def topology_digest(run_id: str, nodes: int) -> str:
    """The digest of the node-level topology a generation runs on (run identity and width)."""
    text = json.dumps({"run_id": run_id, "nodes": nodes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ContextError(RuntimeError):
    """The restart context is missing, unsafe, corrupt or from another run/topology."""


def ensure_private_dir(directory: str) -> None:
    """Create `directory` owner-only (0700), or accept an existing one only when this user owns it
    and neither group nor others have any access. Never changes existing permissions."""
    try:
        os.makedirs(directory, mode=0o700, exist_ok=False)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ContextError(f"cannot create the restart-context directory {directory}: {exc.strerror or exc}") from None
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise ContextError(f"restart-context directory {directory} is not a directory (a link or a file); "
                           "point lm_resiliency_restart_context_path into a directory this user owns")
    if info.st_uid != os.geteuid():
        raise ContextError(f"restart-context directory {directory} is owned by uid {info.st_uid}, not this user "
                           f"(uid {os.geteuid()}); refusing to use it. Use a directory this user owns")
    if info.st_mode & 0o077:
        raise ContextError(f"restart-context directory {directory} has mode {stat.S_IMODE(info.st_mode):04o}: "
                           "group/other access is not allowed. It is not changed for you; chmod 700 it or "
                           "use another directory")


@dataclass(frozen=True)
class RestartContext:
    """What one worker generation runs as (written by the agent, read by the worker bootstrap)."""

    run_id: str
    node_id: str
    generation: int
    slot: int
    nodes: int
    topology_digest: str
    policy_digest: Optional[str]
    checkpoint_step: int
    checkpoint_source: str  # "none" (start fresh) or "gemini"
    decision: str  # this node's part: "fresh", "same-node restart", "replacement"
    # "latest" capture, or "recovery_verified" (after SDC or a hang SCOUT localized); and why this
    # step, in words (which fault, which slot retired, who selected it).
    trust: str = dataclasses.field(default=TRUST_LATEST, kw_only=True)
    reason: str = dataclasses.field(default="", kw_only=True)

    def to_json(self) -> Dict[str, Any]:
        return dict(dataclasses.asdict(self), schema=CONTEXT_SCHEMA)

    @classmethod
    def from_json(cls, data: Any, where: str) -> "RestartContext":
        if not isinstance(data, dict) or data.get("schema") != CONTEXT_SCHEMA:
            raise ContextError(f"{where}: not a restart context (schema {CONTEXT_SCHEMA})")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) - {"schema"} != names:
            raise ContextError(f"{where}: fields {sorted(set(data) - {'schema'})} differ from {sorted(names)}")
        for name in ("generation", "slot", "nodes", "checkpoint_step"):
            if not is_int(data[name]) or data[name] < 0:
                raise ContextError(f"{where}: {name} must be a non-negative integer, got {data[name]!r}")
        for name in ("run_id", "node_id", "topology_digest", "checkpoint_source", "decision"):
            if not isinstance(data[name], str) or not data[name]:
                raise ContextError(f"{where}: {name} must be a non-empty string")
        if not isinstance(data["reason"], str):
            raise ContextError(f"{where}: reason must be a string")
        if data["checkpoint_source"] not in ("none", "gemini"):
            raise ContextError(f"{where}: checkpoint_source must be 'none' or 'gemini'")
        if data["trust"] not in (TRUST_LATEST, TRUST_VERIFIED):
            raise ContextError(f"{where}: trust must be {TRUST_LATEST!r} or {TRUST_VERIFIED!r}")
        return cls(**{name: data[name] for name in names})


def read_json(path: str) -> Any:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ContextError(f"{path}: not a regular file")
        data = f.read(_MAX_BYTES + 1)
    if len(data) > _MAX_BYTES:
        raise ContextError(f"{path}: larger than {_MAX_BYTES} bytes")
    try:
        return loads_strict_json(data.decode("utf-8"))
    except ValueError as exc:
        raise ContextError(f"{path}: not valid JSON: {exc}") from None


def write_context(path: str, context: RestartContext) -> None:
    atomic_write(path, encode_json(context.to_json()))


def read_context(path: str) -> RestartContext:
    try:
        return RestartContext.from_json(read_json(path), path)
    except OSError as exc:
        raise ContextError(f"cannot read the restart context {path}: {exc.strerror or exc}") from None


def encode_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode("utf-8")


def record_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"worker-{local_rank}.json")


def write_worker_record(directory: str, local_rank: int, run_id: str, step: int, local_world_size: int,
                        verified_step: int) -> None:
    """A worker's newest completely captured step and newest RECOVERY_VERIFIED step (-1: none),
    the agent's input for the next generation."""
    atomic_write(record_path(directory, local_rank),
                 encode_json({"schema": RECORD_SCHEMA, "run_id": run_id, "step": step,
                          "local_world_size": local_world_size, "verified_step": verified_step}))


@dataclass(frozen=True)
class NodeSteps:
    """What a node's workers recorded: the newest step all of them captured, and the newest
    RECOVERY_VERIFIED step all of them hold (-1: some worker knows none)."""

    latest: int
    verified: int


def read_worker_steps(directory: str, run_id: str) -> List[NodeSteps]:
    """Every worker record of `run_id` in `directory` (empty: none yet). A record of another run
    is ignored; a corrupt one fails closed."""
    records = []
    for name in sorted(os.listdir(directory)):
        if not (name.startswith("worker-") and name.endswith(".json")):
            continue
        path = os.path.join(directory, name)
        data = read_json(path)
        if not isinstance(data, dict) or data.get("schema") != RECORD_SCHEMA or set(data) != {
                "schema", "run_id", "step", "local_world_size", "verified_step"}:
            raise ContextError(f"{path}: not a worker record ({RECORD_SCHEMA})")
        if data["run_id"] != run_id:
            continue
        if not is_int(data["step"]) or data["step"] < 0:
            raise ContextError(f"{path}: step must be a non-negative integer")
        if not is_int(data["verified_step"]) or data["verified_step"] < -1:
            raise ContextError(f"{path}: verified_step must be -1 (none) or a non-negative step")
        records.append(NodeSteps(data["step"], data["verified_step"]))
    return records


def node_steps(directory: str, run_id: str) -> Optional[NodeSteps]:
    """The newest steps every local worker of `run_id` recorded (min over records), or None."""
    records = read_worker_steps(directory, run_id)
    if not records:
        return None
    return NodeSteps(min(r.latest for r in records), min(r.verified for r in records))
