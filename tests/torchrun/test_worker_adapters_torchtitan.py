"""TorchTitanWorkerAdapter on TorchTitan's real Trainer (CPU patches of tests/frameworks/
torchtitan_cpu.py, FSDP over 3 gloo ranks), the bootstrap driven as the shim drives it."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)

from tests.harness import run_ranks
from tests.torchrun.worker_workloads import titan_train


def _env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.getsockname()[1])}


@pytest.mark.slow  # about 9 minutes on 2 busy cores: two 3-rank TorchTitan runs
@pytest.mark.timeout(2400)
def test_trainer_worker_recovers_exactly_the_selected_step_bitwise(tmp_path):
    first = run_ranks(titan_train, 3, str(tmp_path), 4, timeout=900, init=False, env=_env())
    assert [row[:3] for row in first] == [(1, 4, None)] * 3
    # Told to load step 2 (not the newer 4): train() starts at step 3 and ends bitwise equal.
    second = run_ranks(titan_train, 3, str(tmp_path), 4, 2, timeout=900, init=False, env=_env())
    assert [row[:3] for row in second] == [(3, 4, "gemini")] * 3
    for rank in range(3):
        before, after = first[rank][3], second[rank][3]
        assert (before["step"], after["step"], before["lr"]) == (4, 4, after["lr"])
        assert before["ntokens_seen"] == after["ntokens_seen"]
        tensors = {**{("model", n): v for n, v in before["model"].items()},
                   **{(n, k): v for n, moments in before["optimizer"].items() for k, v in moments.items()}}
        found = {**{("model", n): v for n, v in after["model"].items()},
                 **{(n, k): v for n, moments in after["optimizer"].items() for k, v in moments.items()}}
        assert tensors.keys() == found.keys()
        different = [key for key in tensors if not torch.equal(tensors[key], found[key])]
        assert not different, f"rank {rank} differs after recovering step 2: {different}"
