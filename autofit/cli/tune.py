"""``autofit tune``: the fastest configuration that fits, written to a tuned file.

    autofit tune tiny-gpt2 --dataset tiny-samples --device cpu:1GiB --target-batch-size 16 \\
        -o tuned.yaml
    autofit tune tiny-gpt2 --dataset tiny-samples --device cpu:2GiB --nproc-per-node 2 \\
        --strategy fsdp -o tuned.yaml     # + tuned-accelerate.yaml (accelerate launch)
    autofit tune --training-args args.yaml --device cpu:1GiB
        # -> args-tuned.yaml: args.yaml with only the tuned fields changed

``--training-args FILE`` takes your own arguments file, YAML or JSON: TrainingArguments
fields alone, or beside your script's keys (the transformers examples' ModelArguments and
DataTrainingArguments, ``trl sft --config``'s ModelConfig and ScriptArguments). Its batch
(per-device x accumulation x devices) is the target unless ``--target-batch-size`` is given;
its eval/save cadence and steps are the run planned; ``model_name_or_path`` and
``train_file`` are the model and data when MODEL / ``--dataset`` are not given (a relative
path as your script reads it: from the working directory). The output is that file in its
format with only the tuned fields changed (every other key, its place and YAML comments
kept), written beside it as ``<name>-tuned<suffix>`` unless ``-o`` says where; the file
itself is written only with ``--in-place``.

Exit codes: 0 ok, 3 nothing fits (the message says what would), 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from autofit.cli.options import (
    EXIT_OK,
    add_adapter_options,
    add_block_size_option,
    add_rank_options,
    add_recipe_options,
    add_trainer_option,
    data_task,
    model_kwargs,
    padded_samples,
    rank_kwargs,
    recipe_kwargs,
    script_lengths,
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
    t.add_argument("model", nargs="?", default=None,
                   help="hub id, local directory, config.json path or bundled name (default: "
                        "the --training-args file's model_name_or_path)")
    t.add_argument("--dataset", default=None,
                   help=".json/.jsonl file, a save_to_disk directory, or a bundled name "
                        "(tiny-samples; default: the --training-args file's train_file)")
    t.add_argument("--training-args", default=None, metavar="FILE",
                   help="your arguments file (YAML or JSON): TrainingArguments fields, also "
                        "beside your script's model/data keys (transformers examples, trl sft "
                        "--config); its batch is the target, its eval/save cadence planned; "
                        "the output is this file with only the tuned fields changed")
    t.add_argument("--in-place", action="store_true",
                   help="write the tuned fields into the --training-args file itself")
    t.add_argument("--device", default="auto")
    t.add_argument("--target-batch-size", type=int, default=None,
                   help="effective batch to keep (micro batch × accumulation × devices)")
    t.add_argument("--max-seq-len", type=int, default=None, help="truncate samples to this length")
    t.add_argument("--margin", type=float, default=None,
                   help="fraction of capacity kept free above the measured reserved peak "
                        "(default: what the modelled run needs above its longest step, "
                        "+ 0.03 safety; the reasons say how much)")
    t.add_argument("--time-budget", type=float, default=None, help="seconds; best so far after it")
    t.add_argument("-o", "--output", default=None,
                   help="tuned file (.yaml or .json; default tuned.yaml, or with "
                        "--training-args FILE: FILE's name + -tuned beside it, same format)")
    for k in KNOBS:  # each knob's own options restrict it (--precision, --optim, ...)
        k.add_options(t)
    add_rank_options(t)  # --nproc-per-node, --nnodes: the ranks the tuned run has
    add_recipe_options(t)  # the user's DeepSpeed / accelerate config: kept, the rest searched
    add_trainer_option(t)  # the chunked loss is searched only for --trainer autofit
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


def _guard_record(output: Any, model: Any) -> Any:
    """The rescues ``autofit run --guard`` wrote beside the tuned file this tune replaces
    (``<name>-guard.jsonl``), when that file was tuned for the same model; else None (no
    run of it, or evidence about another model)."""
    from autofit.emit import read_config
    from autofit.trial.guard import record_beside

    record = record_beside(output)
    if not record.is_file() or not Path(output).is_file():
        return None
    try:
        meta = read_config(output)[1]
    except Exception:  # noqa: BLE001 - a file we cannot read says nothing about this model
        return None
    return record if model is not None and str(meta.get("model")) == str(model) else None


def run_tune(args: argparse.Namespace) -> int:
    """Run ``autofit tune``; returns the exit code."""
    from autofit.api import autofit
    from autofit.cli.datasets import load_dataset_ref
    from autofit.emit import check_config_output
    from autofit.report import print_fit

    source = _arguments_file(args)  # its fields, model and data: before any work
    output = _output(args, source)
    check_config_output(output, name="-o")  # before any work: never a tune lost at the end
    data = load_dataset_ref(args.dataset)
    found = data_task(data) if args.task is None else None
    if found is not None:  # run_ner.py's data: a token classifier is what trains
        args.task = found[0]
    if getattr(args, "pad_to_max_len", False):  # the file's pad_to_max_length
        data = padded_samples(data, args.max_seq_len)
    # text without --tokenizer: the model's own tokenizer, as run_clm.py loads it from
    # model_name_or_path (estimate, measure and check do the same)
    tokenizer = tokenizer_for(args, data)
    kwargs: dict[str, Any] = dict(
        training_args=_fields_of(source),
        device=args.device, target_batch_size=args.target_batch_size,
        max_seq_len=args.max_seq_len, margin=args.margin, time_budget_s=args.time_budget,
        max_micro_batch=args.max_micro_batch, task=args.task, tokenizer=tokenizer,
        max_trials=args.max_trials, cache=not args.no_cache, method=args.method,
        trainer=args.trainer,
    )
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    record = _guard_record(output, args.model)
    if record is not None:  # what a guarded run of the file being replaced needed
        kwargs["guard_record"] = str(record)
    kwargs.update({k.name: k.from_options(args) for k in KNOBS})
    kwargs.update(rank_kwargs(args))
    kwargs.update(recipe_kwargs(args))
    ds = source.fields.get("deepspeed") if source is not None else None
    if isinstance(ds, str) and "deepspeed_config" not in kwargs and not ds.lstrip().startswith("{"):
        from pathlib import Path

        if not Path(ds).is_absolute() and not Path(ds).is_file():  # relative to the file
            kwargs["deepspeed_config"] = str(Path(source.path).parent / ds)
    kwargs.update({k: v for k, v in model_kwargs(args).items() if k != "task"})
    if args.json:
        result = autofit(args.model, data, **kwargs)
    else:
        from autofit.report import TrialProgress

        with TrialProgress(args.max_trials) as progress:
            result = autofit(args.model, data, progress=progress, **kwargs)
    notes = (*(source.notes if source is not None else ()), *(found[1:] if found else ()))
    if notes:  # the file's keys kept, its model/data taken: first in the reasons
        result = dataclasses.replace(result, reasons=(*notes, *result.reasons))
    path = result.save(output, source=source.path if source is not None else None)
    if args.json:
        print(json.dumps({"config": result.config.to_dict(), "confirmed": result.confirmed,
                          "from_cache": result.from_cache, "reasons": list(result.reasons),
                          "trials": [t.to_dict() for t in result.trials],
                          "candidates": list(result.candidates), "output": str(path),
                          "estimate": result.estimate.to_dict()}, indent=2, default=str))
    else:
        print_fit(result, path)
    return EXIT_OK


def _arguments_file(args: argparse.Namespace) -> Any:
    """The ``--training-args`` file, read and checked (None without one); the model and
    dataset it names fill in ``args.model`` / ``args.dataset`` / ``args.tokenizer`` when the
    command line does not give them, with a note each.

    Raises:
        BadInputError: no model or no dataset, from either; a file that cannot be read.
        InvalidArgumentsError: TrainingArguments fields that TrainingArguments would refuse.
    """
    from autofit.errors import BadInputError

    source = None
    if args.training_args:
        from autofit.emit import check_training_arguments
        from autofit.emit.args_file import read_args_file

        source = read_args_file(args.training_args)
        check_training_arguments(source.fields, source=args.training_args)  # all at once
        taken = []
        if args.model is None and source.model:
            args.model = source.model
            taken.append(f"model {source.model}: the file's model_name_or_path")
        if args.dataset is None and source.dataset:
            args.dataset = source.dataset
            taken.append(f"dataset {source.dataset}: the file's {source.dataset_key}")
        elif args.dataset is None and source.mixture:
            args.dataset = source.load_mixture()  # as trl sft loads it
            taken.append(f"dataset: the file's datasets ({_mixture_line(source.mixture)}), "
                         f"{len(args.dataset)} training samples as trl.get_dataset loads them")
        # the script's own lengths: run_clm's block_size, run_ner's max_seq_length, ...
        script = script_lengths(source.keys)
        if getattr(args, "block_size", None) is None and args.max_seq_len is None:
            if script.block_size is not None:
                args.block_size = script.block_size
            args.max_seq_len = script.max_seq_len
            args.pad_to_max_len = script.pad
            if script.note:
                taken.append(script.note)
        tok = source.keys.get("tokenizer_name")
        if args.tokenizer is None and isinstance(tok, str) and tok:
            args.tokenizer = tok
            taken.append(f"tokenizer {tok}: the file's tokenizer_name")
        adapter_given = (args.lora_r is not None or args.lora_alpha is not None
                         or args.lora_target_modules or args.peft_config)
        if source.peft_config is not None and not adapter_given:
            args.peft_config = source.peft_config  # trains as trl.get_peft_config builds it
            taken.append(f"LoRA r={source.peft_config['r']}: the file's use_peft and lora_* "
                         "keys (as TRL builds the adapter)")
        source = dataclasses.replace(source, notes=(*source.notes, *taken))
    if args.model is None:
        raise BadInputError("no model: give MODEL, or a --training-args file with "
                            "model_name_or_path")
    if args.dataset is None:
        raise BadInputError("no dataset: give --dataset, or a --training-args file with "
                            "train_file (transformers' examples) or datasets (trl sft)")
    return source


def _mixture_line(entries: tuple[dict[str, Any], ...]) -> str:
    """A TRL mixture in a few words: ``json train.jsonl; json more.jsonl``."""
    def one(e: dict[str, Any]) -> str:
        files = e.get("data_files")
        files = ", ".join(map(str, files)) if isinstance(files, list) else files
        return " ".join(str(x) for x in (e["path"], files) if x)
    return "; ".join(one(e) for e in entries)


def _fields_of(source: Any) -> Any:
    """The file's TrainingArguments fields as ``autofit(training_args=)`` takes them (an
    SFTConfig's as ``SFTConfigFields``: SFTTrainer and its loss are what runs)."""
    if source is None:
        return None
    from autofit.knobs.trl_loss import SFTConfigFields

    return SFTConfigFields(source.fields) if source.sft else dict(source.fields)


def _output(args: argparse.Namespace, source: Any) -> Path:
    """``-o``; by default ``tuned.yaml``, or beside a ``--training-args`` file as
    ``<name>-tuned<suffix>`` (its format). The arguments file itself only with --in-place.

    Raises:
        BadInputError: ``-o`` names the arguments file without --in-place, or --in-place
            without a file or with another ``-o``.
    """
    from autofit.errors import BadInputError

    if args.in_place:
        if source is None:
            raise BadInputError("--in-place writes into the --training-args file: give one")
        if args.output and not _same(Path(args.output), source.path):
            raise BadInputError("--in-place writes into the --training-args file: drop -o "
                                f"{args.output}")
        return source.path
    if args.output is None:
        if source is None:
            return Path("tuned.yaml")
        return source.path.with_name(f"{source.path.stem}-tuned{source.path.suffix}")
    out = Path(args.output)
    if source is not None and _same(out, source.path):
        raise BadInputError(f"-o {args.output} is your --training-args file: give another -o, "
                            "or --in-place to write the tuned fields into it")
    return out


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
