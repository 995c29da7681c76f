"""The public functions: ``estimate`` and ``autofit``, each a short pipeline of named stages.

    >>> from autofit import estimate, TrainConfig
    >>> est = estimate("tiny-llama", TrainConfig(micro_batch_size=4), seq_len=512, device="cpu")
    >>> sorted(est.breakdown)
    ['activations', 'gradients', 'optimizer_states', 'overhead', 'temporaries', 'weights']

Both build the request once, validated, from their keywords: the model's ``ModelSpec``
(``autofit.trial.model.model_spec``) and, for ``autofit``, the search's ``TuneOptions``
(``autofit.stages.options``). ``autofit()`` runs the flow of docs/design.md one stage
after another, each a function (here or in ``autofit.stages``) that takes what the
earlier ones made, returns a new value and never writes into its inputs:

    script_data -> probe -> _space -> _estimator -> _margin -> _trial_runner -> _study
    -> _search -> fit_result
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.config import ModelSpec, TrainConfig, one_process_strategy
from autofit.errors import BadInputError, fix
from autofit.knobs import KNOBS, registry
from autofit.knobs.base import Scope, asks_on
from autofit.knobs.chunked_loss import liger_offered
from autofit.knobs.compile import compile_asked, compile_recipe
from autofit.knobs.trainer import (
    chunked_loss_refused,
    for_trainer,
    implied_trainer,
    normalize_trainer,
    runs_chunked_loss,
)
from autofit.knobs.trl_loss import is_sft_config, loss_impl_of, trl_loss_type
from autofit.memory.breakdown import MemoryEstimate
from autofit.probe.device import DeviceInfo, resolve_device
from autofit.probe.quant import check_precision
from autofit.stages.options import (
    METHODS,
    MODEL_OPTIONS,
    TuneOptions,
    check_method,
    fix_recipe,
    guard_evidence,
)
from autofit.stages.probed import Probed, probe, script_data
from autofit.stages.run import WholeRun, eval_working_set, trial_run

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from autofit.config import Collator, ModelSource
    from autofit.knobs.recipe import Recipe
    from autofit.memory.ranks import Layout
    from autofit.memory.simulate import Simulator
    from autofit.probe.data import DataInfo
    from autofit.probe.model import ModelInfo
    from autofit.probe.packing import ScriptData
    from autofit.search.engine import Engine, SearchOutcome
    from autofit.search.margin import RunMargin
    from autofit.search.space import SearchSpace
    from autofit.search.study import TrialRecorder

__all__ = ["estimate", "autofit", "METHODS"]


def estimate(
    model: ModelSource,
    config: TrainConfig | None = None,
    *,
    seq_len: int | None = None,
    device: str | DeviceInfo = "auto",
    method: str = "analytic",
    task: str | None = None,
    attn_implementation: str | None = None,
    lora: Any = None,
    peft_config: Any = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    quantization_config: Any = None,
    dataset: object = None,
    max_seq_len: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    epochs: float = 1.0,
    seed: int = 42,
    sampling: str = "random",
    eval_steps: int | None = None,
    eval_batch_size: int | None = None,
    save_steps: int | None = None,
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    strategy: str | None = None,
    offload: str | None = None,
    sharding: Any = None,
    block_size: int | None = None,
    deepspeed_config: Any = None,
    accelerate_config: Any = None,
    trainer: str | None = None,
) -> MemoryEstimate:
    """Estimate the device memory of one training step (and, with a dataset, of the run).

    Args:
        model: an ``nn.Module`` / ``PreTrainedModel`` / ``PeftModel``, a hub id, a
            local model directory, a ``config.json`` path or a bundled name.
        config: the training configuration (default ``TrainConfig()``).
        seq_len: tokens per sample of the worst-case batch (default ``config.seq_len``).
        device: ``"cpu"``, ``"cpu:8GiB"``, ``"cuda"``, ``"cuda:1"`` or a catalog
            name such as ``"H100-80GB"``.
        method: ``"analytic"`` (closed form, microseconds) or ``"simulate"``
            (the real step on fake tensors, replayed through an allocator model).
        task: ``causal-lm``, ``masked-lm``, ``seq2seq``, ``seq-cls`` or ``token-cls`` (default:
            from the model's config).
        attn_implementation: ``"eager"`` or ``"sdpa"`` for a model built by name.
        lora: a ``LoraSpec``, a dict of its fields or a ``peft.LoraConfig``, for a
            model built by name.
        peft_config: any PEFT method, for a model built by name: a ``peft.PeftConfig``,
            a dict as in ``adapter_config.json`` (with ``peft_type``), or a path to
            such a file (``autofit.probe.peft``); not together with ``lora``.
        load_in_4bit: a 4-bit base (bitsandbytes, QLoRA's nf4 computing in bfloat16),
            for a model given by reference.
        load_in_8bit: an 8-bit base (bitsandbytes' LLM.int8, float32).
        quantization_config: how the base is quantized, in detail: a
            ``transformers.BitsAndBytesConfig``, a dict as in a config.json's
            ``quantization_config``, or a path to such a JSON file
            (``autofit.probe.quant``). The base is loaded in its compute dtype.
        dataset: the training samples: the step is the longest batch's (``seq_len``
            defaults to the longest sample), and the whole run — its micro batches in
            the Trainer's order (``epochs``, ``seed``, ``sampling``:
            ``train_sampling_strategy``), replayed through the allocator model
            (``autofit.memory.run``) — fills ``run_peak_reserved_bytes`` and
            ``run_device_total_bytes``.
        max_seq_len: truncation length of the dataset's samples.
        tokenizer: for a dataset of text.
        eval_steps, eval_batch_size: the run evaluates every ``eval_steps`` optimizer
            steps with ``eval_batch_size`` samples at the longest length (with a dataset;
            an interval longer than the run evaluates once, at its end).
        save_steps: the run saves a checkpoint every ``save_steps`` optimizer steps (to
            the host: no device memory on a GPU).
        nproc_per_node, nnodes, strategy, offload: several processes (override the
            config's fields): every rank is estimated (``per_rank``), the top-level figures
            are those of the rank that peaks, ``host_bytes`` is a node's host memory
            (``autofit.memory.ranks``).
        block_size: pack the dataset into blocks of this many tokens as the transformers
            examples' ``group_texts`` does (``autofit.probe.packing``): every sample
            ``block_size`` long.
        sharding: how the ranks run beyond the config: a dict of
            ``autofit.memory.ranks.Layout`` fields, e.g. ``{"fsdp_recipe": "torch",
            "zero_optimizer": "deepspeed"}`` (default: what the Trainer runs).
        deepspeed_config, accelerate_config: the user's launch recipe (a path, or a dict:
            ``ds_config.json``, an accelerate config YAML; ``autofit.knobs.recipe``): its
            strategy, offload, sizes, precision, DeepSpeed optimizer and ranks are what is
            estimated (they override the config's; its batch numbers must agree with it).
        trainer: what runs the step: ``"plain"`` (``transformers.Trainer``), ``"autofit"``
            (``autofit.ChunkedLossTrainer``: the only one with ``chunked_loss``) or
            ``"trl"`` (``trl.SFTTrainer``: TRL's loss); default: the one ``config`` implies.

    Returns:
        A ``MemoryEstimate``.

    Raises:
        AutofitError: on bad input (unknown model, device, precision; no
            trainable parameter; missing bitsandbytes ...), with what to do.

    Example:
        >>> est = estimate("tiny-gpt2", TrainConfig(micro_batch_size=2, precision="bf16-mixed"),
        ...                seq_len=256, device="A100-80GB")
        >>> est.fits
        True
    """
    from autofit.trial.model import model_spec

    config, recipe, layout = _launch(config, trainer, sharding, deepspeed_config,
                                     accelerate_config, nproc_per_node=nproc_per_node,
                                     nnodes=nnodes, strategy=strategy, offload=offload)
    check_method(method)
    seen, data = _estimate_data(dataset, block_size, max_seq_len, tokenizer)
    seq = _step_length(seq_len, config, data, seed)
    dev = _estimate_device(device, config)
    spec = model_spec(model, task=task, attn_implementation=attn_implementation, lora=lora,
                      peft_config=peft_config, load_in_4bit=load_in_4bit,
                      load_in_8bit=load_in_8bit, quantization_config=quantization_config,
                      device=dev)
    module, info = _estimate_model(spec, config, data, block_size)
    sim = None
    if method == "simulate" or data is not None:
        from autofit.memory.simulate import Simulator

        sim = Simulator(module, task=info.task, device=dev, model_name=info.name,
                        sharding=recipe.layout_fields if recipe is not None else None)
    est = _step_estimate(info, config, seq, dev, method, layout, sim)
    if recipe is not None:
        est = dataclasses.replace(est, notes=(*est.notes, *recipe.lines(config.world_size)))
    if data is None:
        return est
    return _run_estimate(est, sim, info, config, seq, dev, data, seen, epochs=epochs, seed=seed,
                         sampling=sampling, eval_steps=eval_steps,
                         eval_batch_size=eval_batch_size, save_steps=save_steps)


def _launch(config: TrainConfig | None, trainer: str | None, sharding: Any,
            deepspeed_config: Any, accelerate_config: Any,
            **ranks: int | str | None) -> tuple[TrainConfig, Recipe | None, Layout | None]:
    """``estimate``'s step 1: the configuration as launched (the ranks given, the user's
    recipe applied, checked against the trainer), the recipe (or None) and the ranks'
    ``Layout`` when they run otherwise than the Trainer does (or None)."""
    config = config if config is not None else TrainConfig()
    if not isinstance(config, TrainConfig):
        raise BadInputError(f"config must be a TrainConfig, got {type(config).__name__}")
    config = _with_ranks(config, **ranks)
    recipe = _recipe(deepspeed_config, accelerate_config)
    if recipe is not None:
        config = recipe.apply(config)
        sharding = {**recipe.layout_fields, **(sharding or {})}
    config, _ = for_trainer(config, trainer)  # a lever the trainer does not run: bad input
    return config, recipe, _layout(config, sharding)


def _estimate_data(dataset: object, block_size: int | None, max_seq_len: int | None,
                   tokenizer: PreTrainedTokenizerBase | None
                   ) -> tuple[ScriptData | None, DataInfo | None]:
    """``estimate``'s step 2: the samples as the script sees them (``ScriptData``) and their
    lengths (``DataInfo``); (None, None) without a dataset."""
    if dataset is None:
        if block_size is not None:
            raise BadInputError(fix("--block-size", "block_size=") + " packs a dataset: give "
                                + fix("--dataset", "dataset=") + " too")
        return None, None
    from autofit.probe.data import probe_data
    from autofit.probe.packing import as_script_sees

    seen = as_script_sees(dataset, block_size=block_size, max_seq_len=max_seq_len,
                          tokenizer=tokenizer)
    return seen, probe_data(seen.dataset, max_seq_len=seen.max_seq_len, tokenizer=tokenizer)


def _step_length(seq_len: int | None, config: TrainConfig, data: DataInfo | None, seed: int) -> int:
    """``estimate``'s step 3: the tokens per sample of the worst-case step (given, the
    config's, else the longest sample); ``seed`` checked with it, with or without data."""
    seq = seq_len if seq_len is not None else config.seq_len
    if seq is None and data is not None:
        seq = data.length_max  # the longest batch: the worst step
    if seq is None:
        raise BadInputError("give " + fix("--seq-len (tokens per sample), e.g. --seq-len 1024",
                                          "seq_len (tokens per sample), e.g. seq_len=1024")
                            + fix(" or --dataset", " or dataset="))
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise BadInputError(f"seq_len must be a positive integer, got {seq!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadInputError(f"seed must be a whole number (TrainingArguments.seed), got {seed!r}")
    return seq


def _estimate_device(device: str | DeviceInfo, config: TrainConfig) -> DeviceInfo:
    """``estimate``'s step 4: the device, checked against the ranks and every knob's value
    (an estimate runs nothing: ``run=False``)."""
    dev = resolve_device(device)
    if config.world_size > 1:
        from autofit.probe.device import check_ranks_per_node

        check_ranks_per_node(config.nproc_per_node, dev, "nproc_per_node")
    for k in KNOBS:
        k.check(dev, getattr(config, k.name), run=False)
    return dev


def _estimate_model(spec: ModelSpec, config: TrainConfig, data: DataInfo | None,
                    block_size: int | None) -> tuple[Any, Any]:
    """``estimate``'s step 5: the model built on the meta device and described
    (``ModelInfo``), checked against the data, the block size, the chunked loss and the
    precision."""
    from autofit.probe.model import build_model, describe

    module, task = build_model(spec.ref, task=spec.task,
                               attn_implementation=spec.attn_implementation, lora=spec.lora,
                               quantization_config=spec.quant)
    check_positions(data, module)
    if block_size is not None:
        from autofit.probe.model import token_limits
        from autofit.probe.packing import check_block_size

        check_block_size(block_size, max_positions=token_limits(module)[1])
    registry.check_model(config, module, task)
    name = spec.ref if isinstance(spec.ref, str) else None
    info = describe(module, task=task, name=str(name) if name else None)
    check_precision(info.quant, info.dtype, config.precision)
    return module, info


def _step_estimate(info: ModelInfo, config: TrainConfig, seq: int, dev: DeviceInfo, method: str,
                   layout: Layout | None, sim: Simulator | None) -> MemoryEstimate:
    """``estimate``'s step 6: one step's estimate, by the closed form or the simulator, for
    one process or every rank of ``layout``."""
    from autofit.memory.ranks import estimate_analytic

    if layout is not None:  # several ranks launched otherwise than the Trainer does
        from autofit.memory.ranks import estimate_ranks_analytic
        from autofit.memory.simulate import simulate_ranks

        return (simulate_ranks(sim, config, seq, layout).estimate if method == "simulate"
                else estimate_ranks_analytic(info, config, seq, dev, layout))
    return (sim.simulate(config, seq_len=seq) if method == "simulate"
            else estimate_analytic(info, config, seq, dev))


def _run_estimate(est: MemoryEstimate, sim: Simulator | None, info: ModelInfo,
                  config: TrainConfig, seq: int, dev: DeviceInfo, data: DataInfo,
                  seen: ScriptData, *, epochs: float, seed: int, sampling: str,
                  eval_steps: int | None, eval_batch_size: int | None,
                  save_steps: int | None) -> MemoryEstimate:
    """``estimate``'s step 7, with a dataset: ``est`` with the whole run's need (its
    evaluations and saves checked, then ``_with_run``) and how the samples were packed."""
    if (eval_steps is None) != (eval_batch_size is None):
        raise BadInputError("give " + fix("--eval-steps and --eval-batch-size",
                                          "eval_steps and eval_batch_size") + " together")
    for name, v in (("eval_steps", eval_steps), ("eval_batch_size", eval_batch_size),
                    ("save_steps", save_steps)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BadInputError(f"{name} must be a positive integer, got {v!r}")
    eval_bytes = eval_working_set(info, config, seq, dev, eval_batch_size, None)
    est = _with_run(est, sim, config, data, epochs=epochs, seed=seed, sampling=sampling,
                    max_seq_len=seen.max_seq_len, eval_steps=eval_steps, eval_bytes=eval_bytes,
                    save_steps=save_steps)
    if seen.reasons:
        est = dataclasses.replace(est, notes=(*seen.reasons, *est.notes))
    return est


def autofit(
    model: ModelSource,
    dataset: object,
    *,
    device: str | DeviceInfo = "auto",
    target_batch_size: int | None = None,
    max_seq_len: int | None = None,
    margin: float | None = None,
    objective: str = "throughput",
    time_budget_s: float | None = None,
    **constraints: object,
):
    """The fastest training configuration of ``model`` on ``device`` that fits for the whole run.

    Estimates every candidate (each knob's values x micro batch: precision,
    checkpointing, optimizer, ...), ranks them by predicted throughput, confirms
    the best few with real micro-steps on the worst-case batch of ``dataset``, and
    returns the fastest measured one.

    Args:
        model: as for ``estimate`` (a module, a hub id, a directory, a config).
        dataset: a ``datasets.Dataset`` (tokenized, or text + ``tokenizer=``), a
            torch ``Dataset`` or a list of dicts with ``input_ids``.
        device: ``auto``, ``cpu``, ``cpu:4GiB``, ``cuda``, ``cuda:N`` or a catalog card
            (planned from the estimate alone when the card is not present).
        target_batch_size: the effective batch to keep (micro x accumulation x
            devices); default: a user's ``training_args=`` batch, else none.
        max_seq_len: truncation length of the samples.
        margin: fraction of the capacity kept free above the measured peak (default:
            what the run replayed in the Trainer's order needs above its longest step
            — 0 on the CPU — + a 3% safety, ``autofit.search.margin``; the reasons
            say how much and why).
        objective: ``"throughput"`` (the only one so far).
        time_budget_s: stop starting trials after this long; the best confirmed
            candidate so far is returned.
        **constraints: one keyword per knob restricts it (``precision=[...]``,
            ``optimizer=[...]``, ``gradient_checkpointing=False``); and
            ``max_micro_batch=``, ``training_args=`` (a ``TrainingArguments``, only
            the tuned fields change), ``method=`` (``analytic``; ``simulate``: on a
            device that is not here, the best candidates are bracketed by simulating
            their step instead of planning from the closed form; on one that is, the
            simulated step is the estimate the trials start from), ``tokenizer=``,
            ``collator=``, ``task=``, ``cache=`` (False, True or a storage URL),
            ``confirm_top=``, ``max_trials=``, ``progress=``, ``isolation=``,
            ``trial_timeout_s=``, ``generate_max_new_tokens=`` (eval by generation:
            sizes the eval batch's KV cache), ``block_size=`` (the samples packed into
            blocks of that many tokens as the transformers examples' ``group_texts``
            does, ``autofit.probe.packing``).
            An ``SFTConfig`` as ``training_args`` brings its ``max_length`` (truncation)
            and ``packing``: the lengths SFTTrainer produces are planned for.
            ``trainer=`` (what will run the file:
            ``"plain"``, a ``transformers.Trainer``, the default; ``"autofit"``,
            ``autofit.ChunkedLossTrainer``, the only one that runs the chunked loss;
            ``"trl"``, ``trl.SFTTrainer``, implied by an ``SFTConfig``; ``chunked_loss=True``
            alone implies ``"autofit"``. ``autofit.knobs.trainer``).
            ``guard_record=`` (the rescues ``autofit.guard`` wrote in a run of the
            previous tuned file, ``<name>-guard.jsonl``: a training micro step of b
            samples that ran out of memory in the real run; micro batches of b and more
            are not tried. ``autofit tune -o FILE`` reads the one beside FILE).

    Returns:
        A ``FitResult``.

    Raises:
        DoesNotFitError: nothing fits; the message says what would (LoRA, QLoRA, a
            knob value that changes the math, or a shorter sequence), with the
            estimated numbers.
        AutofitError: bad input, with what to do.

    Example:
        >>> from autofit import autofit
        >>> data = [{"input_ids": list(range(1, 65))}] * 16
        >>> r = autofit("tiny-llama", data, device="A100-80GB", target_batch_size=16)
        >>> r.config.effective_batch_size, r.confirmed
        (16, False)
    """
    import time

    from autofit.stages.result import fit_result, result_from_cache, simulator_of
    from autofit.trial.model import model_spec

    started_at = time.monotonic()
    options = TuneOptions.of(constraints, objective, target_batch_size=target_batch_size,
                             max_seq_len=max_seq_len, margin=margin, time_budget_s=time_budget_s)
    # bad model keywords (two adapters, a conflicting quantization): before anything is built
    spec = model_spec(model, **{k: constraints[k] for k in MODEL_OPTIONS if k in constraints})
    reasons: list[str] = []
    options = fix_recipe(options, reasons)  # the user's launch recipe: kept, not searched
    options = guard_evidence(options, reasons)  # a guarded run's rescues: what it needed
    progress = _progress_printer(options.progress)
    seen = script_data(dataset, max_seq_len, options, reasons)
    probed = probe(spec, seen, device, options, reasons, warm_trials=True)
    scope = _space(probed, target_batch_size, options, reasons)
    whole = WholeRun(probed, scope.base_args, options)
    estimator = _estimator(probed, options, progress, reasons, whole)
    kept = _margin(probed, scope.space, estimator, margin, whole, progress)
    runner = _trial_runner(probed, options, estimator, reasons, kept, whole)
    recorder, key = _study(probed, scope.space, kept.fraction, objective, runner, options)
    cached = recorder.cached_result() if recorder is not None else None
    if cached is not None:
        return result_from_cache(cached, recorder, probed, scope.base_args, scope.trainer,
                                 simulator_of(probed, runner, options))
    outcome, engine = _search(probed, scope.space, estimator, runner, recorder, options,
                              margin=kept.fraction, time_budget_s=time_budget_s,
                              add_fragmentation=margin is None,  # the default margin reports it
                              started_at=started_at, progress=progress)
    return fit_result(probed, scope.space, engine, outcome, runner, recorder, key, whole, kept,
                      scope.trainer, reasons)


@dataclass(frozen=True)
class _Scope:
    """What stage 2 decided the search may try: the space, the user's TrainingArguments
    fields to keep (or None) and the trainer that will run the file
    (``autofit.knobs.trainer``)."""

    space: Any  # autofit.search.SearchSpace
    base_args: dict[str, Any] | None
    trainer: str


def _space(probed: Probed, target_batch_size: int | None, options: TuneOptions,
           reasons: list[str]) -> _Scope:
    """Stage 2: the search space (each knob's values, the micro batches that keep the target),
    the user's TrainingArguments fields to keep, if given, and the trainer."""
    from autofit.search import build_space

    dev = probed.device
    world_size = dev.nproc_per_node * dev.nnodes
    training_args = options.training_args
    base_args = _base_args(training_args, reasons)
    if base_args is not None and target_batch_size is None:
        target_batch_size = (int(base_args.get("per_device_train_batch_size", 8))
                             * int(base_args.get("gradient_accumulation_steps", 1)) * world_size)
        reasons.append(f"target batch {target_batch_size}: from training_args "
                       "(per-device batch × accumulation × devices)")
    max_micro = int(options.max_micro_batch)
    if target_batch_size is None:  # no target: more samples than the dataset has gain nothing
        max_micro = min(max_micro, max(probed.data.num_samples, 1))
    allowed = {k.name: options.asked(k.name) for k in KNOBS}
    if allowed.get("precision") is None:
        allowed["precision"] = _quantized_precisions(probed, reasons)
    if allowed.get("torch_compile") is None:
        allowed["torch_compile"] = compile_asked(base_args, reasons)
    trainer, loss_impl = _trainer(options.trainer, training_args, base_args, allowed, dev,
                                  loss_impl_of(training_args), reasons)
    allowed = registry.narrow(allowed, Scope(probed.module, probed.task, dev, trainer,
                                             loss_impl, training_args, reasons))
    # the user's compile mode and regional compilation, for the compiled candidates
    mode, regional = compile_recipe(base_args, options.recipe, reasons)
    space = build_space(probed.device, max_micro_batch=max_micro,
                        target_batch_size=target_batch_size, world_size=world_size,
                        nnodes=dev.nnodes, optim_args=options.optim_args, reasons=reasons,
                        loss_impl=loss_impl, compile_mode=mode,
                        compile_regional=bool(regional),
                        **allowed)
    return _Scope(space, base_args, trainer)


def _base_args(training_args: Any, reasons: list[str]) -> dict[str, Any] | None:
    """The user's TrainingArguments fields to keep (its secrets dropped), or None."""
    if training_args is None:
        return None
    from autofit.emit.secrets import NOT_SECRET, drop_secrets

    if hasattr(training_args, "to_dict"):  # a TrainingArguments: already valid
        base_args = training_args.to_dict()
        if is_sft_config(training_args):  # to_dict masks every *_token field: these are
            for k in NOT_SECRET:  # SFTConfig's tokens, not secrets
                if hasattr(training_args, k):
                    base_args[k] = getattr(training_args, k)
        real = {k: getattr(training_args, k, None) for k in base_args}
    else:  # a dict of its fields: what TrainingArguments would refuse, all at once
        from autofit.emit.validate import check_training_arguments

        check_training_arguments(training_args, source="training_args")
        base_args, real = dict(training_args), None
    reasons += drop_secrets(base_args, real)  # never written, masked or not
    from autofit.knobs.checkpointing import every_n_layers_note

    reasons += every_n_layers_note(base_args)
    return base_args


def _quantized_precisions(probed: Probed, reasons: list[str]) -> list[str] | None:
    """The precisions a bitsandbytes base allows when none was asked (it is never cast and
    autocasts only to its own 16-bit dtype), or None: the knob's defaults."""
    info = getattr(probed, "info", None)
    if getattr(info, "quant", None) is None:
        return None
    from autofit.errors import AutofitError
    from autofit.knobs import PRECISION

    values, _ = PRECISION.defaults(probed.device)
    ok = []
    for v in values:
        try:
            check_precision(info.quant, info.dtype, v)
            ok.append(v)
        except AutofitError:
            pass
    if ok == list(values):
        return None
    reasons.append(f"precision: {', '.join(ok)} searched (the base is quantized in "
                   f"{info.dtype}: never cast, autocast only to its own dtype)")
    return ok


def _trainer(given: str | None, training_args: Any, base_args: dict[str, object] | None,
             allowed: Mapping[str, object], dev: DeviceInfo, loss_impl: str,
             reasons: list[str]) -> tuple[str, str]:
    """The trainer that will run the file and the loss it computes (``loss_impl``). Given
    (``trainer=``) or implied: ``trl`` for an SFTConfig, ``autofit`` when the chunked loss
    is asked for, else ``plain``."""
    asked = allowed.get("chunked_loss")
    wants = asks_on(asked)
    sft = is_sft_config(training_args)
    if given is None:
        trainer = implied_trainer(chunked_loss=wants, sft=sft)
        if trainer == "autofit":
            reasons.append("trainer autofit.ChunkedLossTrainer: implied by "
                           + fix("--chunked-loss", "chunked_loss=True")
                           + " (a plain transformers.Trainer does not run the chunked loss)")
    else:
        trainer = normalize_trainer(given)
        if wants and not runs_chunked_loss(trainer) and not (
                trainer == "plain" and liger_offered({"use_cpu": dev.kind == "cpu"})):
            raise BadInputError(chunked_loss_refused(trainer))
    if trainer != "trl":
        loss_impl = "model"
    elif not sft:  # TrainingArguments handed to SFTTrainer: SFTConfig's defaults
        loss_impl = "trl" if trl_loss_type(base_args or {}, sft=True) else "model"
    return trainer, loss_impl


@dataclass(frozen=True)
class _Estimator:
    """How the search asks "how much memory?" and "how fast?" of a configuration."""

    total: Callable[[TrainConfig], int]  # device total bytes
    speed: Callable[[TrainConfig], float]  # predicted tokens/s


def _estimator(probed: Probed, options: TuneOptions, progress: Callable[[str], None] | None,
               reasons: list[str], whole: WholeRun) -> _Estimator:
    """Stage 3: the closed form, or on a present device with ``method='simulate'`` the
    simulated step's peak line per combination; on a CPU, + what the run's other lengths
    leave of oneDNN's 16-bit kernels (``WholeRun.half_growth``)."""
    from autofit.memory.ranks import estimate_analytic
    from autofit.search.speed import predict_speed

    info, dev, seq = probed.info, probed.device, probed.seq_len

    def speed(config: TrainConfig) -> float:
        return predict_speed(info, config, seq, dev).tokens_per_s

    layout = options.layout_fields

    def analytic(config: TrainConfig) -> int:
        return estimate_analytic(info, config, seq, dev, layout).device_total_bytes

    if options.method == "simulate" and dev.present:
        from autofit.stages.simulated import simulated_estimate

        reasons.append("estimates: the simulated step (a line through micro batches 1, 2 and "
                       "4 per combination), confirmed by trials")
        return _Estimator(whole.counted(simulated_estimate(
            probed.module, probed.task, info, dev, seq, progress, layout)), speed)
    return _Estimator(whole.counted(analytic), speed)


def _margin(probed: Probed, space: SearchSpace, estimator: _Estimator, margin: float | None,
            whole: WholeRun, progress: Callable[[str], None] | None) -> Any:
    """Stage 4a: the margin kept free (``autofit.search.margin.RunMargin``). Given: as given.
    Else from evidence (``autofit.search.margin``): the run the estimate alone would choose,
    replayed in the Trainer's order with its evaluations and saves, above its longest step,
    + a safety."""
    from autofit.search.margin import SAFETY, given_margin, run_margin

    dev = probed.device
    if margin is not None:
        return given_margin(margin, dev)
    if dev.allocator != "cuda":
        return run_margin(None, None, None, dev)
    from autofit.search import Engine

    plan = Engine(space, dev.capacity_bytes, estimate=estimator.total, speed=estimator.speed,
                  trial=None, seq_len=probed.seq_len, margin=SAFETY).run()
    if plan.config is None:
        return run_margin(None, None, None, dev)
    config = plan.config
    if progress is not None:
        progress(f"replaying the run of micro batch {config.micro_batch_size} × "
                 f"{config.grad_accum_steps} in the Trainer's order (for the margin)")
    return whole.replay(config, whole.eval_batch(config, SAFETY))


def _trial_runner(probed: Probed, options: TuneOptions, estimator: _Estimator,
                  reasons: list[str], kept: RunMargin | None = None,
                  whole: WholeRun | None = None) -> Any:
    """Stage 4b: ``config -> TrialResult``: real micro-steps on a present device; simulated
    steps for an absent card with ``method='simulate'`` (then ``.simulator`` is set); None
    for a plan from the estimate alone."""
    dev = probed.device
    if dev.present:
        return _device_trials(probed, options, kept, whole)
    if options.method == "simulate":
        from autofit.stages.simulated import simulated_trials

        reasons.append(f"{dev.name} is not present here: the best candidates were bracketed by "
                       "simulating their training step on fake tensors with the allocator "
                       "model of the target (unconfirmed on hardware); run autofit on the "
                       "target to confirm")
        return simulated_trials(probed.module, probed.task, probed.info, dev, probed.seq_len,
                                estimator.speed, options.layout_fields)
    reasons.append(f"{dev.name} is not present here: planned from the estimate alone "
                   "(unconfirmed); run autofit on the target to confirm (or "
                   + fix("--method simulate", "method='simulate'")
                   + " for an exact plan of the simulated step)")
    return None


def _device_trials(probed: Probed, options: TuneOptions, kept: RunMargin | None = None,
                   whole: WholeRun | None = None) -> Callable[[TrainConfig], Any]:
    """Real trials: ``measure`` on the worst-case batch of each micro batch size, with the
    run around it (``trial_run``): an evaluation step at the eval batch the estimate gives
    that configuration and, where the modelled run fragments a caching allocator, the run's
    first lengths in its order before the measured steps."""
    from autofit.probe.data import worst_case_batch

    whole = whole if whole is not None else WholeRun(probed, None, options)
    spec = probed.model_spec
    batches: dict[int, Any] = {}
    # while the ranks of a trial run: each rank's step, as a status line (not a new trial)
    shown = options.progress
    rank_progress = getattr(shown, "status", None) or (
        _progress_printer(shown) if shown else None)
    longest: dict[str, Any] = {}  # the largest worst-case batch the key hashed (no collator)
    recipe = options.recipe  # the user's DeepSpeed config runs on the ranks
    recipe_ds = recipe is not None and recipe.deepspeed is not None

    def rows(b: int, collator: Collator | None) -> Any:
        return worst_case_batch(probed.dataset, b, max_seq_len=probed.max_seq_len,
                                tokenizer=options.tokenizer, collator=collator,
                                task=probed.task, text_column=options.text_column)

    def trial(config: TrainConfig, timed_steps: int | None = None,
              outpaced_below: float | None = None) -> Any:
        """``timed_steps``: the engine's word that this speed decides nothing (1), else
        the trial's default (``MEASURE_STEPS``); ``outpaced_below``: the tokens/s under
        which the trial stops after its first timed step (a confirmed rival's, over
        ``autofit.search.engine.OUTPACED``)."""
        from autofit.trial import measure  # looked up per call: tests count the calls

        b = config.micro_batch_size
        if b not in batches:
            sliceable = longest and all(hasattr(v, "clone") for v in longest.values())
            if options.collator is None and sliceable and b <= len(longest["input_ids"]):
                # its first b rows are the worst-case batch of b: no new pass over the data
                # (copied, so that a trial holds and ships b rows, not the whole storage)
                batches[b] = {k: v[:b].clone() for k, v in longest.items()}
            else:
                batches[b] = rows(b, options.collator)
        result = measure(probed.model, config, batches[b], device=probed.device,
                         task=probed.task, isolation=options.isolation,
                         timeout_s=options.trial_timeout_s,
                         attn_implementation=spec.attn_implementation, lora=spec.lora,
                         quantization_config=spec.quant,
                         run=trial_run(probed, config, kept, None, options, whole,
                                       outpaced_below=outpaced_below),
                         progress=rank_progress,
                         **({"deepspeed_config": recipe.deepspeed_for(b, config.grad_accum_steps,
                             config.world_size)} if recipe_ds else {}),
                         **({} if timed_steps is None else {"measure_steps": timed_steps}))
        return whole.with_growth(result, config)

    def digest(largest: int) -> str:
        """The content of every batch a trial can be fed: the ``largest`` longest rows (each
        smaller worst-case batch is their first rows), padded as the default collator does;
        the collator itself is keyed apart (it may be random, e.g. masking)."""
        from autofit.search.study import batch_digest

        longest.clear()
        longest.update(rows(largest, None))
        return batch_digest(longest)

    trial.digest = digest  # type: ignore[attr-defined]
    trial.timed_steps = True  # type: ignore[attr-defined]  # the engine may ask for fewer
    trial.outpaced_below = True  # type: ignore[attr-defined]  # and stop an outpaced one
    return trial


def _study(probed: Probed, space: SearchSpace, margin: float, objective: str, runner: Any,
           options: TuneOptions) -> tuple[Any, str]:
    """Stage 5: the cache key of this question, and the optuna study that records the trials
    (resume, cache) when real trials run and the cache is on."""
    from autofit.probe.model import fingerprint
    from autofit.probe.versions import library_versions
    from autofit.search import ENGINE_VERSION, cache_key
    from autofit.search.study import collator_identity

    dev = probed.device
    trials_run = runner is not None and dev.present
    seen, recipe = probed.seen, options.recipe
    key = cache_key({
        "model": fingerprint(probed.info), "seq_len": probed.seq_len,
        "samples": probed.data.num_samples,
        # what the trials are fed: the worst-case rows' content, and the collator
        "batch": runner.digest(space.micro_batches[-1]) if trials_run else None,
        "collator": collator_identity(options.collator),
        "device": [dev.name, dev.product, dev.capacity_bytes], "versions": library_versions(),
        "space": space.describe(), "margin": margin, "method": options.method,
        "objective": objective, "engine": ENGINE_VERSION,
        # packed samples: the file records how (a cached answer must carry it)
        **({"packing": seen.meta} if seen is not None and seen.meta else {}),
        **({"recipe": [list(kv) for kv in recipe.sharding], "deepspeed": recipe.deepspeed}
           if recipe is not None else {}),
    })
    cache = options.cache
    if not cache or not trials_run:
        return None, key
    from autofit.search.study import open_recorder

    # a cache fault is one warning line and None: the run goes on without the cache
    return open_recorder(key, storage=cache if isinstance(cache, str) else None, space=space,
                         capacity_bytes=dev.capacity_bytes,
                         claim_ttl_s=float(options.trial_timeout_s) + 300.0), key


def _search(probed: Probed, space: SearchSpace, estimator: _Estimator, runner: Any,
            recorder: TrialRecorder | None, options: TuneOptions, *, margin: float,
            add_fragmentation: bool, time_budget_s: float | None, started_at: float,
            progress: Callable[[str], None] | None) -> tuple[SearchOutcome, Engine]:
    """Stage 6: the engine estimates every candidate, ranks them and confirms the best."""
    from autofit.search import Engine

    simulated = runner is not None and not probed.device.present
    engine = Engine(space, probed.device.capacity_bytes, estimate=estimator.total,
                    speed=estimator.speed, trial=runner, seq_len=probed.seq_len, margin=margin,
                    confirm_top=int(options.confirm_top), max_trials=int(options.max_trials),
                    time_budget_s=time_budget_s, recorder=recorder, progress=progress,
                    started_at=started_at, add_fragmentation=add_fragmentation,
                    trial_word="simulated" if simulated else "measured")
    return engine.run(), engine


def check_positions(data: DataInfo | None, module: torch.nn.Module) -> None:
    """Raise when the longest sample of ``data`` (a ``DataInfo``, or None) is longer than the
    model's learned positions: an index error at the first long batch, never a memory
    verdict (a 12.5M-token sample was "54586 TiB over")."""
    if data is None:
        return
    from autofit.probe.model import token_limits

    _, positions = token_limits(module)
    if positions is not None and data.length_max > positions:
        raise BadInputError(
            f"the longest sample has {data.length_max} tokens, more than the model's "
            f"{positions} learned positions: truncate with "
            + fix(f"--max-seq-len {positions}", f"max_seq_len={positions}"))


def _with_ranks(config: TrainConfig, **fields: int | str | None) -> TrainConfig:
    """``config`` with the several-process fields given (``None``: the config's)."""
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        one_process_strategy(config.strategy, config.world_size)
        return config
    if "nproc_per_node" in given or "nnodes" in given:
        n = given.get("nproc_per_node", config.nproc_per_node)
        m = given.get("nnodes", config.nnodes)
        for name, v in (("nproc_per_node", n), ("nnodes", m)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadInputError(f"{name} must be a positive integer, got {v!r}")
        given["world_size"] = n * m  # type: ignore[operator]
    config = config.replace(**given)
    one_process_strategy(config.strategy, config.world_size)
    return config


def _recipe(deepspeed_config: Any, accelerate_config: Any) -> Recipe | None:
    """The user's launch recipe (``autofit.knobs.recipe.Recipe``), or None."""
    if deepspeed_config is None and accelerate_config is None:
        return None
    from autofit.knobs.recipe import read_recipe

    return read_recipe(deepspeed=deepspeed_config, accelerate=accelerate_config)


def _layout(config: TrainConfig, sharding: Any) -> Layout | None:
    """The ``Layout`` of ``sharding`` (a dict of its fields or a Layout), or None."""
    if sharding is None:
        return None
    from autofit.memory.ranks import Layout

    if isinstance(sharding, Layout):
        return dataclasses.replace(sharding, strategy=config.strategy, offload=config.offload,
                                   nproc_per_node=config.nproc_per_node, nnodes=config.nnodes)
    if not isinstance(sharding, dict):
        raise BadInputError("sharding must be a dict of Layout fields, "
                            f"got {type(sharding).__name__}")
    known = {f.name for f in dataclasses.fields(Layout)} - {"strategy", "offload",
                                                            "nproc_per_node", "nnodes"}
    unknown = sorted(set(sharding) - known)
    if unknown:
        raise BadInputError(f"unknown sharding field(s) {', '.join(unknown)}; "
                            f"choose from {', '.join(sorted(known))}")
    return Layout.of(config, **sharding)


def _with_run(est: MemoryEstimate, sim: Simulator | None, config: TrainConfig, data: DataInfo, *,
              epochs: float, seed: int, sampling: str, max_seq_len: int | None,
              eval_steps: int | None = None, eval_bytes: int = 0,
              save_steps: int | None = None) -> MemoryEstimate:
    """``est`` with the whole run's need: the run's order replayed through the allocator."""
    from autofit.memory.run import simulate_run
    from autofit.probe.run import run_order

    order = run_order(data.lengths, micro_batch_size=config.micro_batch_size,
                      grad_accum_steps=config.grad_accum_steps, epochs=epochs, seed=seed,
                      sampling=sampling, max_seq_len=max_seq_len)
    run = simulate_run(sim, config, order, eval_steps=eval_steps, eval_bytes=eval_bytes,
                       save_steps=save_steps)
    # the run is never below this estimate's own step (an analytic step may sit above the
    # simulated one): what the run adds is added to it
    total = est.device_total_bytes + run.fragmentation_bytes
    notes = (*est.notes, *run.notes,
             f"whole run: {run.steps} optimizer steps replayed; the peak stopped growing at "
             f"step {run.converged_step}; its need is decided in the {run.peak_phase} phase")
    return dataclasses.replace(
        est, run_peak_reserved_bytes=max(run.peak_reserved_bytes, est.peak_reserved_bytes),
        run_device_total_bytes=total, fits=total <= est.capacity_bytes, notes=notes)


def _progress_printer(enabled: Any) -> Callable[[str], None] | None:
    """``progress=`` as a line printer: False -> None, a callable as is, True -> stderr."""
    if not enabled:
        return None
    if callable(enabled):
        return enabled
    from rich.console import Console

    console = Console(stderr=True)
    return lambda line: console.print(f"[dim]autofit:[/] {line}")
