"""The private torch.distributed.elastic details the backend uses (torch 2.13)."""

from __future__ import annotations

import time
from typing import Any, Tuple


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
