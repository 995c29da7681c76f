"""``autofit check``: pre-flight of a configuration file from the command line.

    autofit check tuned.yaml                      # exit 0 fits here, 3 does not, 2 bad input
    autofit check tuned.yaml --device cuda:1 --json
    autofit check train_args.yaml --model ./my-model --dataset train.jsonl

``check`` reads a file ``FitResult.save`` wrote (model, task, sequence length and
device are in its ``# autofit: {...}`` line) or a plain TrainingArguments
YAML/JSON (then ``--model`` and ``--dataset`` or ``--seq-len`` say what it trains).
The device is ``--device``, else the file's device when it is present here, else
``auto``. The verdict comes from the check cache when exactly this configuration
was measured before (no trial: about a second), else from one trial on the
worst-case batch (see ``autofit.preflight.check``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from autofit.cli.options import EXIT_DOES_NOT_FIT, EXIT_OK

__all__ = ["add_check_parser", "run_check_command"]


def add_check_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``check`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "check",
        help="pre-flight: will this tuned file fit on this machine? (exit 0 fits, 3 does not)",
        description="Verify a configuration file on the present device: estimate, then one "
        "trial on the worst-case batch unless the cache holds one for exactly this "
        "configuration. Exit 0 fits, 3 does not fit, 2 bad input.",
    )
    p.add_argument("config", help="tuned.yaml / .json (autofit tune -o), or a TrainingArguments "
                   "YAML/JSON with --model")
    p.add_argument("--device", default=None,
                   help="default: the file's device if present here, else auto")
    p.add_argument("--model", default=None, help="the model (overrides the file's)")
    p.add_argument("--dataset", default=None,
                   help=".json/.jsonl file, save_to_disk directory or bundled name")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens of the longest sample, without --dataset (default: the file's)")
    p.add_argument("--max-seq-len", type=int, default=None, help="truncate samples to this length")
    p.add_argument("--task", default=None, help="causal-lm, masked-lm, seq2seq or seq-cls")
    p.add_argument("--margin", type=float, default=0.0,
                   help="fraction of the capacity that must stay free (default 0)")
    p.add_argument("--no-trial", action="store_true", help="estimate only")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: fits, estimate, trial, from_cache, reasons, problems")
    p.set_defaults(func=run_check_command)
    return p


def _default_device(meta: dict[str, Any]) -> tuple[str, str]:
    """The device to check on: the file's when present here, else auto (with why)."""
    name = meta.get("device")
    if name:
        from autofit.errors import UnknownDeviceError
        from autofit.probe.device import resolve_device

        try:
            if resolve_device(name).present:
                return name, f"device {name}: the file's"
        except UnknownDeviceError:
            pass
        return "auto", f"device auto: the file's {name} is not present here"
    return "auto", "device auto: the file names none"


def run_check_command(args: argparse.Namespace) -> int:
    """Run ``autofit check``; returns the exit code."""
    from autofit.emit import read_config
    from autofit.errors import BadInputError
    from autofit.preflight import config_of
    from autofit.preflight.check import run_check

    fields, meta = read_config(args.config)
    model = args.model or meta.get("model")
    if not model:
        raise BadInputError(f"{args.config} names no model (a plain TrainingArguments file?): "
                            "give --model")
    dataset = None
    if args.dataset:
        from autofit.cli.datasets import load_dataset_ref

        dataset = load_dataset_ref(args.dataset)
    seq_len = args.seq_len if args.seq_len is not None else (
        None if dataset is not None else meta.get("seq_len"))
    if dataset is None and seq_len is None:
        raise BadInputError(f"{args.config} has no sequence length: give --dataset or --seq-len")
    if args.device:
        device, why = args.device, f"device {args.device}: as given"
    else:
        device, why = _default_device(meta)
    config = config_of(fields)
    eval_batch = fields.get("per_device_eval_batch_size")
    # an eval batch that does not fit stops the job only when the file evaluates
    evaluates = (str(fields.get("eval_strategy") or "no") != "no" or bool(fields.get("do_eval"))
                 or bool(fields.get("do_predict")))
    progress = None
    if not args.json:
        from rich.console import Console

        console = Console(stderr=True)
        progress = lambda line: console.print(f"[dim]autofit:[/] {line}")  # noqa: E731
    report = run_check(
        model, config, seq_len=seq_len, dataset=dataset, device=device,
        task=args.task or meta.get("task"), margin=args.margin, trial=not args.no_trial,
        cache=not args.no_cache, tune_meta=meta,
        eval_batch_size=int(eval_batch) if eval_batch else None, eval_required=evaluates,
        seq_len_source=("as given" if args.seq_len is not None else "the file's"),
        max_seq_len=args.max_seq_len or meta.get("max_seq_len"), progress=progress,
    )
    from dataclasses import replace

    report = replace(report, reasons=(why, *report.reasons))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        _print_check(report, args.config)
    return EXIT_OK if report.fits else EXIT_DOES_NOT_FIT


def _print_check(report: Any, path: str) -> None:
    from rich.console import Console
    from rich.text import Text

    from autofit.probe.device import format_bytes
    from autofit.report import estimate_renderable

    console = Console()
    if report.estimate is not None:
        console.print(estimate_renderable(report.estimate))
    t = report.trial
    if t is not None:
        src = "from the cache" if report.from_cache else "ran now"
        if t.oom:
            console.print(f"trial ({src}): OUT OF MEMORY at micro batch "
                          f"{t.batch_shape[0]} x {t.batch_shape[1]}")
        elif t.device_total_bytes is not None:
            console.print(f"trial ({src}): {format_bytes(t.device_total_bytes)} peak at "
                          f"{t.batch_shape[0]} x {t.batch_shape[1]} tokens"
                          + (f", {t.tokens_per_s:,.0f} tokens/s" if t.tokens_per_s else ""))
    if report.eval_estimate is not None:
        console.print(f"eval step (batch {report.eval_batch_size}): ~"
                      f"{format_bytes(report.eval_estimate.device_total_bytes)} (estimate)")
    if report.fits:
        console.print(Text(f"✓ {path} fits on {report.device}", style="bold green"))
    else:
        console.print(Text(f"✗ {path} does NOT fit on {report.device}", style="bold red"))
        for p in report.problems:
            console.print(Text(f"  ✗ {p}", style="red"))
    for r in report.reasons:
        console.print(f"  • {r}")
