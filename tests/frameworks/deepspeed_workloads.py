"""DeepSpeed training loops for tests/frameworks/test_deepspeed.py (module level so forked ranks run them).

The loop is the plain DeepSpeed loop a user writes (`engine(x)`, `engine.backward(loss)`,
`engine.step()`); lm-resiliency attaches with `enable_resiliency(engine, interval=...)`. Data depends
only on the step, micro-batch and rank; dropout and the NumPy/Python RNG streams make RNG restore
matter; a WarmupLR scheduler, a forward-updated buffer and a caller-owned counter cover engine
scheduler, buffer and client state. Gradient accumulation is 2, so `engine.step()` is called twice
per optimizer step (with `managed_gradient_accumulation: false`, once after both backwards).

`DeepSpeedZygote` keeps one process that imported DeepSpeed (about 20 s on 2 cores) and forks
every run's ranks from it with `tests.harness.run_ranks`, so each run starts in well under a second.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn

FEATURES = 8
MICRO_BATCH = 4
GRAD_ACCUM = 2


def extensions_dir() -> str:
    """Where DeepSpeed caches its compiled ops: inside the virtual environment, so CI reuses the build."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


class Net(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Dropout(0.1), nn.Linear(width, width),
                                    nn.Tanh(), nn.Linear(width, 4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.seen += x.shape[0]
        return self.layers(x)


def ds_config(stage: int, *, optimizer: bool = True, section: Optional[dict] = None,
              precision: str = "fp32", offload: bool = False, managed: bool = True) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GRAD_ACCUM,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
    }
    if not managed:  # the caller owns the accumulation boundary: one engine.step() per optimizer step
        config["managed_gradient_accumulation"] = False
    if precision == "bf16":
        config["bf16"] = {"enabled": True}  # checks gradients for inf/nan and skips such steps
    if stage == 3:
        # Weights (> 100 elements) are partitioned, biases stay persistent: both ZeRO-3 paths.
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    if offload:  # ZeRO-Offload to host memory, still with the torch optimizer
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            config["zero_optimization"]["offload_param"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}}
        config["scheduler"] = {"type": "WarmupLR",
                               "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 4}}
    if section is not None:
        config["lm_resiliency"] = section
    return config


def init_ranks(rank: int) -> None:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))


def build_engine(stage: int, rank: int, width: int = 24, client: bool = False, **config_kwargs: Any):
    """`client=True`: a torch AdamW and StepLR passed to deepspeed.initialize() instead of config sections."""
    import deepspeed

    torch.manual_seed(0)
    np.random.seed(rank)
    random.seed(rank)
    model = Net(width)
    if client:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=ds_config(stage, optimizer=False, **config_kwargs))
        return engine
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(stage, **config_kwargs))
    return engine


def micro_batch(step: int, micro: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + micro * 100 + rank)
    x = torch.randn(MICRO_BATCH, FEATURES, generator=g)
    # The global NumPy and Python RNG streams feed the data too: their restore is checked.
    return (x + float(np.random.rand()) * 1e-3 + random.random() * 1e-3).to(dtype)


def train_step(engine, step: int, rank: int, poison: bool = False) -> None:
    """One optimizer step = GRAD_ACCUM micro-batches; `poison` makes the gradients non-finite."""
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    managed = engine.managed_gradient_accumulation()
    for micro in range(GRAD_ACCUM):
        loss = engine(micro_batch(step, micro, rank, dtype)).float().pow(2).mean()
        if poison:
            loss = loss * float("inf")
        engine.backward(loss)
        if managed:
            engine.step()
    if not managed:
        engine.step()


def _plain(value: Any) -> Any:
    """A ZeRO optimizer state_dict with DeepSpeed's Python objects turned into comparable values."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "param_slice_mappings"}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, (int, float, str, bool, type(None))):
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else value
    return {k: _plain(v) for k, v in sorted(vars(value).items())}  # loss scaler


def final_state(engine, stage: int, counter: dict) -> Dict[str, Any]:
    import deepspeed

    params = [p for _, p in engine.module.named_parameters()]
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        partitions = {n: p.ds_tensor.detach().clone() for n, p in engine.module.named_parameters()}
    else:
        full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        partitions = {}
    return {
        "params": full,
        "partitions": partitions,
        "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()},
        "optimizer": _plain(engine.optimizer.state_dict()),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
        "engine": [engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps],
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "python_rng": random.getstate(),
        "counter": dict(counter),
    }


def train(rank: int, world: int, stage: int, folder: Optional[str], steps: int,
          kill_after: Optional[int] = None, precision: str = "fp32", offload: bool = False,
          managed: bool = True, client: bool = False, interval: int = 2) -> tuple:
    """Train `steps` optimizer steps; `folder=None` runs plain DeepSpeed without lm-resiliency.
    Returns (resumed step, step-count trace, final state)."""
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    init_ranks(rank)
    engine = build_engine(stage, rank, precision=precision, offload=offload, managed=managed, client=client)
    counter = {"samples": 0}
    session = None
    start = 0
    if folder is not None:
        session = enable_resiliency(
            engine, interval=interval,
            checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=2, run_id=f"ds-zero{stage}",
                                          replication_jump=1, timeout_s=60),
            extra_state_fn=lambda: {"counter": dict(counter)},
            load_extra_state_fn=lambda extra: counter.update(extra["counter"]),
        )
        start = session.step_count
        assert start == engine.global_steps, (start, engine.global_steps)
    trace = []
    for step in range(start, steps):
        train_step(engine, step, rank)
        counter["samples"] += MICRO_BATCH * GRAD_ACCUM
        if session is not None:
            trace.append((session.step_count, engine.global_steps))
            if kill_after is not None and step + 1 == kill_after:
                session.flush_for_restart()  # the capture of the previous interval is on disk
                session.manager._drain()
                os.kill(os.getpid(), signal.SIGKILL)
    result = final_state(engine, stage, counter)
    if session is not None:
        session.close()
    return start, trace, result


def no_optimizer(rank: int, world: int, stage: int) -> str:
    from lm_resiliency import enable_resiliency

    init_ranks(rank)
    engine = build_engine(stage, rank, optimizer=False)
    try:
        enable_resiliency(engine, interval=2)
    except TypeError as exc:
        return str(exc)
    raise AssertionError("enable_resiliency accepted an engine without an optimizer")


def misuse(rank: int, world: int) -> Dict[str, str]:
    """Argument errors, raised before anything is attached."""
    from lm_resiliency import enable_resiliency
    from lm_resiliency.config import ConfigError

    init_ranks(rank)
    errors = {}
    engine = build_engine(1, rank)
    for name, call in (("optimizer", lambda: enable_resiliency(engine, engine.optimizer, interval=2)),
                       ("option", lambda: enable_resiliency(engine, interval=2, scheduler=object()))):
        try:
            call()
        except TypeError as exc:
            errors[name] = str(exc)
    bad = build_engine(1, rank, section={"interval": 2, "checkpoint": {"disk_folder": "x", "bogus": 1}})
    try:
        enable_resiliency(bad)
    except ConfigError as exc:
        errors["section"] = str(exc)
    assert "step" not in vars(engine) and "step" not in vars(bad), "hooks left behind after a refused attach"
    return errors


def load_guard(rank: int, world: int, folder: str, durable: str, phase: str) -> Dict[str, Any]:
    """phase "durable": train 3 steps without lm-resiliency and save a DeepSpeed checkpoint.
    phase "seed": generation zero, attach, then engine.load_checkpoint() seeds step_count; train to 4 and
    flush, then show a load after managed steps is refused. phase "recovered": GEMINI recovers step 4,
    engine.load_checkpoint() is refused, and engine.destroy() closes the session. phase "fallback": a fresh
    GEMINI folder, and engine.load_checkpoint() as load_fallback seeds step_count."""
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    init_ranks(rank)
    engine = build_engine(2, rank)
    if phase == "durable":
        for step in range(3):
            train_step(engine, step, rank)
        engine.save_checkpoint(durable, tag="step3")
        return {"global_steps": engine.global_steps}
    out: Dict[str, Any] = {}
    fallback = (lambda: engine.load_checkpoint(durable, tag="step3")) if phase == "fallback" else None
    session = enable_resiliency(
        engine, interval=2, load_fallback=fallback,
        checkpoint=InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=1, run_id="ds-guard",
                                      replication_jump=1, timeout_s=60, host_memory="heap"))
    out["recovered_from"] = session.recovered_from
    out["start"] = session.step_count
    if phase == "seed":
        path, _ = engine.load_checkpoint(durable, tag="step3")
        out["loaded"] = path is not None
        out["seeded"] = session.step_count
        for step in range(session.step_count, 4):
            train_step(engine, step, rank)
        out["after"] = session.step_count
        session.flush_for_restart()
        try:
            engine.load_checkpoint(durable, tag="step3")
        except RuntimeError as exc:
            out["late_error"] = str(exc)
        out["global_steps"] = engine.global_steps
    elif phase == "fallback":
        out["global_steps"] = engine.global_steps
    else:
        try:
            engine.load_checkpoint(durable, tag="step3")
        except RuntimeError as exc:
            out["error"] = str(exc)
        out["global_steps"] = engine.global_steps
        engine.destroy()  # the engine's teardown closes the session first
        out["closed_by_destroy"] = session.flush_for_restart() == -1
    session.close()
    out["unwrapped"] = not {"step", "load_checkpoint", "destroy"} & set(vars(engine))
    return out


def skipped_step(rank: int, world: int, stage: int, folder: str) -> List[tuple]:
    """bf16 ZeRO: the 4th optimizer step has non-finite gradients, so DeepSpeed skips it. It still counts in
    global_steps; step_count follows, and nothing is captured at that step. Returns, per optimizer step,
    (step_count, global_steps, skipped_steps, was_step_applied, newest captured step)."""
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    init_ranks(rank)
    engine = build_engine(stage, rank, precision="bf16")
    session = enable_resiliency(
        engine, interval=2,
        checkpoint=InMemoryCkptConfig(disk_folder=folder, run_id="ds-skip", replication_jump=1, timeout_s=60,
                                      host_memory="heap"))
    trace = []
    for step in range(6):
        train_step(engine, step, rank, poison=step == 3)
        session.flush_for_restart()  # completes the pending capture, so latest_step is final
        trace.append((session.step_count, engine.global_steps, engine.skipped_steps, engine.was_step_applied(),
                      session.manager.latest_step))
    session.close()
    return trace


def mismatch(rank: int, world: int, stage: int, folder: str) -> str:
    """GEMINI holds step 2 of a width-24 model; a width-32 engine with the same run id and layout must
    refuse it (ValueError from enable_resiliency) rather than load any of it."""
    from lm_resiliency import InMemoryCkptConfig, enable_resiliency

    init_ranks(rank)
    config = InMemoryCkptConfig(disk_folder=folder, disk_flush_interval=1, run_id="ds-mismatch", replication_jump=1,
                                timeout_s=60, host_memory="heap")
    engine = build_engine(stage, rank)
    session = enable_resiliency(engine, interval=2, checkpoint=config, enable_detection=False)
    for step in range(2):
        train_step(engine, step, rank)
    session.flush_for_restart()
    session.close()
    other = build_engine(stage, rank, width=32)
    before = {n: p.detach().clone() for n, p in other.module.named_parameters()}
    try:
        enable_resiliency(other, interval=2, checkpoint=config, enable_detection=False)
    except ValueError as exc:
        unchanged = all(p.detach().equal(before[n]) for n, p in other.module.named_parameters())
        assert unchanged and other.global_steps == 0 and not {"step", "load_checkpoint"} & set(vars(other))
        return str(exc)
    raise AssertionError("a state captured from another model was loaded")


def config_section(rank: int, world: int, folder: str) -> Dict[str, Any]:
    """The "lm_resiliency" section of the DeepSpeed config drives enable_resiliency(engine)."""
    from lm_resiliency import enable_resiliency

    init_ranks(rank)
    engine = build_engine(1, rank, section={
        "interval": 3, "enable_detection": False,
        "checkpoint": {"disk_folder": folder, "run_id": "ds-section", "replication_jump": 1, "timeout_s": 60,
                       "host_memory": "heap", "disk_flush_interval": 1}})
    session = enable_resiliency(engine)
    for step in range(4):
        train_step(engine, step, rank)
    out = {"interval": session.config.interval, "disk_folder": session.config.disk_folder,
           "scout": session.scout is not None, "latest": session.manager.latest_step,
           "step_count": session.step_count}
    session.close()
    return out


# --------------------------------------------------------------------------- zygote


def _zygote_main(conn) -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    try:
        # The expensive imports every rank needs, done once (deepspeed.initialize imports the muon optimizer).
        for name in ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "lm_resiliency"):
            importlib.import_module(name)
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()  # compiles the CPU comm op into TORCH_EXTENSIONS_DIR on first use (minutes), else loads it
        if importlib.util.find_spec("accelerate") is not None:  # for Accelerate's DeepSpeed integration
            importlib.import_module("accelerate")
        import tests.harness as harness

        harness._CTX = mp.get_context("fork")  # ranks inherit the imports above
    except BaseException:  # reported to the test
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    module = sys.modules[__name__]
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the test process is gone
            return
        if request is None:
            return
        name, world, args, env, timeout = request
        try:
            owner, _, attr = name.rpartition(":")
            fn = getattr(importlib.import_module(owner) if owner else module, attr)
            outcomes = harness.run_ranks(fn, world, *args, timeout=timeout, env=env, init=False,
                                         check=False)
            conn.send(("ok", outcomes))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DeepSpeedZygote:
    def __init__(self, start_timeout: float = 900.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: daemonic processes cannot start the ranks. It exits when the pipe closes.
        self._proc = ctx.Process(target=_zygote_main, args=(child,))
        self._proc.start()
        if not self._conn.poll(start_timeout):
            self.close()
            raise TimeoutError(f"the DeepSpeed zygote did not start within {start_timeout}s")
        status, detail = self._conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(f"the DeepSpeed zygote failed to start:\n{detail}")

    def run(self, name: str, world: int, *args: Any, timeout: float = 80.0, check: bool = True) -> List[Any]:
        """Run `name` (a function of this module, or "module:function") on `world` forked ranks."""
        from tests.harness import RankFailure

        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        self._conn.send((name, world, args, env, timeout))
        if not self._conn.poll(timeout + 30):
            raise RankFailure(f"{name}: no answer from the DeepSpeed zygote within {timeout + 30}s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RankFailure(value)
        if not check:
            return value
        for outcome in value:
            if outcome.error is not None:
                raise RankFailure(f"rank {outcome.rank} raised:\n{outcome.error}")
            if outcome.exitcode != 0:
                raise RankFailure(f"rank {outcome.rank} exited with code {outcome.exitcode} and no result")
        return [o.result for o in value]

    def close(self) -> None:
        try:
            self._conn.send(None)
        except (OSError, ValueError):
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
