"""The record layer (files.py): one reader with a declared schema for every outside document."""

import json
import os
import stat

import pytest
from hypothesis import given, settings, strategies as st

from lm_resiliency.files import (CONFIG, PRIVATE, RecordRejected, RecordSchema, array, atomic_write, boolean,
                                 check_private_dir, encode_record, ensure_private_dir, integer, nested, nullable,
                                 number, parse_record, read_file_bytes, read_record, text, write_record)

INNER = RecordSchema(what="inner part", fields={"slot": integer(0, 7)})
SCHEMA = RecordSchema(what="test record", identity=("schema", "lm-resiliency-test/1"), fields={
    "step": integer(0), "name": text(), "ratio": number(0.0, 1.0), "on": boolean(),
    "ranks": array(integer(0, 1023), max_length=8), "parent": nullable(text()), "inner": nested(INNER),
    "kind": text(choices=("a", "b")), "note": text(nonempty=False, required=False)})
GOOD = {"schema": "lm-resiliency-test/1", "step": 3, "name": "x", "ratio": 0.5, "on": True, "ranks": [0, 2],
        "parent": None, "inner": {"slot": 1}, "kind": "a"}


def refused(doc, match):
    with pytest.raises(RecordRejected, match=match):
        parse_record(json.dumps(doc), SCHEMA, "store key k")


def test_a_valid_record_round_trips_exactly():
    assert parse_record(encode_record(GOOD, SCHEMA), SCHEMA, "here") == GOOD


@pytest.mark.parametrize("change, match", [
    ({"schema": "lm-resiliency-test/2"}, "store key k: not a test record of this version: schema: expected "
                                         "'lm-resiliency-test/1', got 'lm-resiliency-test/2'"),
    ({"schema": None}, "schema: expected 'lm-resiliency-test/1', got None"),
    ({"step": -1}, "step must be at least 0"),
    ({"step": True}, "step must be int, got bool"),
    ({"step": 1.5}, "step must be int"),
    ({"ratio": 2}, "ratio must be at most 1"),
    ({"name": ""}, "name must not be empty"),
    ({"ranks": [0, 1, 2, 3, 4, 5, 6, 7, 8]}, "at most 8"),
    ({"ranks": [0, "1"]}, r"ranks\[1\] must be int"),
    ({"inner": {"slot": 9}}, "inner.slot must be at most 7"),
    ({"inner": {"slot": 1, "x": 0}}, r"unknown key\(s\) \['inner.x'\] in a inner part; accepted: \['slot'\]"),
    ({"kind": "c"}, "kind must be one of"),
    ({"extra": 1}, r"unknown key\(s\) \['extra'\]"),
])
def test_every_declared_rule_refuses(change, match):
    refused(dict(GOOD, **change), match)


def test_missing_keys_and_non_objects_are_refused():
    refused({k: v for k, v in GOOD.items() if k != "step"}, r"missing keys \['step'\]")
    refused([GOOD], "is not a JSON object")


@pytest.mark.parametrize("data, match", [
    (b'{"a": NaN}', "not valid JSON"), (b'{"a": 1, "a": 2}', "not valid JSON"), (b"\xff", "not valid JSON"),
    (b"[" * 300 + b"]" * 300, "not valid JSON"), (b"{" + b" " * 70000 + b"}", "at most 65536"),
])
def test_bytes_that_are_not_a_bounded_strict_json_document_are_refused(data, match):
    with pytest.raises(RecordRejected, match=match):
        parse_record(data, SCHEMA, "f")


def test_the_caller_may_raise_its_own_subclass():
    class ContextRefused(RecordRejected):
        pass

    with pytest.raises(ContextRefused):
        parse_record(b"{}", SCHEMA, "f", error=ContextRefused)


def test_files_are_read_only_when_safe(tmp_path):
    path = str(tmp_path / "r.json")
    assert read_record(path, SCHEMA) is None
    write_record(path, GOOD, SCHEMA)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and read_record(path, SCHEMA) == GOOD
    os.chmod(path, 0o640)
    with pytest.raises(RecordRejected, match="has mode 640"):
        read_record(path, SCHEMA)
    os.chmod(path, 0o644)
    assert read_file_bytes(path, "policy", max_bytes=4096, trust=CONFIG) is not None
    os.chmod(path, 0o666)
    with pytest.raises(RecordRejected, match="has mode 666"):
        read_file_bytes(path, "policy", max_bytes=4096, trust=CONFIG)
    link = str(tmp_path / "link.json")
    os.chmod(path, 0o600)
    os.symlink(path, link)
    with pytest.raises(RecordRejected, match="symbolic link"):
        read_record(link, SCHEMA)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo, 0o600)
    with pytest.raises(RecordRejected, match="not a regular file"):
        read_record(fifo, SCHEMA)  # refused at once, never blocks waiting for a writer
    with pytest.raises(RecordRejected, match="larger than 10 bytes"):
        read_file_bytes(path, "x", max_bytes=10, trust=PRIVATE)
    atomic_write(path, b'{"schema": "lm-resiliency-test/1", "st')
    with pytest.raises(RecordRejected, match=f"{path}: not a test record: not valid JSON"):
        read_record(path, SCHEMA)


def test_one_private_directory_policy(tmp_path):
    target = str(tmp_path / "a" / "ctx")
    ensure_private_dir(target, "restart-context directory")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    ensure_private_dir(target, "restart-context directory")  # existing and private: accepted
    os.chmod(target, 0o777)
    with pytest.raises(RecordRejected, match="has mode 0777.*not changed for you"):
        check_private_dir(target, "restart-context directory")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o777
    os.symlink(target, str(tmp_path / "alias"))
    with pytest.raises(RecordRejected, match="alias is a symbolic link; refusing to follow it"):
        ensure_private_dir(str(tmp_path / "alias"), "restart-context directory")
    (tmp_path / "file").write_text("")
    with pytest.raises(RecordRejected, match="file is not a directory"):
        ensure_private_dir(str(tmp_path / "file"), "restart-context directory")


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=20), lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                                 max_size=4),
                    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*GOOD, "other"]), JSON, max_size=12) | JSON
       | st.builds(lambda key, value: {**GOOD, key: value}, st.sampled_from([*GOOD, "note"]), JSON))
def test_random_documents_are_refused_or_round_trip_exactly(doc):
    try:
        data = json.dumps(doc)
    except ValueError:
        return
    try:
        parsed = parse_record(data, SCHEMA, "random")
    except RecordRejected:
        return
    assert parsed == doc and parse_record(encode_record(parsed, SCHEMA), SCHEMA, "again") == doc
