"""The command line: a thin layer over the Python API (parse, call, print).

    autofit estimate tiny-llama --batch-size 4 --seq-len 512
    autofit estimate meta-llama/Llama-3.1-8B --batch-size 2 --seq-len 4096 \\
        --precision bf16-mixed --gradient-checkpointing --device H100-80GB --json

Exit codes: 0 ok (fits), 2 bad input (one line that says what to do), 3 does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from autofit.config import OPTIMIZERS, PRECISIONS
from autofit.errors import AutofitError

__all__ = ["main", "build_parser", "add_model_options", "model_kwargs", "train_config"]

EXIT_OK, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 0, 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_BAD_INPUT, f"autofit: error: {message} (see '{self.prog} --help')\n")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options that describe the model and one training configuration."""
    p.add_argument("model", help="hub id, local directory, config.json path or bundled name")
    p.add_argument("--batch-size", type=int, required=True, help="micro batch size per device")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--precision", default="32-true", help=f"one of {', '.join(PRECISIONS)}")
    p.add_argument("--optim", default="adamw_torch", help=f"one of {', '.join(OPTIMIZERS)}")
    p.add_argument("--optim-args", default=None, help='e.g. "momentum=0.9"')
    p.add_argument("--gradient-checkpointing", action="store_true")
    add_adapter_options(p)
    p.add_argument("--task", default=None, help="causal-lm, masked-lm, seq2seq or seq-cls")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cpu:8GiB, cuda, cuda:N or a card name (H100-80GB, ...)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_adapter_options(p: argparse.ArgumentParser) -> None:
    """Attention implementation, LoRA and a 4-bit base, for a model given by name."""
    p.add_argument("--attn-implementation", choices=["eager", "sdpa"], default=None)
    p.add_argument("--lora-r", type=int, default=None, help="add a LoRA adapter of this rank")
    p.add_argument("--lora-alpha", type=int, default=None)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="module names, or all-linear (default)")
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA-style 4-bit base")


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The model-building keyword arguments of the API from parsed options."""
    from autofit.probe.model import LoraSpec

    lora = None
    if args.lora_r is not None or args.lora_target_modules or args.lora_alpha is not None:
        targets = args.lora_target_modules or ["all-linear"]
        r = args.lora_r if args.lora_r is not None else 8
        lora = LoraSpec(
            r=r,
            alpha=args.lora_alpha if args.lora_alpha is not None else 2 * r,
            target_modules="all-linear" if targets == ["all-linear"] else tuple(targets),
            dropout=args.lora_dropout,
        )
    if args.load_in_4bit and lora is None:
        lora = LoraSpec()  # QLoRA: a frozen 4-bit base trains through adapters
    return dict(
        task=args.task,
        attn_implementation=args.attn_implementation,
        lora=lora,
        load_in_4bit=args.load_in_4bit,
    )


def train_config(args: argparse.Namespace):
    from autofit.config import TrainConfig

    return TrainConfig(
        micro_batch_size=args.batch_size,
        grad_accum_steps=args.grad_accum,
        precision=args.precision,
        gradient_checkpointing=args.gradient_checkpointing,
        optimizer=args.optim,
        optim_args=args.optim_args,
        seq_len=args.seq_len,
    )


def _cmd_estimate(args: argparse.Namespace) -> int:
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


def _cmd_tune(args: argparse.Namespace) -> int:
    from autofit._datasets import load_dataset_ref
    from autofit.api import autofit
    from autofit.report import print_fit

    if not args.output.lower().endswith((".yaml", ".yml", ".json")):
        from autofit.errors import BadInputError

        raise BadInputError(f"-o {args.output}: use a .yaml or .json file name")
    data = load_dataset_ref(args.dataset)
    tokenizer = None
    if args.tokenizer:
        from autofit._cli_measure import _tokenizer

        tokenizer = _tokenizer(args, data)
    kwargs: dict[str, Any] = dict(
        device=args.device, target_batch_size=args.target_batch_size,
        max_seq_len=args.max_seq_len, margin=args.margin, time_budget_s=args.time_budget,
        precision=args.precision, optimizer=args.optim, gradient_checkpointing=args.ckpt,
        max_micro_batch=args.max_micro_batch, task=args.task, tokenizer=tokenizer,
        max_trials=args.max_trials, cache=not args.no_cache, method=args.method,
    )
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


def build_parser() -> argparse.ArgumentParser:
    from autofit.api import METHODS

    parser = _Parser(prog="autofit", description="Find the fastest training configuration "
                     "that fits in device memory, before the run starts.")
    parser.add_argument("--version", action="version", version=f"autofit {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("estimate", help="estimate the memory of one training configuration")
    add_model_options(p)
    p.add_argument("--method", choices=list(METHODS), default="analytic")
    p.set_defaults(func=_cmd_estimate)

    from autofit._cli_measure import add_measure_parser, run_measure

    add_measure_parser(sub).set_defaults(func=run_measure)
    from autofit._cli_preflight import add_check_parser, add_report_parser

    add_check_parser(sub)
    add_report_parser(sub)

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
                        "(allocated + fragmentation; default 0.10)")
    t.add_argument("--time-budget", type=float, default=None, help="seconds; best so far after it")
    t.add_argument("-o", "--output", default="tuned.yaml", help="tuned file (.yaml or .json)")
    t.add_argument("--precision", nargs="+", default=None, help="precisions allowed")
    t.add_argument("--optim", nargs="+", default=None, help="optimizers allowed")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--gradient-checkpointing", dest="ckpt", action="store_const", const=True,
                   help="always checkpoint")
    g.add_argument("--no-gradient-checkpointing", dest="ckpt", action="store_const", const=False,
                   help="never checkpoint")
    t.add_argument("--max-micro-batch", type=int, default=256)
    add_adapter_options(t)
    t.add_argument("--task", default=None)
    t.add_argument("--tokenizer", default=None, help="tokenizer for a dataset with text")
    t.add_argument("--max-trials", type=int, default=12)
    t.add_argument("--method", choices=list(METHODS), default="analytic",
                   help="estimate: analytic (closed form) or simulate (for a card not "
                        "present: the best candidates bracketed by simulated steps)")
    t.add_argument("--no-cache", action="store_true", help="ignore and do not write the cache")
    t.add_argument("--json", action="store_true", help="print the result as one JSON object")
    t.set_defaults(func=_cmd_tune)
    return parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("autofit")
    except Exception:  # noqa: BLE001 - not installed: running from a checkout
        return "0.1.0"


def _quiet_libraries() -> None:
    """Keep library chatter (deprecations, optional-kernel notices) off the terminal."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autofit`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_libraries()
    try:
        return int(args.func(args))
    except AutofitError as e:
        print(f"autofit: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # output piped into `head`
        return EXIT_OK
    except KeyboardInterrupt:
        print("autofit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - never a traceback unless asked
        if os.environ.get("AUTOFIT_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(
            f"autofit: internal error: {type(e).__name__}: {msg} "
            "(set AUTOFIT_DEBUG=1 for the traceback and please report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
