"""``autofit check``: pre-flight of a configuration file from the command line.

    autofit check tuned.yaml                      # exit 0 fits here, 3 does not, 2 bad input
    autofit check tuned.yaml --device cuda:1 --json
    autofit check train_args.yaml --model ./my-model --dataset train.jsonl
    autofit check run_clm_args.yaml               # model_name_or_path / train_file: the file's
    autofit check tuned.yaml                      # a tuned run on 2 ranks: a trial on 2 ranks

``--trainer plain|autofit|trl`` says what will train the file (default: the trainer the
file records, else ``plain``): the verdict is for the file's fields as that trainer runs
them; the metadata grants no lever the fields do not carry (a file tuned for
``autofit.ChunkedLossTrainer`` checked as ``plain`` is checked with the full logits, and
says "fits only with autofit.ChunkedLossTrainer; a plain Trainer needs X" when they do not fit).

``check`` reads a file ``FitResult.save`` wrote (model, task, sequence length and
device are in its ``# autofit: {...}`` line) or a plain TrainingArguments
YAML/JSON (then ``--model`` and ``--dataset`` or ``--seq-len`` say what it trains).
A mixed arguments file (the transformers examples', ``trl sft --config``'s) is read
as well: its keys outside TrainingArguments are ignored with one note, its
``model_name_or_path`` / ``train_file`` are the model and data unless given here, a
TRL file is judged with SFTTrainer's loss and its ``use_peft`` LoRA
(``autofit.emit.args_file``).
The device is ``--device``, else the file's device when it is present here, else
``auto``. The verdict comes from the check cache when exactly this configuration
was measured before (no trial: about a second), else from one trial on the
worst-case batch (see ``autofit.preflight.check``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from autofit.cli.options import (
    EXIT_DOES_NOT_FIT,
    EXIT_OK,
    EXIT_TRIAL_FAILED,
    add_file_subject_options,
    add_rank_options,
    add_recipe_options,
    add_trainer_option,
    file_subject,
)

__all__ = ["add_check_parser", "run_check_command"]


def add_check_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``check`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "check",
        help="pre-flight: will this tuned file fit on this machine? (exit 0 fits, 3 does not)",
        description="Verify a configuration file on the present device: estimate, then one "
        "trial on the worst-case batch unless the cache holds one for exactly this "
        "configuration. Exit 0 fits, 3 does not fit, 2 bad input, 4 the run fails for "
        "another reason than memory (its trial did, or its step as estimated).",
    )
    p.add_argument("config", help="tuned.yaml / .json (autofit tune -o), or a TrainingArguments "
                   "YAML/JSON with --model")
    add_file_subject_options(p)
    add_rank_options(p)  # default: the ranks the tuned file records
    add_recipe_options(p)  # default: the file's deepspeed / fsdp fields
    add_trainer_option(p, "the trainer the file records, else plain")
    p.add_argument("--margin", type=float, default=0.0,
                   help="fraction of the capacity that must stay free (default 0)")
    p.add_argument("--no-trial", action="store_true", help="estimate only")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: fits, estimate, trial, from_cache, reasons, problems")
    p.set_defaults(func=run_check_command)
    return p


def run_check_command(args: argparse.Namespace) -> int:
    """Run ``autofit check``; returns the exit code."""
    from autofit.emit import check_training_arguments
    from autofit.emit.args_file import read_args_file
    from autofit.knobs.trainer import CLASS_NAME, Trainer
    from autofit.preflight.check import run_check
    from autofit.preflight.trainer import file_config, only_with

    source = read_args_file(args.config)  # a mixed file: its other keys are the script's
    fields, meta = source.fields, source.meta
    if source.peft_config is not None and "adapter" not in meta:
        meta = {**meta, "adapter": source.peft_config}  # a TRL file's use_peft: its LoRA
    # every problem at once, exit 2; fields found clean before are not checked again (a
    # cached check answers without importing transformers)
    check_training_arguments(fields, source=args.config, memo=not args.no_cache)
    # what the declared trainer runs from the fields: the metadata grants no other lever (an
    # SFTConfig file that records no trainer is for SFTTrainer)
    declared = args.trainer or ("trl" if source.sft and not meta.get("trainer") else None)
    config, trainer, lost = file_config(fields, meta, declared)
    if config.loss_impl == "trl":  # SFTTrainer's loss: its trial and simulation import trl
        from autofit.errors import require

        require("trl", "checking a plan of trl.SFTConfig (SFTTrainer's loss)")  # before any work
    config, launch_note = _with_ranks(config, meta, args)
    recipe = _recipe(fields, args)
    if recipe is not None:
        config = recipe.apply(config)
    s = file_subject(args, meta, source)
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
        s.model, config, seq_len=s.seq_len, dataset=s.dataset, device=s.device, task=s.task,
        margin=args.margin, trial=not args.no_trial, cache=not args.no_cache, tune_meta=meta,
        eval_batch_size=int(eval_batch) if eval_batch else None, eval_required=evaluates,
        seq_len_source=s.seq_len_source, progress=progress,
        # SFTTrainer truncates at the SFTConfig's max_length (the tune recorded it as the
        # file's max_seq_len): its data preparation decides, unless --max-seq-len is given
        max_seq_len=s.max_seq_len if trainer != "trl" or args.max_seq_len else None,
        tokenizer=s.tokenizer, block_size=s.block_size, packing=s.packing,
        recipe=recipe, liger_loss=config.chunked_loss and trainer != "autofit",
        sft=fields if trainer == "trl" else None,  # SFTTrainer prepares the data
        run_args=fields,  # the run's order and evaluations (what its other shapes add)
    )
    from dataclasses import replace

    why = "as given" if args.trainer else (
        "the file's" if meta.get("trainer") else "an SFTConfig file" if source.sft
        else "the default (the file names none)")
    report = replace(report, reasons=(*source.notes, *s.notes, s.device_reason, *launch_note,
                                      f"trainer {trainer}: {CLASS_NAME[Trainer(trainer)]}, "
                                      f"{why}", *report.reasons))
    report = only_with(report, trainer, lost)
    from autofit.trial.guard import evidence

    found = evidence(args.config, report.config.micro_batch_size)  # a guarded run's record
    if found:
        report = replace(report, fits=False, problems=(*report.problems, found))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        _print_check(report, args.config)
    if report.fails_otherwise:
        return EXIT_TRIAL_FAILED  # not a memory verdict (as measure): the cause is printed
    return EXIT_OK if report.fits else EXIT_DOES_NOT_FIT


def _recipe(fields: dict[str, object], args: argparse.Namespace) -> Any:
    """The launch recipe the run uses: ``--deepspeed-config`` / ``--accelerate-config``, else
    the file's ``deepspeed`` (a path relative to the file, or a dict) / ``fsdp`` fields;
    its batch numbers and precision must agree with the file's."""
    from pathlib import Path

    from autofit.knobs.recipe import check_batch, read_recipe, recipe_of_fields

    if args.deepspeed_config is None and args.accelerate_config is None:
        return recipe_of_fields(fields, args.config, base=Path(args.config).parent)
    ds = args.deepspeed_config
    if ds is None and args.accelerate_config is None:
        ds = fields.get("deepspeed")
    recipe = read_recipe(deepspeed=ds, accelerate=args.accelerate_config,
                         fsdp_fields={k: fields[k] for k in ("fsdp", "fsdp_config")
                                      if fields.get(k)} or None,
                         base=Path(args.config).parent)
    if recipe is not None:
        check_batch(recipe, fields, args.config)
    return recipe


def _with_ranks(config: Any, meta: dict[str, object],
                args: argparse.Namespace) -> tuple[Any, tuple[str, ...]]:
    """``config`` on the ranks the run is launched with (no TrainingArguments field says how
    many processes a run has: the launcher does): the ``<name>-accelerate.yaml`` a tune wrote
    beside the file when there is one (``accelerate launch`` reads it, edited or not), else
    the ranks the tuned file records; ``--nproc-per-node`` / ``--nnodes`` over both. A
    compiled file launched with a launch file that compiles regionally (its ``dynamo_config``)
    is checked compiled that way. Also the reason to show when the launch file and the
    metadata disagree."""
    from autofit.cli.options import rank_kwargs

    recorded = meta.get("config") or {}
    ranks = {k: recorded[k] for k in ("nproc_per_node", "nnodes")
             if isinstance(recorded.get(k), int) and not isinstance(recorded.get(k), bool)}
    note: tuple[str, ...] = ()
    # the launch file beside a tuned file (--accelerate-config, when given, is the recipe's)
    from autofit.emit.launch import launch_settings

    launched = (launch_settings(args.config)
                if meta and getattr(args, "accelerate_config", None) is None else None)
    if launched is not None:
        if launched.pop("regional") and config.torch_compile:
            config = config.replace(torch_compile_regional=True)
        said = (int(ranks.get("nproc_per_node", 1)), int(ranks.get("nnodes", 1)))
        if said != (launched["nproc_per_node"], launched["nnodes"]):
            note = (f"ranks from the launch file beside it ({launched['nproc_per_node']} x "
                    f"{launched['nnodes']} nodes), not the file's metadata ({said[0]} x "
                    f"{said[1]}): accelerate launches what the launch file says",)
        ranks = dict(launched)
    ranks.update(rank_kwargs(args))
    if not ranks:
        return config, note
    nproc, nnodes = int(ranks.get("nproc_per_node", 1)), int(ranks.get("nnodes", 1))
    return config.replace(nproc_per_node=nproc, nnodes=nnodes, world_size=nproc * nnodes), note


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
        e = report.eval_estimate  # in the run: with what its other shapes left (CPU)
        console.print(f"eval step (batch {report.eval_batch_size}): ~"
                      f"{format_bytes(e.run_device_total_bytes or e.device_total_bytes)} "
                      "(estimate)")
    if report.fits:
        console.print(Text(f"✓ {path} fits on {report.device}", style="bold green"))
    elif report.fails_otherwise:
        what = "the trial failed" if report.trial_failed else "its step fails"
        console.print(Text(f"✗ {path}: {what} on {report.device} (not a memory verdict)",
                           style="bold red"))
        for p in report.problems:
            console.print(Text(f"  ✗ {p}", style="red"))
    else:
        console.print(Text(f"✗ {path} does NOT fit on {report.device}", style="bold red"))
        for p in report.problems:
            console.print(Text(f"  ✗ {p}", style="red"))
    for r in report.reasons:
        console.print(f"  • {r}")
