"""adapters/_accelerate_compat.py: every private Accelerate name it uses still exists with the
shape it was checked against. An upgrade that renames one fails here, naming it. A real
Accelerator (CPU, one process) and its real prepared objects; nothing mocked."""

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from lm_resiliency.adapters import _accelerate_compat as compat  # noqa: E402


def _fail(name: str) -> str:
    return (f"accelerate {accelerate.__version__} changed {name} (checked against {compat.ACCELERATE_CHECKED}): "
            "review lm_resiliency/adapters/_accelerate_compat.py")


class _Counter:
    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_prepared_objects_are_read_in_preparation_order():
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = _Counter()
    accelerator.register_for_checkpointing(counter)
    assert compat.models(accelerator) == [model], _fail("Accelerator._models")
    assert compat.optimizers(accelerator) == [optimizer], _fail("Accelerator._optimizers")
    assert compat.dataloaders(accelerator) == [loader], _fail("Accelerator._dataloaders")
    assert compat.schedulers(accelerator) == [scheduler], _fail("Accelerator._schedulers")
    assert compat.custom_objects(accelerator) == [counter], _fail("Accelerator._custom_objects")

    original = type(loader)
    tracked = type(original.__name__, (original,), {})
    compat.swap_class(loader, tracked)
    assert type(loader) is tracked and [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]], \
        _fail("the type slot of a prepared dataloader (DataLoaderAdapter.__class__)")
    compat.swap_class(loader, original)
    assert type(loader) is original
