"""Configuration drift across real gloo processes: ranks gather their fingerprints and name the odd one."""

import os

import torch

from lm_resiliency import wire
from lm_resiliency.faults import (FaultCampaign, FaultIncident, FaultSpec, FaultTarget, IncidentLifetime,
                                  IncidentTrigger, enable_fault_injection)
from lm_resiliency.manager_api import find_drift, format_drift, local_fingerprint
from tests.faults.workloads import batches, make_model, train
from tests.harness import run_ranks


def _gather_and_compare(rank, world, changes):
    change = changes.get(rank)
    if change == "env":
        os.environ["NCCL_ALGO"] = "Tree"
    elif change == "deterministic":
        torch.use_deterministic_algorithms(True)
    drift = find_drift(wire.all_gather_json(local_fingerprint()))
    return drift, format_drift(drift)


def test_clean_ranks_have_no_drift():
    outcomes = run_ranks(_gather_and_compare, 3, {}, timeout=120)
    assert outcomes == [({}, "no configuration drift")] * 3


def test_each_drifted_rank_is_named_with_exactly_its_field():
    outcomes = run_ranks(_gather_and_compare, 4, {1: "env", 3: "deterministic"}, timeout=120)

    drift, report = outcomes[0]
    assert drift == {
        "determinism.deterministic_algorithms": {
            "values": [{"value": False, "ranks": [0, 1, 2]}, {"value": True, "ranks": [3]}],
            "majority": {"value": False, "ranks": [0, 1, 2]},
            "minority_ranks": [3],
        },
        "env.NCCL_ALGO": {
            "values": [{"missing": True, "ranks": [0, 2, 3]}, {"value": "Tree", "ranks": [1]}],
            "majority": {"missing": True, "ranks": [0, 2, 3]},
            "minority_ranks": [1],
        },
    }
    assert report == ("determinism.deterministic_algorithms: false on ranks 0-2 (majority); true on rank 3\n"
                      "env.NCCL_ALGO: unset on ranks 0, 2-3 (majority); \"Tree\" on rank 1")
    # Every rank gathered the same documents, so every rank reaches the same verdict.
    assert all(outcome == outcomes[0] for outcome in outcomes)


def _train_with_injected_drift(rank, world, target):
    model, optimizer = make_model()
    campaign = FaultCampaign("drift", (FaultIncident("c", IncidentTrigger(at=(2,)), (
        FaultSpec("lr", "config_drift", FaultTarget(target, surface="config"), {"key": "lr", "value": 0.5}),
        FaultSpec("env", "config_drift", FaultTarget(target, surface="config"),
                  {"env": "LMR_DRIFT_TEST_MODE", "value": 7}),
    ), lifetime=IncidentLifetime(permanent=True)),))
    faults = enable_fault_injection(model, optimizer, campaign=campaign)
    train(model, optimizer, batches(3))
    # Fingerprinted while the (permanent) drift is in effect: closing the kit restores what it changed.
    fingerprint = local_fingerprint(optimizer=optimizer, env_names=["LMR_DRIFT_TEST_MODE"])
    faults.close()
    return find_drift(wire.all_gather_json(fingerprint))


def test_drift_injected_by_the_fault_kit_is_found_on_the_target_rank():
    # Ground truth from the fault kit's config_drift: only rank 2's lr and environment change.
    outcomes = run_ranks(_train_with_injected_drift, 3, 2, timeout=120)

    drift = outcomes[0]
    assert sorted(drift) == ["env.LMR_DRIFT_TEST_MODE", "optimizer.param_groups.0.lr"]
    assert drift["optimizer.param_groups.0.lr"]["values"][1] == {"value": 0.5, "ranks": [2]}
    assert drift["env.LMR_DRIFT_TEST_MODE"]["values"][1] == {"value": "7", "ranks": [2]}
    assert all(entry["minority_ranks"] == [2] for entry in drift.values())
    assert all(outcome == drift for outcome in outcomes)
