"""Checksums on by default (issue 22, item 9): with `InMemoryCkptConfig()` as it comes, a flipped byte
anywhere in a shard file and an edited shared-memory sidecar are refused, never loaded as other
state; and the seeds' migration rule: node-local checkpoints written with verify_integrity=False
are not eligible until a new checksummed generation is persisted."""

import json
import logging
import os

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager, RecoveryUnavailable
from tests.distributed.gemini_workloads import assert_same

RUN = "integrity-default"


def _state(seed):
    gen = torch.Generator().manual_seed(seed)
    # Two tensors of one shape and dtype: a swapped layout would load each as the other.
    return {"w": torch.randn(8, generator=gen), "v": torch.randn(8, generator=gen),
            "b": torch.arange(3) + seed, "meta": {"lr": 0.1 * seed, "name": "x"}}


def _manager(tmp_path, **kw):
    base = dict(disk_folder=str(tmp_path / "disk"), run_id=RUN, shared_memory_dir=str(tmp_path / "shm"),
                timeout_s=10)
    base.update(kw)
    return InMemoryCheckpointManager(InMemoryCkptConfig(**base), install_signal_handlers=False)


def _recover(tmp_path, **kw):
    """What a relaunch recovers with the default config: (step, state), or (None, None)."""
    manager = _manager(tmp_path, **kw)
    try:
        step = manager.find_latest()
        return step, (manager.load() if step is not None else None)
    finally:
        manager.close(keep_shared=True)


def _only_file(folder, suffix):
    found = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
             if name.endswith(suffix)]
    assert len(found) == 1, found
    return found[0]


def test_the_default_verifies_integrity():
    assert InMemoryCkptConfig().verify_integrity is True


def test_every_single_byte_flip_of_a_shard_is_refused_or_loads_the_same_state(tmp_path):
    first = _manager(tmp_path, host_memory="heap", disk_flush_interval=1)
    first.save(_state(1), 1)
    first.close()
    path = _only_file(tmp_path / "disk", ".gemini")
    with open(path, "rb") as f:
        original = f.read()
    assert _recover(tmp_path, host_memory="heap")[0] == 1
    wrong = []
    for offset in range(len(original)):
        flipped = bytearray(original)
        flipped[offset] ^= 0xFF
        with open(path, "wb") as f:
            f.write(flipped)
        step, state = _recover(tmp_path, host_memory="heap")
        if step is None:
            continue
        try:
            assert step == 1
            assert_same(state, _state(1))
        except AssertionError:
            wrong.append(offset)
    assert wrong == [], f"{len(wrong)} of {len(original)} single-byte flips loaded other state: {wrong[:20]}"


def _sidecars(tmp_path):
    """The two own-slot sidecars of a default run that captured steps 3 and 6 and crashed."""
    first = _manager(tmp_path, disk_flush_interval=0)
    first.save(_state(3), 3)
    first.save(_state(6), 6)
    first.maybe_wait()
    directory = first.host_memory().directory
    first.close(keep_shared=True)
    paths = [os.path.join(directory, f"{name}.json") for name in ("own_a", "own_b")]
    return {json.load(open(p))["step"]: p for p in paths}


def _edit(path, change):
    with open(path) as f:
        doc = json.load(f)
    change(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


def _swap_w_and_v(doc):
    items = dict((key, node) for key, node in doc["structure"]["items"])
    items["w"]["i"], items["v"]["i"] = items["v"]["i"], items["w"]["i"]


@pytest.mark.parametrize("edit", [lambda doc: doc.update(step=9), _swap_w_and_v],
                         ids=["step-3-relabelled-9", "two-tensors-swapped"])
def test_an_edited_shared_memory_sidecar_is_refused_by_default(tmp_path, caplog, edit):
    paths = _sidecars(tmp_path)
    _edit(paths[3], edit)
    with caplog.at_level(logging.WARNING):
        manager = _manager(tmp_path, disk_flush_interval=0)
        assert manager.find_latest() == 6  # never the relabelled 9, never step 3 with w and v swapped
        assert_same(manager.load(), _state(6))
        assert manager.find_latest(step=6) == 6
        with pytest.raises(RecoveryUnavailable, match="step 3 was selected"):
            manager.find_latest(step=3)
        manager.close()
    assert "CRC-32 mismatch" in caplog.text and "shared memory bytes are corrupt" in caplog.text


def test_checkpoints_written_without_checksums_are_not_eligible_until_a_checksummed_generation(tmp_path, caplog):
    old = _manager(tmp_path, verify_integrity=False, disk_flush_interval=1)
    old.save(_state(2), 2)
    old.close(keep_shared=True)  # shared-memory slot and node-local shard, both unchecksummed
    with caplog.at_level(logging.WARNING):
        manager = _manager(tmp_path, disk_flush_interval=1)  # the default: verify_integrity=True
        assert manager.find_latest() is None
        with pytest.raises(RecoveryUnavailable, match="step 2 was selected"):
            manager.find_latest(step=2)
    assert "verify_integrity=False" in caplog.text and "only checksummed" in caplog.text
    manager.save(_state(4), 4)  # the new checksummed generation, flushed
    manager.close(keep_shared=True)

    step, state = _recover(tmp_path, disk_flush_interval=1)
    assert step == 4
    assert_same(state, _state(4))
    step, state = _recover(tmp_path, disk_flush_interval=1, host_memory="heap")  # the disk tier alone
    assert step == 4
    assert_same(state, _state(4))
    with pytest.raises(RecoveryUnavailable, match="step 2 was selected"):
        manager = _manager(tmp_path, host_memory="heap")
        try:
            manager.find_latest(step=2)
        finally:
            manager.close()
