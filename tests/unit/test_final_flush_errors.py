"""A failed final flush (disk full, read-only disk) is raised at close(), not only logged (issue 13
item 9): by the manager, the session, and the framework surfaces' teardown.

The failure is injected at the OS seam: `os.fsync` fails with ENOSPC/EROFS for files under the
test's disk folder only (delayed-allocation filesystems report a full disk at fsync)."""

import errno
import os

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.experimental import InMemoryCheckpointManager
from lm_resiliency.gemini.workers import BackgroundError


class FailingDisk:
    """Make fsync fail with `code` for files under `folder` once armed."""

    def __init__(self, monkeypatch, folder, code=errno.ENOSPC):
        self.folder = os.path.realpath(folder)
        self.code = code
        self.armed = False
        self.failures = 0
        real = os.fsync

        def fsync(fd):
            if self.armed and os.readlink(f"/proc/self/fd/{fd}").startswith(self.folder + os.sep):
                self.failures += 1
                raise OSError(self.code, os.strerror(self.code))
            return real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


def _config(tmp_path, **kw):
    return InMemoryCkptConfig(disk_folder=str(tmp_path / "disk"), run_id="final-flush", host_memory="heap",
                              disk_flush_interval=1, timeout_s=30.0, **kw)


def _message_names_the_problem_and_the_file(error, code, folder):
    text = str(error)
    assert os.strerror(code) in text, text
    assert str(folder) in text, text  # the path of the shard that could not be written
    assert "disk_folder" in text, text  # and what to do about it
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == code


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_manager_close_raises_the_failed_final_flush(tmp_path, monkeypatch, code):
    disk = FailingDisk(monkeypatch, tmp_path / "disk", code)
    manager = InMemoryCheckpointManager(_config(tmp_path), install_signal_handlers=False)
    disk.armed = True
    manager.save({"w": torch.arange(4.0)}, 1)  # the last capture: its flush fails in the background
    with pytest.raises(BackgroundError, match="GEMINI background flush failed") as info:
        manager.close()
    assert disk.failures == 1
    _message_names_the_problem_and_the_file(info.value, code, tmp_path / "disk")
    manager.close()  # reported once; close stays idempotent


def test_manager_with_block_still_raises_the_body_error_first(tmp_path, monkeypatch):
    disk = FailingDisk(monkeypatch, tmp_path / "disk")
    with pytest.raises(KeyError):
        with InMemoryCheckpointManager(_config(tmp_path), install_signal_handlers=False) as manager:
            disk.armed = True
            manager.save({"w": torch.ones(2)}, 1)
            raise KeyError("training failed")


def test_session_close_raises_when_the_last_capture_cannot_be_flushed(tmp_path, monkeypatch):
    disk = FailingDisk(monkeypatch, tmp_path / "disk")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = enable_resiliency(model, optimizer, interval=1, checkpoint=_config(tmp_path),
                                enable_detection=False)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    disk.armed = True  # the loop is over; only the capture completed at close() must be flushed
    with pytest.raises(BackgroundError) as info:
        session.close()
    _message_names_the_problem_and_the_file(info.value, errno.ENOSPC, tmp_path / "disk")
    assert session.manager._closed and not [h for h in optimizer._optimizer_step_pre_hooks.values()]


def test_lightning_teardown_raises_the_failed_final_flush(tmp_path, monkeypatch):
    L = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from lm_resiliency.callbacks.lightning import ResiliencyCallback

    disk = FailingDisk(monkeypatch, tmp_path / "disk")

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)

    class DiskFillsAtTheEnd(L.Callback):
        def on_train_end(self, trainer, pl_module):
            disk.armed = True

    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ResiliencyCallback(interval=1, checkpoint=_config(tmp_path),
                                                      enable_detection=False), DiskFillsAtTheEnd()])
    with pytest.raises(BackgroundError) as info:
        trainer.fit(Tiny())
    _message_names_the_problem_and_the_file(info.value, errno.ENOSPC, tmp_path / "disk")
