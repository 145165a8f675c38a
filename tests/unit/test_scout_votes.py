"""SCOUT vote evidence and configuration: the split travels with every report that is not clean."""

from dataclasses import replace

import pytest

from lm_resiliency.config import ConfigError
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.peers import split, voted_outcome
from lm_resiliency.scout.reports import ReplayResult, replay_fault_reports


def test_reports_carry_the_split_and_the_majority_assumption():
    sdc = voted_outcome("hidden", "blocks.1", (0, 1, 2, 3), {0: "a", 1: "a", 2: "b", 3: "a"}, "test")
    tie = voted_outcome("output", "head", (0, 1, 2, 3), {0: "a", 1: "b", 2: "b", 3: "a"}, "test")
    reports = replay_fault_reports(ReplayResult(4, (sdc, tie)))
    assert [(r.kind, r.ranks) for r in reports] == [("sdc", (2,)), ("sdc_inconclusive", (0, 1, 2, 3))]
    assert reports[0].evidence["split"] == {"a": [0, 1, 3], "b": [2]}
    assert "strict healthy majority" in reports[0].evidence["assumes"]
    assert reports[1].evidence["split"] == {"a": [0, 3], "b": [1, 2]} and "assumes" not in reports[1].evidence
    assert split({3: "x", 0: "y", 1: "x"}) == {"x": [1, 3], "y": [0]}


def test_error_outcomes_are_not_sdc_and_not_reported():
    result = ReplayResult(2, (voted_outcome("output", "head", (0, 1, 2), {0: "a", 1: "a", 2: "a"}, "test"),))
    failed = replace(result.checks[0], verdict="error", detail="boom")
    result = ReplayResult(2, (failed,))
    assert result.errors == (failed,) and not result.sdc and not result.inconclusive and result.healthy
    assert replay_fault_reports(result) == []


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_reference_max_bytes_is_validated(value):
    with pytest.raises(ConfigError, match="reference_max_bytes"):
        ReplayHarnessConfig(reference_max_bytes=value)
