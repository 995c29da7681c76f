"""``autofit tune``: the fastest configuration that fits, written to a tuned file.

    autofit tune tiny-gpt2 --dataset tiny-samples --device cpu:1GiB --target-batch-size 16 \\
        -o tuned.yaml
    autofit tune tiny-gpt2 --dataset tiny-samples --device cpu:2GiB --nproc-per-node 2 \\
        --strategy fsdp -o tuned.yaml     # + tuned-accelerate.yaml (accelerate launch)

Exit codes: 0 ok, 3 nothing fits (the message says what would), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from autofit.cli.options import (
    EXIT_OK,
    add_adapter_options,
    add_block_size_option,
    add_rank_options,
    model_kwargs,
    rank_kwargs,
    tokenizer_for,
)
from autofit.knobs import KNOBS

__all__ = ["add_tune_parser", "run_tune"]


def add_tune_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``tune`` sub-command to an argparse ``subparsers`` object."""
    from autofit.api import METHODS

    t = sub.add_parser("tune", help="find the fastest configuration that fits; write it to a file",
                       description="Estimate every candidate, confirm the best with real "
                       "micro-steps on the worst-case batch, write the tuned TrainingArguments. "
                       "Exit 0 ok, 3 nothing fits, 2 bad input.")
    t.add_argument("model", help="hub id, local directory, config.json path or bundled name")
    t.add_argument("--dataset", required=True,
                   help=".json/.jsonl file, a save_to_disk directory, or a bundled name (tiny-samples)")
    t.add_argument("--device", default="auto")
    t.add_argument("--target-batch-size", type=int, default=None,
                   help="effective batch to keep (micro batch × accumulation × devices)")
    t.add_argument("--max-seq-len", type=int, default=None, help="truncate samples to this length")
    t.add_argument("--margin", type=float, default=None,
                   help="fraction of capacity kept free above the measured reserved peak "
                        "(default: what the modelled run needs above its longest step, "
                        "+ 0.03 safety; the reasons say how much)")
    t.add_argument("--time-budget", type=float, default=None, help="seconds; best so far after it")
    t.add_argument("-o", "--output", default="tuned.yaml", help="tuned file (.yaml or .json)")
    for k in KNOBS:  # each knob's own options restrict it (--precision, --optim, ...)
        k.add_options(t)
    add_rank_options(t)  # --nproc-per-node, --nnodes: the ranks the tuned run has
    t.add_argument("--max-micro-batch", type=int, default=256)
    add_adapter_options(t)
    t.add_argument("--task", default=None)
    t.add_argument("--tokenizer", default=None, help="tokenizer for a dataset with text")
    add_block_size_option(t)
    t.add_argument("--max-trials", type=int, default=12)
    t.add_argument("--method", choices=list(METHODS), default="analytic",
                   help="estimate: analytic (closed form) or simulate (for a card not "
                        "present: the best candidates bracketed by simulated steps)")
    t.add_argument("--no-cache", action="store_true", help="ignore and do not write the cache")
    t.add_argument("--json", action="store_true", help="print the result as one JSON object")
    t.set_defaults(func=run_tune)
    return t


def run_tune(args: argparse.Namespace) -> int:
    """Run ``autofit tune``; returns the exit code."""
    from autofit.api import autofit
    from autofit.cli.datasets import load_dataset_ref
    from autofit.emit import check_config_output
    from autofit.report import print_fit

    check_config_output(args.output, name="-o")  # before any work: never a tune lost at the end
    data = load_dataset_ref(args.dataset)
    tokenizer = None
    if args.tokenizer:
        tokenizer = tokenizer_for(args, data)
    kwargs: dict[str, Any] = dict(
        device=args.device, target_batch_size=args.target_batch_size,
        max_seq_len=args.max_seq_len, margin=args.margin, time_budget_s=args.time_budget,
        max_micro_batch=args.max_micro_batch, task=args.task, tokenizer=tokenizer,
        max_trials=args.max_trials, cache=not args.no_cache, method=args.method,
    )
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    kwargs.update({k.name: k.from_options(args) for k in KNOBS})
    kwargs.update(rank_kwargs(args))
    kwargs.update({k: v for k, v in model_kwargs(args).items() if k != "task"})
    if args.json:
        result = autofit(args.model, data, **kwargs)
    else:
        from autofit.report import TrialProgress

        with TrialProgress(args.max_trials) as progress:
            result = autofit(args.model, data, progress=progress, **kwargs)
    path = result.save(args.output)
    if args.json:
        print(json.dumps({"config": result.config.to_dict(), "confirmed": result.confirmed,
                          "from_cache": result.from_cache, "reasons": list(result.reasons),
                          "trials": [t.to_dict() for t in result.trials],
                          "candidates": list(result.candidates), "output": str(path),
                          "estimate": result.estimate.to_dict()}, indent=2, default=str))
    else:
        print_fit(result, path)
    return EXIT_OK
