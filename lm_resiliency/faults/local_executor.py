"""LocalFaultExecutor: performs, for real and in this process, every fault that can be done
safely on one host; refuses the rest with `UnsupportedFaultError` and the reason."""

from __future__ import annotations

import contextlib
import errno as errno_module
import logging
import os
import signal
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from . import checkpoint_faults
from .campaign import FaultSpec
from .corruption import (INVOLUTIVE, CorruptionOperation, FaultMagnitude, FaultScope, corrupt_tensor, count_changed,
                         hold_change, restore_change, trace_change)
from .errors import InjectedFault, InjectedIOError, InjectedTimeout, UnsupportedFaultError
from .executor import FaultExecutionRequest, FaultExecutionResult, FaultExecutor
from .records import InjectionStatus
from .taxonomy import FailureType, FaultSurface

logger = logging.getLogger(__name__)

F, U = FailureType, FaultSurface

_STALLS = (F.DELAY, F.HANG, F.TIMEOUT, F.EXCEPTION, F.IO_ERROR)
_BATCH_OPS = (F.DROP, F.DUPLICATE, F.REORDER)
_NEVER_HERE = {
    F.NETWORK_PARTITION: "partitioning a real network interface would cut this host off; it needs a "
                         "network namespace or switch control outside the training process (plug one "
                         "in with CallbackFaultExecutor)",
    F.MESSAGE_DROP: "dropping a message in flight needs a hook inside the communication transport "
                    "(plug one in with CallbackFaultExecutor)",
    F.PAYLOAD_CORRUPTION: "corrupting a message payload in flight needs a transport or comm hook "
                          "(e.g. a DDP comm hook; plug it in with CallbackFaultExecutor); use "
                          "tensor_corruption on the gradient surface for the same numeric effect",
    F.RESOURCE_UNAVAILABLE: "making a device or mount unavailable needs the host's device or mount "
                            "manager; a training process cannot do it safely to itself",
}
DEFAULT_EXHAUSTION_BYTES = 16 * 1024 * 1024


class LocalFaultExecutor(FaultExecutor):
    """The built-in executor (see docs/fault_injection.md for the per-type table).

    `allow_process_termination`: process_termination really signals this process (SIGKILL by
    default); without it such faults are refused. `checkpoint_folder`: GEMINI `disk_folder` used
    by checkpoint faults that do not name one in their parameters. `sleep` is injectable for tests.
    """

    def __init__(self, *, allow_process_termination: bool = False,
                 checkpoint_folder: Optional[str] = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.allow_process_termination = bool(allow_process_termination)
        self.checkpoint_folder = checkpoint_folder
        self._sleep = sleep

    # ------------------------------------------------------------------ support

    def check(self, spec: FaultSpec) -> None:
        t, surface, p = spec.type, spec.target.surface, spec.parameters
        if t in _NEVER_HERE:
            raise UnsupportedFaultError(spec.fault_id, _NEVER_HERE[t])
        if surface is U.COLLECTIVE and t is not F.COLLECTIVE_DESYNC:
            raise UnsupportedFaultError(spec.fault_id, f"{t.value} on the collective surface needs a hook "
                                                       "inside the collective library (plug one in with "
                                                       "CallbackFaultExecutor)")
        if t is F.RESOURCE_EXHAUSTION and p.get("resource", "disk") == "device_memory":
            raise UnsupportedFaultError(spec.fault_id, "exhausting accelerator memory would also starve "
                                                       "every other process on the device; it is not done "
                                                       "in a shared host")
        if t is F.PROCESS_TERMINATION and not self.allow_process_termination:
            raise UnsupportedFaultError(spec.fault_id, "process termination is destructive; construct "
                                                       "LocalFaultExecutor(allow_process_termination=True)")
        if t in (F.CHECKPOINT_CORRUPTION, F.CHECKPOINT_TRUNCATION, F.CHECKPOINT_MISSING):
            if "disk_folder" not in p and self.checkpoint_folder is None:
                raise UnsupportedFaultError(spec.fault_id, "no GEMINI disk_folder: give the fault a "
                                                           "'disk_folder' parameter or construct "
                                                           "LocalFaultExecutor(checkpoint_folder=...)")
        if t is F.CONFIG_DRIFT and "key" in p and surface is not U.CONFIG:
            raise UnsupportedFaultError(spec.fault_id, "config_drift targets the config surface")

    # ------------------------------------------------------------------ dispatch

    def execute(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        spec = request.spec
        self.check(spec)
        t = spec.type
        if t is F.TENSOR_CORRUPTION:
            return self._tensor_corruption(request)
        if t is F.STALE_STATE:
            return self._stale_state(request)
        if t in _BATCH_OPS:
            return self._batch(request)
        if t in _STALLS:
            return self._stall(request)
        if t is F.RESOURCE_EXHAUSTION:
            return self._exhaust(request)
        if t is F.PROCESS_TERMINATION:
            return self._terminate(request)
        if t in (F.CHECKPOINT_CORRUPTION, F.CHECKPOINT_TRUNCATION, F.CHECKPOINT_MISSING):
            return self._checkpoint(request)
        if t is F.COLLECTIVE_DESYNC:
            return self._desync(request)
        if t is F.CONFIG_DRIFT:
            return self._config_drift(request)
        raise UnsupportedFaultError(spec.fault_id, f"no local implementation of {t.value}")

    # ------------------------------------------------------------------ tensors

    def _corrupt(self, request: FaultExecutionRequest, tensor: torch.Tensor,
                 seed_offset: int = 0) -> Tuple[torch.Tensor, Dict[str, Any]]:
        p = request.parameters
        return corrupt_tensor(
            tensor, fault_id=request.fault_id,
            operation=CorruptionOperation(p["operation"]),
            scope=FaultScope(p.get("scope", FaultScope.FULL.value)),
            seed=request.seed + seed_offset, fraction=p.get("fraction"), index=p.get("index"),
            bit=p.get("bit"), factor=p.get("factor"), addend=p.get("addend"),
            magnitude=FaultMagnitude(p.get("magnitude", FaultMagnitude.MODERATE.value)))

    def _tensor_corruption(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        """Outputs and inputs are corrupted out of place at each matching call; gradients (fresh
        every step) in place at each step. Parameters and optimizer state persist: the first
        call corrupts them and traces what changed (`request.context`), a later call of a sign
        or bit flip holds the flipped bits (applying it again would give the value back), other
        operations apply again, and `deactivate` writes the original values back."""
        surface = request.spec.target.surface
        if surface in (U.OUTPUT, U.INPUT):
            return self._corrupt_value(request)
        named = list(self._state_tensors(request))
        if not named:
            return FaultExecutionResult(InjectionStatus.NO_EFFECT, {"tensors": []},
                                        detail=f"no {surface.value} tensors to corrupt")
        persistent = surface in (U.PARAMETER, U.OPTIMIZER_STATE)
        traces = request.context.setdefault("traces", {}) if persistent else {}
        held = CorruptionOperation(request.parameters["operation"]) in INVOLUTIVE
        report, total, holding = [], 0, 0
        with torch.no_grad():
            for i, (name, tensor) in enumerate(named):
                if held and name in traces:
                    changed = hold_change(tensor, traces[name], request.fault_id)
                    report.append({"name": name, "held": int(traces[name]["indices"].numel()),
                                   "elements_changed": changed})
                    holding += 1
                    continue
                corrupted, evidence = self._corrupt(request, tensor, seed_offset=i)
                if persistent:
                    traces[name] = trace_change(tensor, corrupted, traces.get(name))
                tensor.copy_(corrupted)
                report.append(dict(evidence, name=name))
                total += evidence["elements_changed"]
        evidence = {"elements_changed": total, "tensors": report[:16]}
        if holding:
            # The flipped bits stay in effect (forced again where training changed them).
            evidence["held"] = True
            return FaultExecutionResult(InjectionStatus.INJECTED, evidence)
        return FaultExecutionResult(InjectionStatus.INJECTED if total else InjectionStatus.NO_EFFECT, evidence)

    def _corrupt_value(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        value = request.value
        index = request.parameters.get("index_in_output", 0)
        if isinstance(value, torch.Tensor):
            corrupted, evidence = self._corrupt(request, value)
            new_value = corrupted
        elif isinstance(value, (tuple, list)) and index < len(value):
            corrupted, evidence = self._corrupt(request, value[index])
            items = list(value)
            items[index] = corrupted
            new_value = type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
            evidence["index_in_output"] = index
        else:
            raise UnsupportedFaultError(request.fault_id, f"cannot find tensor {index} in a "
                                                          f"{type(value).__name__} "
                                                          f"{request.spec.target.surface.value}")
        status = InjectionStatus.INJECTED if evidence["elements_changed"] else InjectionStatus.NO_EFFECT
        return FaultExecutionResult(status, evidence, value=new_value)

    def _parameters(self, request: FaultExecutionRequest) -> List[Tuple[str, torch.nn.Parameter]]:
        module = request.module if request.module is not None else request.model
        named = list(module.named_parameters())
        wanted = request.parameters.get("parameter")
        if wanted is not None:
            named = [(n, p) for n, p in named if n == wanted]
            if not named:
                raise UnsupportedFaultError(request.fault_id, f"module {request.spec.target.module_path!r} "
                                                              f"has no parameter {wanted!r}")
        return named

    def _state_tensors(self, request: FaultExecutionRequest) -> Iterator[Tuple[str, torch.Tensor]]:
        surface = request.spec.target.surface
        for name, param in self._parameters(request):
            if surface is U.PARAMETER:
                yield name, param.data
            elif surface is U.GRADIENT:
                if param.grad is not None:
                    yield name + ".grad", param.grad
            elif surface is U.OPTIMIZER_STATE:
                state = request.optimizer.state.get(param, {}) if request.optimizer is not None else {}
                wanted = request.parameters.get("state_key")
                for key, value in sorted(state.items(), key=lambda kv: str(kv[0])):
                    if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0
                            and (wanted is None or key == wanted)):
                        yield f"{name}:{key}", value

    # ------------------------------------------------------------------ deactivation

    def deactivate(self, request: FaultExecutionRequest) -> Optional[FaultExecutionResult]:
        """Undo what lasts after the occurrence: parameter and optimizer-state corruption gets
        its original values back, held host memory and disk fill are released, a config drift
        is set back. Damaged shards, a killed process, stalls and altered batches cannot be (or
        need not be) undone."""
        context, t = request.context, request.type
        if t is F.TENSOR_CORRUPTION and context.get("traces"):
            traces = context.pop("traces")
            restored, names = 0, []
            with torch.no_grad():
                for name, tensor in self._state_tensors(request):
                    if name in traces:
                        restored += restore_change(tensor, traces.pop(name), request.fault_id)
                        names.append(name)
            evidence: Dict[str, Any] = {"elements_restored": restored, "tensors": names[:16]}
            if traces:
                evidence["gone"] = sorted(traces)[:16]   # e.g. optimizer state replaced by load_state_dict
            return FaultExecutionResult(evidence=evidence, detail=f"original values restored ({request.reason})")
        if t is F.RESOURCE_EXHAUSTION and (context.get("held") or context.get("files")):
            held = context.pop("held", [])
            files = context.pop("files", [])
            for path in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            return FaultExecutionResult(evidence={"released_bytes": sum(len(h) for h in held),
                                                  "removed_files": files},
                                        detail=f"resource released ({request.reason})")
        if t is F.CONFIG_DRIFT and "restore" in context:
            kind, saved = context.pop("restore")
            if kind == "env":
                name, before = saved
                if before is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = before
                evidence = {"env": name, "restored": before}
            else:
                for index, key, before in saved:
                    request.optimizer.param_groups[index][key] = before
                evidence = {"key": saved[0][1], "groups": [i for i, _, _ in saved]}
            return FaultExecutionResult(evidence=evidence, detail=f"configuration set back ({request.reason})")
        return None

    # ------------------------------------------------------------------ stale state

    def _stale_state(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        """Undo this optimizer step's update of the targeted state: snapshot before, restore after."""
        if request.phase == "pre_step":
            request.context["snapshot"] = [(n, t, t.detach().clone())
                                           for n, t in self._state_tensors(request)]
            return FaultExecutionResult(status=None)
        if request.phase != "post_step":
            raise UnsupportedFaultError(request.fault_id, f"stale_state runs around optimizer.step, not "
                                                          f"at {request.phase}")
        snapshot = request.context.pop("snapshot", [])
        total, names = 0, []
        with torch.no_grad():
            for name, tensor, old in snapshot:
                changed, _ = count_changed(old, tensor)
                tensor.copy_(old)
                total += changed
                names.append(name)
        status = InjectionStatus.INJECTED if total else InjectionStatus.NO_EFFECT
        return FaultExecutionResult(status, {"elements_reverted": total, "tensors": names[:16]})

    # ------------------------------------------------------------------ batches

    def _batch(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        t, batch = request.type, request.value
        if request.phase != "batch":
            raise UnsupportedFaultError(request.fault_id, f"{t.value} acts on batches from "
                                                          "FaultInjectionSession.wrap_dataloader")
        if t is F.DROP:
            return FaultExecutionResult(evidence={"action": "drop"}, value=())
        if t is F.DUPLICATE:
            return FaultExecutionResult(evidence={"action": "duplicate"}, value=(batch, batch))
        if request.fetch is None:
            raise UnsupportedFaultError(request.fault_id, f"{t.value} swaps with the next batch, and the request "
                                                          "has no `fetch` to pull it (FaultInjectionSession."
                                                          "wrap_dataloader provides one)")
        try:
            following = request.fetch()
        except StopIteration:
            return FaultExecutionResult(InjectionStatus.NO_EFFECT, {"action": "reorder"}, value=(batch,),
                                        detail="no later batch to swap with")
        return FaultExecutionResult(evidence={"action": "reorder"}, value=(following, batch))

    # ------------------------------------------------------------------ stalls and exceptions

    def _stall(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        t, p = request.type, request.parameters
        seconds = float(p.get("seconds", 0.0))
        if t is F.HANG and request.commit is not None:
            # A hang usually ends with the process being killed: record the ground truth first.
            request.commit({"seconds": seconds, "phase": request.phase, "journaled": "before blocking"})
        started = time.monotonic()
        if seconds > 0:
            self._sleep(seconds)
        waited = round(time.monotonic() - started, 6)
        evidence = {"seconds": seconds, "waited_s": waited, "phase": request.phase}
        ids: Dict[str, Any] = dict(occurrence_id=request.occurrence_id, fault_id=request.fault_id, evidence=evidence)
        if t is F.TIMEOUT:
            raise InjectedTimeout(p.get("message", f"injected timeout after {seconds}s "
                                                   f"({request.occurrence_id})"), **ids)
        if t is F.EXCEPTION:
            raise InjectedFault(p.get("message", f"injected exception ({request.occurrence_id})"), **ids)
        if t is F.IO_ERROR:
            code = p.get("errno", errno_module.EIO)
            evidence["errno"] = code
            raise InjectedIOError(p.get("message", f"injected I/O error ({request.occurrence_id})"),
                                  errno_value=code, **ids)
        return FaultExecutionResult(evidence=evidence)

    # ------------------------------------------------------------------ destructive

    def _exhaust(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        p = request.parameters
        resource = p.get("resource", "disk")
        nbytes = p.get("bytes", DEFAULT_EXHAUSTION_BYTES)
        if resource == "host_memory":
            hold = bytearray(nbytes)  # touched below so the pages are really committed
            for i in range(0, nbytes, 4096):
                hold[i] = 1
            request.context.setdefault("held", []).append(hold)
            return FaultExecutionResult(evidence={"resource": resource, "bytes": nbytes})
        if request.sandbox_dir is None:
            raise UnsupportedFaultError(request.fault_id, "disk exhaustion needs a sandbox directory")
        path = os.path.join(request.sandbox_dir, f"exhaust-{request.call_index}.bin")
        request.context.setdefault("files", []).append(path)
        chunk = b"\0" * min(nbytes, 1 << 20)
        written = 0
        with open(path, "wb") as f:
            while written < nbytes:
                written += f.write(chunk[: nbytes - written])
            f.flush()
            os.fsync(f.fileno())
        return FaultExecutionResult(evidence={"resource": resource, "bytes": os.path.getsize(path),
                                              "path": path})

    def _terminate(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        name = request.parameters.get("signal", "SIGKILL")
        signum = int(getattr(signal, name))
        evidence = {"signal": name, "pid": os.getpid()}
        logger.warning("fault %s: sending %s to this process (pid %d) on purpose", request.occurrence_id,
                       name, os.getpid())
        if request.commit is not None:
            request.commit(evidence)
        os.kill(os.getpid(), signum)
        time.sleep(0.05)  # a handled signal returns here; give its handler a chance to run
        return FaultExecutionResult(status=None if request.commit is not None else InjectionStatus.INJECTED,
                                    evidence=evidence)

    def _checkpoint(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        p, t = request.parameters, request.type
        folder = p.get("disk_folder", self.checkpoint_folder)
        path = checkpoint_faults.select_shard(folder, request.rank, kind=p.get("kind", "own"),
                                              step=p.get("step"), owner_rank=p.get("owner_rank"))
        if path is None:
            return FaultExecutionResult(InjectionStatus.NO_EFFECT, {"disk_folder": folder},
                                        detail=f"no matching GEMINI shard of rank {request.rank} "
                                               f"under {folder}")
        if t is F.CHECKPOINT_CORRUPTION:
            evidence = checkpoint_faults.flip_bytes(path, seed=request.seed, offset=p.get("offset"),
                                                    count=p.get("bytes", 1))
        elif t is F.CHECKPOINT_TRUNCATION:
            evidence = checkpoint_faults.truncate(path, keep_fraction=p.get("keep_fraction"),
                                                  keep_bytes=p.get("keep_bytes"))
        else:
            evidence = checkpoint_faults.remove(path)
        return FaultExecutionResult(evidence=evidence)

    def _desync(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise UnsupportedFaultError(request.fault_id, "collective_desync needs an initialized "
                                                          "default process group")
        # One extra collective that no peer issues: this rank's collective sequence is now one
        # ahead of everyone else's, so the job's next collectives mismatch (error or hang).
        work = dist.all_reduce(torch.zeros(1), async_op=True)
        request.context["work"] = work
        return FaultExecutionResult(evidence={"extra_collective": "all_reduce",
                                              "world_size": dist.get_world_size()})

    def _config_drift(self, request: FaultExecutionRequest) -> FaultExecutionResult:
        p = request.parameters
        if "env" in p:
            name = p["env"]
            before = os.environ.get(name)
            request.context.setdefault("restore", ("env", (name, before)))   # the value before the first call
            os.environ[name] = str(p["value"])
            return FaultExecutionResult(evidence={"env": name, "before": before, "after": os.environ[name]})
        if request.optimizer is None:
            raise UnsupportedFaultError(request.fault_id, "config_drift of an optimizer hyperparameter "
                                                          "needs the optimizer")
        key = p["key"]
        groups = request.optimizer.param_groups
        indices = [p["param_group"]] if "param_group" in p else list(range(len(groups)))
        changed, saved = [], []
        for i in indices:
            if i >= len(groups) or key not in groups[i]:
                raise UnsupportedFaultError(request.fault_id, f"optimizer param_group {i} has no "
                                                              f"hyperparameter {key!r}")
            before = groups[i][key]
            saved.append((i, key, before))
            groups[i][key] = p["value"]
            changed.append({"param_group": i, "before": _plain(before), "after": p["value"]})
        request.context.setdefault("restore", ("optimizer", saved))
        status = (InjectionStatus.INJECTED if any(c["before"] != c["after"] for c in changed)
                  else InjectionStatus.NO_EFFECT)
        return FaultExecutionResult(status, {"key": key, "groups": changed})


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


__all__ = ["DEFAULT_EXHAUSTION_BYTES", "LocalFaultExecutor"]
