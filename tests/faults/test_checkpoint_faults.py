"""Checkpoint faults act on real GEMINI shard files, and the GEMINI loader then rejects them."""

import glob
import os

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.faults import (FailureType, FaultCampaign, FaultIncident, FaultSpec, FaultTarget,
                                  IncidentTrigger, InjectionStatus, LocalFaultExecutor, UnsupportedFaultError,
                                  enable_fault_injection)
from lm_resiliency.faults.checkpoint_faults import list_shards, payload_region
from lm_resiliency.gemini.storage import ShardKey, ShardRejected

from .workloads import batches, make_model, train


@pytest.fixture
def gemini(tmp_path):
    """A single-process GEMINI manager with flushed node-local shards of steps 1 and 2."""
    config = InMemoryCkptConfig(interval=1, disk_flush_interval=0, disk_folder=str(tmp_path / "gemini"),
                                run_id="faults-test", host_memory="heap", verify_integrity=True, timeout_s=30)
    manager = InMemoryCheckpointManager(config, install_signal_handlers=False)
    for step in (1, 2):
        manager.save({"w": torch.arange(256, dtype=torch.float32) * step, "step": step}, step)
        manager.maybe_wait()
        assert manager.flush_now() == step
    yield manager
    manager.close()


def inject(fault_type, params, folder=None):
    campaign = FaultCampaign("ckpt", (FaultIncident("disk", IncidentTrigger(at=(1,)), (
        FaultSpec("shard", fault_type, FaultTarget(rank=0, surface="checkpoint"), params),)),))
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=campaign,
                                    executor=LocalFaultExecutor(checkpoint_folder=folder))
    train(model, optimizer, batches(2))
    faults.close()
    return faults.records


@pytest.mark.parametrize("fault_type, params, reason", [
    (FailureType.CHECKPOINT_CORRUPTION, {}, "CRC-32 mismatch"),
    (FailureType.CHECKPOINT_CORRUPTION, {"offset": 0, "bytes": 4}, "refused it|not a readable torch file"),
    (FailureType.CHECKPOINT_TRUNCATION, {}, "not a readable torch file"),
    (FailureType.CHECKPOINT_TRUNCATION, {"keep_bytes": 0}, "not a readable torch file"),
    (FailureType.CHECKPOINT_MISSING, {}, "shard file is missing"),
], ids=["payload-byte", "header-bytes", "truncate-half", "truncate-all", "remove"])
def test_gemini_rejects_the_damaged_shard(gemini, fault_type, params, reason):
    folder = gemini.config.disk_folder
    gemini.store.read_shard(ShardKey("own", 0, 2))  # intact before
    [record] = inject(fault_type, dict(params, disk_folder=folder))
    assert record.status is InjectionStatus.INJECTED and record.failure_type is fault_type
    assert record.evidence["path"].endswith("own-000000000002.gemini")  # the newest shard by default
    with pytest.raises(ShardRejected, match=reason):
        gemini.store.read_shard(ShardKey("own", 0, 2))
    gemini.store.read_shard(ShardKey("own", 0, 1))  # the older generation is untouched
    if fault_type is FailureType.CHECKPOINT_CORRUPTION and not params:
        start, length, member = payload_region(record.evidence["path"])
        assert start <= record.evidence["offset"] < start + length and member.endswith("data/0")


def test_step_selection_and_executor_default_folder(gemini):
    folder = gemini.config.disk_folder
    [record] = inject(FailureType.CHECKPOINT_MISSING, {"step": 1}, folder=folder)
    assert record.evidence["path"].endswith("own-000000000001.gemini")
    assert [s for _, kind, _, s in list_shards(folder, 0) if kind == "own"] == [2]
    with pytest.raises(ShardRejected, match="missing"):
        gemini.store.read_shard(ShardKey("own", 0, 1))
    gemini.store.read_shard(ShardKey("own", 0, 2))


def test_no_shard_is_no_effect_and_no_folder_is_unsupported(tmp_path):
    [record] = inject(FailureType.CHECKPOINT_TRUNCATION, {"disk_folder": str(tmp_path)})
    assert record.status is InjectionStatus.NO_EFFECT and "no matching GEMINI shard" in record.detail
    with pytest.raises(UnsupportedFaultError, match="disk_folder"):
        inject(FailureType.CHECKPOINT_CORRUPTION, {})


def test_only_gemini_named_files_of_the_target_rank_are_touched(gemini, tmp_path):
    folder = gemini.config.disk_folder
    rank_dir = os.path.dirname(glob.glob(os.path.join(folder, "gemini-*", "rank-*", "own-*.gemini"))[0])
    decoy = os.path.join(rank_dir, "notes.txt")
    with open(decoy, "w") as f:
        f.write("keep me")
    os.symlink(decoy, os.path.join(rank_dir, "own-000000000009.gemini"))  # never followed
    [record] = inject(FailureType.CHECKPOINT_MISSING, {"disk_folder": folder})
    assert record.evidence["path"].endswith("own-000000000002.gemini")
    assert open(decoy).read() == "keep me"
