"""``autofit compare-peft``: every PEFT method on your model, data and device, side by side.

    autofit compare-peft tiny-llama --dataset tiny-samples --device cpu:1GiB
    autofit compare-peft meta-llama/Llama-3.1-8B --seq-len 2048 --device H100-80GB \\
        --methods lora,dora,ia3,prefix_tuning --json

Prints one row per method (trainable parameters, the estimated peak at
``--batch-size``, the largest micro batch that fits, the predicted throughput; on a
present device the fastest are confirmed by trials) and writes the picture
(``--plot``, default ``compare-peft.png``; with ``--json`` a picture is drawn only when
``--plot`` is given). Exit codes: 0 done, 2 bad input, 3 no
method fits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autofit.cli.options import (
    EXIT_DOES_NOT_FIT,
    EXIT_OK,
    add_quant_options,
    quant_spec,
    tokenizer_for,
)

__all__ = ["add_compare_peft_parser", "run_compare_peft"]


def add_compare_peft_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``compare-peft`` sub-command to an argparse ``subparsers`` object."""
    from autofit.api import METHODS

    p = subparsers.add_parser("compare-peft", help="compare PEFT methods on your model and device")
    p.add_argument("model", help="hub id, local directory, config.json path or bundled name")
    p.add_argument("--dataset", default=None,
                   help="the training samples: the step is the longest one's (or --seq-len)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample without --dataset")
    p.add_argument("--max-seq-len", type=int, default=None, help="truncate samples to this length")
    p.add_argument("--tokenizer", default=None, help="tokenizer for a dataset with text")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cpu:8GiB, cuda, cuda:N or a card name (H100-80GB, ...)")
    p.add_argument("--methods", default=None,
                   help="comma-separated method names (default: every method autofit models), "
                        "e.g. lora,dora,ia3,prefix_tuning")
    p.add_argument("--batch-size", type=int, default=1, help="the micro batch of the peak column")
    p.add_argument("--precision", default=None, help="default: bf16-mixed where the device runs it")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim name")
    p.add_argument("--task", default=None, help="causal-lm, masked-lm, seq2seq, seq-cls or token-cls")
    p.add_argument("--margin", type=float, default=0.10, help="fraction of the device kept free")
    p.add_argument("--method", choices=list(METHODS), default="analytic")
    p.add_argument("--confirm-top", type=int, default=2,
                   help="confirm this many of the fastest by trials (present device only)")
    add_quant_options(p)
    p.add_argument("--plot", default=None,
                   help="the picture (.png; default compare-peft.png; with --json only when "
                        "given)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_compare_peft)
    return p


def run_compare_peft(args: argparse.Namespace) -> int:
    """Run ``autofit compare-peft``; returns the exit code."""
    from autofit.compare import compare_peft
    from autofit.errors import BadInputError, require

    quant = quant_spec(args)  # a bad combination: one line, exit 2, before any work
    # --json draws only when --plot is given; the picture's library is checked before any work
    draw = args.plot is not None or not args.json
    plot = Path(args.plot or "compare-peft.png")
    if draw and (plot.suffix.lower() != ".png" or plot.is_dir() or not plot.parent.exists()):
        raise BadInputError(f"--plot must be a .png path in an existing folder, got {args.plot}")
    if draw:
        require("matplotlib", "the picture of autofit compare-peft")
    data = tokenizer = None
    if args.dataset:
        from autofit.cli.datasets import load_dataset_ref

        data = load_dataset_ref(args.dataset)
        tokenizer = tokenizer_for(args, data)
    methods = [m for m in args.methods.split(",") if m.strip()] if args.methods else None
    progress = None
    if not args.json:
        from rich.console import Console

        console = Console(stderr=True)
        progress = lambda msg: console.print(f"[dim]{msg}[/]")  # noqa: E731
    c = compare_peft(args.model, data, device=args.device, methods=methods,
                     micro_batch_size=args.batch_size, seq_len=args.seq_len,
                     max_seq_len=args.max_seq_len, precision=args.precision,
                     gradient_checkpointing=args.gradient_checkpointing, optimizer=args.optim,
                     task=args.task, margin=args.margin, method=args.method,
                     confirm_top=args.confirm_top, tokenizer=tokenizer, progress=progress,
                     quantization_config=quant)
    png = c.plot(plot) if draw and any(r.error is None for r in c.rows) else None
    if args.json:
        import json

        d = c.to_dict()
        d["plot"] = str(png) if png else None
        print(json.dumps(d, indent=2, default=str))
    else:
        from autofit.report.compare import print_comparison

        print_comparison(c, png)
    return EXIT_OK if c.best is not None else EXIT_DOES_NOT_FIT
