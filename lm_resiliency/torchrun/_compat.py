"""The one private torch.distributed.elastic detail the backend reads (torch 2.13)."""

from __future__ import annotations

from typing import Any


def rendezvous_round(handler: Any) -> int:
    """The round of the rendezvous `handler` (a DynamicRendezvousHandler) just completed: the same
    number on every agent of that round, so it keys what the agents exchange for it."""
    try:
        return int(handler._state_holder.state.round)
    except AttributeError as exc:
        raise RuntimeError("lm_resiliency rendezvous: this torch's DynamicRendezvousHandler has no "
                           "_state_holder.state.round (written for torch 2.13); the backend cannot key its "
                           "per-generation agreement") from exc
