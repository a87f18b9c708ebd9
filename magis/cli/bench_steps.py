"""`magis bench train` and `magis bench gpu`: training steps run and measured on this machine's
device, magis's beside eager PyTorch's and torch.compile's (issues 15, 41, 43)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from magis.cli.exits import UsageError, check_output_folder
from magis.cli.output import BudgetOpt, JsonOpt, console, spinner, write_json


def bench_train_cmd(
    workloads: Annotated[
        list[str] | None,
        typer.Argument(
            help="Workloads (default: every :small one); with --compiler inductor also model "
            "files (path/to/model.py:factory)."
        ),
    ] = None,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed steps of each.")] = 5,
    optimizer: Annotated[str, typer.Option("--optimizer", help="adamw or sgd.")] = "adamw",
    compiler: Annotated[
        str, typer.Option("--compiler", help="python (generated code) or inductor.")
    ] = "python",
    mem_limit: Annotated[
        float, typer.Option("--mem-limit", help="magis's plan, with --compiler inductor.")
    ] = 0.5,
    time_budget: BudgetOpt = 60.0,
    json_path: JsonOpt = None,
) -> None:
    """A program-order magis step against eager PyTorch's, median step times (issue 15); with
    --compiler inductor the five variants of `magis.bench.train_compiled` (issue 43)."""
    from magis.bench.train import OPTIMIZERS, bench_train
    from magis.capture import get_workload, list_workloads
    from magis.capture.user_model import is_model_file
    from magis.cli.tables import show_train, show_train_compiled

    if optimizer not in OPTIMIZERS:
        raise UsageError(f"--optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    if compiler not in ("python", "inductor"):
        raise UsageError(f"--compiler {compiler!r}: choose python or inductor")
    names = workloads or [w.name for w in list_workloads() if w.size == "small"]
    for name in names:
        if not is_model_file(name):
            get_workload(name)  # an unknown name fails before any timing
        elif compiler != "inductor":
            raise UsageError(f"{name}: a model file is benchmarked with --compiler inductor")
    with spinner("bench train") as progress:
        if compiler == "inductor":
            from magis.bench.train_compiled import bench_train_compiled

            results = bench_train_compiled(
                names, repeats, optimizer, mem_limit, time_budget, progress=progress
            )
        else:
            rows = bench_train(names, repeats=repeats, optimizer=optimizer, progress=progress)
    if compiler == "inductor":
        show_train_compiled(results)
        return write_json(json_path, {"results": [r.to_json() for r in results]})
    show_train(rows)
    write_json(json_path, {"rows": [r.to_json() for r in rows]})


def bench_gpu_cmd(
    workloads: Annotated[
        list[str] | None,
        typer.Argument(
            help="Workloads (default on cuda: bert-base resnet50 unet corpus:gpt2; on cpu: the "
            "first three :tiny)."
        ),
    ] = None,
    device: Annotated[
        str, typer.Option("--device", help="cuda, or cpu for the same figures.")
    ] = "cuda",
    budget: BudgetOpt = 30.0,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Timed steps per variant.")] = 10,
    deadline: Annotated[
        float | None,
        typer.Option("--deadline", help="Seconds after which no further workload starts."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Folder for gpu.md and gpu.json.")
    ] = None,
    inductor: Annotated[
        bool,
        typer.Option(
            "--inductor",
            help="Also torch.compile, and the program-order and mem-0.5 plans through Inductor.",
        ),
    ] = False,
    json_path: JsonOpt = None,
) -> None:
    """Plans run on a GPU: eager, program order, mem 0.5, lat 1.10 and a swap-heavy plan, each
    measured (peak, step time, verified) beside the simulator on the profiled cost model, and
    the roofline presets against it per op class (issue 41). One command on the GPU machine:
    scripts/gpu-check."""
    import json

    from magis.bench.gpu import GpuBenchOptions, bench_gpu
    from magis.bench.gpu_report import format_markdown

    if device not in ("cuda", "cpu"):
        raise UsageError(f"--device {device!r}: choose cuda or cpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                "magis bench gpu needs a GPU and torch sees none: run scripts/gpu-check on the "
                "GPU machine, or give --device cpu for the same figures on this CPU"
            )
    folder = check_output_folder(out, "--out") if out is not None else None

    def save(report) -> None:  # after every row: a run cut short keeps what it measured
        data = report.to_json()
        for path in (json_path, folder / "gpu.json" if folder else None):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(data, indent=2) + "\n")
        if folder is not None:
            (folder / "gpu.md").write_text(format_markdown(report))

    options = GpuBenchOptions(
        device=device, time_budget=budget, steps=steps, deadline_s=deadline, inductor=inductor
    )
    with spinner("bench gpu") as progress:
        report = bench_gpu(workloads, options, progress=progress, on_update=save)
    save(report)
    console.print(format_markdown(report), markup=False, highlight=False)
