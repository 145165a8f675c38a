"""A worker SIGSTOPped on one host (a hang: the process exists, holds its sockets and answers
nothing): SCOUT's out-of-band monitor on another host localizes the stopped rank, the agents retire
the node that runs it (exit 0, never to rejoin), a standby on a fresh host takes a slot, and every
rank resumes from the newest RECOVERY_VERIFIED step, the lost ranks from the replicas over the
network: final state bitwise equal to an uninterrupted run (which runs without SCOUT: detection
must not change training either). The standby's ranks and the ranks that move hosts hold no trust
record: they take the RECOVERY_VERIFIED history the other ranks agree on (before that fix every
rank refused the verified step: "this run's trust ledger certifies no step"). tests/torchrun/test_retirement.py covers the same path on one
host with a worker that blocks in Python."""

from __future__ import annotations

import re

import pytest

from tests.lab import torchrun_hosts as T

ACTIVE = ["h1", "h2", "h3"]
# SCOUT on, a hang is an idle spell of 10 s (a healthy step of this workload takes well under one).
DETECTION = "\n[replay]\nhang_stall_threshold_s = 10.0\nmonitor_poll_interval_s = 0.5\n"


@pytest.mark.slow  # about 2.5 minutes on 2 busy cores
@pytest.mark.timeout(1500)
def test_a_sigstopped_worker_is_named_its_host_retired_and_a_standby_resumes_bitwise(make_lab, tmp_path,
                                                                                     baseline):
    lab = make_lab(["h0", *ACTIVE])
    run = T.Run(lab, str(tmp_path), "sigstop", store_host="h3", nnodes="3:4", scout=DETECTION)
    for host in ACTIVE:  # global rank 2, the first worker of h2, reaches its hold after step 7
        run.start(host, ["2", "7", "hold"])
    run.wait_formed(ACTIVE)
    run.start("h0", ["2", "7", "hold"])
    run.wait_held(2)
    lab["h2"].stop(lab["h2"].workers()[2].pid)  # SIGSTOP: from now on it answers nothing
    codes = run.wait(900)
    assert all(codes[h] == 0 for h in ("h0", "h1", "h2", "h3")), (codes, run.logs())
    assert re.search(r"SCOUT found hang at step \d+ on global ranks \[2\] in generation 0", run.log("h2")), run.logs()
    assert re.search(r"node \w+ \(slot 1\) RETIRED from run 'sigstop'", run.log("h2")), run.logs()
    assert "generation 1" not in run.log("h2"), "the retired host rejoined the run"
    assert re.search(r"generation 1, node slot 0 of 3: replacement, checkpoint step 6 \(.*newest "
                     r"RECOVERY_VERIFIED step", run.log("h0")), run.logs()
    resumed = run.final()
    assert resumed["start"] == 6
    assert not T.different(resumed, baseline), "not bitwise equal after the hang"
