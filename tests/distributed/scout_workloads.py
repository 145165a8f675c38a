"""Rank functions for the SCOUT replay tests (module-level so child ranks can import them).

The model is a tiny LM-shaped network: Embedding(50,16) -> 3 blocks of Linear(16,16)+tanh+Dropout
in a ModuleList -> Linear(16,4). Every rank starts from the same seed and averages gradients with
one all_reduce (or DDP), so all ranks are bitwise-identical replicas that see different batches.
Faults are test-side forward hooks on ONE rank: they change that rank's module output both in the
training forward and in SCOUT's replay (what a faulty device would do).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from lm_resiliency.manager_api import OrchestrationHooks
from lm_resiliency.scout.config import ReplayHarnessConfig
from lm_resiliency.scout.replay import ReplayDetector, ReplayError
from lm_resiliency.scout.reports import replay_fault_reports
from lm_resiliency.scout.signature import structure_signature, tensor_signature


class Block(nn.Module):
    def __init__(self, width: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x) * scale))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 16, layers: int = 3, out: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([Block(width) for _ in range(layers)])
        self.head = nn.Linear(width, out)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h, scale=1.0)  # a keyword input: replay must carry kwargs too
        return self.head(h)


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


# -- faults (applied to a module output, one rank only) ---------------------------------------

def recording_hooks(events: list) -> OrchestrationHooks:
    """Orchestration hooks that append ("fault", report JSON) and ("recovery", decision JSON) to `events`."""
    return OrchestrationHooks(report_fault=lambda r: events.append(("fault", r.to_json())),
                              report_recovery=lambda d: events.append(("recovery", d.to_json())))


def _target_index(out: torch.Tensor) -> int:
    return int(out.detach().reshape(-1).abs().argmax())


def sign_flip(module, args, kwargs, output):
    out = output.clone()
    flat = out.view(-1)
    flat[_target_index(output)] *= -1
    return out


def bit_flip(module, args, kwargs, output):
    out = output.clone()
    bits = out.view(-1).view(torch.int32)
    bits[_target_index(output)] ^= 1  # lowest mantissa bit: the smallest possible change
    return out


def tiny_perturbation(module, args, kwargs, output):
    """Multiply 1% of the (nonzero) elements by (1 + 1e-6): a few ulps each."""
    out = output.clone()
    flat = out.view(-1)
    nonzero = flat.nonzero().reshape(-1)
    count = max(1, math.ceil(0.01 * flat.numel()))
    picked = nonzero[:: max(1, nonzero.numel() // count)][:count]
    flat[picked] *= (1 + 1e-6)
    return out


FAULTS = {"sign_flip": sign_flip, "bit_flip": bit_flip, "tiny_perturbation": tiny_perturbation}


def backward_sign_flip(module, grad_input, grad_output):
    """A faulty backward only: one element of the module's input gradient changes sign."""
    grad = grad_input[0].clone()
    grad.view(-1)[_target_index(grad)] *= -1
    return (grad, *grad_input[1:])


BACKWARD_FAULTS = {"backward_sign_flip": backward_sign_flip}


# -- training loop ------------------------------------------------------------------------------

def _average_gradients(model: nn.Module, group=None) -> None:
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)


def _batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 50, (8,), generator=gen)


def _module(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def train(rank, world, config, steps, *, fault=None, fault_rank=None, fault_path=None, fault_from_step=1,
          param_fault=None, group=None, group_ranks=None, ddp=False, invariants=False):
    """Train `steps` steps with a ReplayDetector; returns {step: ReplayResult} for checked steps.

    fault: name in FAULTS (a forward hook) or BACKWARD_FAULTS (a full backward hook), applied on
    `fault_path` of rank `fault_rank` from
    `fault_from_step` on ("@hidden:<step>" names the hidden layer SCOUT samples at that step).
    param_fault: (rank, param name or "@optimizer:<step>", after_step): add 1e-3 to one element
    after that step's optimizer.step().
    invariants: assert run() leaves parameters, grads and the RNG untouched."""
    model = make_model()
    trained = nn.parallel.DistributedDataParallel(model) if ddp else model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ranks = list(range(world)) if group_ranks is None else group_ranks
    group = dist.group.WORLD if group is None else group
    detector = ReplayDetector(trained, optimizer, config, group=group, group_ranks=ranks)
    if fault_path is not None and fault_path.startswith("@"):
        fault_path = detector.sampled(*_parse_ref(fault_path))[0]
    results = {}
    handle = None
    for step in range(1, steps + 1):
        if fault is not None and rank == fault_rank and step == fault_from_step:
            target = _module(model, fault_path)
            handle = target.register_full_backward_hook(BACKWARD_FAULTS[fault]) if fault in BACKWARD_FAULTS \
                else target.register_forward_hook(FAULTS[fault], with_kwargs=True)
        detector.arm(step)
        loss = trained(_batch(rank, step)).pow(2).mean()
        loss.backward()
        if not ddp:
            _average_gradients(model, group)
        if detector.checks_due(step):
            before = _invariant_state(model) if invariants else None
            results[step] = detector.run(step)
            if invariants:
                assert _invariant_state(model) == before, f"run({step}) changed parameters, grads or RNG"
        optimizer.step()
        optimizer.zero_grad()
        if param_fault is not None and rank == param_fault[0] and step == param_fault[2]:
            name = param_fault[1]
            if name.startswith("@"):
                name = detector.sampled(*_parse_ref(name))[0].split("[")[0]
            with torch.no_grad():
                model.get_parameter(name).view(-1)[0] += 1e-3
    if handle is not None:
        handle.remove()
    detector.close()
    return results


def _parse_ref(ref: str):
    check, step = ref[1:].split(":")
    return check, int(step)


def _invariant_state(model: nn.Module):
    return (structure_signature(list(model.parameters())),
            structure_signature([p.grad for p in model.parameters()]),
            tensor_signature(torch.get_rng_state()))


# -- rank functions -----------------------------------------------------------------------------

def localize_hidden_fault(rank, world, fault, fault_rank, interval):
    """One fault kind on one rank's hidden layer, sampled at the first check (step `interval`)."""
    config = ReplayHarnessConfig(check_interval=interval, rotate_layers=True)
    results = train(rank, world, config, interval, fault=fault, fault_rank=fault_rank,
                    fault_path=f"@hidden:{interval}")
    result = results[interval]
    return result, replay_fault_reports(result)


def rotation_finds_layer(rank, world, fault_rank):
    """A fault in the last hidden layer is found within one rotation (3 checks)."""
    config = ReplayHarnessConfig(check_interval=1, rotate_layers=True)
    results = train(rank, world, config, 3, fault="bit_flip", fault_rank=fault_rank, fault_path="layers.2")
    return {step: (r, replay_fault_reports(r)) for step, r in results.items()}


def parameter_corruption(rank, world, fault_rank, name, corrupt_after, steps, only_optimizer):
    intervals = dict(embedding_check_interval=1000, hidden_check_interval=1000,
                     output_check_interval=1000) if only_optimizer else {}
    config = ReplayHarnessConfig(check_interval=1, **intervals)
    results = train(rank, world, config, steps, param_fault=(fault_rank, name, corrupt_after))
    return {step: (r, replay_fault_reports(r)) for step, r in results.items()}


def clean_run(rank, world, steps, ddp):
    config = ReplayHarnessConfig(check_interval=1)
    results = train(rank, world, config, steps, ddp=ddp, invariants=True)
    return {step: (r, replay_fault_reports(r)) for step, r in results.items()}


def ddp_fault(rank, world, fault_rank):
    """DDP-wrapped replicas: step 2 clean, then a fault from step 3 found at the step-4 check."""
    config = ReplayHarnessConfig(check_interval=2)
    results = train(rank, world, config, 4, fault="sign_flip", fault_rank=fault_rank, fault_from_step=3,
                    fault_path="@hidden:4", ddp=True, invariants=True)
    return {step: (r, replay_fault_reports(r)) for step, r in results.items()}


def backward_fault(rank, world, fault_rank, ddp):
    """A fault in one rank's backward only, from step 3: the step-4 backward replay finds it."""
    config = ReplayHarnessConfig(check_interval=2)
    results = train(rank, world, config, 4, fault="backward_sign_flip", fault_rank=fault_rank, fault_from_step=3,
                    fault_path="@hidden:4", ddp=ddp, invariants=True)
    return {step: (r, replay_fault_reports(r)) for step, r in results.items()}


def two_peer_output_fault(rank, world):
    config = ReplayHarnessConfig(check_interval=1)
    results = train(rank, world, config, 1, fault="bit_flip", fault_rank=1, fault_path="head")
    return results[1], replay_fault_reports(results[1])


def subgroups(rank, world, fault_rank):
    """Two peer groups of two ([0, 2] and [1, 3]) checked concurrently; a fault on one rank."""
    from lm_resiliency.scout.peers import dense_peer_groups, group_of

    groups = dense_peer_groups(world, model_parallel_size=2)
    handles = [dist.new_group(g, backend="gloo") for g in groups]
    mine = group_of(rank, groups)
    group = handles[groups.index(mine)]
    config = ReplayHarnessConfig(check_interval=1)
    results = train(rank, world, config, 1, fault="sign_flip", fault_rank=fault_rank, fault_path="head",
                    group=group, group_ranks=mine)
    return mine, results[1]


def plan_mismatch(rank, world):
    """One rank configured differently: every rank must raise ReplayError, none may hang."""
    hidden = 2 if rank == 3 else 1
    config = ReplayHarnessConfig(check_interval=1, hidden_check_interval=hidden)
    try:
        train(rank, world, config, 1)
    except ReplayError as exc:
        return str(exc)
    return None


