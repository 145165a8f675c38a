"""A shard or shared-memory sidecar whose structure disagrees with its layout is refused while the
recovery plan is chosen, even with verify_integrity=False, so recovery falls back to the intact
replica instead of failing in load() (issue 22, item 6). 4 real gloo ranks, fresh processes."""

import json
import os
import signal

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from tests.distributed.gemini_workloads import assert_same, train
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(240)

VICTIM = 1  # its replica is held by rank 3 (replication_jump=2)


def _config(tmp, tier):
    return InMemoryCkptConfig(interval=2, replication_jump=2, disk_flush_interval=2 if tier == "disk" else 0,
                              disk_folder=os.path.join(tmp, "disk"), shared_memory_dir=os.path.join(tmp, "shm"),
                              run_id="layout-mismatch", replication_chunk_size=4096, timeout_s=60,
                              verify_integrity=False)


def _train(rank, world, tmp, tier):
    manager, _, _, expected = train(rank, 6, _config(tmp, tier), save_every=2)
    manager._drain()
    torch.save(expected, os.path.join(tmp, f"expected-{rank}.pt"))
    if tier == "disk":
        manager.close()  # the shared-memory slots go: recovery reads the node-local files
    else:
        os.kill(os.getpid(), signal.SIGKILL)  # the slots stay for the relaunch


def _drop_last_tensor_leaf(structure):
    """The state's last tensor leaf is no longer referenced: the structure now disagrees with the
    layout, which still lists every tensor."""
    items = structure["items"]
    model = dict(items)["model"]
    model["items"] = model["items"][:-1]
    return structure


def _edit_shard(path):
    record = torch.load(path, weights_only=True)
    metadata = json.loads(record["metadata"])
    metadata["structure"] = _drop_last_tensor_leaf(metadata["structure"])
    record["metadata"] = json.dumps(metadata, separators=(",", ":"))
    torch.save(record, path)


def _edit_sidecar(path):
    with open(path) as f:
        doc = json.load(f)
    doc["structure"] = _drop_last_tensor_leaf(doc["structure"])
    with open(path, "w") as f:
        json.dump(doc, f)


def _recover(rank, world, tmp, tier):
    if rank == VICTIM:
        if tier == "disk":
            (path,) = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(tmp, "disk"))
                       for f in files if f == "own-000000000006.gemini" and d.endswith(f"rank-{rank:05d}")]
            _edit_shard(path)
        else:
            sidecars = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(tmp, "shm"))
                        for f in files if f in ("own_a.json", "own_b.json")
                        and os.path.basename(d).startswith(f"rank-{rank:05d}.")]
            (path,) = [p for p in sidecars if json.load(open(p))["step"] == 6]
            _edit_sidecar(path)
    manager = InMemoryCheckpointManager(_config(tmp, tier))
    try:
        step = manager.find_latest()
        job = dict(manager.job_recovery_sources)
        return step, job, manager.load()
    finally:
        manager.close()


@pytest.mark.parametrize("tier", ["disk", "shared-memory"])
def test_layout_mismatch_falls_back_to_the_intact_replica_with_integrity_off(tmp_path, tier):
    tmp = str(tmp_path)
    run_ranks(_train, 4, tmp, tier, timeout=120, check=tier == "disk")
    recovered = run_ranks(_recover, 4, tmp, tier, timeout=120)
    medium = "disk" if tier == "disk" else "shared-memory"
    for rank, (step, job, state) in enumerate(recovered):
        exp_step, exp_state = torch.load(os.path.join(tmp, f"expected-{rank}.pt"), weights_only=False)
        assert step == exp_step == 6
        assert job[VICTIM] == (3, medium)  # the victim's state comes from its peer's replica
        assert_same(state, exp_state)
