"""The private torch.distributed.elastic details the backend uses (torch 2.13)."""

from __future__ import annotations

import sys
import time
from types import FrameType
from typing import Any, Optional, Tuple

_CALLER_FRAMES = 12


def rendezvous_round(handler: Any) -> int:
    """The round of the rendezvous `handler` (a DynamicRendezvousHandler) just completed: the same
    number on every agent of that round, so it keys what the agents exchange for it."""
    try:
        return int(handler._state_holder.state.round)
    except AttributeError as exc:
        raise RuntimeError("lm_resiliency rendezvous: this torch's DynamicRendezvousHandler has no "
                           "_state_holder.state.round (written for torch 2.13); the backend cannot key its "
                           "per-generation agreement") from exc


def leave_rendezvous(handler: Any, timeout_s: float) -> None:
    """Remove this node from the participants of `handler`'s rendezvous (a DynamicRendezvousHandler)
    without closing the run: what torch does at the start of each join, as a step of its own."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._stop_heartbeats()
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + timeout_s)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError("lm_resiliency rendezvous: this torch's DynamicRendezvousHandler has no "
                           "_stop_heartbeats/_op_executor or _RendezvousExitOp (written for torch 2.13); a retired "
                           "node cannot leave the run without closing it") from exc


def membership(handler: Any) -> Tuple[int, bool, bool]:
    """(live agents that hold or wait for a training place, whether a round has formed, whether the
    run is closed), from the shared rendezvous state after dropping agents whose keep-alive expired."""
    try:
        holder = handler._state_holder
        holder.sync()
        state = holder.state
        return len(state.participants) + len(state.wait_list), bool(state.complete or state.round > 0), state.closed
    except AttributeError as exc:
        raise RuntimeError("lm_resiliency rendezvous: this torch's DynamicRendezvousHandler state has no "
                           "participants/wait_list/round/closed (written for torch 2.13); standbys cannot wait "
                           "for a lost node") from exc


def agent_local_world_size(handler: Any) -> Optional[int]:
    """The --nproc-per-node (LOCAL_WORLD_SIZE) of the torch elastic agent that calls `handler`, read
    from the `WorkerSpec` (or `WorkerGroup`) whose `rdzv_handler` is `handler` in the calling
    frames (torch 2.13's `SimpleElasticAgent._rendezvous` holds it; the rendezvous API does not pass
    it). None when no such caller is found (the handler was driven by something else)."""
    try:
        from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
    except ImportError:
        return None
    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(_CALLER_FRAMES):
        if frame is None:
            return None
        for value in list(frame.f_locals.values()):
            spec = value.spec if isinstance(value, WorkerGroup) else value
            if isinstance(spec, WorkerSpec) and spec.rdzv_handler is handler:
                return int(spec.local_world_size)
        frame = frame.f_back
    return None
