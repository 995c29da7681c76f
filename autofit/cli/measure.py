"""``autofit measure``: real micro-steps of one configuration, from the command line.

    autofit measure tiny-llama --batch-size 4 --seq-len 256 --device cpu:2GiB
    autofit measure ./my-model --batch-size 8 --dataset train.jsonl --json

Exit codes: 0 the configuration fits, 3 it ran out of memory (the numbers
measured up to the failure are printed, with what to try next), 2 bad input (one
line on stderr, no traceback), 4 the trial failed otherwise (a timeout, a model
that does not run, a trial process killed from outside: the result says which).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from autofit.cli.options import (
    EXIT_DOES_NOT_FIT,
    EXIT_OK,
    EXIT_TRIAL_FAILED,
    add_block_size_option,
    add_config_options,
    add_peft_option,
    add_quant_options,
    add_recipe_options,
    quant_spec,
    recipe_kwargs,
    tokenizer_for,
)
from autofit.knobs import KNOBS, describe_choice, is_choice

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from autofit.trial.result import TrialResult

__all__ = ["add_measure_parser", "run_measure"]

EXIT_OOM = EXIT_DOES_NOT_FIT


def add_measure_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``measure`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "measure",
        help="run real training micro-steps and measure peak memory and speed",
        description="Run a few real training steps of one configuration on the device "
        "and report the peak memory and the speed. Exit 0 fits, 3 out of memory, 2 bad input.",
    )
    p.add_argument("model", help="bundled name, hub id, model directory or config.json")
    p.add_argument("--batch-size", type=int, required=True, help="micro batch size")
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sample (random data), or the truncation length with --dataset",
    )
    add_config_options(p)
    add_recipe_options(p)
    p.add_argument("--attn-implementation", choices=["eager", "sdpa"], default=None)
    p.add_argument("--lora-r", type=int, default=None, help="train a LoRA adapter of this rank")
    p.add_argument("--lora-alpha", type=int, default=None)
    p.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        help="module names, or all-linear (default)",
    )
    add_peft_option(p)
    add_quant_options(p)
    p.add_argument("--task", default=None, help="causal-lm | masked-lm | seq2seq | seq-cls | token-cls")
    p.add_argument(
        "--dataset",
        default=None,
        help=".json / .jsonl file of samples with input_ids (or text + --tokenizer)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer for a dataset with text")
    add_block_size_option(p)
    p.add_argument("--device", default="auto", help="auto | cpu | cpu:4GiB | cuda | cuda:N")
    p.add_argument("--isolation", choices=["auto", "in-process", "subprocess"], default="auto")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--measure-steps", type=int, default=None,
                   help="timed steps; the step time is their median (default 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole trial")
    p.add_argument("--json", action="store_true", help="print one JSON object (TrialResult)")
    p.set_defaults(func=run_measure)
    return p


def _suggestion(args: argparse.Namespace) -> str:
    tries = []
    if args.batch_size > 1:
        tries.append(f"--batch-size {max(1, args.batch_size // 2)}")
    for k in KNOBS:  # each knob's memory-saving value, where the run did not use it
        if args.trainer is not None and not is_choice(k, trainer=args.trainer):
            continue  # the declared trainer does not run it
        if k.saving is not None and k.option_value(args) != k.saving:
            tries.append(k.flag(k.saving))
    if not tries:
        tries = ["a shorter --seq-len", "--optim adamw_bnb_8bit", "LoRA (--lora-r 8)"]
    return "try " + " or ".join(tries)


def _fmt(n: int | None) -> str:
    from autofit.probe.device import format_bytes

    return "n/a" if n is None else format_bytes(n)


def _print_human(result: TrialResult, args: argparse.Namespace) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    b, t = result.batch_shape
    cfg = result.config
    what = (f"{args.model}: batch {b}x{t}, "
            f"{describe_choice({k.name: cfg[k.name] for k in KNOBS})} on {result.device}")
    peak = _fmt(result.peak_reserved_bytes)
    cap = f" of {_fmt(result.capacity_bytes)}" if result.capacity_bytes else ""
    if result.fits:
        console.print(f"[green]fits[/green]  {what}")
        console.print(f"  peak memory {peak}{cap} (allocated {_fmt(result.peak_allocated_bytes)})")
        console.print(
            f"  step {result.step_time_s:.3f} s, {result.tokens_per_s:,.0f} tokens/s, "
            f"{result.samples_per_s:.2f} samples/s (median of {result.steps} steps)"
        )
    elif result.oom:
        console.print(f"[red]does not fit[/red]  {what}")
        console.print(f"  out of memory: {result.error}")
        console.print(f"  peak memory up to the failure {peak}{cap}")
        console.print(f"  {_suggestion(args)}")
    else:
        console.print(f"[yellow]trial failed[/yellow]  {what}")
        console.print(f"  {result.error}")
    for r in result.per_rank:  # several ranks: each rank's own numbers
        what = (f"{_fmt(r['device_total_bytes'])} (resident {_fmt(r['resident_bytes'])})"
                if r["device_total_bytes"] is not None else "not measured")
        end = f": {r['error']}" if r["error"] else ""
        console.print(f"  rank {r['rank']}: {what}{end}")
    console.print(f"  [dim]{result.isolation}: {result.isolation_reason}[/dim]")
    for note in result.notes:
        console.print(f"  [dim]note: {note}[/dim]")


def run_measure(args: argparse.Namespace) -> int:
    """Run ``autofit measure`` for parsed ``args``; returns the exit code."""
    from autofit.errors import AutofitError

    try:
        result = _measure(args)
    except AutofitError as e:
        print(f"autofit measure: error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        _print_human(result, args)
    if result.fits:
        return EXIT_OK
    return EXIT_OOM if result.oom else EXIT_TRIAL_FAILED


def _measure(args: argparse.Namespace) -> Any:
    from autofit.cli.options import train_config
    from autofit.errors import BadInputError

    config = train_config(args)  # the same TrainConfig as `autofit estimate` builds
    _lora(args)  # checked before any work
    data = None
    tokenizer = None
    if args.dataset:
        from autofit.cli.datasets import load_dataset_ref

        data = load_dataset_ref(args.dataset)
        tokenizer = tokenizer_for(args, data)
    elif args.seq_len is None:
        raise BadInputError("give --seq-len (random tokens) or --dataset")
    elif args.block_size is not None:
        raise BadInputError("--block-size packs a dataset: give --dataset too")
    if args.json or config.world_size == 1:
        return _run(args, config, data, tokenizer, None)
    from rich.console import Console

    # while the ranks run: what each is doing, on one line that updates (stderr)
    with Console(stderr=True).status(f"starting {config.world_size} ranks") as shown:
        return _run(args, config, data, tokenizer, shown.update)


def _lora(args: argparse.Namespace) -> Any:
    from autofit.errors import BadInputError
    from autofit.probe.model import LoraSpec

    lora = None
    if args.lora_r is not None:
        targets = args.lora_target_modules or "all-linear"
        if isinstance(targets, list) and targets == ["all-linear"]:
            targets = "all-linear"
        lora = LoraSpec(
            r=args.lora_r,
            alpha=args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r,
            target_modules=tuple(targets) if isinstance(targets, list) else targets,
        )
    elif args.lora_alpha is not None or args.lora_target_modules:
        raise BadInputError("--lora-alpha / --lora-target-modules need --lora-r")
    return lora


def _run(args: argparse.Namespace, config: Any, data: object,
         tokenizer: PreTrainedTokenizerBase | None, progress: Any) -> Any:
    from autofit.probe.model import LoraSpec
    from autofit.trial import measure

    lora = _lora(args)
    quant = quant_spec(args)
    if quant is not None and lora is None and args.peft_config is None:
        lora = LoraSpec()  # a frozen quantized base trains through adapters

    return measure(
        args.model,
        config,
        data,
        device=args.device,
        seq_len=args.seq_len,
        task=args.task,
        isolation=args.isolation,
        warmup_steps=args.warmup_steps,
        # the API's default (autofit.trial.MEASURE_STEPS) unless given
        **({} if args.measure_steps is None else {"measure_steps": args.measure_steps}),
        timeout_s=args.timeout,
        tokenizer=tokenizer,
        attn_implementation=args.attn_implementation,
        lora=lora,
        peft_config=args.peft_config,
        progress=progress,
        quantization_config=quant,
        block_size=args.block_size,
        **recipe_kwargs(args),
        trainer=args.trainer,
    )
