"""The torchrun resiliency cycle (examples/torchrun/resiliency_cycle): the campaign files it ships,
and real runs of `pressure orchestrate` (torchrun agents with `--rdzv-backend=lm_resiliency`, one
machine-id file each, gloo, a DDP module that never calls enable_resiliency)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from examples.torchrun.resiliency_cycle import campaign as cycle_campaign
from examples.torchrun.resiliency_cycle import pressure
from lm_resiliency.faults import FailureType

CAMPAIGNS = os.path.join(os.path.dirname(cycle_campaign.__file__), "campaigns")


def _load(name: str, active: int, standbys: int) -> cycle_campaign.CycleCampaign:
    return cycle_campaign.load(os.path.join(CAMPAIGNS, name), active, standbys)


def test_the_pressure_campaign_covers_all_21_types_17_same_node_and_4_replacements():
    campaign = _load("single_node_pressure.json", 4, 4)
    assert sorted(i.type for i in campaign.incidents) == sorted(FailureType)
    assert [i.expected for i in campaign.incidents].count("same-node") == 17
    assert {i.type.value for i in campaign.incidents if i.expected == "replacement"} == {
        "network_partition", "tensor_corruption", "resource_unavailable", "message_drop"}
    assert len(campaign.fault_campaign().incidents) == 21


def _doc(**incident):
    base = {"id": "x", "type": "exception", "surface": "process", "slot": 0, "step": 4, "expected": "same-node"}
    return {"schema": cycle_campaign.SCHEMA, "name": "t", "steps": 10, "incidents": [dict(base, **incident)]}


@pytest.mark.parametrize("incident, message", [
    ({"surface": "network"}, "$.incidents[0].surface: exception strikes"),
    ({"step": 5}, "$.incidents[0].step: must be a multiple of 2"),
    ({"slot": 3}, "$.incidents[0].slot: must be a training slot 0..2"),
    ({"expected": "elsewhere"}, "$.incidents[0].expected: one of"),
    ({"type": "network_partition", "surface": "network", "expected": "replacement"}, "only 0 standby nodes"),
    ({"parameters": {"bogus": 1}}, "unknown parameter for exception"),
])
def test_an_invalid_cycle_campaign_names_the_field(incident, message):
    with pytest.raises(cycle_campaign.CycleCampaignError) as info:
        cycle_campaign.parse(_doc(**incident), active=3, standbys=0)
    assert message in str(info.value)


def _orchestrate(tmp_path, name: str, nodes: int, active: int, timeout: int) -> dict:
    root = str(tmp_path)
    shutil.copy(os.path.join(CAMPAIGNS, name), os.path.join(root, "campaign.json"))
    code = pressure.main(["orchestrate", "--framework", "pytorch", "--fault-campaign-dir", root, "--nodes", str(nodes),
                          "--active", str(active), "--gpus", "0,1", "--timeout", str(timeout)])
    with open(os.path.join(root, "report.json")) as f:
        report = json.load(f)
    assert code == (0 if report["ok"] else 1)
    return report


def _assert_cycle(report: dict, campaign: cycle_campaign.CycleCampaign) -> None:
    failed = [(r["id"], r["problems"]) for r in report["incidents"] if not r["ok"]]
    assert not failed and report["ok"], (failed, report["final_state"], report["agent_exit_codes"])
    assert [r["outcome"] for r in report["incidents"]] == [i.expected for i in campaign.incidents]
    for row, incident in zip(report["incidents"], campaign.incidents):
        assert 0 < row["selected_step"] < incident.step
        if incident.type is FailureType.TENSOR_CORRUPTION:
            assert row["scout_named"] == [incident.slot]
    assert report["final_state"]["bitwise_equal"]
    assert len(report["killed_nodes"]) == sum(1 for incident in campaign.incidents if incident.node_loss)
    assert all(code == 0 for node, code in report["agent_exit_codes"].items() if int(node) not in report["killed_nodes"])


@pytest.mark.timeout(900)
def test_short_cycle_a_killed_worker_a_localized_sdc_and_a_lost_node_end_bitwise_equal(tmp_path):
    """3 active agents + 2 standbys: a SIGKILLed worker restarts on its node; a parameter SDC
    (SCOUT names rank 2) retires that node and a whole-node loss is replaced, each by a standby;
    every successor generation loads the step the agents selected; the final state equals the
    baseline's."""
    report = _orchestrate(tmp_path, "short_cycle.json", nodes=5, active=3, timeout=300)
    _assert_cycle(report, _load("short_cycle.json", 3, 2))


@pytest.mark.slow
@pytest.mark.timeout(5400)
def test_full_cycle_all_21_failure_types_on_8_agents(tmp_path):
    report = _orchestrate(tmp_path, "single_node_pressure.json", nodes=8, active=4, timeout=400)
    _assert_cycle(report, _load("single_node_pressure.json", 4, 4))
