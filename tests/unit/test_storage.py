"""Node-local GEMINI persistence (format version 3): publication, validation, reaping, sidecar."""

import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

from lm_resiliency.codec import Layout, decode_state, encode_state
from lm_resiliency.gemini.storage import (
    FORMAT_VERSION, NodeLocalStore, ShardKey, ShardRejected, StatusRejected, run_namespace,
    temp_scope,
)

RUN = "run-a"
TOPO = "topo-fingerprint-1"
PATTERN = b"GEMINI-PAYLOAD-PATTERN-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_store(root, rank=0, verify=True, run_id=RUN, topology=TOPO, **kw):
    return NodeLocalStore(str(root), run_id, topology, rank, verify_integrity=verify, **kw)


def sample_state():
    return {
        "model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
                  "marker": torch.frombuffer(bytearray(PATTERN * 4), dtype=torch.uint8)},
        "optim": {"step": 3, "lr": 0.1, "betas": (0.9, 0.999)},
        "rng": torch.tensor([1, 2, 3], dtype=torch.int64),
    }


def pack(state=None):
    enc = encode_state(sample_state() if state is None else state)
    layout = Layout.for_tensors(enc.tensors)
    payload = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for view, tensor in zip(layout.views(payload), enc.tensors):
        view.copy_(tensor)
    return layout, enc.structure, payload


def write(store, key, extra=None):
    layout, structure, payload = pack()
    return store.write_shard(key, layout, structure, payload, extra)


def own(store, step):
    return ShardKey("own", store.rank, step)


def rewrite(path, mutate_meta=None, mutate_obj=None):
    """Load a valid shard file (safely), change it, and save it back in place."""
    obj = torch.load(path, weights_only=True)
    if mutate_meta is not None:
        meta = json.loads(obj["metadata"])
        mutate_meta(meta)
        obj["metadata"] = json.dumps(meta)
    if mutate_obj is not None:
        mutate_obj(obj)
    torch.save(obj, path)


def temp_files(store):
    return sorted(n for n in os.listdir(store.directory) if ".tmp-" in n)


def dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------- layout of the directory


def test_namespace_is_opaque_and_binds_run_and_topology():
    ns = run_namespace(RUN, TOPO)
    assert ns == run_namespace(RUN, TOPO)
    assert ns.startswith("gemini-") and RUN not in ns and TOPO not in ns
    assert ns != run_namespace("run-b", TOPO) != run_namespace(RUN, "topo-2")
    scope = temp_scope()
    assert scope == temp_scope() and scope and all(c in "0123456789abcdef" for c in scope)


def test_directory_and_file_names_and_permissions(tmp_path):
    store = make_store(tmp_path, rank=3)
    ns_dir = tmp_path / run_namespace(RUN, TOPO)
    assert store.directory == str(ns_dir / "rank-00003")
    assert stat.S_IMODE(os.stat(store.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ns_dir).st_mode) == 0o700
    path = write(store, ShardKey("own", 3, 7))
    assert os.path.basename(path) == "own-000000000007.gemini"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    peer = write(store, ShardKey("peer", 2, 7))
    assert os.path.basename(peer) == "peer-00002-000000000007.gemini"
    assert temp_files(store) == []
    # The file is exactly the documented record.
    obj = torch.load(path, weights_only=True)
    assert set(obj) == {"format_version", "metadata", "payload"} and obj["format_version"] == 3
    meta = json.loads(obj["metadata"])
    assert set(meta) == {"format_version", "run_id", "topology", "owner_rank", "holder_rank", "kind",
                         "step", "layout", "structure", "extra", "crc32"}
    assert (meta["run_id"], meta["topology"], meta["owner_rank"], meta["holder_rank"]) == (RUN, TOPO, 3, 3)


def test_store_refuses_symlinked_directories(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere, root / run_namespace(RUN, TOPO))
    with pytest.raises(PermissionError, match="symbolic link"):
        make_store(root)
    root2 = tmp_path / "root2"
    (root2 / run_namespace(RUN, TOPO)).mkdir(mode=0o700, parents=True)
    os.symlink(elsewhere, root2 / run_namespace(RUN, TOPO) / "rank-00000")
    with pytest.raises(PermissionError, match="symbolic link"):
        make_store(root2)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create files owned by another uid")
def test_foreign_owner_refused(tmp_path):
    ns_dir = tmp_path / run_namespace(RUN, TOPO)
    ns_dir.mkdir(mode=0o700)
    os.chown(ns_dir, 12345, -1)
    with pytest.raises(PermissionError, match="owned by uid 12345"):
        make_store(tmp_path)
    os.chown(ns_dir, os.geteuid(), -1)
    store = make_store(tmp_path)
    path = write(store, own(store, 1))
    os.chown(path, 12345, -1)
    with pytest.raises(ShardRejected, match="owned by uid 12345"):
        store.read_shard(own(store, 1))


def test_bad_constructor_arguments(tmp_path):
    with pytest.raises(ValueError, match="run_id"):
        NodeLocalStore(str(tmp_path), "", TOPO, 0, verify_integrity=True)
    with pytest.raises(ValueError, match="rank"):
        NodeLocalStore(str(tmp_path), RUN, TOPO, -1, verify_integrity=True)
    with pytest.raises(ValueError, match="timeout_s"):
        NodeLocalStore(str(tmp_path), RUN, TOPO, 0, verify_integrity=True, timeout_s=0)
    with pytest.raises(ValueError, match="kind"):
        ShardKey("mine", 0, 1)
    with pytest.raises(ValueError, match="step"):
        ShardKey("own", 0, -1)


# ---------------------------------------------------------------- round trip and listing


@pytest.mark.parametrize("verify", [True, False])
def test_round_trip(tmp_path, verify):
    store = make_store(tmp_path, rank=1, verify=verify)
    layout, structure, payload = pack()
    extra = {"trust": "RECOVERY_VERIFIED", "verified_steps": [10, 20], "note": None}
    key = ShardKey("peer", 4, 20)
    store.write_shard(key, layout, structure, payload, extra)
    shard = store.read_shard(key)
    assert shard.key == key and shard.holder_rank == 1
    assert shard.layout == layout
    assert shard.structure == structure and shard.extra == extra
    assert shard.payload.dtype == torch.uint8 and shard.payload.dim() == 1
    assert torch.equal(shard.payload, payload)
    restored = decode_state(shard.structure, shard.layout.views(shard.payload))
    expected = sample_state()
    assert torch.equal(restored["model"]["w"], expected["model"]["w"])
    assert restored["optim"] == expected["optim"]
    meta = json.loads(torch.load(os.path.join(store.directory, key.file_name),
                                 weights_only=True)["metadata"])
    assert (meta["crc32"] is not None) == verify

    # No extra -> {}; rewriting a key replaces the shard.
    store.write_shard(own(store, 5), layout, structure, payload)
    assert store.read_shard(own(store, 5)).extra == {}
    store.write_shard(own(store, 5), layout, structure, payload, {"v": 2})
    assert store.read_shard(own(store, 5)).extra == {"v": 2}
    assert temp_files(store) == []


def test_view_of_larger_buffer_is_stored_compactly(tmp_path):
    store = make_store(tmp_path)
    layout, structure, payload = pack()
    big = torch.zeros(layout.total_bytes + 10_000_000, dtype=torch.uint8)
    big[: layout.total_bytes].copy_(payload)
    path = store.write_shard(own(store, 1), layout, structure, big[: layout.total_bytes])
    assert os.path.getsize(path) < 1_000_000
    assert torch.equal(store.read_shard(own(store, 1)).payload, payload)


def test_list_shards_newest_first_and_ignores_other_names(tmp_path):
    store = make_store(tmp_path, rank=0)
    for key in (own(store, 5), ShardKey("peer", 2, 10), own(store, 20), ShardKey("peer", 1, 20)):
        write(store, key)
    store.write_status({"verified": 5})
    d = store.directory
    for junk in (".own-000000000030.gemini.tmp-abc-1-ff", "notes.txt", "own-30.gemini",
                 "peer-1-000000000040.gemini", "own-000000000050.gemini.bak", "own-000000000060.pt"):
        open(os.path.join(d, junk), "wb").close()
    assert store.list_shards() == [own(store, 20), ShardKey("peer", 1, 20), ShardKey("peer", 2, 10),
                                   own(store, 5)]


def test_remove_and_prune(tmp_path):
    store = make_store(tmp_path)
    keys = [own(store, 1), own(store, 2), ShardKey("peer", 3, 2), ShardKey("peer", 3, 1)]
    for key in keys:
        write(store, key)
    store.remove_shard(own(store, 1))
    store.remove_shard(own(store, 1))  # already gone: no error
    assert own(store, 1) not in store.list_shards()
    store.prune({own(store, 2), ShardKey("peer", 3, 2)})
    assert store.list_shards() == [own(store, 2), ShardKey("peer", 3, 2)]


# ---------------------------------------------------------------- write-side failures


@pytest.mark.parametrize("structure, extra, match", [
    ({"a": object()}, None, r"structure\['a'\].*object"),
    ({"a": (1, 2)}, None, "tuple"),
    ([1.0, float("nan")], None, "non-finite"),
    ({1: "int key"}, None, "not a str"),
    ({"ok": 1}, {"when": torch.tensor(1)}, r"extra\['when'\]"),
])
def test_non_json_metadata_fails_the_write(tmp_path, structure, extra, match):
    store = make_store(tmp_path)
    layout, _, payload = pack()
    with pytest.raises(TypeError, match=match):
        store.write_shard(own(store, 1), layout, structure, payload, extra)
    assert store.list_shards() == [] and temp_files(store) == []


def test_payload_not_matching_layout_fails_the_write(tmp_path):
    store = make_store(tmp_path)
    layout, structure, payload = pack()
    with pytest.raises(ValueError, match="layout needs exactly"):
        store.write_shard(own(store, 1), layout, structure, payload[:-1])
    with pytest.raises(ValueError, match="1-D uint8"):
        store.write_shard(own(store, 1), layout, structure, payload.view(torch.int8))
    with pytest.raises(ValueError, match="owner_rank"):
        store.write_shard(ShardKey("own", 9, 1), layout, structure, payload)
    assert store.list_shards() == []


# ---------------------------------------------------------------- read-side rejections


def test_flipped_payload_byte_rejected_by_crc(tmp_path):
    store = make_store(tmp_path, verify=True)
    path = write(store, own(store, 1))
    data = bytearray(open(path, "rb").read())
    at = data.find(PATTERN)
    assert at >= 0
    data[at + 5] ^= 0x01
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ShardRejected, match="CRC-32 mismatch") as info:
        store.read_shard(own(store, 1))
    assert path in str(info.value)
    # The checksum is what catches it: without verification the corrupt bytes would load.
    lax = make_store(tmp_path, verify=False)
    assert lax.read_shard(own(store, 1)).payload.numel() > 0


def test_missing_crc_rejected_when_verification_enabled(tmp_path):
    write(make_store(tmp_path, verify=False), ShardKey("own", 0, 1))
    with pytest.raises(ShardRejected, match="written without integrity checksum"):
        make_store(tmp_path, verify=True).read_shard(ShardKey("own", 0, 1))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch EVIL_RAN",))


class _Custom:
    pass


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("how, match", [("torch_save_custom_class", "weights-only load refused it"),
                                        ("raw_pickle_reduce", "not the zip archive.*never unpickled")])
def test_pickle_payload_refused_by_weights_only(tmp_path, monkeypatch, how, match):
    monkeypatch.chdir(tmp_path)
    store = make_store(tmp_path)
    path = os.path.join(store.directory, own(store, 1).file_name)
    if how == "torch_save_custom_class":
        torch.save({"format_version": 3, "metadata": "{}", "payload": _Custom()}, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(_Evil(), f)
    with pytest.raises(ShardRejected, match=match):
        store.read_shard(own(store, 1))
    assert not os.path.exists(tmp_path / "EVIL_RAN")


@pytest.mark.parametrize("obj, match", [
    ({"metadata": "{}", "payload": torch.zeros(1, dtype=torch.uint8)}, "no format_version"),
    ({"format_version": 2, "metadata": "{}", "payload": torch.zeros(1, dtype=torch.uint8)},
     "format_version 2 is not 3"),
    ({"format_version": 4, "metadata": "{}", "payload": torch.zeros(1, dtype=torch.uint8)},
     "format_version 4 is not 3"),
    ([1, 2, 3], "not a GEMINI format 3 record"),
])
def test_legacy_and_unknown_formats_refused(tmp_path, obj, match):
    store = make_store(tmp_path)
    torch.save(obj, os.path.join(store.directory, own(store, 1).file_name))
    with pytest.raises(ShardRejected, match=match) as info:
        store.read_shard(own(store, 1))
    assert "durable checkpoint" in str(info.value)


def test_wrong_run_id_and_topology_refused(tmp_path):
    src = make_store(tmp_path, run_id=RUN)
    path = write(src, own(src, 3))
    for other, match in ((make_store(tmp_path, run_id="run-b"), "wrong run id"),
                         (make_store(tmp_path, topology="topo-2"), "wrong topology")):
        shutil.copy(path, os.path.join(other.directory, os.path.basename(path)))
        assert other.list_shards() == [ShardKey("own", 0, 3)]
        with pytest.raises(ShardRejected, match=match):
            other.read_shard(ShardKey("own", 0, 3))


def test_wrong_owner_step_and_holder_refused(tmp_path):
    store = make_store(tmp_path, rank=0)
    peer = write(store, ShardKey("peer", 1, 10))
    os.rename(peer, os.path.join(store.directory, ShardKey("peer", 2, 10).file_name))
    with pytest.raises(ShardRejected, match="wrong owner rank"):
        store.read_shard(ShardKey("peer", 2, 10))

    mine = write(store, own(store, 10))
    os.rename(mine, os.path.join(store.directory, own(store, 11).file_name))
    with pytest.raises(ShardRejected, match="wrong step"):
        store.read_shard(own(store, 11))

    other = make_store(tmp_path, rank=1)
    shutil.copy(write(store, ShardKey("peer", 5, 12)), other.directory)
    with pytest.raises(ShardRejected, match="wrong holder rank"):
        other.read_shard(ShardKey("peer", 5, 12))
    shutil.copy(write(store, own(store, 13)), other.directory)
    with pytest.raises(ShardRejected, match="wrong owner rank"):
        other.read_shard(ShardKey("own", 1, 13))


def test_truncated_and_missing_files_refused(tmp_path):
    store = make_store(tmp_path)
    path = write(store, own(store, 1))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ShardRejected, match="truncated or corrupt"):
        store.read_shard(own(store, 1))
    open(path, "wb").close()
    with pytest.raises(ShardRejected, match="truncated or corrupt"):
        store.read_shard(own(store, 1))
    with pytest.raises(ShardRejected, match="missing"):
        store.read_shard(own(store, 2))


def test_symlink_in_place_of_a_shard_refused(tmp_path):
    store = make_store(tmp_path)
    path = write(store, own(store, 1))
    target = tmp_path / "valid-shard-elsewhere"
    os.rename(path, target)
    os.symlink(target, path)
    with pytest.raises(ShardRejected, match="symbolic link"):
        store.read_shard(own(store, 1))


@pytest.mark.parametrize("mutate_meta, mutate_obj, match", [
    (lambda m: m.update(surprise=1), None, r"unknown key\(s\) \['surprise'\] in a GEMINI shard metadata"),
    (lambda m: m.pop("extra"), None, r"missing keys \['extra'\] in a GEMINI shard metadata"),
    (lambda m: m["layout"]["tensors"][0].update(offset=3), None, "bad layout"),
    (lambda m: m.update(layout={"total_bytes": 1}), None, "bad layout"),
    (lambda m: m.update(crc32=m["crc32"] ^ 1), None, "CRC-32 mismatch"),
    (lambda m: m.update(crc32="abc"), None, "crc32"),
    (lambda m: m.update(kind="peer"), None, "wrong kind"),
    (lambda m: m.update(format_version=2), None, "not a GEMINI shard metadata of this version: format_version: "
                                                 "expected 3, got 2"),
    (lambda m: m.update(step="1"), None, "step must be int, got str '1'"),
    (None, lambda o: o.update(payload=o["payload"][:-1].clone()), "payload has"),
    (None, lambda o: o.update(payload=o["payload"].view(torch.int8)), "1-D uint8"),
    (None, lambda o: o.update(metadata="{not json"), "not valid JSON"),
    (None, lambda o: o.update(metadata="[1]"), "is not a JSON object"),
    (None, lambda o: o.update(extra_key=1), "top-level keys"),
])
def test_schema_violations_refused(tmp_path, mutate_meta, mutate_obj, match):
    store = make_store(tmp_path)
    path = write(store, own(store, 1))
    rewrite(path, mutate_meta, mutate_obj)
    with pytest.raises(ShardRejected, match=match):
        store.read_shard(own(store, 1))


# ---------------------------------------------------------------- temp files and crashes


def test_stale_temp_files_reaped_only_for_dead_writers_in_our_scope(tmp_path):
    store = make_store(tmp_path)
    final = own(store, 7).file_name
    scope = temp_scope()
    foreign = "0123456789abcdef" if scope != "0123456789abcdef" else "fedcba9876543210"
    pid = dead_pid()
    dead = f".{final}.tmp-{scope}-{pid}-deadbeef"
    live = f".{final}.tmp-{scope}-{os.getpid()}-deadbeef"
    other_scope = f".{final}.tmp-{foreign}-{pid}-deadbeef"
    other_shard = f".{own(store, 8).file_name}.tmp-{scope}-{pid}-deadbeef"
    for name in (dead, live, other_scope, other_shard):
        with open(os.path.join(store.directory, name), "wb") as f:
            f.write(b"partial")
    assert store.list_shards() == []
    write(store, own(store, 7))
    assert temp_files(store) == sorted([live, other_scope, other_shard])
    assert store.list_shards() == [own(store, 7)]


_CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from lm_resiliency.codec import Layout
from lm_resiliency.gemini.storage import NodeLocalStore, ShardKey

store = NodeLocalStore(sys.argv[2], sys.argv[3], sys.argv[4], 0, verify_integrity=True)

def stuck_fsync(fd):
    sys.stdout.write("in-fsync\n")
    sys.stdout.flush()
    time.sleep(120)

os.fsync = stuck_fsync
t = torch.arange(256, dtype=torch.uint8)
layout = Layout.for_tensors([t])
store.write_shard(ShardKey("own", 0, 7), layout, {"t": "tensor", "i": 0}, t.clone())
"""


def test_writer_killed_mid_write_leaves_no_visible_shard(tmp_path):
    store = make_store(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, ROOT, str(tmp_path), RUN, TOPO],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        assert line.strip() == "in-fsync", "child writer never reached fsync"
        leftovers = temp_files(store)
        assert len(leftovers) == 1 and f"-{child.pid}-" in leftovers[0]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    assert store.list_shards() == []
    with pytest.raises(ShardRejected, match="missing"):
        store.read_shard(own(store, 7))
    write(store, own(store, 7))
    assert temp_files(store) == []
    assert store.list_shards() == [own(store, 7)]
    store.read_shard(own(store, 7))


# ---------------------------------------------------------------- status sidecar


def test_status_round_trip_and_absent(tmp_path):
    store = make_store(tmp_path, rank=2)
    assert store.read_status() is None
    status = {"recovery_verified": 20, "candidate": 30, "history": [10, 20], "ok": True}
    store.write_status(status)
    assert store.read_status() == status
    path = os.path.join(store.directory, "status.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    doc = json.load(open(path))
    assert doc == {"format_version": FORMAT_VERSION, "run_id": RUN, "topology": TOPO, "rank": 2,
                   "status": status}
    store.write_status({"recovery_verified": 30})
    assert store.read_status() == {"recovery_verified": 30}
    assert temp_files(store) == []
    with pytest.raises(TypeError):
        store.write_status({"bad": {1, 2}})
    assert store.read_status() == {"recovery_verified": 30}


@pytest.mark.parametrize("garbage", [b"", b'{"format_version": 3, "run', b"\xff\xfe\x00garbage"])
def test_persistently_malformed_status_rejected(tmp_path, garbage):
    store = make_store(tmp_path, timeout_s=0.3)
    with open(os.open(os.path.join(store.directory, "status.json"), os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(garbage)
    start = time.monotonic()
    with pytest.raises(StatusRejected, match="malformed"):
        store.read_status()
    assert 0.25 <= time.monotonic() - start < 3


@pytest.mark.parametrize("field, value, match", [
    ("run_id", "run-b", "wrong run id"),
    ("topology", "topo-2", "wrong topology"),
    ("rank", 5, "wrong rank"),
    ("format_version", 2, "format_version: expected 3, got 2"),
    ("status", [1], "status must be dict, got list"),
])
def test_status_identity_mismatch_rejected_without_retry(tmp_path, field, value, match):
    store = make_store(tmp_path, timeout_s=30)
    store.write_status({"recovery_verified": 1})
    path = os.path.join(store.directory, "status.json")
    doc = json.load(open(path))
    doc[field] = value
    with open(path, "w") as f:
        json.dump(doc, f)
    start = time.monotonic()
    with pytest.raises(StatusRejected, match=match):
        store.read_status()
    assert time.monotonic() - start < 1


def test_status_copied_from_another_run_rejected(tmp_path):
    other = make_store(tmp_path, run_id="run-b")
    other.write_status({"recovery_verified": 1})
    store = make_store(tmp_path)
    shutil.copy(os.path.join(other.directory, "status.json"), store.directory)
    with pytest.raises(StatusRejected, match="wrong run id"):
        store.read_status()


def test_status_read_retries_until_file_becomes_well_formed(tmp_path):
    store = make_store(tmp_path, timeout_s=5)
    store.write_status({"recovery_verified": 42})
    path = os.path.join(store.directory, "status.json")
    good = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(good[: len(good) // 2])

    def fix():
        time.sleep(0.2)
        tmp = path + ".fix"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(good)
        os.replace(tmp, path)

    fixer = threading.Thread(target=fix)
    fixer.start()
    try:
        start = time.monotonic()
        assert store.read_status() == {"recovery_verified": 42}
        assert 0.15 <= time.monotonic() - start < 3
    finally:
        fixer.join()


def test_status_symlink_refused(tmp_path):
    store = make_store(tmp_path)
    store.write_status({"recovery_verified": 1})
    path = os.path.join(store.directory, "status.json")
    os.rename(path, tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", path)
    with pytest.raises(StatusRejected, match="symbolic link"):
        store.read_status()
