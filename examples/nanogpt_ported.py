"""A nanoGPT-style training script (character-level GPT, DDP, gradient accumulation, cosine LR from
its own iteration counter, its own ckpt.pt, the next batch prefetched inside the step, optional
AMP GradScaler) ported to lm-resiliency. Each edit is marked `# lm-resiliency:`; docs/porting.md
explains them one by one.

    # 3 CPU ranks; rank 1 SIGKILLs itself after iteration 10, the job goes down
    LM_RESILIENCY_RUN_ID=gpt-demo python -m torch.distributed.run --standalone --nproc-per-node 3 \\
        examples/nanogpt_ported.py --out-dir /tmp/gpt-demo --kill-rank 1 --kill-iter 10
    # the same command without --kill-* resumes from the newest GEMINI capture and finishes
    LM_RESILIENCY_RUN_ID=gpt-demo python -m torch.distributed.run --standalone --nproc-per-node 3 \\
        examples/nanogpt_ported.py --out-dir /tmp/gpt-demo

    python examples/nanogpt_ported.py --self-test   # both, compared with an uninterrupted launch
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lm_resiliency import InMemoryCkptConfig, enable_resiliency  # lm-resiliency: the one import

# ---------------------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.dropout = config.n_head, config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(config.n_embd), CausalSelfAttention(config)
        self.ln_2, self.mlp = nn.LayerNorm(config.n_embd), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


# ----------------------------------------------------------------------------------------- data


def make_corpus() -> tuple[torch.Tensor, int]:
    """A character-level corpus generated here (no download): seeded pseudo-words."""
    g = torch.Generator().manual_seed(1234)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(letters[i] for i in torch.randint(0, 26, (int(n),), generator=g))
             for n in torch.randint(2, 8, (2000,), generator=g)]
    text = " ".join(words) + ".\n"
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long), len(chars)


# ------------------------------------------------------------------------------------- training


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    master_process = rank == 0
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(1337 + rank)
    data, vocab_size = make_corpus()
    block_size, batch_size, grad_accum = 32, 4, 2
    learning_rate, min_lr, warmup_iters, lr_decay_iters = 3e-3, 3e-4, 4, args.max_iters
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block_size, (batch_size,))  # the global torch RNG
        x = torch.stack([data[i:i + block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    def get_lr(it: int) -> float:  # cosine with warmup, from the script's own iteration counter
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        ratio = min(1.0, (it - warmup_iters) / (lr_decay_iters - warmup_iters))
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same initial weights on every rank
        model = GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size))
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=learning_rate)
    amp = args.dtype != "float32"
    # fp16 needs loss scaling; a disabled scaler passes every call through.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, enabled=args.dtype == "float16")
    ddp_model = DDP(model)  # enable_resiliency pins its gradient bucket layout (docs/porting.md, section 8)

    def save_checkpoint(it: int) -> None:  # the script's own durable checkpoint
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "iter_num": it}, ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)

    # lm-resiliency: the script's `init_from == "resume"` branch becomes load_fallback, called only
    # when GEMINI has nothing to recover. It returns the iteration it loaded: that becomes
    # resiliency.step_count (returning None would leave it at 0).
    def load_checkpoint() -> int | None:
        if args.init_from != "resume" or not os.path.exists(ckpt_path):
            return None
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        return int(checkpoint["iter_num"])

    # The first batch is fetched before the loop, as nanoGPT does. lm-resiliency: fetch it before
    # enable_resiliency, whose recovery then replaces it (and the RNG that drew it) with the captured one.
    batch = {"X_Y": get_batch()}
    # lm-resiliency: the loop fetches the next batch before optimizer.step(), so the RNG captured after
    # the step is already past that draw: the prefetched batch is part of the captured state.
    resiliency = enable_resiliency(
        ddp_model, optimizer, scaler=scaler, interval=args.interval,
        checkpoint=InMemoryCkptConfig(disk_folder=os.path.join(args.out_dir, "gemini"),
                                      disk_flush_interval=args.interval, run_id=args.run_id),
        extra_state_fn=lambda: {"X": batch["X_Y"][0], "Y": batch["X_Y"][1]},
        load_extra_state_fn=lambda extra: batch.update(X_Y=(extra["X"].clone(), extra["Y"].clone())),
        load_fallback=load_checkpoint,
    )
    # lm-resiliency: the loop counter comes from the session: a GEMINI capture, the step load_fallback
    # returned, or 0. GradScaler-skipped steps count in both, so they never drift apart.
    iter_num = resiliency.step_count
    if master_process:
        print(f"resumed at iter {iter_num} from {resiliency.recovered_from}" if iter_num else "starting from scratch",
              flush=True)

    X, Y = batch["X_Y"]
    while iter_num < args.max_iters:
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num > 0 and iter_num % args.ckpt_interval == 0 and master_process:
            save_checkpoint(iter_num)
        for micro_step in range(grad_accum):
            ddp_model.require_backward_grad_sync = micro_step == grad_accum - 1  # sync on the last only
            with torch.autocast("cpu", dtype=getattr(torch, args.dtype), enabled=amp):
                loss = ddp_model(X, Y) / grad_accum
            X, Y = batch["X_Y"] = get_batch()  # prefetch the next batch while this one runs backward
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if master_process and iter_num % 5 == 0:
            print(f"iter {iter_num}: loss {loss.item() * grad_accum:.4f}, lr {lr:.2e}, "
                  f"scale {scaler.get_scale() if scaler.is_enabled() else 1.0:g}", flush=True)
        if rank == args.kill_rank and iter_num == args.kill_iter:
            os.kill(os.getpid(), signal.SIGKILL)  # a worker dies; the others fail at their next all-reduce
    if master_process:
        torch.save(model.state_dict(), os.path.join(args.out_dir, "final.pt"))
    resiliency.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ self-test


def self_test(dtype: str) -> int:
    """Uninterrupted launch vs. a launch that loses rank 1 then a relaunch: same final weights."""
    base = tempfile.mkdtemp(prefix="nanogpt-ported-")

    def launch(out_dir: str, *extra: str) -> subprocess.Popen:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                   os.path.abspath(__file__), "--out-dir", out_dir, "--dtype", dtype, *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", LM_RESILIENCY_RUN_ID=f"nanogpt-{os.path.basename(out_dir)}")
        print(f"$ {' '.join(command[3:])}", flush=True)
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(process: subprocess.Popen) -> tuple[int, str, str]:
        stdout, stderr = process.communicate(timeout=240)
        print(stdout, flush=True)
        return process.returncode, stdout, stderr

    uninterrupted, managed = os.path.join(base, "uninterrupted"), os.path.join(base, "managed")
    running = [launch(uninterrupted), launch(managed, "--kill-rank", "1", "--kill-iter", "10")]  # side by side
    (code_a, _, err_a), (code_b, _, _) = finish(running[0]), finish(running[1])
    code_c, out_c, err_c = finish(launch(managed))
    if code_a != 0 or code_b == 0 or code_c != 0:
        print(f"FAIL: exit codes {code_a}, {code_b} (must fail: a worker was killed), {code_c}\n"
              f"{err_c[-3000:] or err_a[-3000:]}")
        return 1
    expected = torch.load(os.path.join(uninterrupted, "final.pt"), weights_only=True)
    actual = torch.load(os.path.join(managed, "final.pt"), weights_only=True)
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    # The library's own line (rank 0, WARNING: visible with default logging) says what was recovered.
    library_line = re.search(r"lm-resiliency: resumed run '[^']+' at step \d+ from .*", err_c)
    if "resumed at iter" not in out_c or library_line is None or different:
        print(f"FAIL: no resume line, or final parameters differ: {different}\n{err_c[-3000:]}")
        return 1
    print(library_line.group(0))
    print("OK: the relaunched run finished bitwise equal to the uninterrupted run")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="/tmp/nanogpt-ported")
    parser.add_argument("--init-from", choices=["scratch", "resume"], default="resume")
    parser.add_argument("--max-iters", type=int, default=16)
    parser.add_argument("--interval", type=int, default=4, help="GEMINI capture interval (iterations)")
    parser.add_argument("--ckpt-interval", type=int, default=10, help="the script's own ckpt.pt interval")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float16")
    # lm-resiliency: one run identity for every relaunch of this run (torchrun --standalone makes a
    # new TORCHELASTIC_RUN_ID per launch); the environment variable wins when set.
    parser.add_argument("--run-id", default=os.environ.get("LM_RESILIENCY_RUN_ID", "nanogpt-ported"))
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-iter", type=int, default=-1)
    parser.add_argument("--self-test", action="store_true")
    arguments = parser.parse_args()
    sys.exit(self_test(arguments.dtype) if arguments.self_test else train(arguments))
