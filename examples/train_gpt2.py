"""Train a small GPT-2 from scratch, once eagerly and once through `magis.compile`.

The text is the source of a few modules of Python's own standard library (shipped with every
Python, nothing downloaded), read as characters. Both runs start from the same weights and see
the same batches, with AdamW, a warm-up into a cosine learning-rate schedule and gradient
clipping; magis's run executes the plan its search found for a limit of half the captured
step's peak (`plan.report()` says how close it came).

    .venv/bin/python examples/train_gpt2.py            # 300 steps each
    .venv/bin/python examples/train_gpt2.py --steps 100 --time-budget 10

It prints both loss curves at a few steps, the measured peak of one eager step and of one
magis step (same tracker: live tensor storages plus the resident ones), and the plan's figures.

`factory()` is the same model at the size GPT-2 is trained at, for the command line (magis
builds it under fake tensors: nothing is allocated, nothing downloaded):

    magis analyze examples/train_gpt2.py:factory
    magis optimize examples/train_gpt2.py:factory --lat-limit 1.10 --time-budget 20
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import textwrap
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import magis
from magis.backend import LiveBytesTracker


def corpus() -> str:
    """Characters to learn from: the source of a few standard-library modules."""
    return "".join(inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap, argparse))


def batches(text: str, vocab: dict[str, int], batch: int, seq: int, seed: int):
    """Endless random windows of `seq` characters (ids), reproducible from `seed`."""
    ids = torch.tensor([vocab[c] for c in text])
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=gen)
        yield torch.stack([ids[s : s + seq] for s in starts])


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-character prediction, as Hugging Face computes it from labels=."""
    return model(input_ids=ids, labels=ids).loss


def factory(batch: int = 8, seq: int = 1024):
    """GPT-2 small as published (124M parameters, 12 layers, hidden 768, vocabulary 50257,
    dropout 0.1) on a batch of `batch` x `seq` token ids, and the loss above: what
    `magis analyze|optimize examples/train_gpt2.py:factory` plans for (`--batch` sets `batch`)."""
    model = GPT2LMHeadModel(GPT2Config())
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    return model, (ids,), loss_fn


def optimizer_and_schedule(model: torch.nn.Module, steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(steps // 20, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def eager_step(model, opt, ids: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model, ids)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def eager_peak(model, opt, ids: torch.Tensor) -> int:
    """One eager step under the tracker `measure=True` uses: resident tensors (weights, buffers,
    optimizer state, batch) plus the peak of what the step allocates (gradients included)."""
    resident = [*model.parameters(), *model.buffers(), ids]
    resident += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    tracker = LiveBytesTracker(resident)
    with tracker:
        eager_step(model, opt, ids)
    return tracker.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--mem-limit", default="0.5")
    parser.add_argument("--time-budget", type=float, default=20.0)
    parser.add_argument("--hardware", default="cpu", help="cost model of the search")
    args = parser.parse_args()

    text = corpus()
    vocab = {c: i for i, c in enumerate(sorted(set(text)))}
    config = GPT2Config(
        vocab_size=len(vocab), n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    eager_model = copy.deepcopy(model)
    print(f"{len(text)} characters, {len(vocab)} symbols; GPT-2 with "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")  # fmt: skip

    opt, sched = optimizer_and_schedule(model, args.steps)
    example = next(batches(text, vocab, args.batch, args.seq, seed=123))
    start = time.perf_counter()
    train_step = magis.compile(
        model,
        opt,
        (example,),
        loss_fn=loss_fn,
        mem_limit=args.mem_limit,
        time_budget=args.time_budget,
        hardware=args.hardware,
        clip_grad_norm=1.0,
    )
    compile_s = time.perf_counter() - start
    print(f"magis.compile: {compile_s:.1f} s (capture, search, code generation)")
    print(train_step.plan.report())

    eager_opt, eager_sched = optimizer_and_schedule(eager_model, args.steps)
    curves: dict[str, list[float]] = {"eager": [], "magis": []}
    seconds = {"eager": 0.0, "magis": 0.0}
    for which, data in (("eager", batches(text, vocab, args.batch, args.seq, seed=1)),
                        ("magis", batches(text, vocab, args.batch, args.seq, seed=1))):  # fmt: skip
        for _ in range(args.steps):
            ids = next(data)
            start = time.perf_counter()
            if which == "eager":
                loss = eager_step(eager_model, eager_opt, ids)
                eager_sched.step()
            else:
                loss = train_step(ids)
                sched.step()
            seconds[which] += time.perf_counter() - start
            curves[which].append(loss.item())

    print(f"\n{'step':>6} {'eager loss':>11} {'magis loss':>11}")
    for i in sorted({0, *range(args.steps // 10 - 1, args.steps, max(args.steps // 10, 1))}):
        print(f"{i + 1:>6} {curves['eager'][i]:>11.4f} {curves['magis'][i]:>11.4f}")
    for which in ("eager", "magis"):
        print(f"{which}: {seconds[which] / args.steps * 1e3:.1f} ms per step")

    train_step.measure = True
    train_step(example)
    print(f"\nmeasured peak, one step: eager {eager_peak(eager_model, eager_opt, example):,} B; "
          f"magis {train_step.last_peak_bytes:,} B (the plan's simulated peak: "
          f"{train_step.simulated_peak_bytes:,} B)")  # fmt: skip


if __name__ == "__main__":
    main()
