"""A small expert-parallel MoE trained as users do: top-1 routing, token dispatch and combine with
`all_to_all_single` over the expert-parallel group (an autograd function, as Megatron's), dense
parameters under DDP, expert gradients averaged over the expert-data-parallel group.

Shared by the MoE tests (tests/distributed/moe_workloads.py, the default sizes) and the MoE part
of benchmarks/scout_bench.py (larger sizes, optional dense blocks after the MoE layer).

Mesh ("edp", "ep"): rank r sits at ep = r % EP, edp = r // EP; EP ranks split the experts,
EDP ranks hold equal copies of the same experts. `hierarchical=True` adds a second AllToAll over
the EDP group (a 2-D dispatch), so the job's AllToAll groups overlap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh


@dataclass(frozen=True)
class MoESizes:
    """`width` model width, `hidden` expert (and dense block) inner width, `experts_per_rank` local
    experts, `vocab` embedding rows, `outputs` head width, `blocks` dense residual MLP blocks after
    the MoE layer (an `nn.ModuleList`, absent when 0)."""

    width: int = 8
    hidden: int = 16
    experts_per_rank: int = 2
    vocab: int = 32
    outputs: int = 4
    blocks: int = 0


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: List[int], recv: List[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


class GroupedExperts(nn.Module):
    """The post-dispatch expert stage: (tokens, tokens_per_expert, probabilities)."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden) * 0.3)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width) * 0.3)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor,
                probabilities: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, chunk in enumerate(tokens.split(tokens_per_expert.tolist())):
            outs.append(torch.relu(chunk @ self.w1[e]) @ self.w2[e])
        return torch.cat(outs) * probabilities.unsqueeze(1)


class MoELayer(nn.Module):
    def __init__(self, ep_group: Any, ep: int, edp_group: Any, sizes: MoESizes) -> None:
        super().__init__()
        self.ep_group, self.ep, self.edp_group = ep_group, ep, edp_group
        self.local = sizes.experts_per_rank
        self.router = nn.Linear(sizes.width, self.local * ep)
        self.experts = GroupedExperts(self.local, sizes.width, sizes.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, expert = torch.softmax(self.router(x), dim=-1).max(dim=-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=self.local * self.ep)               # per global expert
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)                # [src][local expert]
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv_matrix = recv_counts.view(self.ep, self.local)
        recv = recv_matrix.sum(1).tolist()
        payload = torch.cat([x[order], probs[order].unsqueeze(1)], dim=1)
        if self.edp_group is not None:  # second hop: a round trip over the EDP group (2-D dispatch shape)
            n = dist.get_world_size(self.edp_group)
            rows = payload.shape[0] // n * n
            moved = _AllToAll.apply(payload[:rows], [rows // n] * n, [rows // n] * n, self.edp_group)
            back = _AllToAll.apply(moved, [rows // n] * n, [rows // n] * n, self.edp_group)
            payload = torch.cat([back, payload[rows:]])
        received = _AllToAll.apply(payload, send, recv, self.ep_group)
        # Received rows are ordered (source rank, local expert): regroup by local expert.
        local = torch.arange(self.local).repeat(self.ep).repeat_interleave(recv_matrix.reshape(-1))
        by_expert = torch.argsort(local, stable=True)
        tokens, p = received[by_expert, :-1], received[by_expert, -1]
        out = self.experts(tokens, recv_matrix.sum(0), p)
        restored = torch.empty_like(out).index_copy(0, by_expert, out)
        combined = _AllToAll.apply(restored, recv, send, self.ep_group)
        return torch.empty_like(combined).index_copy(0, order, combined)


class Block(nn.Module):
    """A dense residual MLP block (width -> hidden -> width)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class TinyMoE(nn.Module):
    def __init__(self, ep_group: Any, ep: int, edp_group: Any = None, sizes: MoESizes = MoESizes()) -> None:
        super().__init__()
        self.embed = nn.Embedding(sizes.vocab, sizes.width)
        self.moe = MoELayer(ep_group, ep, edp_group, sizes)
        if sizes.blocks:
            self.blocks = nn.ModuleList(Block(sizes.width, sizes.hidden) for _ in range(sizes.blocks))
        self.head = nn.Linear(sizes.width, sizes.outputs)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.moe(h)
        for block in getattr(self, "blocks", ()):
            h = block(h)
        return self.head(h)


def build(rank: int, world: int, ep: int, hierarchical: bool = False, sizes: MoESizes = MoESizes(), lr: float = 1e-2):
    """(DDP model, the unwrapped model, optimizer, mesh, edp group) on this rank."""
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    ep_group, edp_group = mesh.get_group("ep"), mesh.get_group("edp")
    torch.manual_seed(0)
    model = TinyMoE(ep_group, ep, edp_group if hierarchical else None, sizes)
    with torch.no_grad():  # experts differ per EP coordinate, equal across EDP
        gen = torch.Generator().manual_seed(100 + rank % ep)
        for p in model.moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    expert_names = [f"moe.experts.{n}" for n, _ in model.moe.experts.named_parameters()]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return ddp, model, optimizer, mesh, edp_group


def average_expert_gradients(model: TinyMoE, edp_group: Any) -> None:
    """What DDP does not do for the experts: average their gradients over the expert-DP group."""
    for p in model.moe.experts.parameters():
        dist.all_reduce(p.grad, group=edp_group)
        p.grad.div_(dist.get_world_size(edp_group))
