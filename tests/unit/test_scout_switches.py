"""SCOUT's switches in one process: 0 turns periodic replay (`check_interval`) or one check class
(`*_check_interval`, e.g. the output check) off; the top-level `interval` never turns it back on."""

import pytest
import torch

from lm_resiliency import InMemoryCkptConfig, ReplayHarnessConfig, enable_resiliency
from lm_resiliency.config import ConfigError
from lm_resiliency.scout.replay import ReplayDetector
from tests.distributed.scout_workloads import make_model


def test_zero_is_accepted_as_off_and_negative_values_are_refused_naming_the_field():
    off = ReplayHarnessConfig(check_interval=0)
    assert not off.replay_enabled and off.probe_interval == 0 and off.round_interval == 0
    assert [off.due(c, 10) for c in ("embedding", "hidden", "output", "optimizer")] == [False] * 4
    only_hidden = ReplayHarnessConfig(check_interval=0, hidden_check_interval=5)
    assert only_hidden.replay_enabled and only_hidden.round_interval == 5
    assert [only_hidden.due("hidden", s) for s in (4, 5, 10)] == [False, True, True]
    no_output = ReplayHarnessConfig(check_interval=4, output_check_interval=0)
    assert no_output.due("hidden", 8) and not no_output.due("output", 8)
    with pytest.raises(ConfigError, match=r"^ReplayHarnessConfig.check_interval: must be a non-negative integer "
                                          r"number of optimizer steps \(0: periodic replay off\), at most 1000000000, got -1$"):
        ReplayHarnessConfig(check_interval=-1)
    with pytest.raises(ConfigError, match=r"^ReplayHarnessConfig.output_check_interval: must be None \(inherit "
                                          r"check_interval\), 0 \(off\) or a positive integer, at most 1000000000, got -2$"):
        ReplayHarnessConfig(output_check_interval=-2)


def test_the_output_check_off_is_never_scheduled_and_leaves_the_head_uncovered():
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters())
    detector = ReplayDetector(model, optimizer, ReplayHarnessConfig(check_interval=1, output_check_interval=0),
                              group=None, group_ranks=[0])
    assert [detector.checks_due(s) for s in (1, 2)] == [["embedding", "hidden", "optimizer"]] * 2
    assert detector.coverage()["uncovered"] == ["head.weight", "head.bias"]
    detector.close()


def test_replay_off_keeps_gemini_and_the_top_level_interval_does_not_turn_it_on(tmp_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = enable_resiliency(model, optimizer, interval=2, replay=ReplayHarnessConfig(check_interval=0),
                                checkpoint=InMemoryCkptConfig(disk_folder=str(tmp_path), run_id="switch"))
    try:
        assert session.replay_config.check_interval == 0 and session.config.interval == 2
        assert session.scout is not None and session.scout.detector is None and session.ledger is None
        for _ in range(4):
            model(torch.randint(0, 50, (8,))).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        model(torch.randint(0, 50, (8,)))
        session.manager.maybe_wait()
        assert session.manager.latest_step == 4 and session.last_replay_result is None
    finally:
        session.close()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session = enable_resiliency(model, optimizer, interval=3, replay=ReplayHarnessConfig(check_interval=5),
                                checkpoint=InMemoryCkptConfig(disk_folder=str(tmp_path / "b"), run_id="switch-b"))
    assert session.replay_config.check_interval == 3   # a positive base is the shared cadence
    session.close()


def test_a_capture_cadence_only_an_off_class_would_match_is_refused(tmp_path):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"InMemoryCkptConfig.interval=4 is not a multiple of any SCOUT check "
                                         r"interval \{'embedding': 3, 'hidden': 3, 'output': 0, 'optimizer': 3\}"):
        enable_resiliency(model, optimizer, checkpoint=InMemoryCkptConfig(interval=4, disk_folder=str(tmp_path),
                                                                          run_id="cadence"),
                          replay=ReplayHarnessConfig(check_interval=3, output_check_interval=0))
