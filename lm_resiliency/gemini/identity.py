"""Run identity and the job-wide topology fingerprint, both agreed by every rank.

The run id binds GEMINI state (shared-memory slots, node-local files) to one training run: a
relaunch recovers only state of the same run id. It comes from, in order, `config.run_id`,
LM_RESILIENCY_RUN_ID, or torchrun's TORCHELASTIC_RUN_ID; placeholder values (`none`, which
torchrun exports when no `--rdzv-id` is given, or blank) are not an identity. Without any, rank 0
draws a fresh id: state of this launch can then never be found by a relaunch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch.distributed as dist

from lm_resiliency import wire
from lm_resiliency.config import RUN_ID_ENV, env_run_id
from lm_resiliency.errors import ResiliencyError

logger = logging.getLogger(__name__)

ELASTIC_RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
PLACEHOLDER_RUN_IDS = ("none",)
FIX = ("set InMemoryCkptConfig(run_id=...) (ResiliencyCallback(run_id=...)), or LM_RESILIENCY_RUN_ID, to the "
       "same value on every launch of this training run, or launch with torchrun --rdzv-id=<job id>")

_warned_placeholders: set = set()


class IdentityMismatch(ResiliencyError, RuntimeError):
    """Ranks disagree on the run identity; nothing is loaded or written."""


@dataclass(frozen=True)
class RunIdentity:
    """The agreed run id, where it came from, and whether a relaunch will see it again.

    `source` is "config", "LM_RESILIENCY_RUN_ID", "TORCHELASTIC_RUN_ID" or "generated".
    `stable` is False for a generated id and for a torchrun id that looks drawn per launch
    (torchrun --standalone, or a single-node launch without --rdzv-id): such an id survives
    torchrun's own restarts (--max-restarts) but not a new torchrun command."""

    run_id: str
    source: str
    stable: bool


def is_placeholder(value: Optional[str]) -> bool:
    """True for values that name no run: None, blank, or `none` in any case."""
    return value is None or value.strip() == "" or value.strip().lower() in PLACEHOLDER_RUN_IDS


def _is_launch_uuid(value: str) -> bool:
    """torchrun --standalone (and a single-node static launch without --master-port) passes
    `str(uuid.uuid4())`, new for every torchrun command."""
    try:
        parsed = uuid.UUID(value)
    except ValueError:
        return False
    return parsed.version == 4 and str(parsed) == value


def local_run_id(configured: Optional[str]) -> Tuple[Optional[str], str, List[str]]:
    """(run id or None, its source, placeholder values that were skipped) from this process's
    configuration and environment."""
    skipped = []
    for source, value in (("config", configured), (RUN_ID_ENV, env_run_id()),
                          (ELASTIC_RUN_ID_ENV, os.environ.get(ELASTIC_RUN_ID_ENV))):
        if value is None:
            continue
        if is_placeholder(value):
            skipped.append(f"{source}={value!r}")
            continue
        return value, source, skipped
    return None, "generated", skipped


def resolve_identity(configured: Optional[str], group: Optional[dist.ProcessGroup] = None) -> RunIdentity:
    """The run identity every rank agrees on (one all-gather; a broadcast when nobody has one).
    Raises IdentityMismatch when ranks were given different ids. Rank 0 of `group` warns when the
    id will not be found by a relaunch."""
    run_id, source, skipped = local_run_id(configured)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if dist.is_initialized():
        ids = wire.all_gather_json([run_id, source], group)
        values = [i for i, _ in ids]
        if len(set(values)) != 1:
            raise IdentityMismatch(
                f"ranks disagree on the GEMINI run id: {sorted(set(map(str, values)))}. Set the same "
                "InMemoryCkptConfig.run_id (or LM_RESILIENCY_RUN_ID) on every rank.")
        if run_id is None:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            run_id = wire.broadcast_json(uuid.uuid4().hex, src=src, group=group)
        source = ids[0][1]
    elif run_id is None:
        run_id = uuid.uuid4().hex
    stable = source != "generated" and not (source == ELASTIC_RUN_ID_ENV and _is_launch_uuid(run_id))
    identity = RunIdentity(run_id, source, stable)
    if rank == 0:
        _warn(identity, skipped)
    return identity


def _warn(identity: RunIdentity, skipped: List[str]) -> None:
    fresh = [s for s in skipped if s not in _warned_placeholders]
    if fresh:
        _warned_placeholders.update(fresh)
        logger.warning("lm-resiliency: ignoring placeholder run id %s: it names no run (torchrun exports "
                       "TORCHELASTIC_RUN_ID=none when no --rdzv-id is given), and two unrelated jobs would "
                       "share state under it", ", ".join(fresh))
    if identity.source == "generated":
        logger.warning("lm-resiliency: no run id is set, so this launch got the fresh run id %s: a relaunch "
                       "cannot find the GEMINI state it saves and will start from step 0. To resume after a "
                       "crash, %s.", identity.run_id, FIX)
    elif not identity.stable:
        logger.warning("lm-resiliency: the run id %s comes from TORCHELASTIC_RUN_ID, which torchrun draws anew "
                       "for every launch (--standalone, or no --rdzv-id): torchrun's own restarts "
                       "(--max-restarts) resume from it, a new torchrun command will not. To resume after a "
                       "relaunch, %s.", identity.run_id, FIX)
    else:
        logger.info("lm-resiliency: run id %r (from %s)", identity.run_id, identity.source)


def topology_fingerprint(descriptor: dict, group: Optional[dist.ProcessGroup] = None) -> str:
    """sha256 over every rank's descriptor in rank order (ranks, pairing, mesh shape...)."""
    per_rank = wire.all_gather_json(descriptor, group)
    digest = hashlib.sha256()
    for item in per_rank:
        digest.update(hashlib.sha256(json.dumps(item, sort_keys=True).encode()).digest())
    return digest.hexdigest()[:32]
