"""Pre-flight in training pipelines: will this run fit on this machine, start to end?

Before a job spends a GPU hour, check the configuration it is about to run, on the
device it is about to run on: an estimate, then one real micro-step on the
worst-case batch (the longest samples), or the cache when exactly this
configuration was measured before. Then either stop with every reason at once,
or fix it without changing the effective batch::

    import autofit
    from transformers import Trainer

    trainer = Trainer(model=model, args=args, train_dataset=train,
                      callbacks=[autofit.AutofitCallback()])
    report = autofit.preflight(trainer, fix=True)  # may shrink the micro batch, raise accumulation
    trainer.train()                                # the callback checks again (from the cache)

``preflight`` accepts a ``Trainer`` (TRL's ``SFTTrainer`` included: its
``SFTConfig`` is a ``TrainingArguments``), or ``TrainingArguments`` / a dict of
their fields with ``model=`` and ``dataset=``. With ``fix=True`` it changes
``per_device_train_batch_size`` and ``gradient_accumulation_steps`` only (micro x
accumulation x world size stays), and ``per_device_eval_batch_size`` when the
evaluation step would not fit (evaluation does not change training); every change
is logged (logger ``"autofit"``) and listed in ``PreflightReport.changes``.
Otherwise a configuration that does not fit raises ``PreflightError`` listing
every problem.

``AutofitCallback`` runs the same check at ``on_train_begin``. It can verify and
stop, but not fix: ``Trainer`` builds the train dataloader, the step counts and
the optimizer *before* calling ``on_train_begin``, so a batch size changed there
would not reach this run. Fix with ``preflight(trainer, fix=True)`` before
``trainer.train()``; the callback then confirms from the cache with no new trial.

Known limitations:
    NB: the trial runs ``Trainer``'s step (``autofit.trial.step``); extras that a
    subclass adds to ``compute_loss`` (e.g. ``SFTTrainer``'s entropy and token
    accuracy, computed from the logits under ``no_grad``) are not measured.
    NB: a DeepSpeed / FSDP configuration is not changed by ``fix``; its
    ``train_micro_batch_size_per_gpu`` must follow.
    NB: the worst-case batch pads to the longest sample; a collator that pads to a
    fixed length (``padding="max_length"``) needs ``max_seq_len=`` that length.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError
from autofit.knobs import owned_fields
from autofit.knobs.trainer import normalize_trainer, trainer_of
from autofit.knobs.trl_loss import loss_impl_of
from autofit.preflight.verdict import PreflightError, PreflightReport

if TYPE_CHECKING:
    from collections.abc import Mapping

    from transformers import PreTrainedTokenizerBase, Trainer, TrainingArguments

    from autofit.config import Collator, ModelSource
    from autofit.probe.device import DeviceInfo

__all__ = ["preflight", "config_of", "file_config", "trainer_loss", "only_with"]

logger = logging.getLogger("autofit")

# TrainingArguments fields the check reads (SFTConfig / Seq2SeqTrainingArguments add some),
# every knob's own fields included.
_ARG_FIELDS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", *owned_fields(),
    "per_device_eval_batch_size", "eval_strategy", "do_eval", "predict_with_generate",
    "generation_max_length", "max_length", "world_size",
    # what an evaluation keeps for compute_metrics (autofit.preflight.predictions)
    "eval_accumulation_steps", "prediction_loss_only", "batch_eval_metrics",
)


# ---------------------------------------------------------------- reading a run


def _is_trainer(obj: object) -> bool:
    return hasattr(obj, "args") and hasattr(obj, "train") and hasattr(obj, "model")


def _fields(args: TrainingArguments | Mapping[str, object]) -> dict[str, Any]:
    if isinstance(args, dict):
        d = dict(args)
    else:
        d = {}
        for k in _ARG_FIELDS:
            try:
                v = getattr(args, k)
            except (AttributeError, RuntimeError, ValueError):
                continue
            d[k] = getattr(v, "value", v)
    return d


def config_of(args: TrainingArguments | Mapping[str, object]) -> TrainConfig:
    """The ``TrainConfig`` a ``TrainingArguments`` (or a dict of its fields) runs.

    Raises:
        InvalidArgumentsError: a dict with fields TrainingArguments would refuse (unknown
            names, wrong types, bf16 and fp16 both true, ...), every one listed.

    Example:
        >>> config_of({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
        ...            "bf16": True}).effective_batch_size
        8
    """
    from autofit.emit import config_from_arguments

    d = _fields(args)
    # a dict is checked as TrainingArguments would check it (every problem at once; world_size
    # is the one key read here that is not a field); an object its own class built already
    config = config_from_arguments(d, extra=("world_size",) if isinstance(args, dict)
                                   else _ARG_FIELDS)
    ws = d.get("world_size")
    if isinstance(ws, int) and ws > 1:
        config = config.replace(world_size=ws)
    if not isinstance(args, dict) and loss_impl_of(args) == "trl":
        config = config.replace(loss_impl="trl")  # an SFTConfig: SFTTrainer's fused loss
    return config


def trainer_loss(config: TrainConfig, trainer: Trainer,
                 args: TrainingArguments | Mapping[str, object] = None) -> TrainConfig:
    """``config`` with the loss ``trainer`` computes (a ``Trainer`` object, read by its class,
    or a name of ``autofit.knobs.trainer.TRAINERS``): ``autofit.ChunkedLossTrainer``'s chunked
    one; TRL's fused LM head only under ``SFTTrainer`` without a ``compute_loss_func`` (with
    one, SFTTrainer's loss uses the full logits; ``args``: the fields it reads, for a
    TrainingArguments that SFTTrainer turns into an SFTConfig); else the model's own."""
    from autofit.knobs.trl_loss import trl_loss_type

    name = trainer if isinstance(trainer, str) else trainer_of(trainer)
    if name == "autofit":
        return config.replace(chunked_loss=True, loss_impl="model")
    custom = getattr(trainer, "compute_loss_func", None) is not None
    fused = config.loss_impl == "trl" if args is None else trl_loss_type(args, sft=True)
    if name == "trl" and not custom and not config.chunked_loss and fused:
        return config.replace(loss_impl="trl")
    return config.replace(loss_impl="model")


def file_config(fields: dict[str, object], meta: dict[str, object],
                trainer: str | None = None) -> tuple[TrainConfig, str, str | None]:
    """What a configuration file runs under the declared trainer (``trainer``, else the one
    its metadata records, else ``plain``): ``(config, trainer, lost)``. The config holds what
    the fields carry and what that trainer runs; the metadata grants nothing else. ``lost``
    names the trainer the file was tuned for when it ran a lever this one does not (the
    chunked loss, TRL's loss), else None.

    Example:
        >>> meta = {"trainer": "autofit", "config": {"chunked_loss": True}}
        >>> c, t, lost = file_config({"per_device_train_batch_size": 8}, meta, "plain")
        >>> c.chunked_loss, t, lost
        (False, 'plain', 'autofit.ChunkedLossTrainer')
    """
    from autofit.knobs.trainer import CLASS_NAME, Trainer, normalize_trainer, recorded_trainer

    declared = normalize_trainer(trainer) if trainer is not None else recorded_trainer(meta)
    config = config_of(fields)  # the fields' own levers (use_liger_kernel: the chunked loss)
    tuned = meta.get("config") or {}
    if declared == "autofit":  # ChunkedLossTrainer: chunked whenever the tune chose it
        config = config.replace(chunked_loss=bool(tuned.get("chunked_loss")) or config.chunked_loss)
    elif declared == "trl":
        config = trainer_loss(config, "trl", fields)
    lost = None
    if tuned.get("chunked_loss") and not config.chunked_loss:
        lost = CLASS_NAME[Trainer.AUTOFIT]
    elif tuned.get("loss_impl") == "trl" and config.loss_impl != "trl":
        lost = CLASS_NAME[Trainer.TRL]
    return config, declared, lost


def only_with(report: PreflightReport, declared: str, lost: str | None) -> PreflightReport:
    """``report`` of a file checked for ``declared`` where it was tuned for ``lost`` (a trainer
    whose lever ``declared`` does not run): when it does not fit, the first problem says so in
    one line, "fits only with autofit.ChunkedLossTrainer; a plain Trainer needs X (> C)"; when
    it does, a reason says the lever is not needed."""
    import dataclasses

    from autofit.probe.device import format_bytes

    if lost is None:
        return report
    who = "a plain Trainer" if declared == "plain" else {
        "autofit": "autofit.ChunkedLossTrainer", "trl": "trl.SFTTrainer"}[declared]
    if report.fits:
        return dataclasses.replace(report, reasons=(
            *report.reasons, f"tuned for {lost}; fits for {who} as well (checked without it)"))
    t, est = report.trial, report.estimate
    if t is not None and t.fits and t.device_total_bytes is not None:
        need = f"{format_bytes(t.device_total_bytes)} measured"
    elif est is not None:
        need = f"~{format_bytes(est.device_total_bytes)}" + (
            " (out of memory in a trial)" if t is not None and t.oom else "")
    else:
        need = "more (out of memory in a trial)"
    line = (f"fits only with {lost}; {who} needs {need} (> {format_bytes(report.capacity_bytes)} "
            f"on {report.device}): train with {lost}, or tune for {who}")
    return dataclasses.replace(report, problems=(line, *report.problems))


def _eval_settings(d: dict[str, object], eval_dataset: object,
                   generate_max_new_tokens: int | None) -> tuple[int | None, int | None]:
    strategy = str(d.get("eval_strategy") or "no")
    evaluates = eval_dataset is not None or strategy != "no" or bool(d.get("do_eval"))
    batch = int(d["per_device_eval_batch_size"]) if (
        evaluates and d.get("per_device_eval_batch_size")) else None
    gen = generate_max_new_tokens
    if gen is None and d.get("predict_with_generate"):
        gen = d.get("generation_max_length") or None
    return batch, gen


def _apply(target: object, trainer: Trainer, changes: dict[str, tuple[int | None, int | None]]
           ) -> None:
    for name, (_, new) in changes.items():
        if isinstance(target, dict):
            target[name] = new
        else:
            setattr(target, name, new)
    if trainer is not None and "per_device_train_batch_size" in changes:
        # Trainer reads its own copy when it builds the train dataloader (as it does after
        # a hyperparameter-search trial changes the arguments)
        trainer._train_batch_size = trainer.args.train_batch_size


def preflight(
    trainer_or_args: Trainer | TrainingArguments | Mapping[str, object],
    model: ModelSource | None = None,
    dataset: object = None,
    fix: bool = False,
    device: str | DeviceInfo = "auto",
    *,
    seq_len: int | None = None,
    max_seq_len: int | None = None,
    eval_dataset: object = None,
    generate_max_new_tokens: int | None = None,
    margin: float = 0.0,
    trial: bool = True,
    cache: bool | str = True,
    tokenizer: PreTrainedTokenizerBase | None = None,
    collator: Collator | None = None,
    timeout_s: float | None = 600.0,
    raise_on_failure: bool = True,
    block_size: int | None = None,
    trainer: str | None = None,
) -> PreflightReport:
    """Check (and with ``fix=True`` repair) the configuration a training run is about to use.

    Args:
        trainer_or_args: a ``transformers.Trainer`` / ``trl.SFTTrainer`` (its args,
            model, train and eval datasets are used), a ``TrainingArguments`` or a dict
            of its fields.
        model: the model (a module or a reference); default: the trainer's.
        dataset: the training samples; default: the trainer's ``train_dataset``.
        fix: shrink the micro batch (raising accumulation by the same factor) until
            it fits, and the eval batch if evaluation would not fit; applied to the
            arguments (and the trainer) in place.
        device: ``auto`` (the present accelerator, else the CPU), ``cuda:1``,
            ``cpu:8GiB``, ...
        seq_len: tokens of the longest sample, when no dataset is given.
        max_seq_len: truncation length (default: ``SFTConfig.max_length`` if set).
        eval_dataset: evaluation samples (default: the trainer's).
        generate_max_new_tokens: tokens generated per eval sample
            (``predict_with_generate``; default: ``generation_max_length`` then).
        margin: fraction of the capacity that must stay free for "fits" (default 0;
            a fix keeps at least 10%).
        trial: run a confirming trial (else the verdict is the estimate's).
        cache: use and fill the check cache (False, True or an optuna storage URL).
        tokenizer: for a dataset with text instead of ``input_ids``.
        collator: replaces the default pad-to-longest collation of the trial batch.
        timeout_s: wall-clock limit of a trial.
        raise_on_failure: raise ``PreflightError`` when it does not fit (else
            return the report with ``fits=False``).
        block_size: the dataset packed into blocks of this many tokens, as the
            transformers examples' ``group_texts`` (default: an ``SFTConfig`` with
            ``packing=True`` packs into its ``max_length`` by its ``packing_strategy``).
        trainer: what will train, for arguments without a ``Trainer``: ``"plain"``
            (default), ``"autofit"`` (``autofit.ChunkedLossTrainer``: the chunked loss) or
            ``"trl"`` (``trl.SFTTrainer``; the default for an ``SFTConfig``). A ``Trainer``
            is read by its class (ChunkedLossTrainer -> autofit, SFTTrainer -> trl, else
            plain); a different ``trainer=`` is bad input.

    Returns:
        A ``PreflightReport``.

    Raises:
        PreflightError: it does not fit (and could not be fixed); every problem listed.
        AutofitError: bad input (no model, no dataset and no seq_len, ...).

    Example:
        >>> data = [{"input_ids": list(range(1, 65))}] * 8
        >>> r = preflight({"per_device_train_batch_size": 2}, model="tiny-llama",
        ...               dataset=data, device="A100-80GB")
        >>> r.fits, r.trial is None
        (True, True)
    """
    from autofit.preflight.check import run_check

    trainer_name = trainer
    trainer = trainer_or_args if _is_trainer(trainer_or_args) else None
    args = trainer.args if trainer is not None else trainer_or_args
    if args is None or not (isinstance(args, dict) or hasattr(args, "per_device_train_batch_size")):
        raise BadInputError("preflight needs a Trainer, TrainingArguments or a dict of their "
                            f"fields, got {type(trainer_or_args).__name__}")
    given = dataset  # a trainer's own train_dataset is already prepared (packed) by it
    if trainer is not None:
        model = model if model is not None else trainer.model
        dataset = dataset if dataset is not None else getattr(trainer, "train_dataset", None)
        if eval_dataset is None:
            eval_dataset = getattr(trainer, "eval_dataset", None)
    if model is None:
        raise BadInputError("give model= (a module or a reference such as 'tiny-llama')")
    if dataset is None and seq_len is None:
        raise BadInputError("give dataset= (the training samples) or seq_len= (tokens of the "
                            "longest sample)")
    d = _fields(args)
    config = config_of(args)
    from autofit.knobs.recipe import recipe_of_fields

    recipe = recipe_of_fields(d, "the training arguments")  # its deepspeed / fsdp fields
    if recipe is not None:
        config = recipe.apply(config)
    declared = normalize_trainer(trainer_name) if trainer_name is not None else None
    if trainer is not None:
        if declared is not None and declared != trainer_of(trainer):
            raise BadInputError(f"trainer={trainer_name!r}, but the trainer is a "
                                f"{type(trainer).__name__} ({trainer_of(trainer)}): drop "
                                "trainer= (the trainer's class says it)")
        config = trainer_loss(config, trainer, args)
    elif declared is not None:
        config = trainer_loss(config, declared, args)
    # (the chunked loss of a trainer other than ChunkedLossTrainer is liger's: its field)
    runs = trainer_of(trainer) if trainer is not None else declared
    packing = None
    if block_size is None and max_seq_len is None and isinstance(d.get("max_length"), int):
        if d.get("packing") and given is not None:  # SFTTrainer packs into max_length rows
            block_size, packing = d["max_length"], d.get("packing_strategy") or "bfd"
        else:
            max_seq_len = d["max_length"]  # SFTConfig truncates to it
    eval_batch, gen = _eval_settings(d, eval_dataset, generate_max_new_tokens)
    eval_seq = None
    if eval_batch and eval_dataset is not None:
        from autofit.probe.data import probe_data

        eval_seq = probe_data(eval_dataset, max_seq_len=max_seq_len,
                              tokenizer=tokenizer).length_max
    report = run_check(model, config, seq_len=seq_len, dataset=dataset, device=device,
                       margin=margin, trial=trial, cache=cache, eval_batch_size=eval_batch,
                       eval_seq_len=eval_seq, generate_max_new_tokens=gen, fix=fix,
                       max_seq_len=max_seq_len, tokenizer=tokenizer, collator=collator,
                       timeout_s=timeout_s, block_size=block_size, packing=packing,
                       recipe=recipe, liger_loss=config.chunked_loss and runs != "autofit")
    from autofit.preflight.predictions import with_kept_predictions

    report, more = with_kept_predictions(report, trainer, d, eval_dataset, eval_seq, fix=fix,
                                         margin=margin)
    if more:
        import dataclasses

        report = dataclasses.replace(report, changes={**report.changes, **more})
    if report.changes:
        _apply(args, trainer, report.changes)
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in report.changes.items())
        why = "; ".join(r for r in report.reasons if r.startswith("fixed:"))
        logger.warning("pre-flight changed %s (effective batch %d kept): %s", what,
                       report.config.effective_batch_size, why)
    if report.fits:
        logger.info("pre-flight: %s", report.reasons[-1] if report.reasons else "fits")
    elif raise_on_failure:
        raise PreflightError(report)
    return report
