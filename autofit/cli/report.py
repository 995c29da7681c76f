"""``autofit report``: a configuration file's memory breakdown (and a tuned file's candidates)
as a PNG chart and a self-contained HTML page.

    autofit report tuned.yaml                     # tuned.png + tuned.html beside it
    autofit report train_args.yaml --model ./my-model --dataset train.jsonl --device A100-80GB

``--trainer`` (default: the trainer the file records, else ``plain``) is what will train
it: a file tuned for ``autofit.ChunkedLossTrainer`` reported as ``plain`` is estimated with the
full logits (the metadata grants no lever the fields do not carry), and exits 3 with "fits
only with autofit.ChunkedLossTrainer" when that does not fit.

A file ``autofit tune`` wrote is drawn from its metadata (the chosen
configuration's breakdown, the candidates and the trials). A plain
TrainingArguments file (or a tuned one with ``--model/--dataset/--seq-len/--device``
overriding what it says) is estimated for that model, longest sample and device,
as ``autofit check`` reads it: the breakdown against the device's capacity. A mixed
arguments file (a script's model and data keys beside the fields) is read as ``check``
reads it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autofit.cli.options import (
    EXIT_DOES_NOT_FIT,
    EXIT_OK,
    add_file_subject_options,
    add_trainer_option,
    file_subject,
)

__all__ = ["add_report_parser", "run_report_command"]


def add_report_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``report`` sub-command to an argparse ``subparsers`` object."""
    from autofit.api import METHODS

    p = subparsers.add_parser(
        "report",
        help="draw a configuration file's memory breakdown and candidates (PNG + HTML)",
        description="Write <name>.png and a self-contained <name>.html beside a configuration "
        "file: the configuration's memory by component against the capacity, and for a tuned "
        "file the candidates tried (micro batch vs peak and vs throughput, OOMs marked). A "
        "plain TrainingArguments file needs --model and --dataset or --seq-len.",
    )
    p.add_argument("config", help="a file written by autofit tune -o / FitResult.save, or a "
                   "TrainingArguments YAML/JSON with --model")
    add_file_subject_options(p)
    add_trainer_option(p, "the trainer the file records, else plain")
    p.add_argument("--method", choices=list(METHODS), default="analytic",
                   help="how a plain file's configuration is estimated")
    p.add_argument("-o", "--output", default=None,
                   help="where to write (its stem names both files; default: beside the file)")
    p.set_defaults(func=run_report_command)
    return p


def _overrides(args: argparse.Namespace) -> bool:
    return any(getattr(args, n) is not None for n in ("model", "dataset", "seq_len", "device",
                                                       "max_seq_len", "task", "block_size"))


def _estimated(args: argparse.Namespace, fields: dict[str, object], meta: dict[str, object],
               config: Any, source: Any = None, liger_loss: bool = False,
               sft: bool = False) -> Any:
    """ReportData of the file's configuration (``config``: as the declared trainer runs the
    fields), estimated for the model, data and device. ``liger_loss``: the chunked loss in
    ``config`` is liger's (``use_liger_kernel``), which runs only on a model liger patches.
    ``sft``: SFTTrainer runs it, and prepares the data as the fields say (EOS, max_length,
    packing)."""
    from autofit.api import estimate
    from autofit.report.files import ReportData

    s = file_subject(args, meta, source)
    seq_len, reasons = s.seq_len, [*s.notes, s.device_reason]
    if s.dataset is not None:
        from autofit.probe.data import probe_data
        from autofit.probe.packing import as_script_sees

        # SFTTrainer truncates at the SFTConfig's max_length (recorded as max_seq_len)
        max_seq = s.max_seq_len if not sft or args.max_seq_len else None
        seen = as_script_sees(s.dataset, block_size=s.block_size, max_seq_len=max_seq,
                              packing=s.packing, sft=fields if sft else None,
                              tokenizer=s.tokenizer)
        reasons += seen.reasons
        data = probe_data(seen.dataset, max_seq_len=seen.max_seq_len, tokenizer=s.tokenizer)
        seq_len = data.length_max
        reasons.append(f"sequence length {seq_len}: the longest sample (p50 {data.length_p50})")
    else:
        reasons.append(f"sequence length {seq_len}: {s.seq_len_source}")
    config = config.replace(seq_len=seq_len)
    if (liger_loss and config.chunked_loss) or config.liger_kernels:
        from autofit.knobs.liger import liger_as_run
        from autofit.probe.model import build_model

        module, _ = build_model(s.model, task=s.task)  # (on the meta device; cached)
        config, why = liger_as_run(config, module, str(s.model), liger_loss=liger_loss)
        reasons += [why] if why else []
    est = estimate(s.model, config, seq_len=seq_len, device=s.device, method=args.method,
                   task=s.task)
    reasons.append(f"{est.method} estimate of the file's configuration; no trial "
                   "(autofit check runs one)")
    return ReportData(model=str(s.model), device=est.device, estimate=est,
                      config=config.to_dict(), training_arguments=fields, seq_len=seq_len,
                      reasons=tuple(reasons),
                      eval_micro_batch=fields.get("per_device_eval_batch_size"))


def report_output(output: str | None, config: str) -> Path:
    """Where ``autofit report`` writes (``-o``, else beside the file), checked before any work.

    Raises:
        BadInputError: the ``.png`` or ``.html`` cannot be written there (``-o`` a folder,
            a read-only folder or file); one line naming what to give instead.
    """
    from autofit.emit import check_output

    out = Path(output) if output else Path(config)
    return check_output(out, writes=[out.with_suffix(".png"), out.with_suffix(".html")],
                        name="-o" if output else "the report of",
                        fix="choose another path" if output else
                        "give -o where to write it (e.g. -o /tmp/report.html)")


def run_report_command(args: argparse.Namespace) -> int:
    """Run ``autofit report``; returns the exit code."""
    from rich.console import Console

    from autofit.emit import check_training_arguments
    from autofit.emit.args_file import read_args_file
    from autofit.errors import require
    from autofit.preflight.trainer import file_config
    from autofit.report import estimate_renderable
    from autofit.report.files import report_data_from_file, write_report

    require("matplotlib", "autofit report (its picture)")  # before any work
    source = read_args_file(args.config)  # a mixed file: its other keys are the script's
    fields, meta = source.fields, source.meta
    out = report_output(args.output, args.config)
    check_training_arguments(fields, source=args.config)  # every problem at once, exit 2
    # what the declared trainer runs from the fields: the metadata grants no other lever
    declared = args.trainer or ("trl" if source.sft and not meta.get("trainer") else None)
    config, trainer, lost = file_config(fields, meta, declared)
    if meta.get("estimate") and meta.get("config") and not _overrides(args) and lost is None:
        data = report_data_from_file(args.config)
    else:  # the file's notes first (a tuned file's metadata holds them already)
        from dataclasses import replace

        data = _estimated(args, fields, meta, config, source,
                          liger_loss=trainer != "autofit", sft=trainer == "trl")
        data = replace(data, reasons=(*source.notes, *data.reasons))
    png, page = write_report(data, out)
    console = Console()
    console.print(estimate_renderable(data.estimate))
    for r in data.reasons:
        console.print(f"  • {r}")
    console.print(f"wrote {png} and {page}")
    if lost is not None and not data.estimate.fits:
        from autofit.probe.device import format_bytes

        who = "a plain Trainer" if trainer == "plain" else f"trainer {trainer}"
        console.print(f"[red]✗ fits only with {lost}; {who} needs "
                      f"~{format_bytes(data.estimate.device_total_bytes)} (> "
                      f"{format_bytes(data.estimate.capacity_bytes)} on {data.device})[/red]")
        return EXIT_DOES_NOT_FIT
    return EXIT_OK
