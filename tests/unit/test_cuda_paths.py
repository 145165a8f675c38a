"""GEMINI's CUDA paths (marked gpu: skipped without a CUDA device; `pytest -m gpu tests` runs them)."""

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, enable_resiliency
from lm_resiliency.gemini.device import allocate_host_buffer, launch_copy

pytestmark = pytest.mark.gpu


def test_side_stream_copy_survives_the_source_being_freed_and_its_memory_reused():
    expected = torch.arange(1 << 20, dtype=torch.float32)
    destination = allocate_host_buffer(expected.numel() * 4, pin_memory=True).view(torch.float32)
    assert destination.is_pinned()
    source = expected.cuda()
    torch.cuda._sleep(50_000_000)  # keep the training stream busy so the side-stream copy waits
    pending = launch_copy([destination], [source])
    del source  # a snapshot clone the capture no longer references
    reuse = torch.full((1 << 20,), -1.0, device="cuda")  # would take the freed block without record_stream
    pending.finish()
    assert torch.equal(destination, expected)
    del reuse


def _cuda_objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model, optimizer, steps, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(16, 64, device="cuda", generator=g)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_cuda_model_resumes_bitwise_from_pinned_host_slots(tmp_path):
    config = InMemoryCkptConfig(disk_folder=str(tmp_path), run_id="cuda", interval=1, disk_flush_interval=1)
    model, optimizer = _cuda_objects()
    session = enable_resiliency(model, optimizer, checkpoint=config, enable_detection=False)
    _train(model, optimizer, 4, seed=1)
    assert session.flush_for_restart() == 4
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    expected_adam = [s["exp_avg"].cpu().clone() for s in optimizer.state.values()]
    session.close()

    model, optimizer = _cuda_objects()
    session = enable_resiliency(model, optimizer, checkpoint=config, enable_detection=False)
    assert session.step_count == 4 and session.recovered_from == "gemini"
    assert all(torch.equal(v.cpu(), expected[k]) and v.is_cuda for k, v in model.state_dict().items())
    assert all(torch.equal(s["exp_avg"].cpu(), e) for s, e in zip(optimizer.state.values(), expected_adam))
    session.close()
