"""How a rank that stops replicating lets its partners go at once instead of after `timeout_s`.

Two parts. `close_links` closes every link of GEMINI's group on this rank, even while another
thread waits on it: gloo closes all pairs of a group's context when a wait on it times out, and
that is the only way to end a blocked wait early (destroying the group does not, while a pending
handle still holds it; neither do abort()/shutdown()). Every wait of the partners on this rank
then fails with "Connection closed by peer", and every later post fails at once. The
`AbandonBoard` says why, out of band: a key per rank in the c10d store, read only after an
exchange failed (never on the healthy path), so the partner's error names the rank and step.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from lm_resiliency._torch_compat import default_store
from lm_resiliency.files import RecordRejected, RecordSchema, encode_record, integer, parse_record, text

logger = logging.getLogger(__name__)

# No GEMINI transfer uses p2p tag 0 (replication.message_tag starts at 1), so the probe below
# never matches a real message.
_CLOSE_TAG = 0
_STORE_TIMEOUT = timedelta(seconds=2)
NOTICE_SCHEMA = RecordSchema(what="GEMINI abandonment notice",
                             fields={"step": integer(0), "reason": text(nonempty=False, max_length=None)})


def close_links(group: dist.ProcessGroup, peer: int) -> None:
    """Close every link of `group` on this rank now: a receive from `peer` that nobody sends,
    waited for one millisecond."""
    probe = torch.zeros(1, dtype=torch.uint8)
    try:
        dist.irecv(probe, peer, group=group, tag=_CLOSE_TAG).wait(timeout=timedelta(milliseconds=1))
    except (RuntimeError, ValueError) as exc:  # the expected outcome, or links already closed
        logger.debug("GEMINI: closed the links of GEMINI's group: %s", exc)
        return
    logger.error("GEMINI: a message arrived on the reserved tag %d from rank %d; GEMINI's group may "
                 "still be open", _CLOSE_TAG, peer)


class AbandonBoard:
    """Per-rank notices "rank r stopped replicating after step s, because ..." in the c10d store,
    under a prefix of one manager generation (run id and the timeline drawn at construction), so
    a relaunch on the same store never reads an old notice. Every store call is bounded (a clone
    of the store with a short timeout) and best effort: a missing store only loses the names."""

    def __init__(self, store: dist.Store, prefix: str) -> None:
        self._store = dist.PrefixStore(prefix, store)

    @staticmethod
    def open(prefix: str) -> Optional["AbandonBoard"]:
        try:
            store = default_store()
            clone = store.clone()
            clone.set_timeout(_STORE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - no default store, or a custom one that cannot clone
            logger.info("GEMINI: no bounded c10d store for abandonment notices (%s); a partner's "
                        "error will not name the rank that stopped", exc)
            return None
        return AbandonBoard(clone, prefix)

    def mark(self, rank: int, step: int, reason: str) -> None:
        try:
            self._store.set(str(rank), encode_record({"step": step, "reason": reason}, NOTICE_SCHEMA))
        except (RuntimeError, ValueError) as exc:
            logger.warning("GEMINI: could not record in the c10d store that rank %d stopped "
                           "replicating after step %d: %s", rank, step, exc)

    def find(self, ranks: Iterable[int]) -> Optional[str]:
        """"rank r stopped replicating after step s (reason)" for each of `ranks` that did, or None."""
        notices = []
        for rank in ranks:
            try:
                if not self._store.check([str(rank)]):
                    continue
                notice = parse_record(self._store.get(str(rank)), NOTICE_SCHEMA, f"store key {rank}")
                notices.append(f"rank {rank} stopped replicating after step {notice['step']} "
                               f"({notice['reason']})")
            except (RuntimeError, RecordRejected) as exc:
                logger.debug("GEMINI: reading rank %d's notice failed: %s", rank, exc)
        return "; ".join(notices) or None
