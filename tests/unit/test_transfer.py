"""Checkpoint transfer in one process: backend choice, the offer a receiver refuses before it
allocates or writes anything, bounded waits, and the pair-group rules."""

import json
import os
import sys
import time
import types
from datetime import timedelta

import pytest
import torch.distributed as dist

from lm_resiliency.gemini.storage import NodeLocalStore, ShardKey
from lm_resiliency.manager_api import (
    CheckpointTransfer,
    TransferBackendUnavailable,
    TransferKey,
    TransferMetadataStore,
    TransferRefused,
    make_transfer,
)
from lm_resiliency.manager_api.transfer import TorchDistTransfer, build_offer
from lm_resiliency.manager_api.transfer_metadata import TransferRecord, metadata_crc
from tests.distributed.test_checkpoint_transfer import STRUCTURE, write_replica

RUN = "unit-run"
KEY = TransferKey(RUN, 7, 1)


def _stores(tmp_path, topology="topology"):
    """Rank 2's directory holding rank 1's replica at step 7, and rank 1's empty directory."""
    sender = NodeLocalStore(str(tmp_path / "node-2"), RUN, "topology", 2, verify_integrity=True)
    write_replica(sender, 1, 7, 300)
    receiver = NodeLocalStore(str(tmp_path / "node-1"), RUN, topology, 1, verify_integrity=True)
    return sender, receiver


def _offer(sender_store, **changes):
    record = build_offer(KEY, sender_store.read_shard(ShardKey("peer", 1, 7)), 2, 1, "topology", 512)
    doc = record.to_json()
    doc.update(changes)
    return doc


def _refused_before_writing(tmp_path, doc, match, topology="topology"):
    """Publish `doc` as rank 2's offer; rank 1's receive must refuse it, tell rank 2 why, and
    leave its directory empty."""
    sender, receiver = _stores(tmp_path, topology)
    store = dist.HashStore()
    metadata = TransferMetadataStore(store, timeout_s=5)
    name = metadata.prefix(KEY, 2, 1) + "/offer"
    store.set(name, json.dumps(doc).encode())
    transfer = make_transfer("torch_dist", store=store, rank=1, timeout_s=5)
    with pytest.raises(TransferRefused, match=match) as refused:
        transfer.receive(KEY, receiver, from_rank=2)
    assert os.listdir(receiver.directory) == []
    if isinstance(doc, dict):  # the sender hears why, instead of waiting out its timeout
        name = f"{metadata.prefix(KEY, 2, 1)}/{doc['nonce']}/accept"
        store.wait([name], timedelta(seconds=5))
        answer = json.loads(store.get(name))
        assert answer == {"ok": False, "reason": str(refused.value)}
    return str(refused.value)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'rdma'; choose one of \['torch_dist', 'nixl'\]"):
        make_transfer("rdma", store=dist.HashStore(), rank=0)


def test_nixl_without_nixl_fails_closed_unless_fallback_is_allowed(caplog):
    assert "nixl" not in sys.modules
    with pytest.raises(TransferBackendUnavailable, match="NIXL is not importable.*allow_backend_fallback=True"):
        make_transfer("nixl", store=dist.HashStore(), rank=0)
    transfer = make_transfer("nixl", store=dist.HashStore(), rank=0, allow_backend_fallback=True)
    assert isinstance(transfer, TorchDistTransfer) and isinstance(transfer, CheckpointTransfer)
    assert transfer.backend == "torch_dist"
    assert "falling back to the two-sided torch_dist transfer" in caplog.text


def test_importable_nixl_still_fails_closed(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", types.ModuleType("nixl"))
    with pytest.raises(TransferBackendUnavailable, match="no NIXL transfer implementation"):
        make_transfer("nixl", store=dist.HashStore(), rank=0)
    with pytest.raises(TypeError, match="allow_backend_fallback must be a bool"):
        make_transfer("nixl", store=dist.HashStore(), rank=0, allow_backend_fallback=1)


def test_non_gloo_group_is_refused():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match="uses the 'fake' backend; checkpoint transfer needs a dedicated gloo"):
            make_transfer("torch_dist", store=dist.HashStore(), rank=0, process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_receiver_times_out_when_the_sender_never_offers(tmp_path):
    _, receiver = _stores(tmp_path)
    transfer = make_transfer("torch_dist", store=dist.HashStore(), rank=1, timeout_s=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"waited 1.0s for rank 2 to offer step 7 of rank 1"):
        transfer.receive(KEY, receiver, from_rank=2)
    assert time.monotonic() - start < 10
    assert os.listdir(receiver.directory) == []


def test_sender_times_out_when_the_receiver_never_answers(tmp_path):
    sender, _ = _stores(tmp_path)
    transfer = make_transfer("torch_dist", store=dist.HashStore(), rank=2, timeout_s=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="waited 1.0s for rank 1 to accept the transfer of step 7 of rank 1"):
        transfer.send(KEY, sender, to_rank=1)
    assert time.monotonic() - start < 10


def test_key_mismatch_is_refused(tmp_path):
    sender, _ = _stores(tmp_path)
    _refused_before_writing(tmp_path, _offer(sender, step=6), r"the offer is for step 6 of rank 1")


def test_endpoint_mismatch_is_refused(tmp_path):
    sender, _ = _stores(tmp_path)
    _refused_before_writing(tmp_path, _offer(sender, sender=3), "the offer names sender 3 and receiver 1")


def test_wrong_byte_count_is_refused(tmp_path):
    sender, _ = _stores(tmp_path)
    doc = _offer(sender)
    _refused_before_writing(tmp_path, dict(doc, total_bytes=doc["total_bytes"] + 64),
                            r"it announces \d+ bytes, its layout holds \d+")


def test_wrong_layout_is_refused(tmp_path):
    sender, _ = _stores(tmp_path)
    doc = _offer(sender)
    layout = json.loads(json.dumps(doc["layout"]))
    layout["tensors"][1]["offset"] = 8  # overlaps the first tensor
    _refused_before_writing(tmp_path, dict(doc, layout=layout), "invalid tensor layout.*overlaps")


def test_chunk_count_and_metadata_checksum_are_checked(tmp_path):
    sender, _ = _stores(tmp_path)
    doc = _offer(sender)
    _refused_before_writing(tmp_path, dict(doc, chunk_crc32=doc["chunk_crc32"][:-1]),
                            r"carries 2 chunk checksums.*make 3")
    (tmp_path / "again").mkdir()
    _refused_before_writing(tmp_path / "again", dict(doc, structure={"leaves": 3}),
                            "metadata checksum does not match")


def test_topology_mismatch_is_refused(tmp_path):
    sender, _ = _stores(tmp_path)
    _refused_before_writing(tmp_path, _offer(sender), "for topology 'topology', this store holds 'other'",
                            topology="other")


def test_malformed_offers_are_refused(tmp_path):
    sender, _ = _stores(tmp_path)
    doc = _offer(sender)
    doc["pickle"] = "no"
    _refused_before_writing(tmp_path, doc, r"transfer record: unknown key\(s\) \['pickle'\]")
    (tmp_path / "again").mkdir()
    _refused_before_writing(tmp_path / "again", [1, 2], r"transfer record: the document is not a JSON object \(list\)")


def test_offer_is_keyed_by_run_and_endpoints(tmp_path):
    sender, receiver = _stores(tmp_path)
    metadata = TransferMetadataStore(dist.HashStore(), timeout_s=5)
    assert metadata.prefix(KEY, 2, 1) != metadata.prefix(TransferKey("other-run", 7, 1), 2, 1)
    assert metadata.prefix(KEY, 2, 1) != metadata.prefix(KEY, 0, 1)
    with pytest.raises(ValueError, match="the store belongs to run 'unit-run', the key to run 'other-run'"):
        make_transfer("torch_dist", store=dist.HashStore(), rank=1).receive(
            TransferKey("other-run", 7, 1), receiver, from_rank=2)
    with pytest.raises(ValueError, match="other endpoint must be .* other than this endpoint's rank 1"):
        make_transfer("torch_dist", store=dist.HashStore(), rank=1).receive(KEY, receiver, from_rank=1)


def test_offer_records_round_trip_and_checksum_what_they_carry(tmp_path):
    sender, _ = _stores(tmp_path)
    doc = _offer(sender)
    record = TransferRecord.from_json(json.loads(json.dumps(doc)))
    assert record.to_json() == doc
    assert record.metadata_crc32 == metadata_crc(doc["layout"], STRUCTURE, {"note": "x"})
    assert len(record.chunk_crc32) == 3 and record.total_bytes == 1280


def _claiming(total_bytes, chunk_size, crcs):
    """A hand-written offer of rank 1's step 7 from rank 2 claiming `total_bytes` in an empty
    layout: a few hundred bytes of JSON whatever it claims."""
    layout = {"total_bytes": total_bytes, "tensors": []}
    return {"version": 1, "run_id": RUN, "step": 7, "source_rank": 1, "sender": 2, "receiver": 1,
            "nonce": "0badc0de", "topology": "topology", "layout": layout, "structure": None, "extra": {},
            "total_bytes": total_bytes, "chunk_size": chunk_size, "chunk_crc32": crcs,
            "metadata_crc32": metadata_crc(layout, None, {})}


def _refused_with_bounded_memory(tmp_path, doc, match, **transfer_kw):
    """Rank 1 refuses `doc` and answers rank 2, allocating (Python heap, traced) at most 4 MiB."""
    import tracemalloc

    _, receiver = _stores(tmp_path)
    store = dist.HashStore()
    metadata = TransferMetadataStore(store, timeout_s=5)
    store.set(metadata.prefix(KEY, 2, 1) + "/offer", json.dumps(doc).encode())
    transfer = make_transfer("torch_dist", store=store, rank=1, timeout_s=5, **transfer_kw)
    tracemalloc.start()
    try:
        with pytest.raises(TransferRefused, match=match) as refused:
            transfer.receive(KEY, receiver, from_rank=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024, f"refusing the offer allocated {peak} bytes"
    assert os.listdir(receiver.directory) == []
    answer = json.loads(store.get(f"{metadata.prefix(KEY, 2, 1)}/{doc['nonce']}/accept"))
    assert answer == {"ok": False, "reason": str(refused.value)}  # the sender hears why at once


@pytest.mark.parametrize("claimed", [2 ** 22, 2 ** 40])
def test_a_tiny_offer_claiming_one_byte_chunks_is_refused_by_its_checksum_count(tmp_path, claimed):
    doc = _claiming(claimed, 1, [])
    assert len(json.dumps(doc)) < 400  # the audit's offer was 327 bytes
    _refused_with_bounded_memory(tmp_path, doc, rf"carries 0 chunk checksums, {claimed} bytes in 1-byte chunks "
                                                rf"make {claimed}", max_bytes=2 ** 41)


def test_an_offer_larger_than_this_host_can_take_is_refused_by_default(tmp_path):
    doc = _claiming(2 ** 40, 2 ** 24, [0] * 2 ** 16)  # a consistent offer of 1 TiB
    _refused_with_bounded_memory(tmp_path, doc, r"announces 1099511627776 bytes, more than this host can take "
                                                r"\(\d+ bytes of physical memory, \d+ bytes free under .*node-1")


def test_an_offer_whose_structure_disagrees_with_its_layout_is_refused(tmp_path):
    sender, _ = _stores(tmp_path)
    doc = _offer(sender)
    structure = {"t": "dict", "items": [["values", {"t": "tensor", "i": 0}]]}  # the second tensor is lost
    doc.update(structure=structure, metadata_crc32=metadata_crc(doc["layout"], structure, doc["extra"]))
    _refused_before_writing(tmp_path, doc, r"its structure does not match its layout .*1 tensor leaves are not "
                                           "referenced")
