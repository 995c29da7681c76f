"""``autofit estimate``: the memory of one training configuration, without running it.

    autofit estimate tiny-llama --batch-size 4 --seq-len 512
    autofit estimate meta-llama/Llama-3.1-8B --batch-size 2 --seq-len 4096 \\
        --precision bf16-mixed --gradient-checkpointing --device H100-80GB --json

Exit codes: 0 fits, 3 does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from autofit.cli.options import (
    EXIT_DOES_NOT_FIT,
    EXIT_OK,
    add_block_size_option,
    add_model_options,
    model_kwargs,
    recipe_kwargs,
    tokenizer_for,
    train_config,
)

__all__ = ["add_estimate_parser", "run_estimate"]


def add_estimate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``estimate`` sub-command to an argparse ``subparsers`` object."""
    from autofit.api import METHODS

    p = subparsers.add_parser("estimate", help="estimate the memory of one training configuration")
    add_model_options(p)
    p.add_argument("--method", choices=list(METHODS), default="analytic")
    p.add_argument("--dataset", default=None,
                   help="the training samples (.json/.jsonl, a save_to_disk directory or a "
                        "bundled name): adds the whole run's need (run_* keys)")
    p.add_argument("--max-seq-len", type=int, default=None, help="truncate samples to this length")
    p.add_argument("--tokenizer", default=None, help="tokenizer for a dataset with text")
    add_block_size_option(p)
    p.add_argument("--epochs", type=float, default=1.0, help="epochs of the run (with --dataset)")
    p.add_argument("--seed", type=int, default=42, help="the run's seed (its batch order)")
    p.add_argument("--eval-steps", type=int, default=None,
                   help="the run evaluates every N optimizer steps (with --eval-batch-size)")
    p.add_argument("--eval-batch-size", type=int, default=None,
                   help="per_device_eval_batch_size of those evaluations")
    p.add_argument("--save-steps", type=int, default=None,
                   help="the run saves a checkpoint every N optimizer steps")
    p.set_defaults(func=run_estimate)
    return p


def run_estimate(args: argparse.Namespace) -> int:
    """Run ``autofit estimate``; returns the exit code."""
    from autofit.api import estimate

    run: dict[str, Any] = {}
    if args.dataset:
        from autofit.cli.datasets import load_dataset_ref

        data = load_dataset_ref(args.dataset)
        run = dict(dataset=data, max_seq_len=args.max_seq_len, epochs=args.epochs,
                   seed=args.seed, tokenizer=tokenizer_for(args, data),
                   eval_steps=args.eval_steps, eval_batch_size=args.eval_batch_size,
                   save_steps=args.save_steps, block_size=args.block_size)
    elif args.block_size is not None:
        from autofit.errors import BadInputError

        raise BadInputError("--block-size packs a dataset: give --dataset too")
    est = estimate(
        args.model,
        train_config(args),
        seq_len=args.seq_len,
        device=args.device,
        method=args.method,
        trainer=args.trainer,
        **model_kwargs(args),
        **recipe_kwargs(args),
        **run,
    )
    if args.json:
        d = est.to_dict()
        keys = ["peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "breakdown",
                "method", "fits", "capacity_bytes", "run_peak_reserved_bytes",
                "run_device_total_bytes"]
        out = {k: d[k] for k in keys} | {k: v for k, v in d.items() if k not in keys}
        print(json.dumps(out, indent=2))
    else:
        from autofit.report import print_estimate

        print_estimate(est)
    return EXIT_OK if est.fits else EXIT_DOES_NOT_FIT
