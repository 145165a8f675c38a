"""What an adapter's expert layout becomes: the gathered group partition, and the expert modules
dense replay leaves out (single process; the multi-rank reading is in tests/frameworks)."""

import pytest
from torch import nn

from lm_resiliency.adapter import gather_partition
from lm_resiliency.scout.harness import _declared_experts
from lm_resiliency.scout.replay import ReplayUnsupportedError


def test_gather_partition_refuses_groups_that_do_not_partition_the_job():
    assert gather_partition([0], 1.0, "test adapter") == [[0]]
    with pytest.raises(RuntimeError, match=r"^test adapter: the process groups \[\[1\]\] do not partition the 1 "):
        gather_partition([1], 1.0, "test adapter")


def test_declared_expert_modules_are_looked_up_by_path():
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(2, 2)])}))
    assert _declared_experts(model, {"expert_modules": ["1.experts"]}) == (model[1]["experts"],)
    assert _declared_experts(model, {}) == () and _declared_experts(model, None) == ()
    with pytest.raises(ReplayUnsupportedError, match=r"expert modules \['moe.experts'\] that the replayed model"):
        _declared_experts(model, {"expert_modules": ["moe.experts"]})
