"""Losing the host that serves the rendezvous store (pytorch #168242: every worker breaks): the run
cannot go on without the store, so every other agent stops its workers and exits with a message
that says so and what to do, instead of a store traceback or a hang."""

from __future__ import annotations

import re

import pytest

from tests.lab import torchrun_hosts as T

ACTIVE = ["h1", "h2", "h3"]


@pytest.mark.timeout(900)
def test_losing_the_store_host_ends_the_run_with_a_clear_message(make_lab, tmp_path):
    lab = make_lab(ACTIVE)
    run = T.Run(lab, str(tmp_path), "store-loss", store_host="h3", nnodes="3:3")
    for host in ACTIVE:  # rank 4 (on h3, which serves the store) holds after step 7
        run.start(host, ["4", "7", "hold"])
    run.wait_held(4)
    lab["h3"].crash()
    codes = run.wait(300)
    assert codes == {"h1": 1, "h2": 1, "h3": -9}, (codes, run.logs())
    for host in ("h1", "h2"):
        assert re.search(r"RendezvousRefused: node \w+ \(slot \d\) leaves run 'store-loss': the rendezvous store at "
                         r"h3:\d+ does not answer, .* If every node reports this, the store's host \(the one serving "
                         r"--rdzv-endpoint\) is gone and the run cannot go on: relaunch the job", run.log(host)), \
            run.logs()
        assert not lab[host].workers(), f"{host}'s workers outlived the run"
