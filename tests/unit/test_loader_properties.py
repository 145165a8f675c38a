"""Property tests of GEMINI's two loaders of files a crash or an attacker may have damaged: the
node-local shard loader (`NodeLocalStore.read_shard`) and the shared-memory sidecar parser
(`SharedSlotArena.adopt`). Byte flips, truncations, extensions, overwrites and structural
mutations (JSON fields replaced, deleted, added or nested, sizes and offsets changed, zip entries
compressed, dropped, added, reordered or rewritten) of a valid file: each is refused with the
module's rejection, or loads bitwise identical to what was written (what the file says, when the
test re-signs its checksum). Never another exception; never a hang (pytest-timeout bounds each).
"""

import io
import json
import os
import tempfile
import warnings
import zipfile
from itertools import count

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lm_resiliency.codec import Layout, encode_state  # noqa: E402
from lm_resiliency.gemini.shm import SharedSlotArena  # noqa: E402
from lm_resiliency.gemini.slots import SlotPair  # noqa: E402
from lm_resiliency.gemini.storage import NodeLocalStore, ShardKey, ShardRejected, _shard_crc  # noqa: E402

PROPERTY = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
pytestmark = pytest.mark.timeout(300)

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "ids": torch.arange(5, dtype=torch.int64),
         "optim": {"step": 3, "betas": [0.9, 0.999], "name": "adamw"}}
KEY = ShardKey("own", 0, 7)

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


# ------------------------------------------------------------------ mutations


@st.composite
def byte_mutation(draw):
    """A function bytes -> bytes: flip, truncate, extend or overwrite somewhere in the file (the
    position is drawn independently of the size, which may differ between runs)."""
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "overwrite", "wrap"]))
    spot = draw(st.integers(0, 2 ** 20))
    levels = draw(st.sampled_from([300, 5000, 100_000]))
    mask = draw(st.integers(1, 255))
    junk = draw(st.binary(min_size=1, max_size=64))

    def mutate(data):
        at = spot % len(data)
        if kind == "flip":
            return data[:at] + bytes([data[at] ^ mask]) + data[at + 1:]
        if kind == "truncate":
            return data[:at]
        if kind == "extend":
            return data + junk
        if kind == "wrap":  # deeper than any recursion limit for the larger counts
            return b"[" * levels + data + b"]" * levels
        return data[:at] + junk + data[at + len(junk):]

    return mutate


def _paths(doc):
    """Every (parent, key) in a JSON document, found without recursion."""
    found, stack = [], [doc]
    while stack:
        node = stack.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else ()
        for key in keys:
            found.append((node, key))
            stack.append(node[key])
    return found


@st.composite
def json_mutation(draw, doc):
    """A function that returns a mutated deep copy of the JSON document `doc` (a function, so that
    Hypothesis never has to print a deeply nested value)."""
    paths = len(_paths(doc))
    where = draw(st.integers(0, paths - 1))
    action = draw(st.sampled_from(["replace", "delete", "add", "nest", "perturb"]))
    value = draw(JSON_VALUES)
    name = draw(st.text(max_size=6))
    levels = draw(st.sampled_from([1, 2, 100, 300, 600]))  # past MAX_JSON_DEPTH, below json's recursion
    delta = draw(st.sampled_from([-65, -64, -1, 1, 63, 64, 2 ** 40, -(2 ** 40)]))

    def mutate(original):
        copy = json.loads(json.dumps(original))
        parent, key = _paths(copy)[where]
        if action == "replace":
            parent[key] = value
        elif action == "delete":
            del parent[key]
        elif action == "add":
            if isinstance(parent, dict):
                parent[name] = value
            else:
                parent.insert(key, value)
        elif action == "nest":
            for _ in range(levels):
                parent[key] = [parent[key]]
        else:
            old = parent[key]
            parent[key] = old + delta if isinstance(old, int) and not isinstance(old, bool) else delta
        return copy

    return mutate


# ------------------------------------------------------------------ the node-local shard loader


def _valid_shard(store):
    enc = encode_state(STATE)
    layout = Layout.for_tensors(enc.tensors)
    payload = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for view, tensor in zip(layout.views(payload), enc.tensors):
        view.copy_(tensor)
    path = store.write_shard(KEY, layout, enc.structure, payload, {"k": [1, 2]})
    with open(path, "rb") as f:
        data = f.read()
    return path, data, torch.load(io.BytesIO(data), weights_only=True)


@pytest.fixture(scope="module")
def shard():
    with tempfile.TemporaryDirectory() as root:
        store = NodeLocalStore(root, "prop-run", "prop-topo", 0, verify_integrity=True)
        path, data, obj = _valid_shard(store)
        yield store, path, data, obj, store.read_shard(KEY)


def _load(store, path, data):
    with open(path, "wb") as f:
        f.write(data)
    try:
        return store.read_shard(KEY)
    except ShardRejected:
        return None


def _same_shard(got, want):
    assert got.key == want.key and got.holder_rank == want.holder_rank
    assert got.layout == want.layout and got.structure == want.structure and got.extra == want.extra
    assert torch.equal(got.payload, want.payload)


def _torch_file(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@PROPERTY
@given(data=st.data())
def test_shard_bytes_mutated_are_refused_or_load_identical(shard, data):
    store, path, original, _, want = shard
    mutate = data.draw(byte_mutation())
    got = _load(store, path, mutate(original))
    if got is not None:
        _same_shard(got, want)


@PROPERTY
@given(data=st.data(), resign=st.booleans())
def test_shard_metadata_mutated_is_refused_or_loads_what_the_file_says(shard, data, resign):
    store, path, _, obj, want = shard
    original = json.loads(obj["metadata"])
    meta = data.draw(json_mutation(original))(original)
    if resign and isinstance(meta, dict):  # a consistent checksum: the schema checks alone decide
        meta["crc32"] = _shard_crc({k: v for k, v in meta.items() if k != "crc32"}, obj["payload"])
    got = _load(store, path, _torch_file(dict(obj, metadata=json.dumps(meta))))
    if got is None:
        return
    if not resign:
        _same_shard(got, want)
        return
    assert got.structure == meta["structure"] and got.extra == meta["extra"]
    assert got.layout == Layout.from_json(meta["layout"]) and torch.equal(got.payload, obj["payload"])


@PROPERTY
@given(data=st.data())
def test_shard_record_fields_mutated_are_refused_or_load_identical(shard, data):
    store, path, _, obj, want = shard
    field = data.draw(st.sampled_from(["format_version", "metadata", "deep-metadata", "payload", "extra-key",
                                       "drop"]))
    mutated = dict(obj)
    if field == "deep-metadata":
        levels = data.draw(st.sampled_from([300, 5000, 100_000]))
        mutated["metadata"] = "[" * levels + obj["metadata"] + "]" * levels
    elif field == "payload":
        mutated["payload"] = data.draw(st.sampled_from([
            torch.zeros_like(obj["payload"]), obj["payload"][:-1].clone(), obj["payload"].to(torch.int16),
            obj["payload"].reshape(-1, 8), torch.cat([obj["payload"], obj["payload"]])]))
    elif field == "extra-key":
        mutated[data.draw(st.text(max_size=6))] = data.draw(JSON_VALUES)
    elif field == "drop":
        del mutated[data.draw(st.sampled_from(sorted(obj)))]
    else:
        mutated[field] = data.draw(JSON_VALUES)
    got = _load(store, path, _torch_file(mutated))
    if got is not None:
        _same_shard(got, want)


@PROPERTY
@given(data=st.data())
def test_shard_zip_entries_changed_are_refused_or_load_identical(shard, data):
    store, path, original, _, want = shard
    with zipfile.ZipFile(io.BytesIO(original)) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    change = data.draw(st.sampled_from(["compress", "drop", "add", "reorder", "rewrite", "duplicate"]))
    index = data.draw(st.integers(0, len(entries) - 1))
    methods = [zipfile.ZIP_STORED] * len(entries)
    if change == "compress":
        methods[index] = data.draw(st.sampled_from([zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]))
    elif change == "drop":
        del entries[index], methods[index]
    elif change == "add":
        entries.insert(index, (entries[0][0].split("/")[0] + "/" + data.draw(st.sampled_from(
            ["data/1", "extra", "data.pkl2"])), data.draw(st.binary(max_size=64))))
        methods.append(zipfile.ZIP_STORED)
    elif change == "reorder":
        entries = data.draw(st.permutations(entries))
    elif change == "rewrite":
        entries[index] = (entries[index][0], data.draw(st.binary(max_size=128)))
    else:
        entries.append(entries[index])
        methods.append(zipfile.ZIP_STORED)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # duplicate names
            for (name, payload), method in zip(entries, methods):
                archive.writestr(zipfile.ZipInfo(name), payload, compress_type=method)
    got = _load(store, path, buffer.getvalue())
    if change == "compress":
        assert got is None, "a compressed archive entry was loaded"
    if got is not None:
        _same_shard(got, want)


# ------------------------------------------------------------------ the shared-memory sidecar parser

_ARENA = dict(run_id="prop-run", topology="prop-topo", rank=0, verify_integrity=True, pin_memory=False,
              peer_owner=None)


@pytest.fixture(scope="module")
def shm_root():
    with tempfile.TemporaryDirectory() as root:
        yield root, count()


def _published_slot(root, series):
    arena = SharedSlotArena(root, series=series, **_ARENA)
    pair = SlotPair("own", arena.allocate, 5.0, mirror=arena)
    enc = encode_state(STATE)
    layout = Layout.for_tensors(enc.tensors)
    slot = pair.begin_write(layout)
    for view, tensor in zip(layout.views(slot.buffer), enc.tensors):
        view.copy_(tensor)
    pair.publish(slot, 7, enc.structure, 0, {"k": [1, 2]})
    want = slot.buffer[: layout.total_bytes].clone()
    arena.close(keep=True)  # the writer dies; its slot stays
    sidecar = os.path.join(arena.directory, f"{slot.name}.json")
    with open(sidecar, "rb") as f:
        return slot.name, sidecar, f.read(), layout, enc.structure, want


def _adopt_after(root, series, name, sidecar, data, layout, structure, want):
    with open(sidecar, "wb") as f:
        f.write(data)
    successor = SharedSlotArena(root, series=series, **_ARENA)
    try:
        adopted = {slot.name: slot for slot in successor.adopt()}
        if name not in adopted or successor.verify(name) is not None:
            return
        slot = adopted[name]
        assert (slot.step, slot.owner_rank, slot.extra, slot.structure) == (7, 0, {"k": [1, 2]}, structure)
        assert slot.layout == layout and torch.equal(slot.buffer[: layout.total_bytes], want)
    finally:
        successor.close(keep=False)


@PROPERTY
@given(data=st.data())
def test_shm_sidecar_bytes_mutated_are_refused_or_adopted_identical(shm_root, data):
    root, counter = shm_root
    series = f"series-{next(counter)}"
    name, sidecar, original, layout, structure, want = _published_slot(root, series)
    mutate = data.draw(byte_mutation())
    _adopt_after(root, series, name, sidecar, mutate(original), layout, structure, want)


@PROPERTY
@given(data=st.data())
def test_shm_sidecar_fields_mutated_are_refused_or_adopted_identical(shm_root, data):
    root, counter = shm_root
    series = f"series-{next(counter)}"
    name, sidecar, original, layout, structure, want = _published_slot(root, series)
    doc = json.loads(original)
    doc = data.draw(json_mutation(doc))(doc)
    _adopt_after(root, series, name, sidecar, json.dumps(doc).encode(), layout, structure, want)
