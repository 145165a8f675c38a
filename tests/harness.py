"""Run a function on N real processes joined by a gloo process group.

    results = run_ranks(fn, 4, arg1, arg2, timeout=60)

`fn(rank, world_size, *args)` runs in each child after `init_process_group("gloo")` over a
FileStore in a fresh temporary directory. The first child exception is re-raised in the
test with the child's traceback; a child that hangs past `timeout` is killed and the test
fails with the ranks that did not finish. Children are forked from a forkserver that has
torch imported already, so a 4-rank test costs tens of milliseconds to start, not seconds.

Use `check=False` to get `RankOutcome`s instead (for tests whose ranks die on purpose).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "numpy"])


class RankFailure(AssertionError):
    """A child rank raised, crashed or hung."""


@dataclass
class RankOutcome:
    rank: int
    exitcode: Optional[int]
    result: Any = None
    error: Optional[str] = None

    @property
    def killed_by(self) -> Optional[int]:
        """Signal number that ended the child, if any."""
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None


def _child(fn: Callable, rank: int, world_size: int, args: tuple, init_file: Optional[str],
           result_path: str, env: Dict[str, str], timeout: float) -> None:
    code = 0
    try:
        os.environ.update({
            "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0", "OMP_NUM_THREADS": "1",
        })
        os.environ.update(env)
        import torch
        import torch.distributed as dist
        from datetime import timedelta

        torch.set_num_threads(1)
        if init_file is not None:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:  # any child failure must reach the test
        payload = ("error", traceback.format_exc())
        code = 1
    try:
        with open(result_path + ".tmp", "wb") as f:
            pickle.dump(payload, f)
        os.replace(result_path + ".tmp", result_path)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            # gloo threads can abort a normal interpreter exit; skip it.
            os._exit(code)


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              env: Optional[Dict[str, str]] = None, init: bool = True,
              check: bool = True) -> List[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; see module doc."""
    with tempfile.TemporaryDirectory(prefix="lmr-ranks-") as tmp:
        init_file = os.path.join(tmp, "store") if init else None
        procs = []
        for rank in range(world_size):
            proc = _CTX.Process(
                target=_child,
                args=(fn, rank, world_size, args, init_file, os.path.join(tmp, f"result{rank}"),
                      dict(env or {}), timeout),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10)
        outcomes = []
        for rank, proc in enumerate(procs):
            outcome = RankOutcome(rank, proc.exitcode)
            path = os.path.join(tmp, f"result{rank}")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, value = pickle.load(f)
                if status == "ok":
                    outcome.result = value
                else:
                    outcome.error = value
            outcomes.append(outcome)
    if hung:
        raise RankFailure(f"ranks {hung} did not finish within {timeout}s (killed)"
                          + "".join(f"\n--- rank {o.rank} ---\n{o.error}" for o in outcomes if o.error))
    if not check:
        return outcomes
    for outcome in outcomes:
        if outcome.error is not None:
            raise RankFailure(f"rank {outcome.rank} raised:\n{outcome.error}")
    for outcome in outcomes:
        if outcome.exitcode != 0:
            raise RankFailure(f"rank {outcome.rank} exited with code {outcome.exitcode} and no result")
    return [o.result for o in outcomes]
