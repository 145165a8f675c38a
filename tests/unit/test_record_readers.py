"""Every reader of outside documents is on the record layer (issue 22): one rejection root
(`RecordRejected`, each reader's own type kept as a subclass with its old bases), file trust
(mode, owner, no link) for records that were read without it, and the one private-directory
policy (create 0700, never chmod an existing directory: refuse it, say what to do)."""

import os
import stat

import pytest

from lm_resiliency.files import RecordRejected
from lm_resiliency.gemini.shm import SegmentRejected, SharedMemoryUnavailable, SharedSlotArena
from lm_resiliency.gemini.storage import (NodeLocalDirRejected, NodeLocalStore, ShardRejected, StatusRejected,
                                          run_namespace)

RUN, TOPO = "records-run", "records-topology"


def _store(root):
    return NodeLocalStore(str(root), RUN, TOPO, 0, verify_integrity=True, timeout_s=5)


@pytest.mark.parametrize("error, bases", [
    (ShardRejected, ()), (StatusRejected, ()), (SegmentRejected, ()), (NodeLocalDirRejected, (PermissionError,)),
])
def test_every_rejection_is_a_record_rejection_and_keeps_its_bases(error, bases):
    assert issubclass(error, RecordRejected) and issubclass(error, Exception)
    assert all(issubclass(error, base) for base in bases)


def test_a_status_sidecar_others_can_read_is_refused(tmp_path):
    store = _store(tmp_path)
    store.write_status({"recovery_verified": 4})
    path = os.path.join(store.directory, "status.json")
    os.chmod(path, 0o644)
    with pytest.raises(StatusRejected, match=f"{path}: status sidecar has mode 644; expected 0600 at most"):
        store.read_status()


def test_an_existing_node_local_directory_others_can_enter_is_refused_not_changed(tmp_path):
    namespace = tmp_path / run_namespace(RUN, TOPO)
    namespace.mkdir(mode=0o755)
    os.chmod(namespace, 0o755)
    with pytest.raises(PermissionError, match=r"has mode 0755: group/other access is not allowed. It is not "
                                              r"changed for you; chmod 700 it"):
        _store(tmp_path)
    assert stat.S_IMODE(os.stat(namespace).st_mode) == 0o755
    os.chmod(namespace, 0o700)
    assert os.path.isdir(_store(tmp_path).directory)


def test_an_existing_shared_memory_root_others_can_enter_is_refused_not_changed(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    os.chmod(root, 0o755)
    with pytest.raises(SharedMemoryUnavailable, match="shared-memory directory .* has mode 0755: group/other "
                                                      "access is not allowed"):
        SharedSlotArena(str(root), RUN, TOPO, 0, series=str(tmp_path / "disk"), verify_integrity=False,
                        pin_memory=False, peer_owner=None)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o755


def test_a_manifest_others_can_read_is_refused(tmp_path):
    from lm_resiliency.trust.decision import RECOVERY_VERIFIED
    from lm_resiliency.trust.errors import CertificationError, ManifestRejected
    from lm_resiliency.trust.manifests import ManifestStore, manifest_name

    assert issubclass(ManifestRejected, RecordRejected) and issubclass(ManifestRejected, CertificationError)
    store = ManifestStore(str(tmp_path / "manifests"), "env")
    store.ensure_directory()
    store.write("ckpt-10", 10, RECOVERY_VERIFIED)
    assert store.newest_verified()["step"] == 10
    path = tmp_path / "manifests" / manifest_name("ckpt-10")
    os.chmod(path, 0o644)
    with pytest.raises(ManifestRejected, match=f"{path}: durable checkpoint manifest has mode 644"):
        store.newest_verified()


def test_an_existing_manifest_directory_others_can_enter_is_refused_not_changed(tmp_path):
    from lm_resiliency.trust.errors import ManifestRejected
    from lm_resiliency.trust.manifests import ManifestStore

    (tmp_path / "manifests").mkdir()
    os.chmod(tmp_path / "manifests", 0o750)
    with pytest.raises(ManifestRejected, match="has mode 0750: group/other access is not allowed"):
        ManifestStore(str(tmp_path / "manifests"), "env").ensure_directory()
    assert stat.S_IMODE(os.stat(tmp_path / "manifests").st_mode) == 0o750


def test_a_malformed_abandonment_notice_names_nobody():
    import torch.distributed as dist

    from lm_resiliency.gemini.abandon import AbandonBoard

    store = dist.HashStore()
    board = AbandonBoard(store, "records/")
    board.mark(1, 7, "replica send failed")
    dist.PrefixStore("records/", store).set("2", '{"step": "x", "reason": "forged"}')
    dist.PrefixStore("records/", store).set("3", '{"step": 4')
    assert board.find([1, 2, 3]) == "rank 1 stopped replicating after step 7 (replica send failed)"


def test_a_persisted_trust_record_of_the_wrong_shape_is_a_record_rejection():
    from lm_resiliency.trust.errors import CertificationError
    from lm_resiliency.trust.rules import TrustState, loaded

    good = TrustState(catalog_size=1).to_doc()
    assert loaded(TrustState(catalog_size=1), good)[0] == TrustState(catalog_size=1)
    for change, message in (({"catalog_size": 0}, "catalog_size must be at least 1, got 0"),
                            ({"verified_history": [{"step": 3}]}, r"missing keys \['verified_history\[0\]"),
                            ({"sdc_pending": "no"}, "sdc_pending must be bool")):
        with pytest.raises(CertificationError, match=message) as info:
            loaded(TrustState(catalog_size=1), {**good, **change})
        assert isinstance(info.value, RecordRejected)


def test_fault_kit_files_others_may_write_or_linked_are_refused(tmp_path):
    from lm_resiliency.faults import CampaignJournal, FaultCampaign, JsonCampaignStateStore
    from lm_resiliency.faults.errors import CampaignSchemaError

    assert issubclass(CampaignSchemaError, RecordRejected) and issubclass(CampaignSchemaError, ValueError)
    state = tmp_path / "state.json"
    store = JsonCampaignStateStore(str(state))
    assert store.claim("a@1/rank-0", {"pid": 1})
    os.chmod(state, 0o666)
    with pytest.raises(RecordRejected, match=f"{state}: campaign state has mode 666"):
        store.load()
    os.chmod(state, 0o600)
    os.rename(state, tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", state)
    with pytest.raises(RecordRejected, match="campaign state is a symbolic link"):
        store.load()
    os.unlink(state)
    with open(os.open(state, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write('{"schema_version": 1, "claims": {')  # truncated
    with pytest.raises(RecordRejected, match="not a campaign state: not valid JSON"):
        store.load()
    journal = tmp_path / "journal.jsonl"
    journal.write_text("")
    os.chmod(journal, 0o622)
    with pytest.raises(RecordRejected, match="campaign journal has mode 622"):
        CampaignJournal(str(journal)).records()
    manifest = tmp_path / "campaign.json"
    os.mkfifo(manifest)
    with pytest.raises(RecordRejected, match="campaign manifest is not a regular file"):
        FaultCampaign.from_file(str(manifest))


def test_a_transfer_refusal_is_a_record_rejection_and_stays_a_runtime_error():
    from lm_resiliency.manager_api.transfer_metadata import TransferRefused

    assert issubclass(TransferRefused, RecordRejected) and issubclass(TransferRefused, RuntimeError)


def test_wire_documents_are_strict_json():
    import torch

    from lm_resiliency.wire import decode_json

    for text in ('{"step": 1, "step": 2}', '{"loss": NaN}'):
        with pytest.raises(ValueError, match="duplicate JSON key 'step'|non-standard JSON constant NaN"):
            decode_json(torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8))


def test_a_fifo_machine_id_path_is_refused_at_once(tmp_path, monkeypatch):
    from lm_resiliency.torchrun.identity import MACHINE_ID_ENV, read_machine_id
    from tests.fifo import refusal_without_blocking

    fifo = str(tmp_path / "machine-id")
    os.mkfifo(fifo)
    monkeypatch.setenv(MACHINE_ID_ENV, fifo)
    error = refusal_without_blocking(read_machine_id, fifo)
    assert isinstance(error, ValueError) and "machine id file is not a regular file" in str(error)


def test_layouts_and_replica_headers_are_declared_schemas():
    from lm_resiliency.codec import LAYOUT_SCHEMA, Layout, StateSchemaError
    from lm_resiliency.gemini.replication import REPLICA_HEADER_SCHEMA, ReplicaHeaderRejected

    assert issubclass(StateSchemaError, RecordRejected) and issubclass(ReplicaHeaderRejected, RuntimeError)
    assert LAYOUT_SCHEMA.fields["tensors"].items.record.fields["dtype"].choices
    with pytest.raises(StateSchemaError, match=r"layout: tensors\[0\].shape\[1\] must be at least 0, got -2"):
        Layout.from_json({"total_bytes": 64, "tensors": [{"dtype": "float32", "shape": [1, -2], "offset": 0,
                                                          "nbytes": 8}]})
    assert set(REPLICA_HEADER_SCHEMA.fields) == {"step", "owner_rank", "layout", "structure", "extra", "tails"}
