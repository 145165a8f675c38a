"""Two neighbouring hosts lost at once on simulated hosts (lab/): h1 (ranks 0, 1) and h2 (ranks 2,
3, which hold the replicas of ranks 0 and 1) crash after step 7, with `disk_flush_interval = 2`
so step 6 is on every host's node-local disk too. The operator stops the job (SIGTERM to the
last agent) and relaunches it with the same command on h1, h2 and h3 once h1 and h2 are back.

With their disks wiped, no copy of ranks 0 and 1 exists anywhere: every worker of the generation
that selected step 6 fails closed with an error naming them, and the next one starts fresh. With their disks kept, ranks 0 to 3 recover from
node-local disk or the replicas in h3's memory, ranks 4, 5 from h3's memory, bitwise.
"""

from __future__ import annotations

import time

import pytest

from tests.lab import torchrun_hosts as T

HOSTS = ["h1", "h2", "h3"]


def _lose_h1_and_h2_then_relaunch(make_lab, tmp_path, run_id, wipe_disk):
    lab = make_lab(HOSTS)
    run = T.Run(lab, str(tmp_path), run_id, store_host="h3", nnodes="3:3", flush=2, max_restarts=1)
    for host in HOSTS:
        run.start(host, ["0", "7", "hold"])
    run.wait_held(0)
    run.wait_replicas(HOSTS, 6)
    run.wait_shards(HOSTS, 6)
    lab["h1"].crash(wipe_disk=wipe_disk)
    lab["h2"].crash(wipe_disk=wipe_disk)
    deadline = time.monotonic() + 300
    while lab["h3"].workers():  # h3's workers fail on their lost peers; its agent waits for nodes
        assert time.monotonic() < deadline, run.logs()
        time.sleep(0.5)
    run.stop_agent("h3")
    run.wait(60)
    lab["h1"].boot()
    lab["h2"].boot()
    run.relaunch()
    for host in HOSTS:
        run.start(host)
    return run


@pytest.mark.slow  # about 2 minutes on 2 busy cores
@pytest.mark.timeout(1500)
def test_two_neighbouring_hosts_lost_with_their_disks_fail_closed_naming_the_missing_ranks(make_lab, tmp_path,
                                                                                           baseline):
    """The generation that selected step 6 loads nothing, every worker naming the ranks without a
    copy; the next generation starts fresh, saying why (docs/torchrun.md, "A run never wedges"),
    so the run ends as an uninterrupted one: never a mix of steps."""
    run = _lose_h1_and_h2_then_relaunch(make_lab, tmp_path, "double-wiped", wipe_disk=True)
    codes = run.wait(900)
    assert all(code == 0 for code in codes.values()), (codes, run.logs())
    named = "no rank holds a usable copy of ranks 0, 1 at step 6"
    assert all(named in run.log(host) for host in HOSTS), run.logs()
    fresh = "fresh, checkpoint step 0 (no node recorded a capture it can load (steps [6] could not be loaded)"
    assert all(fresh in run.log(host) for host in HOSTS), run.logs()
    resumed = run.final()
    assert resumed["start"] == 0
    assert not T.different(resumed, baseline), "the fresh start is not the uninterrupted run"


@pytest.mark.slow  # about 2 minutes on 2 busy cores
@pytest.mark.timeout(1500)
def test_two_neighbouring_hosts_back_with_their_disks_recover_from_node_local_disk(make_lab, tmp_path, baseline):
    run = _lose_h1_and_h2_then_relaunch(make_lab, tmp_path, "double-disks", wipe_disk=False)
    codes = run.wait(900)
    assert all(code == 0 for code in codes.values()), (codes, run.logs())
    # Ranks 0, 1 from their own disk on h1, 2, 3 from their replicas in h3's memory (memory before
    # disk), 4, 5 from their own slots in h3's memory.
    assert "at step 6 from disk (ranks 0, 1), peer memory (ranks 2, 3), memory (ranks 4, 5)" in run.log("h1"), run.logs()
    resumed = run.final()
    assert resumed["start"] == 6
    assert not T.different(resumed, baseline), "not bitwise equal after the relaunch"
