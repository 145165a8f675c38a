"""A host cut off from the others for good during training (its link down: no packet in or out,
its processes and memory intact), a standby parked: the agents that still reach the store fence it
once its keep-alive stood still for the fence bound (twice the keep-alive expiry, 12 s here), a
standby takes its slot and the run resumes bitwise from the replicas. The cut-off agent stops its
workers on its own and, when the link heals, exits refused: it never rejoins the run.

On the code before fencing (lm_resiliency/torchrun/fencing.py) nothing named the lost host: the
standby joined once the membership stayed short, while the cut-off agent sat in its monitor loop
with its workers running and nothing kept it from rejoining after a heal (the test fails waiting
for the FENCED line).
"""

from __future__ import annotations

import re
import time

import pytest

from tests.lab import torchrun_hosts as T

ACTIVE = ["h1", "h2", "h3"]
FENCE_BOUND_S = 12.0  # 2 x keep_alive_interval x keep_alive_max_attempt (torchrun_hosts.RDZV_CONF)


def _wait_for(run: T.Run, host: str, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(pattern, run.log(host))
        if found:
            return found
        assert time.monotonic() < deadline, f"{host} never logged {pattern!r}:\n{run.logs()}"
        time.sleep(0.2)


@pytest.mark.timeout(1500)
def test_a_partitioned_host_is_fenced_replaced_and_refused_when_the_link_heals(make_lab, tmp_path, baseline):
    lab = make_lab(["h0", *ACTIVE])
    run = T.Run(lab, str(tmp_path), "partition", store_host="h3", nnodes="3:4")
    for host in ACTIVE:  # rank 2 (on h2) holds after step 7; its peers wait for it in step 8
        run.start(host, ["2", "7", "hold"])
    run.wait_formed(ACTIVE)
    run.start("h0", ["2", "7", "hold"])
    run.wait_held(2)
    run.wait_replicas(ACTIVE, 6)
    cut = time.monotonic()
    lab.partition("h2")
    fenced = _wait_for(run, "h3", r"node (\w+) \(slot 1 of generation 0\) has not reached the rendezvous store for "
                                  r"([\d.]+)s \(fence bound 12s\): lost or cut off\. FENCED", 120)
    detected_s = time.monotonic() - cut
    print(f"fenced {detected_s:.1f}s after the cut (bound {FENCE_BOUND_S:g}s of silence)")
    assert float(fenced.group(2)) >= FENCE_BOUND_S  # never fenced before the bound
    assert detected_s < 60, "the cut-off host was not fenced within a bounded time"
    _wait_for(run, "h2", r"cannot reach the rendezvous store at h3:\d+ \(no keep-alive for [\d.]+s, fence bound 12s\)"
                         r": stopping this node's workers", 120)
    lab.heal(["h2"])
    assert run.agents["h2"].wait(180) == 1, run.logs()
    refused = run.log("h2")
    assert re.search(r"RendezvousRefused: node \w+ \(slot 1\) leaves run 'partition': (node \w+ FENCED it in "
                     r"generation 0 after [\d.]+s without its keep-alive \(lost or cut off from the store\)|it was cut off from the rendezvous store at "
                     r"h3:\d+ for [\d.]+s \(fence bound 12s: twice the keep-alive expiry\), so the other nodes "
                     r"FENCED it)\. It stopped its workers and may not rejoin", refused), run.logs()
    assert "generation 1" not in refused, "the cut-off host rejoined the run"
    assert not lab["h2"].workers(), "the cut-off host's workers still run"
    codes = run.wait(900)
    assert all(codes[h] == 0 for h in ("h0", "h1", "h3")), (codes, run.logs())
    assert "generation 1, node slot 0 of 3: replacement, checkpoint step 6" in run.log("h0"), run.logs()
    resumed = run.final()
    assert resumed["start"] == 6
    assert not T.different(resumed, baseline), "not bitwise equal after the partition"
