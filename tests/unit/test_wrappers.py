"""lm_resiliency/wrappers.py: the one walk through DDP, DataParallel and torch.compile wrappers,
used by the PyTorch adapter (state_dict keys, the DDP to pin), SCOUT replay and the DDP trace."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency.wrappers import find_ddp, unwrap_model
from tests.harness import run_ranks


def _nestings(rank, world):
    inner = nn.Linear(4, 2)
    ddp = DDP(inner)
    compiled_outside = torch.compile(ddp)
    compiled_inside = DDP(torch.compile(nn.Linear(4, 2)))
    return {
        "ddp": (unwrap_model(ddp) is inner, find_ddp(ddp) is ddp),
        "compile(ddp)": (unwrap_model(compiled_outside) is inner, find_ddp(compiled_outside) is ddp),
        "ddp(compile)": (list(unwrap_model(compiled_inside).state_dict()) == ["weight", "bias"],
                         find_ddp(compiled_inside) is compiled_inside),
    }


def test_unwrap_and_find_ddp_through_every_nesting_of_real_ddp():
    for result in run_ranks(_nestings, 2, timeout=120):
        assert result == {"ddp": (True, True), "compile(ddp)": (True, True), "ddp(compile)": (True, True)}


def test_plain_data_parallel_and_compiled_models_unwrap_to_the_users_module():
    inner = nn.Linear(4, 2)
    assert unwrap_model(inner) is inner and find_ddp(inner) is None
    assert unwrap_model(nn.DataParallel(inner)) is inner
    compiled = torch.compile(inner)
    assert unwrap_model(compiled) is inner and find_ddp(compiled) is None
    assert list(unwrap_model(torch.compile(nn.DataParallel(inner))).state_dict()) == ["weight", "bias"]
