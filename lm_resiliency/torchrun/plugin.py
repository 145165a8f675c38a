"""The `torchrun.handlers` entry point. torch loads it while importing its rendezvous package, so
this module imports nothing from torch: the backend module (which imports that package) is
loaded only when torchrun creates a handler."""

from __future__ import annotations

from typing import Any, Callable


def create_rendezvous_handler(params: Any) -> Any:
    """The `lm_resiliency` rendezvous handler for `params` (a RendezvousParameters)."""
    from lm_resiliency.torchrun.backend import LMResiliencyRendezvousHandler

    return LMResiliencyRendezvousHandler(params)


def get_rendezvous_handler_creator() -> Callable[[Any], Any]:
    """Returns the creator torch registers as the `lm_resiliency` rendezvous backend."""
    return create_rendezvous_handler
