"""Rank functions shared by the GEMINI distributed tests (module-level so ranks can import them)."""

import os
import random

import numpy as np
import torch

from lm_resiliency.experimental import InMemoryCheckpointManager


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def full_state(model, optimizer, step):
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        # No NaN here: a non-finite value anywhere in a direct save() is refused (check_finite).
        "extra": {"step": step, "name": "run", "lr": 0.01, "eps": 1e-300, "ids": (1, 2, 3),
                  "np_scalar": np.float32(1.5), "dtype": torch.bfloat16},
    }


def snapshot(state):
    """A deep copy with cloned tensors, safe to return from a rank."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    if isinstance(state, np.ndarray):
        return state.copy()
    return state


def train(rank, steps, config, save_every, manager=None, seed=0):
    """The GEMINI guide's loop. Returns (manager, model, optimizer, expected state at last capture)."""
    model = make_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = manager or InMemoryCheckpointManager(config)
    gen = torch.Generator().manual_seed(100 + rank)
    expected = None
    for step in range(1, steps + 1):
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        loss.backward()
        manager.maybe_wait()
        optimizer.step()
        optimizer.zero_grad()
        if step % save_every == 0:
            state = full_state(model, optimizer, step)
            expected = (step, snapshot(state))
            manager.save(state, step)
    manager.maybe_wait()
    return manager, model, optimizer, expected


def assert_same(actual, expected, path="state"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual.view(torch.uint8) if actual.dtype == torch.bool else actual, expected) or \
            actual.numpy().tobytes() == expected.numpy().tobytes(), path
        return
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray) and actual.dtype == expected.dtype, path
        assert actual.tobytes() == expected.tobytes(), path
        return
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), f"{path}: keys {list(actual)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
        return
    if isinstance(expected, float) and expected != expected:
        assert actual != actual, path
        return
    assert type(actual) is type(expected) and actual == expected, f"{path}: {actual!r} != {expected!r}"


def shard_dir(config, manager):
    return manager.store.directory


def env_rank():
    return int(os.environ["RANK"])
