"""InMemoryCkptConfig(enable=False): nothing is captured, written or found (manager and session)."""

import os

import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.experimental import InMemoryCheckpointManager


def _files(folder):
    return [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names]


def test_disabled_manager_captures_and_finds_nothing(tmp_path):
    config = InMemoryCkptConfig(enable=False, disk_folder=str(tmp_path / "ckpt"), run_id="off",
                                disk_flush_interval=1, shared_memory_dir=str(tmp_path / "shm"))
    manager = InMemoryCheckpointManager(config)
    for step in (1, 2):
        manager.save({"w": torch.full((8,), float(step))}, step)
        manager.maybe_wait()
    assert manager.latest_step == -1
    assert manager.flush_now() == -1
    assert manager.find_latest() is None and manager.load() is None
    assert manager.process_group is None and manager.host_memory().slot_bytes == {}
    manager.close()
    assert _files(tmp_path) == []


def test_enable_resiliency_with_disabled_checkpoint_captures_and_finds_nothing(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = InMemoryCkptConfig(enable=False, interval=1, disk_flush_interval=1, run_id="off",
                                disk_folder=str(tmp_path / "ckpt"), shared_memory_dir=str(tmp_path / "shm"))
    session = enable_resiliency(model, optimizer, checkpoint=config, enable_detection=False)
    try:
        assert session.recover() is None
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert session.manager is None and session.flush_for_restart() == -1
    finally:
        session.close()
    assert _files(tmp_path) == []
