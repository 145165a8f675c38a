"""What a torchrun record must match before the agent acts on it: the run, the launch, the
rendezvous round, the node and the topology it was written for. A record that does not match is
stale (another launch's, another node's copy, another width) and is ignored with a line saying
which file and why; it is never acted on."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional, Set

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundBinding:
    """One rendezvous round of one launch on one node, as its agent knows it."""

    run_id: str
    """The run (`--rdzv-id`)."""
    launch_id: str
    """The launch the agents agreed on (launches.py)."""
    node_id: str
    """This node's hashed identity."""
    generation: int
    """The round: the one being formed (worker records) or the one that just ended (fault records)."""
    nodes: int
    """How many nodes train in the round (0 when not known yet)."""
    nproc_per_node: Optional[int]
    """The agent's --nproc-per-node (LOCAL_WORLD_SIZE); None when the agent could not learn it."""


def foreign(doc: dict, binding: RoundBinding) -> Optional[str]:
    """Why `doc` (a record with run_id and node_id) belongs to another run or node, or None."""
    if doc["run_id"] != binding.run_id:
        return f"it belongs to run {doc['run_id']!r}, not {binding.run_id!r}"
    if doc["node_id"] != binding.node_id:
        return (f"it was written on another node (node id {doc['node_id'][:12]}, this node is "
                f"{binding.node_id[:12]}): a copied directory")
    return None


class StaleLog:
    """Logs each ignored record once per agent (the agent reads its directory every round and
    every monitor interval)."""

    def __init__(self) -> None:
        self._seen: Set[str] = set()

    def note(self, lines: Iterable[str]) -> None:
        for line in lines:
            if line not in self._seen:
                self._seen.add(line)
                logger.warning("lm_resiliency rendezvous: ignoring %s", line)
