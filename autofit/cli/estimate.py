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
    add_model_options,
    model_kwargs,
    train_config,
)

__all__ = ["add_estimate_parser", "run_estimate"]


def add_estimate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``estimate`` sub-command to an argparse ``subparsers`` object."""
    from autofit.api import METHODS

    p = subparsers.add_parser("estimate", help="estimate the memory of one training configuration")
    add_model_options(p)
    p.add_argument("--method", choices=list(METHODS), default="analytic")
    p.set_defaults(func=run_estimate)
    return p


def run_estimate(args: argparse.Namespace) -> int:
    """Run ``autofit estimate``; returns the exit code."""
    from autofit.api import estimate

    est = estimate(
        args.model,
        train_config(args),
        seq_len=args.seq_len,
        device=args.device,
        method=args.method,
        **model_kwargs(args),
    )
    if args.json:
        d = est.to_dict()
        keys = ["peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "breakdown",
                "method", "fits", "capacity_bytes"]
        out = {k: d[k] for k in keys} | {k: v for k, v in d.items() if k not in keys}
        print(json.dumps(out, indent=2))
    else:
        from autofit.report import print_estimate

        print_estimate(est)
    return EXIT_OK if est.fits else EXIT_DOES_NOT_FIT
