"""Every record schema of the package, found by walking it, meets random documents: each is refused
with RecordRejected or read back exactly, never another exception (issue 22). Three kinds of input
per schema: random JSON, documents built from the schema's own fields (which must be accepted and
round-trip), and mutations of those (a key dropped, an unknown key, a value replaced, the version
changed). A schema another module adds is covered without editing this test."""

from __future__ import annotations

import importlib
import json
from typing import Any, Dict, List, Optional

import pytest
from hypothesis import given, settings, strategies as st

from lm_resiliency.files import JSON_TYPES, Field, RecordRejected, RecordSchema, encode_record, parse_record
from tests.test_layering import modules


def discover() -> Dict[str, RecordSchema]:
    """Every module-level RecordSchema of every package module that declares one, by module.name."""
    found: Dict[str, RecordSchema] = {}
    seen = set()
    for name, path in sorted(modules().items()):
        if "RecordSchema(" not in path.read_text():
            continue  # only modules that declare a schema are imported (no framework imports)
        module = importlib.import_module(name)
        for attribute, value in sorted(vars(module).items()):
            if isinstance(value, RecordSchema) and id(value) not in seen:
                seen.add(id(value))
                found[f"{name}.{attribute}"] = value
    return found


SCHEMAS = discover()

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
                    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=16)


def _bounded(limit: Optional[int], default: int = 4) -> int:
    return default if limit is None else min(limit, default)


def valid_value(field: Field) -> Optional[st.SearchStrategy]:
    """Values `field` accepts (None: it accepts none that JSON can hold)."""
    if field.choices is not None:
        return st.sampled_from(field.choices)
    options: List[st.SearchStrategy] = []
    for kind in field.types:
        if kind is type(None):
            options.append(st.none())
        elif kind is bool:
            options.append(st.booleans())
        elif kind is int:
            low = None if field.minimum is None else int(field.minimum)
            high = None if field.maximum is None else int(field.maximum)
            options.append(st.integers(low if low is not None else -2 ** 70, high if high is not None else 2 ** 70))
        elif kind is float:
            options.append(st.floats(field.minimum, field.maximum, allow_nan=False, allow_infinity=False))
        elif kind is str:
            options.append(st.text(min_size=1 if field.nonempty else 0, max_size=_bounded(field.max_length, 12)))
        elif kind is list:
            items = JSON if field.items is None else valid_value(field.items)
            if items is not None:
                options.append(st.lists(items, min_size=1 if field.nonempty else 0,
                                        max_size=max(_bounded(field.max_length), 1 if field.nonempty else 0)))
        elif kind is dict:
            if field.record is not None:
                nested = valid_document(field.record)
                if nested is not None:
                    options.append(nested)
            else:
                values = JSON if field.items is None else valid_value(field.items)
                if values is not None:
                    options.append(st.dictionaries(st.text(max_size=8), values, min_size=1 if field.nonempty else 0,
                                                   max_size=max(_bounded(field.max_length), 1)))
        # any other type (a tensor, say) is not JSON: no value for it
    if set(JSON_TYPES) <= set(field.types) and field.items is None and field.record is None:
        return JSON
    return st.one_of(options) if options else None


def valid_document(schema: RecordSchema) -> Optional[st.SearchStrategy]:
    """Documents `schema` accepts: its identity, every required key, some optional ones."""
    required: Dict[str, st.SearchStrategy] = {}
    optional: Dict[str, st.SearchStrategy] = {}
    for key, field in schema.fields.items():
        value = valid_value(field)
        if value is None:
            if field.required:
                return None
            continue
        (required if field.required else optional)[key] = value
    if schema.identity is not None:
        required[schema.identity[0]] = st.just(schema.identity[1])
    return st.fixed_dictionaries(required, optional=optional)


def mutated(schema: RecordSchema, doc: Dict[str, Any], data: st.DataObject) -> Any:
    how = data.draw(st.sampled_from(["drop", "unknown", "replace", "identity", "whole"]))
    doc = dict(doc)
    if how == "drop" and doc:
        doc.pop(data.draw(st.sampled_from(sorted(doc))))
    elif how == "unknown":
        doc[data.draw(st.text(min_size=1, max_size=8))] = data.draw(JSON)
    elif how == "replace" and doc:
        doc[data.draw(st.sampled_from(sorted(doc)))] = data.draw(JSON)
    elif how == "identity" and schema.identity is not None:
        doc[schema.identity[0]] = data.draw(JSON)
    elif how == "whole":
        return data.draw(JSON)
    return doc


def refused_or_exact(schema: RecordSchema, doc: Any) -> bool:
    """True when `doc` was read back exactly, False when it was refused; anything else raises."""
    try:
        data = json.dumps(doc)
    except ValueError:
        return False
    try:
        parsed = parse_record(data, schema, "random")
    except RecordRejected:
        return False
    assert parsed == doc
    assert parse_record(encode_record(parsed, schema), schema, "again") == doc
    return True


def test_the_package_declares_its_records_as_schemas():
    names = {name.rsplit(".", 1)[1] for name in SCHEMAS}
    for expected in ("SHARD_METADATA_SCHEMA", "STATUS_SCHEMA", "SIDECAR_SCHEMA", "OWNER_SCHEMA", "MANIFEST_SCHEMA",
                     "TRUST_SCHEMA", "POLICY_SCHEMA", "WORKER_POLICY_SCHEMA", "STATE_SCHEMA", "SNAPSHOT_SCHEMA",
                     "RECORD_SCHEMA", "LAYOUT_SCHEMA", "NOTICE_SCHEMA", "REPLICA_HEADER_SCHEMA"):
        assert expected in names, f"{expected} not found among {sorted(names)}"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_schema_refuses_or_reads_back_exactly(name, data):
    schema = SCHEMAS[name]
    keys = [*schema.fields, *([schema.identity[0]] if schema.identity else []), "other"]
    refused_or_exact(schema, data.draw(JSON | st.dictionaries(st.sampled_from(keys), JSON, max_size=len(keys))))
    valid = valid_document(schema)
    if valid is None:
        return
    doc = data.draw(valid)
    assert refused_or_exact(schema, doc), f"{name}: a document built from its own fields was refused: {doc!r}"
    refused_or_exact(schema, mutated(schema, doc, data))
