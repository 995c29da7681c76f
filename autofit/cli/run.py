"""``autofit run``: run your own training command and measure its real peak.

    autofit run --device cpu:1GiB -- python train.py tuned.yaml
    autofit run --json -- torchrun --nproc-per-node 2 train.py tuned.yaml
    autofit run --config tuned.yaml --record run.json -- accelerate launch train.py

The command's output passes through live; then a small table: the measured peak
(per process when there are several), autofit's whole-run figure from the tuned
file (``--config``, else the command's argument that is a tuned file), their ratio,
the exit code and whether the run survived. ``--json`` prints the record as one
JSON line instead. Exit status: the command's (2 when it cannot be started).
See ``autofit.preflight.run``.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["add_run_parser", "run_run_command"]


def add_run_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``run`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "run",
        help="run your training command and measure its real peak against autofit's figure",
        description="Run COMMAND (after --) with a hook in every Python process it starts, "
        "measure each process's peak memory (CPU: resident memory above the moment the model "
        "is built; CUDA: the allocator's peak) and compare it with the tuned file's whole-run "
        "figure. Exits with the command's exit code.",
    )
    p.add_argument("--device", default=None,
                   help="auto (default: what the processes use), cpu, or cpu:CAP (e.g. "
                   "cpu:1GiB: every process capped at CAP above its baseline, as trials do)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the tuned file to compare with (default: the command's argument "
                   "that is a file autofit tuned)")
    p.add_argument("--json", action="store_true",
                   help="print the record as one JSON line on stdout (instead of the table)")
    p.add_argument("--record", default=None, metavar="FILE", help="also write the JSON record")
    p.add_argument("--guard", action="store_true",
                   help="guard every transformers.Trainer of the command (autofit.guard): an "
                        "OOM inside a micro step is split and the run goes on, with the same "
                        "math; rescues are written beside the tuned file (<name>-guard.jsonl)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the training command, e.g. -- python train.py tuned.yaml")
    p.set_defaults(func=run_run_command)
    return p


def run_run_command(args: argparse.Namespace) -> int:
    """Run ``autofit run``; returns the command's exit code."""
    from autofit.preflight.run import run_command

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    result = run_command(command, device=args.device, config=args.config, record=args.record,
                         guard=args.guard)
    if args.json:
        print(json.dumps(result.to_dict(), separators=(",", ":")), flush=True)
    else:
        _print_table(result)
    return result.exit_code


def _print_table(r: object) -> None:
    from rich.console import Console
    from rich.table import Table

    from autofit.probe.device import format_bytes

    def size(n: int | None) -> str:
        return "-" if n is None else format_bytes(n)

    table = Table(box=None, pad_edge=False, show_header=False, title="autofit run",
                  title_justify="left", title_style="bold")
    table.add_column(style="dim")
    table.add_column()
    what = {"cuda": "CUDA allocator, reserved", "cpu": "resident above the model's start"}
    table.add_row("measured peak", f"{size(r.measured_bytes)}"
                  + (f" ({what[r.measured_kind]})" if r.measured_kind else ""))
    if len(r.processes) > 1:
        for p in r.processes:
            who = f"rank {p.rank}" if p.rank is not None else f"pid {p.pid}"
            table.add_row(f"  {who}", size(p.peak_bytes))
    table.add_row("autofit's whole run", size(r.predicted_bytes)
                  + (f" ({r.config})" if r.config else " (no tuned file: --config FILE)"))
    if r.ratio is not None:
        verdict = "within" if r.ratio <= 1.05 else "OVER"
        table.add_row("measured / predicted", f"{r.ratio:.2f} ({verdict} the promise +5%)")
    if r.cap_bytes is not None:
        table.add_row("device", f"{r.device} (capped per process)")
        spaces = [p.address_space_bytes for p in r.processes if p.address_space_bytes]
        if spaces:  # what the cap bounds: a run can die under it below its resident peak
            table.add_row("address space", f"{size(max(spaces))} above the model's start "
                          f"(the cap counts it; {size(r.cap_bytes)})")
    table.add_row("exit code", str(r.exit_code))
    survived = "yes" if r.survived else "no" + (": out of memory" if r.out_of_memory else "")
    table.add_row("survived", survived)
    if r.guarded:
        table.add_row("guard", f"{len(r.rescues)} rescue(s)" if r.rescues else "no OOM absorbed")
        for line in r.rescues:
            table.add_row("  rescue", line.removeprefix("autofit.guard: "))
    for note in r.notes:
        table.add_row("note", note)
    Console(highlight=False).print(table)
