"""A small supervisor: launches the ranks of one generation, watches them, relaunches after a failure.

Per generation it starts WORLD processes joined by a fresh FileStore rendezvous (what torchrun's
agent does with `--max-restarts`), all with the same GEMINI run id, so the relaunched ranks find
the previous generation's checkpoints. It then polls, every 50 ms:

- the ranks' event files (`events/rank<r>.jsonl`, see worker.py) and the campaign journal, and
  prints one line per generation, injection, detection and recovery;
- for an out-of-band SCOUT hang report (written by the monitor thread of the reporting rank
  while its training thread is blocked): the generation is killed (SIGTERM, then SIGKILL);
- for a rank that died of a signal it was not sent by the supervisor: that rank is the one
  localized; the others get a few seconds to fail on their own (GEMINI flushes on the way out),
  then they are killed.

A generation ends as "finished" (every rank exits 0), "sdc_stop" (every rank exits 75: SCOUT
found SDC and the ranks stopped for a restart from RECOVERY_VERIFIED state), "rank_died",
"hang", or "error"/"timeout" (which stop the demo). The ranks resume from `session.step_count`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from . import scenario
from .worker import RESTART_EXIT_CODE, child_main

POLL_S = 0.05
DEATH_GRACE_S = 5.0      # the survivors of a dead rank fail on their own (and flush) within this
KILL_GRACE_S = 1.5       # SIGTERM -> SIGKILL
MAX_GENERATIONS = 8


@dataclass
class Generation:
    index: int
    launched_at: float
    ended_at: Optional[float] = None
    resumed_step: Optional[int] = None
    recovered_from: Optional[str] = None
    sources: Dict[int, Dict[str, str]] = field(default_factory=dict)
    last_step: int = 0
    end: str = ""
    detail: str = ""
    exit_codes: List[Optional[int]] = field(default_factory=list)
    detected_at: Optional[float] = None

    def to_json(self) -> Dict[str, Any]:
        doc = dict(self.__dict__)
        doc["sources"] = {str(k): v for k, v in self.sources.items()}
        return doc


class _Tail:
    """Complete JSON lines appended to a file since the last read."""

    def __init__(self, path: str) -> None:
        self.path, self._offset, self._rest = path, 0, b""

    def read(self) -> List[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        *lines, self._rest = (self._rest + data).split(b"\n")
        out = []
        for line in lines:
            if line.strip():
                out.append(json.loads(line.decode("utf-8")))
        return out


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class Job:
    """One training run (baseline or managed) across as many generations as it takes."""

    def __init__(self, root: str, label: str, *, campaign: bool, steps: int, say: Callable[[str], None],
                 generation_timeout_s: float = 240.0) -> None:
        self.root, self.label, self.campaign, self.steps = root, label, campaign, steps
        self.paths = scenario.paths(root, label)
        self.say = say
        self.generation_timeout_s = generation_timeout_s
        self.generations: List[Generation] = []
        self.events: List[dict] = []
        self.deaths: List[dict] = []          # supervisor-observed process deaths (localizations)
        self._event_tails = [_Tail(os.path.join(self.paths["events"], f"rank{r}.jsonl"))
                             for r in range(scenario.WORLD)]
        self._journal_tail = _Tail(self.paths["journal"])
        self._printed: set = set()
        self.started_at: Optional[float] = None
        self.ended_at: Optional[float] = None

    # ------------------------------------------------------------------ run

    def run(self) -> bool:
        shutil.rmtree(self.paths["base"], ignore_errors=True)
        for key in ("gemini", "events", "logs", "rendezvous", "final"):
            os.makedirs(self.paths[key], exist_ok=True)
        os.makedirs(os.path.dirname(self.paths["journal"]), exist_ok=True)
        self.started_at = time.time()
        try:
            for index in range(MAX_GENERATIONS):
                gen = self._run_generation(index)
                if gen.end == "finished":
                    return True
                if gen.end in ("error", "timeout"):
                    self.say(f"{self.label}: generation {index} failed ({gen.detail}); see {self.paths['logs']}")
                    return False
            self.say(f"{self.label}: still not finished after {MAX_GENERATIONS} generations")
            return False
        finally:
            self.ended_at = time.time()

    def _launch(self, index: int) -> List["_Rank"]:
        store = os.path.join(self.paths["rendezvous"], f"gen{index}")
        ranks = []
        for rank in range(scenario.WORLD):
            options = {"root": self.root, "label": self.label, "rank": rank, "world": scenario.WORLD,
                       "gen": index, "store": store, "steps": self.steps, "campaign": self.campaign}
            log = os.path.join(self.paths["logs"], f"gen{index}-rank{rank}.log")
            ranks.append(_Rank(_context().Process(target=child_main, args=(options, log),
                                                  name=f"{self.label}-gen{index}-rank{rank}")))
        for r in ranks:
            r.process.start()
        return ranks

    def _run_generation(self, index: int) -> Generation:
        gen = Generation(index=index, launched_at=time.time())
        self.generations.append(gen)
        run_id = f"demo-{self.label}"
        if index == 0:
            self.say(f"{self.label} gen 0 | launching {scenario.WORLD} ranks (run id {run_id})")
        else:
            self.say(f"{self.label} gen {index} | relaunching {scenario.WORLD} ranks with the same run id {run_id}")
        procs = self._launch(index)
        death_at: Optional[float] = None
        first_failure_at: Optional[float] = None
        killed = False
        while True:
            self._poll(gen)
            codes = [p.poll() for p in procs]
            now = time.time()
            if all(c is not None for c in codes):
                break
            if not gen.end:
                hang = self._hang_reported(gen)
                if hang is not None:
                    gen.end, gen.detected_at = "hang", now
                    gen.detail = (f"SCOUT hang report names rank(s) {hang['ranks']}: "
                                  f"supervisor kills generation {index}")
                    self.say(f"{self.label} gen {index} | {gen.detail}")
                    _terminate(procs)
                    killed = True
                    continue
                failed = [r for r, c in enumerate(codes) if c not in (None, 0, RESTART_EXIT_CODE)]
                if self._record_death(gen, index, codes, now):
                    death_at = now
                    self.say(f"{self.label} gen {index} | supervisor: {gen.detail}; waiting "
                             f"{DEATH_GRACE_S:.0f}s for the others to fail and flush")
                elif failed:
                    # A peer of a killed rank often fails (connection closed) before the killed
                    # rank is reaped: wait a grace period for the death before calling it an error.
                    first_failure_at = first_failure_at or now
                    if now - first_failure_at > DEATH_GRACE_S:
                        gen.end, death_at = "error", now
                        gen.detail = "rank(s) " + ", ".join(f"{r} exited {codes[r]}" for r in failed)
            if death_at is not None and not killed and now - death_at > DEATH_GRACE_S:
                _terminate(procs, grace_s=0.0)
                killed = True
            if not killed and now - gen.launched_at > self.generation_timeout_s:
                gen.end, gen.detail = "timeout", f"no result within {self.generation_timeout_s:.0f}s"
                _terminate(procs)
                killed = True
            time.sleep(POLL_S)
        self._poll(gen)
        gen.ended_at = time.time()
        gen.exit_codes = [r.returncode for r in procs]
        if not gen.end and not self._record_death(gen, index, gen.exit_codes, gen.ended_at):
            if all(c == 0 for c in gen.exit_codes):
                gen.end = "finished"
            elif all(c == RESTART_EXIT_CODE for c in gen.exit_codes):
                gen.end = "sdc_stop"
                gen.detail = f"ranks stopped after step {gen.last_step} for a restart from RECOVERY_VERIFIED state"
            else:
                gen.end, gen.detail = "error", f"exit codes {gen.exit_codes}"
        if gen.end == "finished":
            self.say(f"{self.label} gen {index} | finished step {gen.last_step} "
                     f"({gen.ended_at - self.started_at:.1f}s since launch)")
        elif gen.end in ("rank_died", "hang", "sdc_stop"):
            self.say(f"{self.label} gen {index} | ended after step {gen.last_step} ({gen.end})")
        return gen

    def _record_death(self, gen: "Generation", index: int, codes: list, now: float) -> bool:
        """Mark the generation as ended by a rank killed with a signal, if any was."""
        dead = [r for r, c in enumerate(codes) if c is not None and c < 0]
        if not dead:
            return False
        gen.end, gen.detected_at = "rank_died", now
        names = ", ".join(f"rank {r} ({_signal_name(codes[r])})" for r in dead)
        gen.detail = f"{names} died"
        self.deaths.append({"gen": index, "ranks": dead, "detected_at": now,
                            "signals": [_signal_name(codes[r]) for r in dead]})
        return True

    # ------------------------------------------------------------------ watching

    def _hang_reported(self, gen: Generation) -> Optional[dict]:
        for event in self.events:
            if event["gen"] == gen.index and event["event"] == "fault" and event["report"]["kind"] == "hang":
                return event["report"]
        return None

    def _once(self, key: Any, text: str) -> None:
        if key not in self._printed:
            self._printed.add(key)
            self.say(text)

    def _poll(self, gen: Generation) -> None:
        prefix = f"{self.label} gen {gen.index} |"
        for tail in self._event_tails:
            for event in tail.read():
                self.events.append(event)
                self._on_event(gen, event, prefix)
        if self.campaign:
            for record in self._journal_tail.read():
                self._on_record(record)

    def _on_event(self, gen: Generation, event: dict, prefix: str) -> None:
        kind, rank = event["event"], event["rank"]
        if event["gen"] != gen.index:
            return
        if kind == "resumed":
            gen.resumed_step = event["step"]
            gen.recovered_from = event["recovered_from"]
            gen.sources[rank] = event["sources"]
            if len(gen.sources) == scenario.WORLD:
                self.say(f"{prefix} {self.describe_resume(gen)}")
        elif kind == "step":
            gen.last_step = max(gen.last_step, event["step"])
            if rank == 0 and (event["step"] % 10 == 0 or event["step"] == self.steps):
                self.say(f"{prefix} step {event['step']:3d}  loss {event['loss']:.4f} (rank 0)")
        elif kind == "rejected":
            self._once(("rejected", gen.index, event["owner"], event["step"]),
                       f"{prefix} GEMINI (rank {rank}) refused rank {event['owner']}'s node-local shard of "
                       f"step {event['step']}: {event['reason']}")
        elif kind == "fault":
            r = event["report"]
            key = ("fault", gen.index, r["kind"], tuple(r["ranks"]), r["step"], r["resource"])
            where = "out-of-band monitor" if r["kind"] == "hang" else "replay check"
            detail = (f" (rule {r['evidence'].get('rule')}, stalled {_stalled(r)})" if r["kind"] == "hang"
                      else f" ({r['resource']})")
            self._once(key, f"{prefix} SCOUT {where}: {r['kind']} on rank(s) {r['ranks']} at step {r['step']}{detail}")
        elif kind == "stop":
            self._once(("stop", gen.index), f"{prefix} ranks stop after step {event['step']}: SDC means the "
                                            f"restart must use RECOVERY_VERIFIED state (verified steps "
                                            f"{event['verified']})")

    def _on_record(self, record: dict) -> None:
        status, occurrence = record["status"], record["occurrence_id"]
        gen = record.get("generation")
        if status == "injected":
            where = f" ({record['module_path']} {record['surface']})" if record.get("module_path") else ""
            self._once(("injected", occurrence),
                       f"{self.label} gen {gen} | injected {occurrence}: {record['failure_type']} on rank "
                       f"{record['rank']} at iteration {record['iteration']}{where}")
        elif status == "already_claimed":
            self._once(("claimed", occurrence, gen),
                       f"{self.label} gen {gen} | {occurrence} was injected before the restart: the replayed "
                       f"iteration is not hit again (restart-stable occurrence id)")
        elif status in ("no_effect", "failed", "unsupported", "expired", "armed"):
            self._once((status, occurrence, gen),
                       f"{self.label} gen {gen} | {occurrence} on rank {record['rank']}: {status} ({record['detail']})")

    def describe_resume(self, gen: Generation) -> str:
        if not gen.resumed_step:
            return "fresh start at step 0"
        parts = []
        for rank in range(scenario.WORLD):
            own = gen.sources.get(rank, {}).get(f"own:{rank}")
            if own is not None:
                continue
            holders = [h for h, s in gen.sources.items() if f"held:{rank}" in s]
            if holders:
                medium = gen.sources[holders[0]][f"held:{rank}"]
                parts.append(f"rank {rank} from rank {holders[0]}'s replica ({medium})")
        media = sorted({src for s in gen.sources.values() for key, src in s.items() if key.startswith("own:")})
        text = f"resumed at step {gen.resumed_step} from GEMINI ({'/'.join(media) or 'peer replicas'})"
        previous = self.generations[gen.index - 1] if gen.index > 0 else None
        if previous is not None and previous.end == "sdc_stop":
            text += ", the newest RECOVERY_VERIFIED step"
        if parts:
            text += "; " + "; ".join(parts)
        return text


def _stalled(report: dict) -> str:
    stalled = report.get("evidence", {}).get("stalled_s", {})
    return ", ".join(f"rank {r} {s:.1f}s" for r, s in sorted(stalled.items())) or "?"


class _Rank:
    """One rank's process (a `multiprocessing.Process` forked by the fork server)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process

    def poll(self) -> Optional[int]:
        """None while running, else the exit code (negative: the signal that ended it)."""
        return self.process.exitcode

    @property
    def returncode(self) -> Optional[int]:
        return self.process.exitcode

    def send(self, signum: int) -> None:
        if self.process.exitcode is None and self.process.pid is not None:
            try:
                os.kill(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> None:
        self.process.join(timeout)


_CONTEXT = None


def _context():
    """A fork server that imported torch and lm_resiliency once: each generation's ranks start in
    a fraction of a second instead of importing torch four times on two cores."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.optim",
                                         "numpy", "lm_resiliency", "lm_resiliency.faults",
                                         "resiliency_demo.worker"])
    return _CONTEXT


def _terminate(ranks: List[_Rank], grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM (GEMINI flushes where the Python thread can run), then SIGKILL the stragglers."""
    alive = [r for r in ranks if r.poll() is None]
    if grace_s > 0:
        for r in alive:
            r.send(signal.SIGTERM)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(r.poll() is None for r in alive):
            time.sleep(POLL_S)
    for r in alive:
        r.send(signal.SIGKILL)
    for r in alive:
        r.wait(10)
