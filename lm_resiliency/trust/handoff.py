"""The one builder of the `RecoveryDecision` handed to orchestration.

Both the session (`prepare_recovery`, out-of-band faults) and the manager API
(`dispatch_replay_faults`) build their decision here, so the two cannot drift apart. Nothing here
communicates: a fault may already have made the training process group unusable.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch.distributed as dist

from lm_resiliency.recovery import RecoveryDecision, RecoveryMode

logger = logging.getLogger(__name__)


def reporting_rank() -> Tuple[int, ...]:
    """(this process's global rank,), or (0,) without torch.distributed or when it cannot be read."""
    try:
        if dist.is_available() and dist.is_initialized():
            return (dist.get_rank(),)
    except Exception:  # noqa: BLE001 - a broken process group must not block fault reporting
        logger.debug("could not read the global rank for a recovery decision", exc_info=True)
    return (0,)


def recovery_decision(failure: str, mode: RecoveryMode, reason: str, *, step: Optional[int],
                      source: Optional[str], checkpoint_id: Optional[str] = None, topology: Optional[str] = None,
                      problem: str = "") -> RecoveryDecision:
    """The decision for `failure` in trust `mode`: the checkpoint this rank found for it (`step`
    None: none, and `problem` may say why, appended to `reason`), reported by this rank."""
    return RecoveryDecision(
        failure=str(failure), mode=mode.value, source=source, step=step, durable_checkpoint_id=checkpoint_id,
        topology=topology, available=step is not None, reason=f"{reason}; {problem}" if problem else reason,
        ranks=reporting_rank())
