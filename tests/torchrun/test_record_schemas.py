"""Every torchrun record schema (files on disk, documents in the rendezvous store) against random
documents: each is refused with the record layer's one error type, or read back exactly; the typed
readers above the schemas raise only their own documented error."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings, strategies as st

from lm_resiliency.files import RecordRejected, encode_record, parse_record
from lm_resiliency.torchrun import context as ctx
from lm_resiliency.torchrun.coordinator import (LEASE_RECORD, PLACEMENT_RECORD, SUCCESSOR_RECORD,
                                                TorchrunCoordinatorError, TorchrunSuccessorPlacement, read_placement)
from lm_resiliency.torchrun.launches import LAUNCH_RECORD, LaunchError, parse_launch
from lm_resiliency.torchrun.retirement import ACK_RECORD, FAULT_RECORD, NodeFault
from lm_resiliency.torchrun.selection import NODE_REPORT, NodeReport
from lm_resiliency.torchrun.worker_records import WORKER_RECORD
from tests.unit.test_records import JSON

H = "a" * 32
FAULT = {"schema": "lm-resiliency-torchrun-fault/2", "run_id": "r", "launch_id": H, "node_id": H, "generation": 1,
         "kind": "sdc", "ranks": [1], "slots": [0], "step": 4, "verified_step": 2}
# One valid document per schema, and the typed reader that stands above it (None: the schema alone).
VALID = {
    "context": (ctx.CONTEXT_RECORD, dict(ctx.RestartContext(
        run_id="r", launch_id=H, node_id=H, generation=1, slot=0, nodes=1, nproc_per_node=2,
        topology_digest=ctx.topology_digest("r", 1), policy_digest=None, checkpoint_step=4,
        checkpoint_source="gemini", decision="fresh").to_json()),
        lambda data: ctx.RestartContext.from_json(json.loads(data), "random"), ctx.ContextError),
    "worker": (WORKER_RECORD, {"schema": "lm-resiliency-torchrun-worker/3", "run_id": "r", "launch_id": H,
                               "node_id": H, "generation": 1, "slot": 0, "nodes": 1, "local_rank": 0,
                               "local_world_size": 2, "world_size": 2, "step": 4, "verified_step": -1,
                               "refused_steps": [6]}, None, None),
    "fault": (FAULT_RECORD, FAULT, lambda data: NodeFault.parse(data, "random"), ctx.ContextError),
    "ack": (ACK_RECORD, {"schema": "lm-resiliency-torchrun-fault-ack/1", "run_id": "r", "launch_id": H,
                         "node_id": H, "generation": 1}, None, None),
    "launch": (LAUNCH_RECORD, {"schema": "lm-resiliency-torchrun-launch/1", "launch_id": H, "beat_interval_s": 1.0,
                               "expiry_s": 15.0}, lambda data: parse_launch(data, "random"), LaunchError),
    "report": (NODE_REPORT, {"schema": "lm-resiliency-torchrun-node-report/1", "node_id": H, "generation": 1,
                             "slot": 0, "latest": 4, "verified": 2, "refused": [], "fault": FAULT},
               lambda data: NodeReport.parse(data, "random", 1, 0), ctx.ContextError),
    "placement": (PLACEMENT_RECORD, {"schema": "lm-resiliency-torchrun-placement/1", "run_id": "r", "generation": 0,
                                     "nodes": 1, "node_ids": [H], "topology_digest": ctx.topology_digest("r", 1)},
                  read_placement, TorchrunCoordinatorError),
    "successor": (SUCCESSOR_RECORD, {"schema": "lm-resiliency-torchrun-successor/1", "run_id": "r", "generation": 1,
                                     "kind": "same-node", "retire_slots": [], "checkpoint_step": 4,
                                     "checkpoint_source": "gemini", "trust": "latest", "reason": "x", "nodes": 1,
                                     "topology_digest": "d", "deadline_s": 30.0, "renew_interval_s": 1.0,
                                     "publication": "p"},
                  lambda data: TorchrunSuccessorPlacement.from_json(json.loads(data), "random"),
                  TorchrunCoordinatorError),
    "lease": (LEASE_RECORD, {"sequence": 3, "remaining_s": 2.5}, None, None),
}

@pytest.mark.parametrize("name", sorted(VALID))
def test_each_valid_record_round_trips_through_its_reader(name):
    schema, doc, reader, _ = VALID[name]
    data = encode_record(doc, schema)
    assert parse_record(data, schema, "here") == doc
    if reader is not None:
        reader(data)


def _documents(doc: dict):
    return (st.dictionaries(st.sampled_from([*doc, "other"]), JSON, max_size=len(doc) + 1) | JSON
            | st.builds(lambda key, value: {**doc, key: value}, st.sampled_from([*doc, "other"]), JSON)
            | st.builds(lambda key: {k: v for k, v in doc.items() if k != key}, st.sampled_from(sorted(doc))))


@pytest.mark.parametrize("name", sorted(VALID))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_documents_are_refused_or_round_trip_exactly(name, data):
    schema, valid, reader, error = VALID[name]
    doc = data.draw(_documents(valid))
    text = json.dumps(doc, allow_nan=True)
    parsed = None
    with contextlib.suppress(RecordRejected):
        parsed = parse_record(text, schema, "random")
    assert parsed is None or (parsed == doc and parse_record(encode_record(parsed, schema), schema, "again") == doc)
    if reader is not None:
        with contextlib.suppress(error):
            reader(text.encode())
