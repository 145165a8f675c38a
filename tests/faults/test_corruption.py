"""Tensor corruption: every operation x scope, verified bit-exact."""

import math

import pytest
import torch

from lm_resiliency.faults import CorruptionOperation, FaultMagnitude, FaultScope, UnsupportedFaultError
from lm_resiliency.faults.corruption import corrupt_tensor, count_changed, default_bit

OPS = list(CorruptionOperation)


def sample(dtype=torch.float32):
    return (torch.arange(1, 25, dtype=torch.float32).reshape(4, 6) / 7).to(dtype)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.value)
@pytest.mark.parametrize("scope", list(FaultScope), ids=lambda s: s.value)
def test_operation_and_scope(op, scope):
    x = sample()
    kw = {"fraction": 0.25} if scope is FaultScope.FRACTION else {}
    out, ev = corrupt_tensor(x, fault_id="f", operation=op, scope=scope, seed=7, **kw)
    expected = {FaultScope.FULL: 24, FaultScope.ELEMENT: 1, FaultScope.FRACTION: 6}[scope]
    assert ev["elements_changed"] == expected == count_changed(x, out)[0]
    assert torch.equal(x, sample())  # never in place
    changed = (out != x) | torch.isnan(out)
    assert int(changed.sum()) == expected
    vals = out[changed]
    orig = x[changed]
    if op is CorruptionOperation.SIGN_FLIP:
        assert torch.equal(vals, -orig)
    elif op is CorruptionOperation.SCALE:
        assert torch.equal(vals, orig * 2.0)
    elif op is CorruptionOperation.ADD:
        assert torch.equal(vals, orig + 1.0)
    elif op is CorruptionOperation.ZERO:
        assert torch.all(vals == 0)
    elif op is CorruptionOperation.NAN:
        assert torch.all(torch.isnan(vals))
    elif op is CorruptionOperation.INF:
        assert torch.all(torch.isinf(vals))
    elif op is CorruptionOperation.BIT_FLIP:
        xor = vals.view(torch.int32) ^ orig.view(torch.int32)
        assert torch.all(xor == (1 << 22))  # moderate: highest mantissa bit


def test_seeded_choices_are_reproducible_and_seed_dependent():
    x = torch.zeros(1000) + 1
    a, ea = corrupt_tensor(x, fault_id="f", operation=CorruptionOperation.ZERO, scope=FaultScope.FRACTION,
                           fraction=0.01, seed=1)
    b, eb = corrupt_tensor(x, fault_id="f", operation=CorruptionOperation.ZERO, scope=FaultScope.FRACTION,
                           fraction=0.01, seed=1)
    c, _ = corrupt_tensor(x, fault_id="f", operation=CorruptionOperation.ZERO, scope=FaultScope.FRACTION,
                          fraction=0.01, seed=2)
    assert torch.equal(a, b) and ea == eb and not torch.equal(a, c)
    assert ea["elements_changed"] == 10


def test_single_bit_flip_at_explicit_element_and_bit():
    x = torch.ones(8)
    out, ev = corrupt_tensor(x, fault_id="f", operation=CorruptionOperation.BIT_FLIP, scope=FaultScope.ELEMENT,
                             index=5, bit=0, seed=0)
    assert ev["index"] == 5 and ev["bit"] == 0 and ev["indices"] == [5]
    assert out[5].item() == 1.0 + 2 ** -23 and torch.equal(out[:5], x[:5])
    sign, _ = corrupt_tensor(x, fault_id="f", operation=CorruptionOperation.BIT_FLIP,
                             scope=FaultScope.ELEMENT, index=0, bit=31, seed=0)
    assert sign[0].item() == -1.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int8,
                                   torch.uint8])
def test_bit_flip_dtypes(dtype):
    x = torch.full((4,), 3, dtype=dtype)
    for magnitude in FaultMagnitude:
        out, ev = corrupt_tensor(x, fault_id="f", operation=CorruptionOperation.BIT_FLIP, magnitude=magnitude)
        assert ev["bit"] == default_bit(dtype, magnitude)
        assert ev["elements_changed"] == 4 and out.dtype == dtype


def test_magnitudes_and_explicit_knobs():
    x = torch.ones(3)
    for magnitude, factor in ((FaultMagnitude.SUBTLE, 1.001), (FaultMagnitude.SEVERE, 1e4)):
        out, ev = corrupt_tensor(x, fault_id="f", operation=CorruptionOperation.SCALE, magnitude=magnitude)
        assert ev["factor"] == factor and math.isclose(out[0].item(), factor, rel_tol=1e-6)
    out, _ = corrupt_tensor(x, fault_id="f", operation=CorruptionOperation.ADD, addend=-3.0)
    assert torch.equal(out, torch.full((3,), -2.0))
    severe, _ = corrupt_tensor(torch.full((1,), 0.5), fault_id="f", operation=CorruptionOperation.BIT_FLIP,
                               magnitude=FaultMagnitude.SEVERE)
    assert severe.item() > 1e37  # highest exponent bit


def test_autograd_graph_survives():
    x = torch.ones(4, requires_grad=True)
    for op in OPS:
        out, _ = corrupt_tensor(x * 2, fault_id="f", operation=op, scope=FaultScope.ELEMENT, index=0)
        out.sum().backward()
        assert x.grad is not None
        x.grad = None
    out, _ = corrupt_tensor(x * 1, fault_id="f", operation=CorruptionOperation.SIGN_FLIP)
    out.sum().backward()
    assert torch.equal(x.grad, -torch.ones(4))


def test_no_effect_and_unsupported():
    _, ev = corrupt_tensor(torch.zeros(4), fault_id="f", operation=CorruptionOperation.ZERO)
    assert ev["elements_changed"] == 0
    # Verification is bitwise (as SCOUT signatures are): negating +0.0 gives -0.0, a changed element.
    _, ev = corrupt_tensor(torch.zeros(4), fault_id="f", operation=CorruptionOperation.SIGN_FLIP)
    assert ev["elements_changed"] == 4
    with pytest.raises(UnsupportedFaultError, match="floating-point"):
        corrupt_tensor(torch.ones(2, dtype=torch.int64), fault_id="f", operation=CorruptionOperation.NAN)
    with pytest.raises(UnsupportedFaultError, match="bit 40"):
        corrupt_tensor(torch.ones(2), fault_id="f", operation=CorruptionOperation.BIT_FLIP, bit=40)
    with pytest.raises(UnsupportedFaultError, match="out of range"):
        corrupt_tensor(torch.ones(2), fault_id="f", operation=CorruptionOperation.ZERO, scope=FaultScope.ELEMENT,
                       index=2)
    with pytest.raises(UnsupportedFaultError, match="bool"):
        corrupt_tensor(torch.ones(2, dtype=torch.bool), fault_id="f", operation=CorruptionOperation.ZERO)
