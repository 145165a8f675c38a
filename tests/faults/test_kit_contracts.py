"""The fault kit's contracts from the API guide: evaluation compares ranks, resources and components;
permanent and bounded state faults behave as scheduled; a changed manifest is refused; executors are
deactivated; bad schedules are refused when the campaign is built."""

import pytest
import torch

from lm_resiliency.faults import (CampaignIdentityError, CampaignJournal, CorruptionOperation, FailureType,
                                  FaultCampaign, FaultIncident, FaultScope, FaultSpec, FaultSurface, FaultTarget,
                                  IncidentLifetime, IncidentTrigger, InjectionStatus, JsonCampaignStateStore,
                                  IterationRange, LocalizationResult, enable_fault_injection)
from lm_resiliency.scout.reports import CheckOutcome, ReplayResult, replay_fault_reports

from .workloads import batches, make_model, train


def _labelled_campaign(resource="layers.2", component="layers.2", seed=0):
    return FaultCampaign(name="labelled", seed=seed, incidents=(FaultIncident(
        incident_id="sdc", trigger=IncidentTrigger(at=(2,)),
        faults=(FaultSpec(fault_id="flip", type=FailureType.TENSOR_CORRUPTION,
                          target=FaultTarget(rank=1, module_path="layers.2", surface=FaultSurface.OUTPUT,
                                             resource=resource, component=component),
                          parameters={"operation": CorruptionOperation.SIGN_FLIP.value,
                                      "scope": FaultScope.FULL.value}),)),))


def _scout_claim(module_path, rank=1, step=2, check="output"):
    """What SCOUT's vote reports for `check` of `module_path`, as a neutral localization."""
    result = ReplayResult(step=step, checks=(CheckOutcome(
        check=check, module_path=module_path, group_ranks=(0, 1, 2),
        signatures={0: "aa", 1: "bb", 2: "aa"} if rank == 1 else {0: "aa", 1: "aa", 2: "bb"},
        verdict="sdc", faulty=(rank,), hosts={rank: f"node-{rank}"}),))
    (report,) = replay_fault_reports(result)
    return LocalizationResult.from_fault_report(report)


def _injected_on_rank_1(campaign):
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=campaign, rank=1, world_size=3)
    train(model, optimizer, batches(3))
    return faults


# ------------------------------------------------------------------ evaluation: ranks, resources, components


def test_the_right_rank_resource_and_component_is_localized_exactly():
    faults = _injected_on_rank_1(_labelled_campaign())
    claim = _scout_claim("layers.2")
    assert (claim.resource, claim.components) == ("output:layers.2", ("layers.2",))
    e = faults.evaluate([claim]).evaluation("sdc@2")
    assert e.localized_exactly and e.truth_resources == ("layers.2",) and e.truth_components == ("layers.2",)
    assert (e.false_positive_resources, e.missed_resources, e.false_positive_components) == ((), (), ())


def test_an_over_claimed_resource_is_not_localized_even_with_the_right_rank():
    faults = _injected_on_rank_1(_labelled_campaign())
    right, wrong = _scout_claim("layers.2"), _scout_claim("layers.1", check="hidden")
    e = faults.evaluate([right, wrong]).evaluation("sdc@2")
    assert e.claimed_ranks == e.truth_ranks == (1,)
    assert not e.localized_exactly and e.time_to_localize_s is None
    assert e.false_positive_resources == ("hidden:layers.1",) and e.false_positive_components == ("layers.1",)
    # The wrong module alone: right rank, wrong resource and component, nothing named right.
    e = faults.evaluate([wrong]).evaluation("sdc@2")
    assert not e.localized_exactly and e.missed_resources == ("layers.2",) and e.missed_components == ("layers.2",)


def test_an_over_claimed_component_is_not_localized():
    faults = _injected_on_rank_1(_labelled_campaign(resource="output:layers.2", component="gpu:1"))
    claim = LocalizationResult(ranks=(1,), kind="sdc", iteration=2, resource="output:layers.2",
                               components=("gpu:1", "nvlink:1-2"))
    e = faults.evaluate([claim]).evaluation("sdc@2")
    assert not e.localized_exactly and e.false_positive_components == ("nvlink:1-2",)
    exact = LocalizationResult(ranks=(1,), kind="sdc", iteration=2, resource="output:layers.2", components=("gpu:1",))
    assert faults.evaluate([exact]).evaluation("sdc@2").localized_exactly


def test_unlabelled_faults_are_scored_by_rank_alone_and_components_round_trip_through_json():
    faults = _injected_on_rank_1(_labelled_campaign(resource=None, component=None))
    claim = _scout_claim("layers.1", check="hidden")
    e = faults.evaluate([claim]).evaluation("sdc@2")
    assert e.localized_exactly and e.truth_resources == () and e.false_positive_resources == ()
    assert LocalizationResult.from_json(claim.to_json()) == claim
    (record,) = faults.records
    assert (record.resource, record.component, record.campaign_digest) == (None, None, faults.campaign.digest)


# ------------------------------------------------------------------ the manifest's identity


def test_a_restarted_campaign_whose_manifest_changed_under_the_same_name_is_refused(tmp_path):
    store, journal = JsonCampaignStateStore(str(tmp_path / "state.json")), CampaignJournal(str(tmp_path / "j.jsonl"))
    first = _labelled_campaign(seed=0)
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=first, rank=1, world_size=3,
                                    state_store=store, journal=journal)
    train(model, optimizer, batches(3))
    faults.close()
    changed = _labelled_campaign(seed=7)     # same name, same ids: another manifest
    assert changed.name == first.name and changed.digest != first.digest
    model, optimizer = make_model()
    with pytest.raises(CampaignIdentityError, match=r"belongs to campaign 'labelled' with manifest "
                                                    + first.digest + r", not campaign 'labelled' with manifest "
                                                    + changed.digest + r": the manifest changed under its name"):
        enable_fault_injection(model, optimizer, campaign=changed, rank=1, world_size=3, state_store=store,
                               journal=journal)
    with pytest.raises(CampaignIdentityError, match=r"campaign journal .* holds records of manifest\(s\) \['"
                                                    + first.digest):
        enable_fault_injection(model, optimizer, campaign=changed, rank=1, world_size=3,
                               state_store=JsonCampaignStateStore(str(tmp_path / "fresh.json")), journal=journal)
    # The same manifest restarts: its claim holds, the replayed iteration is not injected twice.
    again = enable_fault_injection(model, optimizer, campaign=FaultCampaign.from_json(first.to_json()), rank=1,
                                   world_size=3,
                                   state_store=store, journal=journal, start_iteration=1)
    train(model, optimizer, batches(2))
    assert [r.status for r in again.records] == [InjectionStatus.ALREADY_CLAIMED]


# ------------------------------------------------------------------ state faults: held while in effect, restored after


def _state_campaign(lifetime, operation="sign_flip", at=(2,), **parameters):
    return FaultCampaign(name="state", incidents=(FaultIncident(
        incident_id="state", trigger=IncidentTrigger(at=at), lifetime=lifetime,
        faults=(FaultSpec(fault_id="w", type=FailureType.TENSOR_CORRUPTION,
                          target=FaultTarget(rank=0, module_path="layers.1", surface=FaultSurface.PARAMETER),
                          parameters={"operation": operation, "parameter": "weight", **parameters}),)),))


def _weight_at_each_forward(model):
    """layers.1.weight as each iteration's forward sees it (after the kit's iteration-start work)."""
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(model.layers[1].weight.detach().clone()))
    return seen


def test_a_permanent_sign_flip_of_a_parameter_stays_in_effect_and_is_undone_at_close():
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=_state_campaign(IncidentLifetime(permanent=True)))
    seen = _weight_at_each_forward(model)
    data = batches(6)
    train(model, optimizer, data[:1])
    original = model.layers[1].weight.detach().clone()       # what iteration 2 starts from
    train(model, optimizer, data[1:])
    flipped = torch.signbit(seen[1])
    assert torch.equal(flipped, ~torch.signbit(original))
    for iteration in range(3, 7):   # held: the weight never flips back (old code re-flipped it every iteration)
        assert torch.equal(torch.signbit(seen[iteration - 1]), flipped), iteration
    records = faults.records
    assert [r.iteration for r in records] == [2, 3, 4, 5, 6] and records[0].evidence["elements_changed"] == 16
    assert all(r.evidence.get("held") for r in records[1:])
    faults.close()
    assert torch.equal(model.layers[1].weight, original)    # the original values are back
    assert faults.records[-1].status is InjectionStatus.DEACTIVATED
    assert faults.records[-1].evidence["elements_restored"] == 16


def test_a_permanent_bit_flip_holds_the_bit_training_would_change():
    model, optimizer = make_model()
    campaign = _state_campaign(IncidentLifetime(permanent=True), operation="bit_flip", scope="element", index=5,
                               bit=22)
    enable_fault_injection(model, optimizer, campaign=campaign)
    seen = _weight_at_each_forward(model)
    data = batches(5)
    train(model, optimizer, data[:1])
    bit = (model.layers[1].weight.detach().reshape(-1)[5].view(torch.int32) >> 22) & 1
    train(model, optimizer, data[1:])
    held = [int((w.reshape(-1)[5].view(torch.int32) >> 22) & 1) for w in seen[1:]]
    assert held == [1 - int(bit)] * 4


def test_a_bounded_state_fault_is_retired_at_the_end_of_its_window_with_the_original_value_restored():
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=_state_campaign(IncidentLifetime(iterations=2)))
    seen = _weight_at_each_forward(model)
    data = batches(5)
    train(model, optimizer, data[:1])
    original = model.layers[1].weight.detach().clone()
    train(model, optimizer, data[1:])
    assert torch.equal(torch.signbit(seen[1]), ~torch.signbit(original))       # iteration 2: flipped
    assert torch.equal(torch.signbit(seen[2]), torch.signbit(seen[1]))         # iteration 3: still flipped
    assert torch.equal(seen[3], original)                                       # iteration 4: restored
    statuses = [(r.iteration, r.status.value) for r in faults.records]
    assert statuses == [(2, "injected"), (3, "injected"), (4, "deactivated")]
    assert faults.records[-1].detail == "original values restored (expired)"
    assert faults.active_occurrences == ()


# ------------------------------------------------------------------ external executors are deactivated


def _partition_campaign(lifetime, type_=FailureType.NETWORK_PARTITION, surface=FaultSurface.NETWORK, at=(2,),
                        module_path=None):
    return FaultCampaign(name="external", incidents=(FaultIncident(
        incident_id="cut", trigger=IncidentTrigger(at=at), lifetime=lifetime,
        faults=(FaultSpec(fault_id="cut", type=type_, target=FaultTarget(rank=0, surface=surface,
                                                                          module_path=module_path),
                          parameters={"seconds": 0.0} if type_ is FailureType.DELAY else {}),)),))


class Partitions:
    """A stand-in for a network controller: what a custom executor opened and closed."""

    def __init__(self):
        self.events = []

    def executor(self):
        from lm_resiliency.faults import CallbackFaultExecutor, FaultExecutionResult

        def start(request):
            request.context.setdefault("opened", request.iteration)
            self.events.append(("open", request.occurrence_id, request.iteration))
            return FaultExecutionResult(evidence={"partition": "open"})

        def stop(request):
            self.events.append(("close", request.occurrence_id, request.reason, request.iteration,
                                request.context["opened"]))
            return FaultExecutionResult(evidence={"partition": "closed"})
        return CallbackFaultExecutor(start, deactivate=stop)


def test_an_external_executor_is_deactivated_at_expiry_replacement_and_close():
    partitions = Partitions()
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=_partition_campaign(IncidentLifetime(iterations=2)),
                                    executor=partitions.executor())
    train(model, optimizer, batches(5))
    assert partitions.events == [("open", "cut@2", 2), ("open", "cut@2", 3), ("close", "cut@2", "expired", 4, 2)]
    assert [r.status.value for r in faults.records] == ["injected", "injected", "deactivated"]
    faults.close()

    partitions = Partitions()   # a forward fault with calls left is replaced by the incident's next occurrence
    model, optimizer = make_model()
    campaign = _partition_campaign(IncidentLifetime(matching_calls=5), FailureType.DELAY, FaultSurface.OUTPUT,
                                   at=(2, 3), module_path="layers.0")
    faults = enable_fault_injection(model, optimizer, campaign=campaign, executor=partitions.executor())
    train(model, optimizer, batches(3))
    assert partitions.events[:3] == [("open", "cut@2", 2), ("close", "cut@2", "replaced", 3, 2),
                                     ("open", "cut@3", 3)]
    faults.close()
    assert partitions.events[3:] == [("close", "cut@3", "closed", 4, 3)]

    partitions = Partitions()   # permanent: undone only when the session closes
    model, optimizer = make_model()
    faults = enable_fault_injection(model, optimizer, campaign=_partition_campaign(IncidentLifetime(permanent=True)),
                                    executor=partitions.executor())
    train(model, optimizer, batches(4))
    assert [e[0] for e in partitions.events] == ["open"] * 3
    faults.close()
    assert partitions.events[-1] == ("close", "cut@2", "closed", 5, 2)


# ------------------------------------------------------------------ refused when the campaign is built


def _incident(trigger, lifetime, surface=FaultSurface.PARAMETER, module_path="layers.1"):
    return FaultIncident(incident_id="i", trigger=trigger, lifetime=lifetime, faults=(FaultSpec(
        fault_id="f", type=FailureType.TENSOR_CORRUPTION, target=FaultTarget(0, module_path, surface),
        parameters={"operation": "sign_flip"}),))


@pytest.mark.parametrize("trigger, lifetime, message", [
    (IncidentTrigger(at=(2, 3)), IncidentLifetime(iterations=2),
     r"occurrences at ticks 2 and 3 would overlap: each stays in effect 2 iterations \(lifetime "
     r"\{'iterations': 2\}\), and the later one would replace the earlier while it is in effect"),
    (IncidentTrigger(at=(2, 4)), IncidentLifetime(matching_calls=3),
     r"occurrences at ticks 2 and 4 would overlap: each stays in effect 3 iterations"),
    (IncidentTrigger(range=IterationRange(start=3, every=2)), IncidentLifetime(permanent=True),
     r"a permanent incident stays in effect until the run ends, so its occurrences at ticks 3 and 5 would overlap"),
    (IncidentTrigger(probability=0.1), IncidentLifetime(iterations=3), r"occurrences at ticks 1 and 2 would overlap"),
])
def test_overlapping_trigger_windows_are_refused_when_the_campaign_is_built(trigger, lifetime, message):
    from lm_resiliency.faults import CampaignSchemaError

    with pytest.raises(CampaignSchemaError, match=r"^FaultCampaign.incidents\[0\].trigger: " + message):
        FaultCampaign(name="c", incidents=(_incident(trigger, lifetime),))
    manifest = {"schema_version": 1, "name": "c", "incidents": [_incident(IncidentTrigger(at=(9,)), lifetime).to_json()]}
    manifest["incidents"][0]["trigger"] = trigger.to_json()
    with pytest.raises(CampaignSchemaError, match=r"incidents\[0\].trigger: " + message):
        FaultCampaign.from_json(manifest)


def test_windows_that_do_not_overlap_are_accepted():
    FaultCampaign(name="c", incidents=(_incident(IncidentTrigger(at=(2, 4)), IncidentLifetime(iterations=2)),))
    # A forward fault's calls need not be one per iteration: no fixed window, nothing to refuse.
    FaultCampaign(name="c", incidents=(_incident(IncidentTrigger(at=(2, 3)), IncidentLifetime(matching_calls=3),
                                                 surface=FaultSurface.OUTPUT),))


def test_several_candidates_for_a_matching_calls_lifetime_are_refused_at_attach():
    from lm_resiliency.faults import UnsupportedFaultError

    def campaign(lifetime, module_path="layers.1"):
        return FaultCampaign(name="c", incidents=(_incident(IncidentTrigger(at=(2,)), lifetime,
                                                            FaultSurface.OUTPUT, module_path),))

    model, optimizer = make_model()
    model.layers[2] = model.layers[1]        # one module called at two places of the forward
    with pytest.raises(UnsupportedFaultError, match=r"module_path 'layers.1' names 2 candidates \(layers.1, "
                                                    r"layers.2\) and a matching_calls lifetime counts the calls of one"):
        enable_fault_injection(model, optimizer, campaign=campaign(IncidentLifetime(matching_calls=1)))
    faults = enable_fault_injection(model, optimizer, campaign=campaign(IncidentLifetime(iterations=1)))
    train(model, optimizer, batches(2))
    assert len([r for r in faults.records if r.injected]) == 2       # both calls of iteration 2
    faults.close()
    # Model chunks: a bare path names it in every chunk; an index names one chunk's.
    chunks = [make_model()[0], make_model(seed=1)[0]]
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.05)
    with pytest.raises(UnsupportedFaultError, match=r"names 2 candidates \(0.layers.1, 1.layers.1\)"):
        enable_fault_injection(chunks, optimizer, campaign=campaign(IncidentLifetime(matching_calls=1)))
    faults = enable_fault_injection(chunks, optimizer, campaign=campaign(IncidentLifetime(matching_calls=1),
                                                                          "1.layers.1"))
    for x in batches(3):
        sum(c(x).pow(2).mean() for c in chunks).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert [(r.iteration, r.status.value) for r in faults.records] == [(2, "injected")]


def test_a_gradient_fault_on_a_frozen_parameter_is_refused_at_attach_and_unsupported_is_a_value_error():
    from lm_resiliency.faults import UnsupportedFaultError

    model, optimizer = make_model()
    model.layers[0].requires_grad_(False)
    campaign = FaultCampaign(name="c", incidents=(FaultIncident(incident_id="g", trigger=IncidentTrigger(at=(2,)),
        faults=(FaultSpec(fault_id="g", type=FailureType.TENSOR_CORRUPTION,
                          target=FaultTarget(0, "layers.0", FaultSurface.GRADIENT),
                          parameters={"operation": "nan"}),)),))
    with pytest.raises(ValueError, match=r"fault 'g' cannot be injected here: every parameter it targets in "
                                         r"layers.0 \(weight, bias\) is frozen \(requires_grad=False\)") as error:
        enable_fault_injection(model, optimizer, campaign=campaign)
    assert isinstance(error.value, UnsupportedFaultError) and issubclass(UnsupportedFaultError, ValueError)
    faults = enable_fault_injection(model, optimizer, campaign=campaign, strict=False)
    train(model, optimizer, batches(2))
    assert [r.status.value for r in faults.records] == ["unsupported"]
