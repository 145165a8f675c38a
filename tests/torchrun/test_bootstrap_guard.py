"""The zero-import worker's guard against a script's own resume on real gloo ranks (the shim's
`start()` minus the environment, as in test_bootstrap.py): in a generation that recovers GEMINI
step N, a script that loaded state into its model before the attach and never read
LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP is refused on every rank before anything is recovered; one
that reads the step attaches and recovers it; a load after the recovery is refused too."""

from __future__ import annotations

import os

from tests.harness import run_ranks
from tests.torchrun.test_bootstrap import KEEP, _bootstrap


def _train(rank: int, world_size: int, directory: str, steps: int, selected: int, mode: str):
    """`mode`: "plain" (no load), "snapshot" (loads a snapshot before DDP, reads no step),
    "reads-step" (the same load, but the loop starts at LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP),
    "late-load" (loads after the first forward)."""
    import torch
    from torch import nn

    bootstrap = _bootstrap(directory, rank, world_size, max(selected, 0), "gemini" if selected >= 0 else "none")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    start = 0
    if mode == "reads-step":
        start = int(os.environ.get("LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP", str(max(selected, 0))))
    if mode in ("snapshot", "reads-step"):
        model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        for step in range(start, steps):
            loss = ddp(torch.full((3, 4), float(rank + step))).sum()
            if mode == "late-load" and step == start:
                model.load_state_dict(model.state_dict())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    except Exception as exc:  # returned to the test: every rank must raise the same refusal
        return f"{type(exc).__name__}: {exc}"
    session = bootstrap.session
    result = (session.step_count, session.recovered_from, model.weight.detach().clone())
    bootstrap.close()
    return result


def test_a_snapshot_resume_before_the_attach_is_refused_unless_the_script_reads_the_resume_step(tmp_path):
    directory = str(tmp_path)
    # Generation zero: a snapshot load before the attach is the script's own business (nothing to recover).
    first = run_ranks(_train, 3, directory, 5, -1, "snapshot", timeout=240, env=KEEP)
    assert [r[:2] for r in first] == [(5, None)] * 3
    # A restart that recovers step 4: the snapshot load would run under GEMINI's step 4. Refused everywhere.
    for result in run_ranks(_train, 3, directory, 6, 4, "snapshot", timeout=240, env=KEEP):
        assert result.startswith("TorchrunWorkerAdapterError: lm-resiliency torchrun worker: not attaching: this "
                                 "generation resumes run 'bootstrap-test' at GEMINI step 4, and the script loaded its "
                                 "own state first (Linear.load_state_dict() ran before the attach; ranks 0, 1, 2) "
                                 "without reading LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP"), result
        assert "nothing was loaded, GEMINI's state is kept for the next launch" in result
    # Nothing was recovered, so the state is still there: the script with the one loop edit resumes from it.
    resumed = run_ranks(_train, 3, directory, 6, 4, "reads-step", timeout=240, env=KEEP)
    assert [r[:2] for r in resumed] == [(6, "gemini")] * 3
    assert all(r[2].equal(resumed[0][2]) for r in resumed)


def test_a_load_into_the_recovered_model_after_the_attach_is_refused(tmp_path):
    directory = str(tmp_path)
    assert [r[:2] for r in run_ranks(_train, 3, directory, 5, -1, "plain", timeout=240, env=KEEP)] == [(5, None)] * 3
    for result in run_ranks(_train, 3, directory, 6, 4, "late-load", timeout=240, env=KEEP):
        assert result.startswith("RecoveredStateOverwrite: lm-resiliency: Linear.load_state_dict() refused: this "
                                 "launch resumed run"), result
        assert "at GEMINI step 4" in result and "LM_RESILIENCY_TORCHRUN_CHECKPOINT_STEP" in result
