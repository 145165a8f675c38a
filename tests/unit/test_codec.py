"""State codec: JSON structure + flat-buffer tensor leaves round trip, and fail-closed rejections."""

import collections
import copy
import json
import math
import random
import struct
import warnings

import numpy as np
import pytest
import torch

from lm_resiliency.codec import (
    ALIGNMENT, Layout, StateEncodingError, StateSchemaError, decode_state, encode_state,
)

# ---------------------------------------------------------------------------------------------
# helpers


def wire(structure):
    """What goes on disk / over the wire: strict JSON (no NaN/Infinity literals)."""
    return json.loads(json.dumps(structure, allow_nan=False))


def through_buffer(tensors, fill=0xAB):
    """Copy tensor leaves into one flat uint8 buffer (padding poisoned) and return its views."""
    layout = Layout.for_tensors(tensors)
    buffer = torch.full((layout.total_bytes,), fill, dtype=torch.uint8)
    views = layout.views(buffer)
    for view, tensor in zip(views, tensors):
        view.copy_(tensor)
    return layout, buffer, views


def round_trip(state):
    encoded = encode_state(state)
    layout, buffer, views = through_buffer(encoded.tensors)
    return decode_state(wire(encoded.structure), views), layout, buffer


def tensor_bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def float_bits(x):
    return struct.pack("<d", x)


def assert_same(expected, actual, path="state"):
    """Bitwise equality that also requires identical types (OrderedDict may come back as dict)."""
    if isinstance(expected, torch.Tensor):
        assert type(actual) is torch.Tensor, path
        assert actual.dtype == expected.dtype, path
        assert actual.shape == expected.shape, path
        assert torch.equal(tensor_bytes(actual), tensor_bytes(expected)), path
    elif isinstance(expected, dict):
        wanted = dict if type(expected) is collections.OrderedDict else type(expected)
        assert type(actual) is wanted, path
        assert [(type(k), k) for k in actual] == [(type(k), k) for k in expected], path
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), path
        assert len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]")
    elif isinstance(expected, np.ndarray):
        assert type(actual) is np.ndarray, path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert actual.tobytes() == np.ascontiguousarray(expected).tobytes(), path
    elif isinstance(expected, np.generic):
        assert type(actual) is type(expected), path
        assert actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes(), path
    elif isinstance(expected, float):
        assert type(actual) is type(expected), path
        assert float_bits(actual) == float_bits(expected), path
    else:
        assert type(actual) is type(expected), path
        assert actual == expected, path


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def trained_model_and_adam():
    model = make_model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    model(torch.randn(5, 4)).square().mean().backward()
    optim.step()
    return model, optim


def realistic_state():
    model, optim = trained_model_and_adam()
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
        "floats": [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308, 0.1],
        "ints": [0, -1, 2**62, 2**100, -(2**70)],
        "sequences": ((1, [2, (3,)]), [(), [], {}], ("a",), []),
        "keys": {0: "int", "0": "str", True: "bool", None: "none", 2.5: "float", -7: "neg"},
        "strings": ["", "héllo ✓", "line\nbreak", '{"t": "tensor", "i": 0}'],
        "flags": [True, False, None],
        "numpy": {
            "f32": np.float32(2.5), "i64": np.int64(-3), "u8": np.uint8(200), "bool": np.bool_(True),
            "c128": np.complex128(1 - 2j), "f16": np.float16(-0.0),
            "array": np.arange(12, dtype=np.float32).reshape(3, 4),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
            "big_endian": np.array([1, 256], dtype=">i4"),
            "zero_d": np.array(7.25),
            "empty": np.zeros((0, 3), dtype=np.float64),
        },
        "meta": {"dtype": torch.bfloat16, "dtypes": [torch.float32, torch.int8, torch.bool],
                 "device": torch.device("cpu"), "cuda": torch.device("cuda", 1)},
        "tensors": {
            "bf16": torch.tensor([1.5, -0.0, math.inf, math.nan, 3e38], dtype=torch.bfloat16),
            "f16": torch.tensor([65504.0, -1e-7], dtype=torch.float16),
            "bool": torch.tensor([[True, False], [False, True]]),
            "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "int64": torch.tensor([2**62, -(2**63)], dtype=torch.int64),
            "complex": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
            "scalar": torch.tensor(3.25, dtype=torch.float64),
            "scalar_int": torch.tensor(9),
            "empty": torch.empty(0),
            "empty_2d": torch.empty(0, 5, dtype=torch.int32),
            "transposed": base.t(),
            "strided": base[:, ::2],
            "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        },
    }


# ---------------------------------------------------------------------------------------------
# round trip


def test_realistic_state_round_trips_bitwise_and_by_type():
    state = realistic_state()
    expected = copy.deepcopy(state)
    decoded, _, _ = round_trip(state)
    assert_same(expected, decoded)


def test_structure_is_strict_json_and_encoding_is_deterministic():
    state = realistic_state()
    first = encode_state(state)
    text = json.dumps(first.structure, allow_nan=False)
    assert json.loads(text) == first.structure
    assert json.dumps(encode_state(state).structure, allow_nan=False) == text


def test_tensor_leaves_are_referenced_in_encounter_order():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    encoded = encode_state({"x": a, "y": [b, {"z": c}]})
    assert [t.shape for t in encoded.tensors] == [a.shape, b.shape, c.shape]
    assert all(type(t) is torch.Tensor and not t.requires_grad for t in encoded.tensors)


def test_decoded_tensors_are_views_into_the_buffer():
    decoded, layout, buffer = round_trip({"w": torch.arange(10.0), "v": torch.ones(3, dtype=torch.int64)})
    start = buffer.data_ptr()
    for tensor in (decoded["w"], decoded["v"]):
        assert start <= tensor.data_ptr() < start + layout.total_bytes
    buffer.zero_()
    assert torch.equal(decoded["w"], torch.zeros(10))


def test_decoded_model_and_optimizer_resume_identically():
    model, optim = trained_model_and_adam()
    decoded, _, _ = round_trip({"model": model.state_dict(), "optim": optim.state_dict()})
    assert all(type(k) is int for k in decoded["optim"]["state"])
    assert type(decoded["optim"]["param_groups"][0]["betas"]) is tuple

    fresh = make_model()
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=5.0)
    fresh.load_state_dict(decoded["model"])
    fresh_optim.load_state_dict(decoded["optim"])
    batch = torch.randn(5, 4)
    for m, o in ((model, optim), (fresh, fresh_optim)):
        o.zero_grad()
        m(batch).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_decoded_rng_states_reproduce_the_streams():
    torch.manual_seed(11)
    np.random.seed(11)
    random.seed(11)
    decoded, _, _ = round_trip({"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                                "python": random.getstate()})
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    torch.set_rng_state(decoded["torch"].clone())
    np.random.set_state(decoded["numpy"])
    random.setstate(decoded["python"])
    assert torch.equal(torch.rand(4), expected[0])
    assert np.array_equal(np.random.rand(4), expected[1])
    assert [random.random() for _ in range(4)] == expected[2]


def test_numpy_float64_scalar_keeps_its_type_through_json():
    value = np.float64(0.1)
    decoded, _, _ = round_trip({"x": value})
    assert type(decoded["x"]) is np.float64


def test_empty_state_and_bare_values():
    for state in ({}, [], (), None, 3, "s", math.nan):
        decoded, layout, _ = round_trip(state)
        assert layout.total_bytes == 0
        assert_same(state, decoded)


# ---------------------------------------------------------------------------------------------
# layout


def test_layout_offsets_are_aligned_disjoint_and_in_bounds():
    tensors = [torch.zeros(3, dtype=torch.uint8), torch.zeros(5, dtype=torch.bfloat16), torch.empty(0),
               torch.zeros((), dtype=torch.float64), torch.zeros(100, dtype=torch.bool), torch.zeros(17)]
    layout = Layout.for_tensors(tensors)
    assert len(layout.specs) == len(tensors)
    end = 0
    for spec, tensor in zip(layout.specs, tensors):
        assert spec.offset % ALIGNMENT == 0
        assert spec.offset >= end
        assert spec.nbytes == tensor.numel() * tensor.element_size()
        assert spec.shape == tuple(tensor.shape)
        end = spec.offset + spec.nbytes
    assert end <= layout.total_bytes
    assert ALIGNMENT == 64


def test_layout_json_round_trip():
    tensors = realistic_state()["tensors"]
    layout = Layout.for_tensors(list(tensors.values()))
    assert Layout.from_json(wire(layout.to_json())) == layout
    assert Layout.from_json(Layout.for_tensors([]).to_json()) == Layout.for_tensors([])


def test_views_reject_a_buffer_too_small_or_not_flat_uint8():
    layout = Layout.for_tensors([torch.zeros(4)])
    for bad in (torch.zeros(layout.total_bytes - 1, dtype=torch.uint8),
                torch.zeros(layout.total_bytes, dtype=torch.int8),
                torch.zeros(2, layout.total_bytes, dtype=torch.uint8)):
        with pytest.raises(StateSchemaError):
            layout.views(bad)


def _layout_doc(*tensors, total=256):
    return {"total_bytes": total, "tensors": [dict(t) for t in tensors]}


GOOD = {"dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}


@pytest.mark.parametrize("doc", [
    pytest.param(_layout_doc(GOOD, {**GOOD, "offset": 0}), id="overlapping"),
    pytest.param(_layout_doc({**GOOD, "shape": [32], "nbytes": 128}, {**GOOD, "offset": 64}),
                 id="overlapping-partially"),
    pytest.param(_layout_doc({**GOOD, "offset": 8}), id="misaligned"),
    pytest.param(_layout_doc({**GOOD, "offset": -64}), id="negative-offset"),
    pytest.param(_layout_doc({**GOOD, "nbytes": 12}), id="nbytes-mismatch"),
    pytest.param(_layout_doc({**GOOD, "dtype": "float64"}), id="nbytes-mismatch-dtype"),
    pytest.param(_layout_doc({**GOOD, "offset": 192, "shape": [32], "nbytes": 128}), id="past-total"),
    pytest.param(_layout_doc(GOOD, total=8), id="past-small-total"),
    pytest.param(_layout_doc({**GOOD, "dtype": "float128"}), id="unknown-dtype"),
    pytest.param(_layout_doc({**GOOD, "dtype": "object"}), id="object-dtype"),
    pytest.param({**_layout_doc(GOOD), "version": 1}, id="extra-top-key"),
    pytest.param(_layout_doc({**GOOD, "stride": [1]}), id="extra-spec-key"),
    pytest.param({"tensors": [GOOD]}, id="missing-total"),
    pytest.param(_layout_doc({k: v for k, v in GOOD.items() if k != "nbytes"}), id="missing-nbytes"),
    pytest.param(_layout_doc(GOOD, total=-1), id="negative-total"),
    pytest.param(_layout_doc(GOOD, total=True), id="bool-total"),
    pytest.param(_layout_doc({**GOOD, "shape": [-4]}), id="negative-dim"),
    pytest.param(_layout_doc({**GOOD, "shape": 4}), id="shape-not-list"),
    pytest.param(_layout_doc({**GOOD, "offset": 0.0}), id="float-offset"),
    pytest.param({"total_bytes": 0, "tensors": {}}, id="tensors-not-list"),
    pytest.param([GOOD], id="not-an-object"),
])
def test_layout_from_json_rejects(doc):
    with pytest.raises(StateSchemaError):
        Layout.from_json(doc)


def test_layout_from_json_accepts_the_valid_template():
    layout = Layout.from_json(_layout_doc(GOOD, {**GOOD, "offset": 64}))
    assert [s.offset for s in layout.specs] == [0, 64]


# ---------------------------------------------------------------------------------------------
# encode rejections


class Custom:
    pass


@pytest.mark.parametrize("bad", [
    pytest.param(Custom(), id="custom-object"),
    pytest.param({1, 2}, id="set"),
    pytest.param(frozenset({1}), id="frozenset"),
    pytest.param(1 + 2j, id="complex"),
    pytest.param(b"bytes", id="bytes"),
    pytest.param(torch.sparse_coo_tensor, id="sparse-coo"),
    pytest.param(print, id="function"),
])
def test_encode_rejects_unsupported_value_with_its_path(bad):
    if bad is torch.sparse_coo_tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad = torch.sparse_coo_tensor([[0]], [1.0], (2,))
    with pytest.raises(StateEncodingError) as info:
        encode_state({"a": [0, bad]})
    assert "state['a'][1]" in str(info.value)


@pytest.mark.parametrize("bad", [
    pytest.param(np.array([1, None], dtype=object), id="numpy-object-array"),
    pytest.param(torch.quantize_per_tensor, id="quantized-tensor"),
    pytest.param(torch.qint8, id="unsupported-dtype-value"),
])
def test_encode_rejection_names_path_for_numpy_and_dtype_errors(bad):
    if bad is torch.quantize_per_tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bad = torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)
    with pytest.raises(StateEncodingError) as info:
        encode_state({"a": [0, bad]})
    assert "state['a'][1]" in str(info.value)


def test_numpy_object_array_is_rejected():
    with pytest.raises(StateEncodingError, match="object"):
        encode_state({"a": [0, np.array([1, None], dtype=object)]})


@pytest.mark.parametrize("key", [(1, 2), frozenset(), b"k", torch.float32])
def test_encode_rejects_unsupported_dict_key_with_its_path(key):
    with pytest.raises(StateEncodingError) as info:
        encode_state({"a": {key: 3}})
    assert "state['a']" in str(info.value)
    assert "dict key" in str(info.value)


# ---------------------------------------------------------------------------------------------
# decode rejections


def T(i):
    return {"t": "tensor", "i": i}


def L(*items):
    return {"t": "list", "items": list(items)}


@pytest.mark.parametrize("structure, n_tensors", [
    pytest.param({"t": "pickle", "v": "gASV"}, 0, id="unknown-tag"),
    pytest.param(L(1, {"t": "set", "items": []}), 0, id="unknown-nested-tag"),
    pytest.param({"a": 1}, 0, id="untagged-object"),
    pytest.param(L(T(0), T(0)), 1, id="repeated-index"),
    pytest.param(L(T(0)), 2, id="unreferenced-tensor"),
    pytest.param(L(), 1, id="no-references"),
    pytest.param(T(1), 1, id="index-out-of-range"),
    pytest.param(T(-1), 1, id="negative-index"),
    pytest.param(T(True), 1, id="bool-index"),
    pytest.param(T("0"), 1, id="string-index"),
    pytest.param({"t": "tensor"}, 1, id="missing-index"),
    pytest.param({"t": "float", "v": "1.5"}, 0, id="bad-special-float"),
    pytest.param({"t": "float", "v": "NaN"}, 0, id="bad-special-float-case"),
    pytest.param({"t": "float", "v": float("nan")}, 0, id="special-float-not-string"),
    pytest.param({"t": "float"}, 0, id="special-float-missing"),
    pytest.param({"t": "list", "items": "abc"}, 0, id="list-items-not-list"),
    pytest.param({"t": "dict", "items": [["a"]]}, 0, id="dict-item-not-pair"),
    pytest.param({"t": "dict", "items": [[L(), 1]]}, 0, id="dict-key-list"),
    pytest.param({"t": "dict", "items": [[T(0), 1]]}, 1, id="dict-key-tensor"),
    pytest.param({"t": "dtype", "v": "float128"}, 0, id="unknown-dtype"),
    pytest.param({"t": "device", "v": "warp-drive:0"}, 0, id="bad-device"),
    pytest.param({"t": "ndarray", "dtype": "|O", "shape": [1], "b64": ""}, 0, id="object-ndarray"),
    pytest.param({"t": "ndarray", "dtype": "<f4", "shape": [2], "b64": "AAAAAA=="}, 0,
                 id="ndarray-byte-count"),
    pytest.param({"t": "ndarray", "dtype": "<f4", "shape": [1], "b64": "!!"}, 0, id="ndarray-bad-b64"),
    pytest.param({"t": "ndarray", "dtype": "<f4", "shape": [-1], "b64": ""}, 0, id="ndarray-neg-shape"),
    pytest.param({"t": "npscalar", "v": 1.0}, 0, id="npscalar-not-wrapping"),
])
def test_decode_rejects_bad_structure(structure, n_tensors):
    with pytest.raises(StateSchemaError):
        decode_state(structure, [torch.zeros(1) for _ in range(n_tensors)])


def test_decode_rejects_ndarray_dict_key_as_schema_error():
    key = {"t": "ndarray", "dtype": "<f4", "shape": [1], "b64": "AAAAAA=="}
    with pytest.raises(StateSchemaError):
        decode_state({"t": "dict", "items": [[key, 1]]}, [])
