"""Run identity and the job-wide topology fingerprint, both agreed by every rank."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Optional

import torch.distributed as dist

from lm_resiliency import wire


class IdentityMismatch(RuntimeError):
    """Ranks disagree on the run identity; nothing is loaded or written."""


def resolve_run_id(configured: Optional[str], group: Optional[dist.ProcessGroup] = None) -> str:
    """config.run_id, else LM_RESILIENCY_RUN_ID, else TORCHELASTIC_RUN_ID, else a fresh id from
    rank 0. All ranks must end up with the same value."""
    local = configured or os.environ.get("LM_RESILIENCY_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    if not dist.is_initialized():
        return local or uuid.uuid4().hex
    ids = wire.all_gather_json(local, group)
    if all(i is None for i in ids):
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return wire.broadcast_json(uuid.uuid4().hex, src=src, group=group)
    if len(set(ids)) != 1:
        raise IdentityMismatch(
            f"ranks disagree on the GEMINI run id: {sorted(set(map(str, ids)))}. Set the same "
            "InMemoryCkptConfig.run_id (or LM_RESILIENCY_RUN_ID) on every rank.")
    return ids[0]


def topology_fingerprint(descriptor: dict, group: Optional[dist.ProcessGroup] = None) -> str:
    """sha256 over every rank's descriptor in rank order (ranks, pairing, mesh shape...)."""
    per_rank = wire.all_gather_json(descriptor, group)
    digest = hashlib.sha256()
    for item in per_rank:
        digest.update(hashlib.sha256(json.dumps(item, sort_keys=True).encode()).digest())
    return digest.hexdigest()[:32]
