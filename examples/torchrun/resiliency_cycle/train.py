"""The cycle's training module: a plain DDP loop started by torchrun. It never calls
enable_resiliency: the worker policy (`lm_resiliency_worker_config`) attaches GEMINI and SCOUT
at the first DDP forward and loads the step the agents selected.

    torchrun ... --module examples.torchrun.resiliency_cycle.train STEPS

`LMR_CYCLE_DIR` names this run's work directory; its `worker.json`, written by the orchestrator,
says where GEMINI flushes and which fault-kit manifest (if any) to perform:

- `progress/g<generation>-s<slot>.json`: written when a generation starts (its restart context:
  node id, decision, selected step, topology digest);
- `markers/<incident>.json`: written by the target rank right before the fault kit performs an
  incident (the orchestrator's cue; for whole-node incidents, `x_node_loss` in the manifest, the
  rank then waits, bounded, for the orchestrator to kill its node);
- `scout/<incident>-rank<r>.json`: the SCOUT verdict (from SCOUT's log record) naming the
  faulty rank of a tensor-corruption incident;
- `final/rank<r>.json`: every parameter and optimizer tensor (hex bytes) at the last step.

A rank whose incident was performed ends its process with `INCIDENT_EXIT` right after that
iteration's optimizer step (before the next forward saves that step's capture), and so does
every rank once SCOUT names a faulty rank: the incident's effect never reaches a capture, and
torchrun starts the next generation.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

INCIDENT_EXIT = 75
NODE_LOSS_WAIT_S = 300.0  # a whole-node incident waits this long for the orchestrator's kill
GLOO_TIMEOUT_S = 120


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(start: int, rank: int) -> Iterator[torch.Tensor]:
    """The batch of iteration i+1 is a pure function of (i, rank): a resumed run sees the same data."""
    step = start
    while True:
        yield torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
        step += 1


def write_json(path: str, doc: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, sort_keys=True)
    os.replace(path + ".tmp", path)


class _ScoutVerdicts(logging.Handler):
    """SCOUT logs every vote that is not clean ("SCOUT <where>, <check> of <path>: sdc, faulty=[r],
    ..."): the ranks of an `sdc` verdict, handed to `on_found` at once (the worker policy then ends
    the generation to retire the named node, so no later hook of the loop may run)."""

    def __init__(self, on_found: Callable[[List[Dict[str, Any]]], None]) -> None:
        super().__init__(logging.WARNING)
        self.found: List[Dict[str, Any]] = []
        self.on_found = on_found

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.name == "lm_resiliency.scout.peers" and len(args) == 6 and args[3] == "sdc":
            self.found.append({"where": str(args[0]), "check": str(args[1]), "module": str(args[2]),
                               "faulty": list(args[4]), "t": time.time()})
            self.on_found(self.found)


class Incidents:
    """The fault kit attached to this rank with the orchestrator's manifest."""

    def __init__(self, work: str, config: Dict[str, Any], ddp: nn.Module, optimizer: torch.optim.Optimizer,
                 rank: int, world: int, generation: int) -> None:
        from lm_resiliency.faults import (CallbackFaultExecutor, CampaignJournal, FaultCampaign,
                                          JsonCampaignStateStore, LocalFaultExecutor, enable_fault_injection)

        self.work, self.rank, self.generation = work, rank, generation
        self.local = LocalFaultExecutor(allow_process_termination=True, checkpoint_folder=config["gemini_disk"])
        self.performed: List[str] = []
        self.scout = _ScoutVerdicts(self._report_scout)
        logging.getLogger("lm_resiliency.scout.peers").addHandler(self.scout)
        self.session = enable_fault_injection(
            ddp, optimizer, campaign=FaultCampaign.from_file(config["fault_campaign"]), rank=rank, world_size=world,
            executor=CallbackFaultExecutor(self._perform),
            state_store=JsonCampaignStateStore(os.path.join(work, "campaign-state.json")),
            journal=CampaignJournal(os.path.join(work, "journal.jsonl")),
            generation=str(generation), sandbox_dir=os.path.join(work, "sandbox"))
        self._sdc_incident = next((i.incident_id for i in self.session.campaign.incidents
                                   if i.faults[0].type.value == "tensor_corruption"), "sdc")
        self._corrupted_at: Optional[int] = None

    def _perform(self, request: Any) -> Any:
        from lm_resiliency.faults import FaultExecutionResult

        kind = request.type.value
        marker = os.path.join(self.work, "markers", f"{request.incident_id}.json")
        if not os.path.exists(marker):
            write_json(marker, {"incident": request.incident_id, "type": kind, "rank": self.rank,
                                "iteration": request.iteration, "generation": self.generation, "pid": os.getpid(),
                                "t": time.time()})
        if request.parameters.get("x_node_loss"):
            # The node is gone for its peers: the orchestrator (the manager) kills this agent.
            if kind == "hang":
                self.local.execute(request)  # journals the hang before it blocks
            else:
                if request.commit is not None:
                    request.commit({"node_loss": kind})
                time.sleep(NODE_LOSS_WAIT_S)
            raise SystemExit(f"{kind}: the orchestrator did not end this node within {NODE_LOSS_WAIT_S}s")
        if kind == "payload_corruption":  # the batch's bytes arrive sign-flipped
            self.performed.append(request.incident_id)
            return FaultExecutionResult(evidence={"elements_changed": int(request.value.numel()),
                                                  "operation": "sign_flip"}, value=(request.value.neg(),))
        result = self.local.execute(request)
        if kind == "tensor_corruption":
            self._corrupted_at = request.iteration  # SCOUT must name this rank (see after_step)
        elif result.status is not None:
            self.performed.append(request.incident_id)
        return result

    def _report_scout(self, verdicts: List[Dict[str, Any]]) -> None:
        write_json(os.path.join(self.work, "scout", f"{self._sdc_incident}-rank{self.rank}.json"),
                   {"rank": self.rank, "generation": self.generation, "verdicts": verdicts})

    def after_step(self, step: int) -> None:
        """End this process when an incident was performed here, SCOUT named a faulty rank, or a
        tensor corruption stayed unnamed for two capture intervals (the orchestrator reports it)."""
        unnamed = self._corrupted_at is not None and step >= self._corrupted_at + 4
        if self.scout.found or self.performed or unnamed:
            logging.getLogger(__name__).warning("rank %d: ending generation %d after step %d (%s)", self.rank,
                                                self.generation, step, self.performed or
                                                ("SCOUT named a rank" if self.scout.found else "corruption unnamed"))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(INCIDENT_EXIT)


def main() -> None:
    from lm_resiliency.integrations.torchrun import get_torchrun_worker_context

    steps = int(sys.argv[1])
    work = os.environ["LMR_CYCLE_DIR"]
    with open(os.path.join(work, "worker.json")) as f:
        config = json.load(f)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    dist.init_process_group("gloo", timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    context = get_torchrun_worker_context()
    start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", "0"))
    write_json(os.path.join(work, "progress", f"g{context.generation:03d}-s{context.slot}.json"),
               {"generation": context.generation, "slot": context.slot, "rank": rank, "node_id": context.node_id,
                "decision": context.decision, "checkpoint_step": context.checkpoint_step,
                "checkpoint_source": context.checkpoint_source, "topology_digest": context.topology_digest,
                "start": start, "pid": os.getpid(), "agent_pid": os.getppid(), "t": time.time()})
    model = build_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    incidents = None
    loader: Any = batches(start, rank)
    if config.get("fault_campaign"):
        incidents = Incidents(work, config, ddp, optimizer, rank, world, context.generation)
        loader = incidents.session.wrap_dataloader(loader)
    step = start
    for x in loader:
        if step >= steps:
            break
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if incidents is not None:
            incidents.after_step(step)
    tensors = {f"param/{name}": p for name, p in model.named_parameters()}
    for index, state in optimizer.state_dict()["state"].items():
        tensors.update({f"optim/{index}/{key}": value for key, value in state.items()
                        if isinstance(value, torch.Tensor)})
    write_json(os.path.join(work, "final", f"rank{rank}.json"),
               {"start": start, "generation": context.generation,
                "tensors": {name: t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes().hex()
                            for name, t in sorted(tensors.items())}})
    if incidents is not None:
        incidents.session.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
