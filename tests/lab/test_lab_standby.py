"""Cross-host standby recovery on simulated hosts (lab/): 3 active hosts and standbys, 2 torchrun
workers each, `replication_jump` = 2 (one host width). A host crashes after a non-capture step
(its processes SIGKILLed, its /dev/shm gone): the standby joins and the lost ranks get their state
from the replicas other hosts hold, over the network, whichever node slot the standby sorts into.

torch numbers node slots by sorting the agents' host names: active h1, h2, h3 hold slots 0, 1, 2;
standby h0 sorts first. Losing h1, h0 takes slot 0 (the lost host's); losing h2, h0 takes slot 0
and h1 moves from slot 0 to slot 1, so its workers' global ranks change from 0, 1 to 2, 3. The
TCP store is served by h3's agent, which stays up.
"""

from __future__ import annotations

import re

import pytest

from tests.lab import torchrun_hosts as T

ACTIVE = ["h1", "h2", "h3"]
HOSTS = ["h0", *ACTIVE, "h4"]


def _crash_after_step_7(make_lab, tmp_path, lost, standbys, run_id):
    """Run with `standbys` parked; a worker of host `lost` holds after step 7 (captures every 2
    steps: 6 is the newest) and the host crashes once every host holds step 6's replicas."""
    lab = make_lab(HOSTS)
    run = T.Run(lab, str(tmp_path), run_id, store_host="h3", nnodes=f"3:{3 + len(standbys)}")
    held_rank = 2 * ACTIVE.index(lost)
    for host in ACTIVE:
        run.start(host, [str(held_rank), "7", "hold"])
    run.wait_formed(ACTIVE)
    for host in standbys:
        run.start(host, [str(held_rank), "7", "hold"])
    run.wait_held(held_rank)
    run.wait_replicas(ACTIVE, 6)
    lab[lost].crash()
    return lab, run


@pytest.mark.timeout(1500)
def test_a_lost_host_is_replaced_by_a_standby_in_its_slot_from_replicas_over_the_network(make_lab, tmp_path,
                                                                                          baseline):
    lab, run = _crash_after_step_7(make_lab, tmp_path, "h1", ["h0"], "same-slot")
    codes = run.wait(900)
    assert codes["h1"] == -9 and all(codes[h] == 0 for h in ("h0", "h2", "h3")), (codes, run.logs())
    assert "generation 1, node slot 0 of 3: replacement, checkpoint step 6" in run.log("h0"), run.logs()
    # Ranks 0 and 1 (now on h0) from h2's replicas; the others from their own shared memory.
    assert "at step 6 from peer memory (ranks 0, 1), memory (ranks 2, 3, 4, 5)" in run.log("h0"), run.logs()
    resumed = run.final()
    assert resumed["start"] == 6
    assert not T.different(resumed, baseline), "not bitwise equal after the replacement"


@pytest.mark.timeout(1500)
def test_a_standby_that_sorts_into_another_slot_moves_the_survivors_and_their_state(make_lab, tmp_path, baseline):
    lab, run = _crash_after_step_7(make_lab, tmp_path, "h2", ["h0"], "other-slot")
    codes = run.wait(900)
    assert codes["h2"] == -9 and all(codes[h] == 0 for h in ("h0", "h1", "h3")), (codes, run.logs())
    assert "generation 1, node slot 0 of 3: replacement, checkpoint step 6" in run.log("h0"), run.logs()
    assert "generation 1, node slot 1 of 3: same-node restart, checkpoint step 6" in run.log("h1"), run.logs()
    # h0 (ranks 0, 1) gets ranks 0 and 1 from h1, which ran them and now is ranks 2, 3; ranks 2 and
    # 3 come from the replicas on h3; ranks 4, 5 stay on h3.
    assert "at step 6 from peer memory (ranks 0, 1, 2, 3), memory (ranks 4, 5)" in run.log("h0"), run.logs()
    resumed = run.final()
    assert resumed["start"] == 6
    assert not T.different(resumed, baseline), "not bitwise equal after the replacement"


@pytest.mark.slow  # about 2 minutes on 2 busy cores
@pytest.mark.timeout(1500)
def test_two_standbys_for_one_lost_host_one_joins_and_the_other_stays_parked(make_lab, tmp_path, baseline):
    lab, run = _crash_after_step_7(make_lab, tmp_path, "h2", ["h0", "h4"], "two-standbys")
    codes = run.wait(900)  # every agent ends by itself, the parked standby too
    joined = [h for h in ("h0", "h4") if re.search(r"generation \d+, node slot \d of 3: replacement", run.log(h))]
    assert len(joined) == 1, run.logs()
    (parked,) = {"h0", "h4"} - set(joined)
    # Every agent ends by itself with status 0, the parked standby too: the run ending released it.
    assert codes["h2"] == -9 and all(codes[h] == 0 for h in ("h1", "h3", "h0", "h4")), (codes, run.logs())
    assert "parks as a standby" in run.log(parked) and "generation" not in run.log(parked), run.logs()
    assert "ended while node" in run.log(parked) and "was a parked standby; it was not needed" in run.log(parked)
    resumed = run.final()
    assert resumed["start"] == 6
    assert not T.different(resumed, baseline), "not bitwise equal after the replacement"
