"""Crash matrix: SIGKILL at each phase of a node-local flush and of a capture. The next recovery
loads the newest complete step, on the same timeline, bitwise. (SIGKILL during a replication
exchange is covered by the replication tests.)

The kill points are installed inside the dying rank's own process by wrapping the functions that
mark each phase (the shard publish, the temp-file rename, the host copy, the READY sidecar)."""

import io
import os
import signal
import time

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini import device, shm, storage
from tests.distributed.gemini_workloads import assert_same
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)

TARGET = "own-000000000006.gemini"
FLUSH_PHASES = {"before_temp_write": 4, "mid_write": 4, "after_fsync_before_rename": 4, "after_rename": 6}
CAPTURE_PHASES = {"mid_copy": 4, "after_copy_before_ready": 4, "after_ready": 6}


def _config(tmp, tier):
    return InMemoryCkptConfig(
        disk_folder=os.path.join(tmp, "disk"), shared_memory_dir=os.path.join(tmp, "shm"), run_id="crash",
        timeout_s=20, verify_integrity=True, host_memory="heap" if tier == "flush" else "shared",
        disk_flush_interval=2 if tier == "flush" else 0)


def _die(tmp):
    with open(os.path.join(tmp, "dying"), "w"):
        pass
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _install_kill_point(tmp, phase):
    if phase in ("before_temp_write", "mid_write"):
        publish = storage.atomic_write

        def atomic_write(path, data, temp_name=None):
            if not path.endswith(TARGET):
                return publish(path, data, temp_name=temp_name)
            if phase == "before_temp_write":
                _die(tmp)

            def half(f):
                whole = io.BytesIO()
                data(whole)
                f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
                f.flush()
                os.fsync(f.fileno())
                _die(tmp)
            return publish(path, half, temp_name=temp_name)

        storage.atomic_write = atomic_write
    elif phase in ("after_fsync_before_rename", "after_rename"):
        replace = os.replace

        def kill_at_rename(src, dst, *args, **kwargs):
            if not str(dst).endswith(TARGET):
                return replace(src, dst, *args, **kwargs)
            if phase == "after_rename":
                replace(src, dst, *args, **kwargs)
            _die(tmp)

        os.replace = kill_at_rename
    elif phase == "mid_copy":
        def finish(self):
            pairs = self._cpu_pairs
            for dst, src in pairs[: len(pairs) // 2]:
                dst.copy_(src)
            _die(tmp)

        device.PendingCopy.finish = finish
    else:
        publish_ready = shm.SharedSlotArena.publish

        def publish(self, slot, step, *args):
            if step == 6 and phase == "after_copy_before_ready":
                _die(tmp)
            publish_ready(self, slot, step, *args)
            if step == 6:
                _die(tmp)

        shm.SharedSlotArena.publish = publish


def _first_life(rank, world, tmp, tier, phase):
    manager = InMemoryCheckpointManager(_config(tmp, tier), replicate=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, 7):
        if step == 6 and rank == 0:
            _install_kill_point(tmp, phase)
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        manager.maybe_wait()
        optimizer.step()
        optimizer.zero_grad()
        if step % 2 == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(_clone(state), os.path.join(tmp, f"expected-{step}-{rank}.pt"))
            manager.save(state, step)
            manager._drain()
    with open(os.path.join(tmp, f"lineage-{rank}"), "w") as f:
        f.write(manager._timeline.lineage)
    while not os.path.exists(os.path.join(tmp, "dying")):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def _recover(rank, world, tmp, tier):
    manager = InMemoryCheckpointManager(_config(tmp, tier), replicate=False)
    step = manager.find_latest()
    state = manager.load()
    parent = manager._timeline.ancestry[0]
    manager.close()
    return step, state, parent


def _matrix(tmp, tier, phase, expected_step):
    outcomes = run_ranks(_first_life, 2, tmp, tier, phase, timeout=90, check=False)
    assert [o.killed_by for o in outcomes] == [signal.SIGKILL] * 2, [o.error for o in outcomes]
    with open(os.path.join(tmp, "lineage-1")) as f:
        lineage = f.read()
    for rank, (step, state, parent) in enumerate(run_ranks(_recover, 2, tmp, tier, timeout=90)):
        assert step == expected_step, phase
        assert parent == (lineage, expected_step)  # the timeline both lives share
        expected = torch.load(os.path.join(tmp, f"expected-{expected_step}-{rank}.pt"), weights_only=False)
        assert_same(state, expected)


@pytest.mark.parametrize("phase", list(FLUSH_PHASES))
def test_sigkill_during_flush_recovers_newest_complete_step(tmp_path, phase):
    _matrix(str(tmp_path), "flush", phase, FLUSH_PHASES[phase])


@pytest.mark.parametrize("phase", list(CAPTURE_PHASES))
def test_sigkill_during_capture_recovers_newest_complete_step(tmp_path, phase):
    _matrix(str(tmp_path), "capture", phase, CAPTURE_PHASES[phase])
