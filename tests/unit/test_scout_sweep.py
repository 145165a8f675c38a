"""FullCatalogSweep on one process: what it records, and why it cannot decide alone."""

import math

import pytest
import torch
from torch import nn

from lm_resiliency.config import ConfigError
from lm_resiliency.recovery import SweepOutcome
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.replay import ReplayDetector
from lm_resiliency.scout.sweep import FullCatalogSweep


def _sweep():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    detector = ReplayDetector(model, optimizer, ReplayHarnessConfig(), group=None, group_ranks=[0])
    return model, FullCatalogSweep(detector, timeout_s=5.0)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "60"])
def test_timeout_must_be_positive_finite_seconds(value):
    with pytest.raises(ConfigError, match=r"ReplayHarnessConfig\.full_sweep_timeout_s: must be a positive, finite"):
        ReplayHarnessConfig(full_sweep_timeout_s=value)


def test_records_only_the_first_forward_after_record_as_a_private_copy():
    model, sweep = _sweep()
    model(torch.ones(1, 4))
    assert sweep.latest is None                      # not armed: nothing kept
    sweep.record(6)
    batch = torch.arange(4.0).reshape(1, 4)
    model(batch)
    model(torch.zeros(1, 4))                         # the hook removed itself after one forward
    batch.add_(100)                                  # the caller reusing its buffer changes nothing
    assert sweep.latest.step == 6 and sweep.latest.training
    assert torch.equal(sweep.latest.args[0], torch.arange(4.0).reshape(1, 4)) and sweep.latest.kwargs == {}
    sweep.record(8)
    model(torch.full((1, 4), 2.0))
    assert sweep.latest.step == 8 and torch.equal(sweep.latest.args[0], torch.full((1, 4), 2.0))
    sweep.close()
    assert sweep.latest is None and not model._forward_pre_hooks


def test_a_rank_without_peers_has_no_evidence():
    model, sweep = _sweep()
    sweep.record(2)
    model(torch.ones(1, 4))
    report = sweep.run(2)
    assert report.outcome is SweepOutcome.NOT_RUN and report.result is None
    assert report.reason == "rank 0 has no equivalent peer to compare a replay against (peer group [0])"
