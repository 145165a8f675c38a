"""Parked standbys over torch's real FileStore and real rendezvous handlers: when more nodes are
lost than one standby replaces, the standbys join one per fence bound until the run has its nodes
again (a turn to join held by a standby that cannot complete the round passes on)."""

from __future__ import annotations

import uuid

from lm_resiliency.torchrun import context as ctx
from tests.torchrun.test_backend import _restore_environment  # noqa: F401 - autouse
from tests.torchrun.test_fencing import _two_active, handlers_of, start_joining


def test_two_lost_nodes_are_replaced_by_two_standbys(tmp_path):
    run_id = uuid.uuid4().hex
    active = _two_active(tmp_path, run_id)
    standbys = handlers_of(tmp_path, run_id, "cd", 4)
    threads, joined = start_joining(standbys)
    try:
        for handler in active:  # both active nodes die: their keep-alives and torch's heartbeats stop
            handler._member.stop()
            handler._inner._stop_heartbeats()
        for thread in threads:
            thread.join(90)
        assert sorted((info.rank, info.world_size) for info in joined.values()) == [(0, 2), (1, 2)], \
            "the second standby never joined: the first one held the turn while the round could not form"
        for name in ("c", "d"):
            context = ctx.read_context(str(tmp_path / f"ctx-{name}" / "context.json"))[0]
            assert (context.generation, context.nodes) == (1, 2)
    finally:
        for handler in (*standbys, *active):
            handler._retired = True  # the dead active nodes must not close the run for the test's shutdown
            handler.shutdown()
