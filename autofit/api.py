"""The public functions: ``estimate`` and ``autofit``, each a short pipeline of named stages.

    >>> from autofit import estimate, TrainConfig
    >>> est = estimate("tiny-llama", TrainConfig(micro_batch_size=4), seq_len=512, device="cpu")
    >>> sorted(est.breakdown)
    ['activations', 'gradients', 'optimizer_states', 'overhead', 'temporaries', 'weights']

``autofit()`` runs the flow of docs/design.md one stage after another, each a function
below that takes what the earlier ones made and never reaches back:

    _probe -> _space -> _estimator -> _trial_runner -> _study -> _search -> _result
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autofit.config import TrainConfig, one_process_strategy
from autofit.errors import BadInputError, fix
from autofit.knobs import KNOBS, choice_of, describe_choice, knob_names
from autofit.knobs.chunked_loss import liger_offered
from autofit.knobs.loss import unsupported_reason
from autofit.knobs.trainer import (
    chunked_loss_refused,
    for_trainer,
    implied_trainer,
    normalize_trainer,
    not_searched_reason,
    runs_chunked_loss,
)
from autofit.knobs.trl_loss import (
    SFT_CONFIG,
    is_sft_config,
    loss_impl_of,
    trl_loss_reason,
    trl_loss_type,
)
from autofit.memory.breakdown import MemoryEstimate
from autofit.probe.device import DeviceInfo, resolve_device
from autofit.probe.quant import check_precision

__all__ = ["estimate", "autofit", "METHODS"]

METHODS = ("analytic", "simulate")


def estimate(
    model: Any,
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
    dataset: Any = None,
    max_seq_len: int | None = None,
    tokenizer: Any = None,
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
        task: ``causal-lm``, ``masked-lm``, ``seq2seq`` or ``seq-cls`` (default:
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
            (``autofit.memory.sharding``).
        block_size: pack the dataset into blocks of this many tokens as the transformers
            examples' ``group_texts`` does (``autofit.probe.packing``): every sample
            ``block_size`` long.
        sharding: how the ranks run beyond the config: a dict of
            ``autofit.memory.sharding.Layout`` fields, e.g. ``{"fsdp_recipe": "torch",
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
    from autofit.memory.ranked import estimate_analytic
    from autofit.probe.model import adapter_request, build_model, describe

    config = config if config is not None else TrainConfig()
    if not isinstance(config, TrainConfig):
        raise BadInputError(f"config must be a TrainConfig, got {type(config).__name__}")
    config = _with_ranks(config, nproc_per_node=nproc_per_node, nnodes=nnodes,
                         strategy=strategy, offload=offload)
    recipe = _recipe(deepspeed_config, accelerate_config)
    if recipe is not None:
        config = recipe.apply(config)
        sharding = {**recipe.layout_fields, **(sharding or {})}
    config, _ = for_trainer(config, trainer)  # a lever the trainer does not run: bad input
    layout = _layout(config, sharding)
    if method not in METHODS:
        raise BadInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    data, packed = None, ()
    if dataset is not None:
        from autofit.probe.data import probe_data
        from autofit.probe.packing import as_script_sees

        seen = as_script_sees(dataset, block_size=block_size, max_seq_len=max_seq_len,
                              tokenizer=tokenizer)
        dataset, max_seq_len, packed = seen.dataset, seen.max_seq_len, seen.reasons
        data = probe_data(dataset, max_seq_len=max_seq_len, tokenizer=tokenizer)
    elif block_size is not None:
        raise BadInputError(fix("--block-size", "block_size=") + " packs a dataset: give "
                            + fix("--dataset", "dataset=") + " too")
    seq = seq_len if seq_len is not None else config.seq_len
    if seq is None and data is not None:
        seq = data.length_max  # the longest batch: the worst step
    if seq is None:
        raise BadInputError("give " + fix("--seq-len (tokens per sample), e.g. --seq-len 1024",
                                          "seq_len (tokens per sample), e.g. seq_len=1024")
                            + fix(" or --dataset", " or dataset="))
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise BadInputError(f"seq_len must be a positive integer, got {seq!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):  # checked with or without data
        raise BadInputError(f"seed must be a whole number (TrainingArguments.seed), got {seed!r}")
    dev = resolve_device(device)
    if config.world_size > 1:
        from autofit.probe.device import check_ranks_per_node

        check_ranks_per_node(config.nproc_per_node, dev, "nproc_per_node")
    for k in KNOBS:  # what the device allows (an estimate runs nothing: run=False)
        k.check(dev, getattr(config, k.name), run=False)
    from autofit.probe.quant import resolve

    module, t = build_model(
        model,
        task=task,
        attn_implementation=attn_implementation,
        lora=adapter_request(lora, peft_config),
        quantization_config=resolve(load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
                                    quantization_config=quantization_config, device=dev),
    )
    check_positions(data, module)
    name = model if isinstance(model, str) else None
    if block_size is not None:
        from autofit.probe.model import token_limits
        from autofit.probe.packing import check_block_size

        check_block_size(block_size, max_positions=token_limits(module)[1])
    check_chunked_loss(config.chunked_loss, module, t)
    info = describe(module, task=t, name=str(name) if name else None)
    check_precision(info.quant, info.dtype, config.precision)
    sim = None
    if method == "simulate" or data is not None:
        from autofit.memory.simulate import Simulator

        sim = Simulator(module, task=t, device=dev, model_name=info.name,
                        sharding=recipe.layout_fields if recipe is not None else None)
    if layout is not None:  # several ranks launched otherwise than the Trainer does
        from autofit.memory._sim_ranks import simulate_ranks
        from autofit.memory.sharding import estimate_ranks_analytic

        est = (simulate_ranks(sim, config, seq, layout).estimate if method == "simulate"
               else estimate_ranks_analytic(info, config, seq, dev, layout))
    else:
        est = (sim.simulate(config, seq_len=seq) if method == "simulate"
               else estimate_analytic(info, config, seq, dev))
    if recipe is not None:
        import dataclasses

        est = dataclasses.replace(est, notes=(*est.notes, *recipe.lines(config.world_size)))
    if data is None:
        return est
    if (eval_steps is None) != (eval_batch_size is None):
        raise BadInputError("give " + fix("--eval-steps and --eval-batch-size",
                                          "eval_steps and eval_batch_size") + " together")
    for name, v in (("eval_steps", eval_steps), ("eval_batch_size", eval_batch_size),
                    ("save_steps", save_steps)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BadInputError(f"{name} must be a positive integer, got {v!r}")
    eval_bytes = _eval_working_set(info, config, seq, dev, eval_batch_size, None)
    est = _with_run(est, sim, config, data, epochs=epochs, seed=seed, sampling=sampling,
                    max_seq_len=max_seq_len, eval_steps=eval_steps, eval_bytes=eval_bytes,
                    save_steps=save_steps)
    if packed:
        import dataclasses

        est = dataclasses.replace(est, notes=(*packed, *est.notes))
    return est


def check_positions(data: Any, module: Any) -> None:
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


def _with_ranks(config: TrainConfig, **fields: Any) -> TrainConfig:
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
        given["world_size"] = n * m
    config = config.replace(**given)
    one_process_strategy(config.strategy, config.world_size)
    return config


def _recipe(deepspeed_config: Any, accelerate_config: Any) -> Any:
    """The user's launch recipe (``autofit.knobs.recipe.Recipe``), or None."""
    if deepspeed_config is None and accelerate_config is None:
        return None
    from autofit.knobs.recipe import read_recipe

    return read_recipe(deepspeed=deepspeed_config, accelerate=accelerate_config)


def _layout(config: TrainConfig, sharding: Any) -> Any:
    """The ``Layout`` of ``sharding`` (a dict of its fields or a Layout), or None."""
    if sharding is None:
        return None
    import dataclasses

    from autofit.memory.sharding import Layout

    if isinstance(sharding, Layout):
        return dataclasses.replace(sharding, strategy=config.strategy, offload=config.offload,
                                   nproc_per_node=config.nproc_per_node, nnodes=config.nnodes)
    if not isinstance(sharding, dict):
        raise BadInputError(f"sharding must be a dict of Layout fields, got {type(sharding).__name__}")
    known = {f.name for f in dataclasses.fields(Layout)} - {"strategy", "offload",
                                                            "nproc_per_node", "nnodes"}
    unknown = sorted(set(sharding) - known)
    if unknown:
        raise BadInputError(f"unknown sharding field(s) {', '.join(unknown)}; "
                            f"choose from {', '.join(sorted(known))}")
    return Layout.of(config, **sharding)


def _with_run(est: MemoryEstimate, sim: Any, config: TrainConfig, data: Any, *, epochs: float,
              seed: int, sampling: str, max_seq_len: int | None, eval_steps: int | None = None,
              eval_bytes: int = 0, save_steps: int | None = None) -> MemoryEstimate:
    """``est`` with the whole run's need: the run's order replayed through the allocator."""
    import dataclasses

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


# Keyword options of autofit() besides the knobs (one keyword per knob restricts it).
_OPTIONS = {
    "max_micro_batch", "training_args", "method", "task", "tokenizer", "collator", "text_column",
    "cache", "confirm_top", "max_trials", "progress", "isolation", "trial_timeout_s",
    "attn_implementation", "lora", "peft_config", "load_in_4bit", "load_in_8bit",
    "quantization_config", "optim_args", "world_size",
    "generate_max_new_tokens", "nproc_per_node", "nnodes", "block_size",
    "deepspeed_config", "accelerate_config", "trainer", "guard_record",
}


def autofit(
    model: Any,
    dataset: Any,
    *,
    device: str | DeviceInfo = "auto",
    target_batch_size: int | None = None,
    max_seq_len: int | None = None,
    margin: float | None = None,
    objective: str = "throughput",
    time_budget_s: float | None = None,
    **constraints: Any,
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

    started_at = time.monotonic()
    opts = _check_options(constraints, objective, target_batch_size=target_batch_size,
                          max_seq_len=max_seq_len, margin=margin, time_budget_s=time_budget_s)
    from autofit.probe.model import adapter_request

    # one adapter request (the LoRA shorthand or any PEFT config) travels as "lora"
    opts["lora"] = adapter_request(opts.get("lora"), opts.pop("peft_config", None))
    # how the base is quantized travels as one QuantSpec (or None), resolved for the device
    from autofit.probe.quant import resolve

    quant = dict(load_in_4bit=bool(opts.pop("load_in_4bit", False)),
                 load_in_8bit=bool(opts.pop("load_in_8bit", False)),
                 quantization_config=opts.get("quantization_config"))
    opts["quantization_config"] = resolve(**quant)  # bad input: before anything is built
    opts["_quant_request"] = quant
    reasons: list[str] = []
    _fix_recipe(opts, reasons)  # the user's launch recipe: kept, not searched
    _guard_evidence(opts, reasons)  # a guarded run's rescues: what the real run needed
    progress = _progress_printer(opts.get("progress", False))
    dataset, max_seq_len = _script_data(dataset, max_seq_len, opts, reasons)
    probed = _probe(model, dataset, device, max_seq_len, opts, reasons, warm_trials=True)
    space, base_args = _space(probed, target_batch_size, opts, reasons)
    estimator = _estimator(probed, opts, progress, reasons)
    add_fragmentation = margin is None  # the default margin also reports measured fragmentation
    whole = _WholeRun(probed, base_args, opts)
    kept = _margin(probed, space, estimator, margin, whole, progress)
    runner = _trial_runner(probed, dataset, max_seq_len, opts, estimator, reasons, kept,
                           whole)
    margin = kept.fraction
    recorder, key = _study(probed, space, margin, objective, runner, opts)
    cached = recorder.cached_result() if recorder is not None else None
    if cached is not None:
        return _result_from_cache(cached, recorder, probed, base_args, opts["trainer"])
    outcome, engine = _search(probed, space, estimator, runner, recorder, margin=margin,
                              add_fragmentation=add_fragmentation, time_budget_s=time_budget_s,
                              started_at=started_at, progress=progress, opts=opts)
    return _result(probed, space, engine, outcome, runner, recorder, key, whole, kept,
                   max_seq_len, reasons)


def _guard_evidence(opts: dict[str, Any], reasons: list[str]) -> None:
    """The rescues of a guarded run of the previous tuned file (``guard_record=``) as
    evidence: a training micro step of b samples ran out of memory in the real run (a
    batch, a neighbour or a fragmentation no plan saw), so the search tries micro batches
    below b only (``max_micro_batch``), and the reasons say why."""
    path = opts.get("guard_record")
    if path is None:
        return
    from pathlib import Path

    from autofit.trial.guard import read_record

    if not Path(path).is_file():
        raise BadInputError(f"guard_record: {path} is not a file (the JSON lines autofit.guard "
                            "writes, <name>-guard.jsonl beside a tuned file)")
    rescues = [r for r in read_record(path) if r.kind == "train" and r.batch_shape]
    if not rescues:
        return
    worst = min(rescues, key=lambda r: (r.batch_shape[0], r.step))
    b = int(worst.batch_shape[0])
    shape = " x ".join(str(d) for d in worst.batch_shape)
    seen = (f"a guarded run ran out of memory {len(rescues)} time(s) in a training micro step "
            f"(the smallest: micro batch {shape} at step {worst.step}, run in {worst.k} pieces; "
            f"{Path(path).name})")
    if b <= 1:
        reasons.append(f"{seen}: one sample is the smallest micro batch, nothing smaller to try")
        return
    cap = int(opts.get("max_micro_batch", 256))
    if b - 1 < cap:
        opts["max_micro_batch"] = b - 1
    reasons.append(f"micro batches of {b} and more not tried: {seen}")


def _fix_recipe(opts: dict[str, Any], reasons: list[str]) -> None:
    """The user's launch recipe (``deepspeed_config=`` / ``accelerate_config=``, else the
    ``training_args``' ``deepspeed`` / ``fsdp`` fields) into ``opts``: the knobs it fixes
    get its one value (a different constraint is bad input), its ranks replace the
    options', and ``opts["_recipe"]`` carries it to the estimator, the trials and the
    tuned file. Its batch numbers are not kept: the tuned file's DeepSpeed config gets
    the tuned ones."""
    from autofit.knobs.recipe import check_batch, read_recipe, recipe_of_fields

    ds, acc = opts.pop("deepspeed_config", None), opts.pop("accelerate_config", None)
    args = opts.get("training_args")
    fields = (args.to_dict() if hasattr(args, "to_dict") else dict(args)
              if isinstance(args, dict) else None)
    if ds is None and acc is None:
        recipe = recipe_of_fields(fields, "training_args") if fields else None
    else:
        recipe = read_recipe(deepspeed=ds, accelerate=acc)
        if recipe is not None and fields is not None:
            check_batch(recipe, fields, "training_args")
    if recipe is None:
        return
    for name, value in recipe.search_constraints().items():
        asked = opts.get(name)
        allowed = [asked] if isinstance(asked, str | bool) else list(asked or [])
        if asked is not None and value[0] not in allowed:
            raise BadInputError(f"{recipe.source} fixes {name} {value[0]} but {name}="
                                f"{asked!r} was asked: drop one")
        opts[name] = value
    for name in ("nproc_per_node", "nnodes"):
        if getattr(recipe, name) is not None:
            opts[name] = getattr(recipe, name)
    if recipe.optim_args is not None:
        opts["optim_args"] = recipe.optim_args
    opts["_recipe"] = recipe
    world = opts.get("world_size") or (opts.get("nproc_per_node") or 1) * (opts.get("nnodes") or 1)
    first, *rest = recipe.lines(int(world))
    reasons += [first + "; kept as given, the rest searched", *rest]


def _layout_fields(opts: dict[str, Any]) -> dict[str, Any] | None:
    """The ``Layout`` fields of the user's recipe in ``opts``, or None."""
    recipe = opts.get("_recipe")
    return recipe.layout_fields if recipe is not None else None


def _check_options(constraints: dict[str, Any], objective: str, **numbers: Any) -> dict[str, Any]:
    """The keyword options, validated before anything is built: every unknown name is one
    line naming the known ones; every bad number is reported, all in one line."""
    known = _OPTIONS | set(knob_names())
    unknown = set(constraints) - known
    if unknown:
        raise BadInputError(
            f"unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    if objective != "throughput":
        raise BadInputError(f"unknown objective {objective!r}; use 'throughput'")
    method = constraints.get("method", "analytic")
    if method not in METHODS:
        raise BadInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if constraints.get("trainer") is not None:
        normalize_trainer(constraints["trainer"])  # an unknown trainer: before anything is built
    problems = _number_problems({**numbers, **constraints})
    if problems:
        raise BadInputError("; ".join(problems))
    return dict(constraints)


# The command line's flag of each option that has one (messages name the caller's own).
_FLAGS = {"target_batch_size": "--target-batch-size", "max_micro_batch": "--max-micro-batch",
          "margin": "--margin", "time_budget_s": "--time-budget", "max_trials": "--max-trials",
          "max_seq_len": "--max-seq-len"}


def _named(option: str) -> str:
    """``option`` as the caller spells it: its flag on the command line, else the keyword."""
    return fix(_FLAGS[option], option) if option in _FLAGS else option


def _number_problems(values: dict[str, Any]) -> list[str]:
    """What is wrong with the numeric options (None: the default), one phrase each."""
    import math

    from autofit.search.space import check_batch_size

    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)

    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    problems = []
    for name in ("target_batch_size", "max_micro_batch"):
        try:
            check_batch_size(_named(name), values.get(name), optional=True)
        except BadInputError as e:
            problems.append(str(e))
    margin = values.get("margin")
    if margin is not None and not (number(margin) and 0 <= margin < 1):
        problems.append(f"{_named('margin')} must be a fraction in [0, 1) of the capacity kept free "
                        f"(e.g. 0.1), got {margin!r}")
    time_budget = values.get("time_budget_s")
    if time_budget is not None and not (number(time_budget) and time_budget > 0):
        problems.append(f"{_named('time_budget_s')} must be a positive number of seconds "
                        f"{fix('(or leave it out', '(or None')} for no limit), got {time_budget!r}")
    timeout = values.get("trial_timeout_s")
    if timeout is not None and not (number(timeout) and 0 < timeout < math.inf):
        problems.append(f"trial_timeout_s must be a positive, finite number of seconds, "
                        f"got {timeout!r}")
    for name in ("max_trials", "confirm_top", "world_size", "max_seq_len",
                 "generate_max_new_tokens", "nproc_per_node", "nnodes"):
        v = values.get(name)
        if v is not None and not (whole(v) and v >= 1):
            problems.append(f"{_named(name)} must be a positive integer, got {v!r}")
    return problems


def _script_data(dataset: Any, max_seq_len: int | None, opts: dict[str, Any],
                 reasons: list[str]) -> tuple[Any, int | None]:
    """Stage 0: the samples as the script feeds them (``block_size=`` packing, an
    SFTConfig's ``max_length`` / ``packing``; ``autofit.probe.packing``)."""
    from autofit.probe.packing import as_script_sees

    args = opts.get("training_args")
    seen = as_script_sees(dataset, block_size=opts.get("block_size"), max_seq_len=max_seq_len,
                          sft=args if is_sft_config(args) else None,
                          tokenizer=opts.get("tokenizer"), text_column=opts.get("text_column"))
    reasons += seen.reasons
    opts["_script_data"] = seen  # _probe checks the block against the model, _result records it
    return seen.dataset, seen.max_seq_len


@dataclass(frozen=True)
class _Probed:
    """What the probe stage found: the model as given and as built, its task and
    description, the data's lengths and the device."""

    model: Any
    module: Any
    task: str
    info: Any  # ModelInfo
    data: Any  # DataInfo
    device: DeviceInfo
    seq_len: int  # the worst-case (longest) sample after truncation

    @property
    def name(self) -> str:
        return self.model if isinstance(self.model, str) else self.info.name


def _probe(model: Any, dataset: Any, device: Any, max_seq_len: int | None,
           opts: dict[str, Any], reasons: list[str], warm_trials: bool = False) -> _Probed:
    """Stage 1: resolve the device, build and describe the model, measure the data's lengths.

    ``warm_trials``: trials will run (a tune): the trial server starts now, on the other
    core, while this process builds the model and reads the data."""
    from autofit.errors import NoTrainableParametersError
    from autofit.probe.data import probe_data
    from autofit.probe.model import build_model, describe, token_limits

    dev = _device_with_ranks(resolve_device(device), opts, reasons)
    if warm_trials:
        from autofit.trial.runner import warm_up

        warm_up(dev, opts.get("isolation", "auto"))  # its imports overlap the probing
    if opts.get("_quant_request") is not None:
        from autofit.probe.quant import resolve

        opts["quantization_config"] = resolve(**opts.pop("_quant_request"), device=dev)
    module, task = build_model(model, task=opts.get("task"),
                               attn_implementation=opts.get("attn_implementation"),
                               lora=opts.get("lora"),
                               quantization_config=opts.get("quantization_config"))
    info = describe(module, task=task, name=model if isinstance(model, str) else None)
    precisions = opts.get("precision")
    for p in [precisions] if isinstance(precisions, str) else (precisions or ()):
        check_precision(info.quant, info.dtype, p)
    if info.quant is not None:
        reasons.append(f"base quantized: {info.quant.describe()} (bitsandbytes); the base "
                       "is loaded in its compute dtype and never cast")
    if info.trainable_params == 0:
        raise NoTrainableParametersError(
            f"{info.name} has no trainable parameter; unfreeze some or add LoRA "
            f"({fix('--lora-r 8', 'lora=' + repr({'r': 8}))})")
    vocab, positions = token_limits(module)  # the data is checked against them
    seen = opts.get("_script_data")
    if seen is not None and seen.block_size is not None:
        from autofit.probe.packing import check_block_size

        check_block_size(seen.block_size, max_positions=positions, name=seen.source)
    data = probe_data(dataset, max_seq_len=max_seq_len, tokenizer=opts.get("tokenizer"),
                      text_column=opts.get("text_column"), vocab_size=vocab,
                      max_positions=positions)
    reasons.append(f"sequence length {data.length_max}: the longest sample"
                   + (f" after truncation at {max_seq_len}" if data.num_truncated else "")
                   + f" (p50 {data.length_p50}, p99 {data.length_p99})")
    return _Probed(model, module, task, info, data, dev, data.length_max)


def _device_with_ranks(dev: DeviceInfo, opts: dict[str, Any], reasons: list[str]) -> DeviceInfo:
    """The device with the run's ranks (``nproc_per_node`` x ``nnodes``; ``world_size`` alone
    is that many processes on one node); each rank is a device like ``dev``."""
    import dataclasses

    nproc, nnodes = opts.get("nproc_per_node"), opts.get("nnodes")
    world = opts.get("world_size")
    if nproc is None and nnodes is None and world is None:
        one_process_strategy(opts.get("strategy"), 1)
        return dev
    nnodes = int(nnodes or 1)
    nproc = int(nproc) if nproc is not None else (
        max(1, int(world) // nnodes) if world is not None else 1)
    if world is not None and int(world) != nproc * nnodes:
        raise BadInputError(f"world_size {world} is not nproc_per_node x nnodes = {nproc} x "
                            f"{nnodes}; give " + fix("--nproc-per-node and --nnodes",
                                                     "nproc_per_node and nnodes") + " alone")
    one_process_strategy(opts.get("strategy"), nproc * nnodes)
    from autofit.probe.device import check_ranks_per_node

    check_ranks_per_node(nproc, dev, "nproc_per_node")
    if nproc * nnodes > 1:
        where = f"{nnodes} nodes x {nproc}" if nnodes > 1 else f"{nproc} processes"
        reasons.append(f"{nproc * nnodes} ranks ({where}), each on a {dev.name}: estimates are "
                       "per rank; trials run every rank (torchrun on this machine)"
                       if dev.present else
                       f"{nproc * nnodes} ranks ({where}), each on a {dev.name}: estimates are "
                       "per rank")
    return dataclasses.replace(dev, nproc_per_node=nproc, nnodes=nnodes)


def _space(probed: _Probed, target_batch_size: int | None, opts: dict[str, Any],
           reasons: list[str]) -> tuple[Any, dict[str, Any] | None]:
    """Stage 2: the search space (each knob's values, the micro batches that keep the target),
    and the user's TrainingArguments fields to keep, if given."""
    from autofit.search import build_space

    base_args = None
    dev = probed.device
    world_size = dev.nproc_per_node * dev.nnodes
    training_args = opts.get("training_args")
    if training_args is not None:
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
        if target_batch_size is None:
            target_batch_size = (int(base_args.get("per_device_train_batch_size", 8))
                                 * int(base_args.get("gradient_accumulation_steps", 1)) * world_size)
            reasons.append(f"target batch {target_batch_size}: from training_args "
                           "(per-device batch × accumulation × devices)")
    max_micro = int(opts.get("max_micro_batch", 256))
    if target_batch_size is None:  # no target: more samples than the dataset has gain nothing
        max_micro = min(max_micro, max(probed.data.num_samples, 1))
    allowed = {k.name: opts.get(k.name) for k in KNOBS}
    loss_impl = loss_impl_of(training_args)
    info = getattr(probed, "info", None)
    if getattr(info, "quant", None) is not None and allowed.get("precision") is None:
        # a bitsandbytes base is never cast and autocasts only to its own 16-bit dtype
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
        if ok != list(values):
            allowed["precision"] = ok
            reasons.append(f"precision: {', '.join(ok)} searched (the base is quantized in "
                           f"{info.dtype}: never cast, autocast only to its own dtype)")
    why = unsupported_reason(probed.module, probed.task)
    trainer, loss_impl = _trainer(opts, training_args, base_args, allowed, dev, loss_impl, reasons)
    if loss_impl == "trl":  # SFTTrainer computes its own loss: autofit's is not what runs
        asked = allowed.get("chunked_loss")
        if asked is True or (isinstance(asked, (list, tuple)) and True in asked):
            raise BadInputError("chunked loss: training_args is an SFTConfig, whose "
                                "SFTTrainer computes TRL's fused LM-head loss; drop "
                                + fix("--chunked-loss", "chunked_loss=True"))
        allowed["chunked_loss"] = False
        reasons.append(trl_loss_reason(trl_loss_type(training_args) or "nll"))
    elif not runs_chunked_loss(trainer) and not liger_offered({"use_cpu": dev.kind == "cpu"}):
        allowed["chunked_loss"] = False  # no field carries it, and the trainer does not run it
        reasons.append(not_searched_reason(trainer))
    elif why is not None:  # the knob has one value for this model: say why
        asked = allowed.get("chunked_loss")
        check_chunked_loss(asked if isinstance(asked, bool) else
                           any(bool(v) for v in (asked or ())), probed.module, probed.task)
        allowed["chunked_loss"] = False
        reasons.append(f"no chunked loss: {why}")
    space = build_space(probed.device, max_micro_batch=max_micro,
                        target_batch_size=target_batch_size, world_size=world_size,
                        nnodes=dev.nnodes, optim_args=opts.get("optim_args"), reasons=reasons,
                        loss_impl=loss_impl, **allowed)
    return space, base_args


def _trainer(opts: dict[str, Any], training_args: Any, base_args: dict[str, Any] | None,
             allowed: dict[str, Any], dev: DeviceInfo, loss_impl: str,
             reasons: list[str]) -> tuple[str, str]:
    """The trainer that will run the file and the loss it computes (``loss_impl``). Given
    (``opts["trainer"]``) or implied: ``trl`` for an SFTConfig, ``autofit`` when the chunked
    loss is asked for, else ``plain``; written back to ``opts["trainer"]`` for the result."""
    asked = allowed.get("chunked_loss")
    wants = asked is True or (isinstance(asked, (list, tuple)) and True in asked)
    sft = is_sft_config(training_args)
    if opts.get("trainer") is None:
        trainer = implied_trainer(chunked_loss=wants, sft=sft)
        if trainer == "autofit":
            reasons.append("trainer autofit.ChunkedLossTrainer: implied by "
                           + fix("--chunked-loss", "chunked_loss=True")
                           + " (a plain transformers.Trainer does not run the chunked loss)")
    else:
        trainer = normalize_trainer(opts["trainer"])
        if wants and not runs_chunked_loss(trainer) and not (
                trainer == "plain" and liger_offered({"use_cpu": dev.kind == "cpu"})):
            raise BadInputError(chunked_loss_refused(trainer))
    if trainer != "trl":
        loss_impl = "model"
    elif not sft:  # TrainingArguments handed to SFTTrainer: SFTConfig's defaults
        loss_impl = "trl" if trl_loss_type(base_args or {}, sft=True) else "model"
    opts["trainer"] = trainer
    return trainer, loss_impl


@dataclass(frozen=True)
class _Estimator:
    """How the search asks "how much memory?" and "how fast?" of a configuration."""

    total: Callable[[TrainConfig], int]  # device total bytes
    speed: Callable[[TrainConfig], float]  # predicted tokens/s


def _estimator(probed: _Probed, opts: dict[str, Any], progress: Any,
               reasons: list[str]) -> _Estimator:
    """Stage 3: the closed form, or on a present device with ``method='simulate'`` the
    simulated step's peak line per combination."""
    from autofit.memory.ranked import estimate_analytic
    from autofit.search.speed import predict_speed

    info, dev, seq = probed.info, probed.device, probed.seq_len

    def speed(config: TrainConfig) -> float:
        return predict_speed(info, config, seq, dev).tokens_per_s

    layout = _layout_fields(opts)

    def analytic(config: TrainConfig) -> int:
        return estimate_analytic(info, config, seq, dev, layout).device_total_bytes

    if opts.get("method", "analytic") == "simulate" and dev.present:
        reasons.append("estimates: the simulated step (a line through micro batches 1, 2 and "
                       "4 per combination), confirmed by trials")
        return _Estimator(_simulated_estimate(probed.module, probed.task, info, dev, seq,
                                              progress, layout), speed)
    return _Estimator(analytic, speed)


def _trial_runner(probed: _Probed, dataset: Any, max_seq_len: int | None, opts: dict[str, Any],
                  estimator: _Estimator, reasons: list[str], kept: Any = None,
                  whole: _WholeRun | None = None) -> Any:
    """Stage 4: ``config -> TrialResult``: real micro-steps on a present device; simulated
    steps for an absent card with ``method='simulate'`` (then ``.simulator`` is set); None
    for a plan from the estimate alone."""
    dev = probed.device
    if dev.present:
        return _device_trials(probed, dataset, max_seq_len, opts, kept, whole)
    if opts.get("method", "analytic") == "simulate":
        reasons.append(f"{dev.name} is not present here: the best candidates were bracketed by "
                       "simulating their training step on fake tensors with the allocator "
                       "model of the target (unconfirmed on hardware); run autofit on the "
                       "target to confirm")
        return _simulated_trials(probed.module, probed.task, probed.info, dev, probed.seq_len,
                                 estimator.speed, _layout_fields(opts))
    reasons.append(f"{dev.name} is not present here: planned from the estimate alone "
                   "(unconfirmed); run autofit on the target to confirm (or "
                   + fix("--method simulate", "method='simulate'")
                   + " for an exact plan of the simulated step)")
    return None


def _device_trials(probed: _Probed, dataset: Any, max_seq_len: int | None,
                   opts: dict[str, Any], kept: Any = None,
                   whole: _WholeRun | None = None) -> Callable[[TrainConfig], Any]:
    """Real trials: ``measure`` on the worst-case batch of each micro batch size, with the
    run around it (``trial_run``): an evaluation step at the eval batch the estimate gives
    that configuration and, where the modelled run fragments a caching allocator, the run's
    first lengths in its order before the measured steps."""
    from autofit.probe.data import worst_case_batch

    whole = whole if whole is not None else _WholeRun(probed, None, opts)
    batches: dict[int, Any] = {}
    # while the ranks of a trial run: each rank's step, as a status line (not a new trial)
    shown = opts.get("progress")
    rank_progress = getattr(shown, "status", None) or (
        _progress_printer(shown) if shown else None)
    longest: dict[str, Any] = {}  # the largest worst-case batch the key hashed (no collator)
    recipe = opts.get("_recipe")  # the user's DeepSpeed config runs on the ranks
    recipe_ds = recipe is not None and recipe.deepspeed is not None

    def rows(b: int, collator: Any) -> Any:
        return worst_case_batch(dataset, b, max_seq_len=max_seq_len,
                                tokenizer=opts.get("tokenizer"), collator=collator,
                                task=probed.task, text_column=opts.get("text_column"))

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
            if opts.get("collator") is None and sliceable and b <= len(longest["input_ids"]):
                # its first b rows are the worst-case batch of b: no new pass over the data
                # (copied, so that a trial holds and ships b rows, not the whole storage)
                batches[b] = {k: v[:b].clone() for k, v in longest.items()}
            else:
                batches[b] = rows(b, opts.get("collator"))
        return measure(probed.model, config, batches[b], device=probed.device, task=probed.task,
                       isolation=opts.get("isolation", "auto"),
                       timeout_s=opts.get("trial_timeout_s", 600.0),
                       attn_implementation=opts.get("attn_implementation"), lora=opts.get("lora"),
                       quantization_config=opts.get("quantization_config"),
                       run=trial_run(probed, config, kept, None, opts, whole,
                                     outpaced_below=outpaced_below),
                       progress=rank_progress,
                       **({"deepspeed_config": recipe.deepspeed_for(
                           b, config.grad_accum_steps, config.world_size)} if recipe_ds else {}),
                       **({} if timed_steps is None else {"measure_steps": timed_steps}))

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


@dataclass(frozen=True)
class _RunPlan:
    """What the Trainer's arguments say of the run beyond one step: its order and its
    evaluations and saves (the defaults when no ``training_args`` are given)."""

    epochs: float = 1.0
    max_steps: int | None = None
    seed: int = 42
    data_seed: int | None = None
    sampling: str = "random"
    drop_last: bool = False
    eval_steps: int | None = None  # None: the run does not evaluate
    save_steps: int | None = None  # None: the run does not save
    assumed: bool = True  # no training_args: one evaluation and one save assumed

    @classmethod
    def of(cls, base_args: dict[str, Any] | None) -> _RunPlan:
        if base_args is None:  # autofit writes an eval batch: assume the run evaluates
            return cls(eval_steps=10**9, save_steps=10**9)
        a = base_args

        def every(strategy_key: str, steps_key: str) -> int | None:
            strategy = str(a.get(strategy_key) or "no").split(".")[-1].lower()
            if strategy in ("no", "none"):
                return None
            if strategy == "steps":
                n = a.get(steps_key) or a.get("logging_steps") or 500
                return max(1, int(n)) if float(n) >= 1 else None  # a fraction: at the end
            return 10**9  # epoch / best: at the end of the (first) epoch, modelled once
        max_steps = a.get("max_steps")
        evals = every("eval_strategy", "eval_steps")
        if evals is None and a.get("do_eval"):  # a script's trainer.evaluate() after training
            evals = 10**9
        return cls(epochs=float(a.get("num_train_epochs") or 1.0),
                   max_steps=int(max_steps) if max_steps and int(max_steps) > 0 else None,
                   seed=int(a.get("seed") or 42), data_seed=a.get("data_seed"),
                   sampling=str(a.get("train_sampling_strategy") or "random"),
                   drop_last=bool(a.get("dataloader_drop_last")),
                   eval_steps=evals, save_steps=every("save_strategy", "save_steps"),
                   assumed=False)

    def order(self, lengths: Any, config: TrainConfig, max_seq_len: int | None) -> Any:
        from autofit.probe.run import run_order

        return run_order(lengths, micro_batch_size=config.micro_batch_size,
                         grad_accum_steps=config.grad_accum_steps, epochs=self.epochs,
                         max_steps=self.max_steps, seed=self.seed, data_seed=self.data_seed,
                         sampling=self.sampling if self.sampling in ("random", "sequential",
                                                                     "group_by_length")
                         else "random",
                         drop_last=self.drop_last, max_seq_len=max_seq_len)


def _eval_working_set(info: Any, config: TrainConfig, seq_len: int, dev: DeviceInfo,
                      eval_micro: int | None, generate_max_new_tokens: int | None) -> int:
    """Bytes an evaluation with ``eval_micro`` adds between the training steps of ``config``."""
    if eval_micro is None:
        return 0
    from autofit.memory.analytic import weights_bytes
    from autofit.memory.eval import estimate_eval
    from autofit.memory.run import eval_working_set

    ev = estimate_eval(info, eval_micro, seq_len, dev, training=config,
                       generate_max_new_tokens=generate_max_new_tokens)
    return eval_working_set(ev, weights_bytes(info, config))


class _WholeRun:
    """The run around the step, for one ``autofit`` call: its plan (``_RunPlan`` of the
    user's training arguments), the eval batch the estimate gives a configuration at a
    margin (memoised: the margin, every trial and the result ask for it), and the replay
    of a configuration's run through the target's allocator model (one ``Simulator``,
    built when first needed)."""

    def __init__(self, probed: _Probed, base_args: dict[str, Any] | None,
                 opts: dict[str, Any]) -> None:
        self.probed, self.base_args, self.opts = probed, base_args, opts
        self.plan = _RunPlan.of(base_args)
        self._eval: dict[tuple[TrainConfig, float], tuple[int | None, list[str]]] = {}
        self._sim: Any = None

    def order(self, config: TrainConfig) -> Any:
        return self.plan.order(self.probed.data.lengths, config, None)

    def eval_batch(self, config: TrainConfig, margin: float,
                   reasons: list[str] | None = None) -> int | None:
        """``_eval_micro_batch`` of ``config`` at ``margin``; its reason line goes to
        ``reasons`` when given. None when evaluating by generation is not sized here."""
        key = (config, float(margin))
        if key not in self._eval:
            lines: list[str] = []
            p = self.probed
            b = _eval_micro_batch(p.info, config, p.seq_len, p.device, margin,
                                  int(self.opts.get("max_micro_batch", 256)),
                                  self.opts.get("generate_max_new_tokens"), lines)
            self._eval[key] = (b, lines)
        b, lines = self._eval[key]
        if reasons is not None:
            reasons.extend(lines)
        return b

    def replay(self, config: TrainConfig, eval_micro: int | None) -> Any:
        """``search.margin.run_margin`` of ``config``'s run (evaluating at ``eval_micro``)."""
        from autofit.memory.simulate import Simulator
        from autofit.search.margin import run_margin

        p = self.probed
        if self._sim is None:
            self._sim = Simulator(p.module, task=p.task, device=p.device,
                                  model_name=p.info.name, sharding=_layout_fields(self.opts))
        gen = self.opts.get("generate_max_new_tokens")
        return run_margin(self._sim, config, self.order(config), p.device,
                          eval_steps=self.plan.eval_steps,
                          eval_bytes=_eval_working_set(p.info, config, p.seq_len, p.device,
                                                       eval_micro, gen),
                          save_steps=self.plan.save_steps)


def _margin(probed: _Probed, space: Any, estimator: _Estimator, margin: float | None,
            whole: _WholeRun, progress: Any) -> Any:
    """Stage 4b: the margin kept free. Given: as given. Else from evidence
    (``autofit.search.margin``): the run the estimate alone would choose, replayed in the
    Trainer's order with its evaluations and saves, above its longest step, + a safety."""
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


RUN_TRIAL_STEPS = 12  # micro batches of the run's order a trial replays before its steps
# the replay's time bound: a slow step replays fewer lengths (the first always runs, and the
# longest, the timed steps, after it); the 12 short steps of a fast model take well under it
RUN_TRIAL_REPLAY_S = 10.0
# on the CPU the replay runs only for a trial whose longest step peaks within this fraction
# of the budget: the whole run's fragmentation measured by benchmarks/soak.py is at most
# +4.7% of a step (gpt2-dropout: +5.4 MiB of 114 MiB), so further under the budget the
# replay cannot change the verdict (twice that bound, for models the soak did not see)
RUN_TRIAL_REPLAY_WITHIN = 0.10


def trial_run(probed: _Probed, config: TrainConfig, kept: Any,
              base_args: dict[str, Any] | None, opts: dict[str, Any],
              whole: _WholeRun | None = None, outpaced_below: float | None = None) -> Any:
    """The short run a trial of ``config`` replays besides its worst-case steps
    (``autofit.trial.step.RunSpec``), or None.

    - an evaluation step at the eval batch the estimate gives ``config`` (inside the run:
      the optimizer states alive), measured apart, so that the eval batch written is one
      that ran (not when evaluating by generation: a trial runs the forward only);
    - the first ``RUN_TRIAL_STEPS`` micro batches of the run's order, each cut to its
      padded length, before the measured steps: on a caching allocator whose modelled run
      needs more than its longest step (``kept.run_bytes``), and on the CPU whenever the
      lengths vary — short batches put their activations on glibc's heap (blocks under
      its mmap threshold), which the longest batch then finds fragmented: measured on
      ``benchmarks/soak.py``'s gpt2-dropout, +3.7 MiB of a 114 MiB step after 12 steps,
      +5.4 MiB over the whole run (the CPU's margin, ``SAFETY``, is 3%: the replay is kept
      there). Within ``RUN_TRIAL_REPLAY_S`` seconds: slow steps replay fewer lengths; on
      the CPU only when the first timed step peaks within ``RUN_TRIAL_REPLAY_WITHIN`` of
      the budget (further under it the replay cannot change the verdict);
    - the search's budget (``capacity * (1 - margin)``): a trial whose peak passes it stops
      at once (``TrialResult.over_budget``), and the timed steps stop after two that agree
      within half the search's speed tie (``autofit.trial.loop``); with ``outpaced_below``
      (the engine's word: a confirmed rival's speed over ``OUTPACED``) a trial whose first
      timed step is slower stops there.
    """
    from autofit.search.engine import SPEED_TIE
    from autofit.search.margin import SAFETY
    from autofit.trial.step import RunSpec

    dev, seq = probed.device, probed.seq_len
    whole = whole if whole is not None else _WholeRun(probed, base_args, opts)
    margin = kept.fraction if kept is not None else SAFETY
    eval_b = None
    if not opts.get("generate_max_new_tokens"):
        eval_b = whole.eval_batch(config, margin)
    lengths: tuple[int, ...] = ()
    fragments = (kept is not None and kept.run_bytes > 0 if dev.allocator == "cuda"
                 else len(set(probed.data.lengths)) > 1)
    if fragments:
        lengths = tuple(whole.order(config).lengths[:RUN_TRIAL_STEPS])
    return RunSpec(lengths=lengths, eval_batch_size=eval_b, eval_length=seq,
                   stop_above_bytes=int(dev.capacity_bytes * (1 - margin)),
                   replay_s=RUN_TRIAL_REPLAY_S, decisive_spread=SPEED_TIE / 2,
                   outpaced_below_tokens_per_s=outpaced_below,
                   replay_within=RUN_TRIAL_REPLAY_WITHIN if dev.allocator != "cuda" else None)


def _study(probed: _Probed, space: Any, margin: float, objective: str, runner: Any,
           opts: dict[str, Any]) -> tuple[Any, str]:
    """Stage 5: the cache key of this question, and the optuna study that records the trials
    (resume, cache) when real trials run and the cache is on."""
    from autofit.probe.model import fingerprint
    from autofit.probe.versions import library_versions
    from autofit.search import ENGINE_VERSION, cache_key
    from autofit.search.study import collator_identity

    dev = probed.device
    trials_run = runner is not None and dev.present
    key = cache_key({
        "model": fingerprint(probed.info), "seq_len": probed.seq_len,
        "samples": probed.data.num_samples,
        # what the trials are fed: the worst-case rows' content, and the collator
        "batch": runner.digest(space.micro_batches[-1]) if trials_run else None,
        "collator": collator_identity(opts.get("collator")),
        "device": [dev.name, dev.product, dev.capacity_bytes], "versions": library_versions(),
        "space": space.describe(), "margin": margin, "method": opts.get("method", "analytic"),
        "objective": objective, "engine": ENGINE_VERSION,
        # packed samples: the file records how (a cached answer must carry it)
        **({"packing": seen.meta} if (seen := opts.get("_script_data")) and seen.meta else {}),
        **({"recipe": [list(kv) for kv in opts["_recipe"].sharding],
            "deepspeed": opts["_recipe"].deepspeed} if opts.get("_recipe") else {}),
    })
    cache = opts.get("cache", True)
    if not cache or not trials_run:
        return None, key
    from autofit.search.study import open_recorder

    # a cache fault is one warning line and None: the run goes on without the cache
    return open_recorder(key, storage=cache if isinstance(cache, str) else None, space=space,
                         capacity_bytes=dev.capacity_bytes,
                         claim_ttl_s=float(opts.get("trial_timeout_s", 600.0)) + 300.0), key


def _search(probed: _Probed, space: Any, estimator: _Estimator, runner: Any, recorder: Any, *,
            margin: float, add_fragmentation: bool, time_budget_s: float | None,
            started_at: float, progress: Any, opts: dict[str, Any]) -> tuple[Any, Any]:
    """Stage 6: the engine estimates every candidate, ranks them and confirms the best."""
    from autofit.search import Engine

    simulated = runner is not None and not probed.device.present
    engine = Engine(space, probed.device.capacity_bytes, estimate=estimator.total,
                    speed=estimator.speed, trial=runner, seq_len=probed.seq_len, margin=margin,
                    confirm_top=int(opts.get("confirm_top", 3)),
                    max_trials=int(opts.get("max_trials", 12)), time_budget_s=time_budget_s,
                    recorder=recorder, progress=progress, started_at=started_at,
                    add_fragmentation=add_fragmentation,
                    trial_word="simulated" if simulated else "measured")
    return engine.run(), engine


def check_chunked_loss(asked: bool, module: Any, task: str) -> None:
    """Raise ``BadInputError`` when the chunked loss is asked for a model that cannot use it."""
    if not asked:
        return
    why = unsupported_reason(module, task)
    if why is not None:
        raise BadInputError(f"chunked loss: {why}; drop "
                            + fix("--chunked-loss", "chunked_loss=True"))


def _chunked_loss_saving(info: Any, config: TrainConfig, seq: int, dev: Any) -> str:
    """The reason line of a chosen chunked loss: what it saves, by the closed form."""
    from autofit.memory.ranked import estimate_analytic
    from autofit.probe.device import format_bytes as _gib

    on = estimate_analytic(info, config, seq, dev).device_total_bytes
    off = estimate_analytic(info, config.replace(chunked_loss=False), seq, dev).device_total_bytes
    return (f"chunked loss: saves ~{_gib(off - on)} at micro batch {config.micro_batch_size} "
            f"(estimated {_gib(off)} -> {_gib(on)}: no (B, T, V) logits, their fp32 "
            "log-softmax or their gradients)")


def _offloading_saving(info: Any, config: TrainConfig, seq: int, dev: Any) -> str:
    """The reason line of chosen activation offloading: what it saves on the device, the host
    memory it needs and the time its copies take, by the closed form and the speed model."""
    from autofit.memory.ranked import estimate_analytic
    from autofit.probe.device import format_bytes as _gib
    from autofit.search.speed import predict_speed

    on = estimate_analytic(info, config, seq, dev)
    off_cfg = config.replace(activation_offloading=False)
    off = estimate_analytic(info, off_cfg, seq, dev).device_total_bytes
    slower = 1 - predict_speed(info, config, seq, dev).tokens_per_s / max(
        predict_speed(info, off_cfg, seq, dev).tokens_per_s, 1e-9)
    return (f"activation offloading: saves ~{_gib(off - on.device_total_bytes)} of device memory "
            f"at micro batch {config.micro_batch_size} (estimated {_gib(off)} -> "
            f"{_gib(on.device_total_bytes)}), needs ~{_gib(on.host_bytes)} of pinned host memory, "
            f"~{100 * slower:.0f}% slower (host copies)")
def _compile_saving(info: Any, config: TrainConfig, seq: int) -> str:
    """The reason line of a chosen torch.compile: what its rule takes off the eager step."""
    from autofit.memory.analytic import compile_saving_bytes
    from autofit.probe.device import format_bytes as _gib

    n = compile_saving_bytes(info, config, seq)
    what = f"~{_gib(n)} fewer" if n >= 0 else f"~{_gib(-n)} more"
    return (f"torch.compile: {what} activations than eager at micro batch "
            f"{config.micro_batch_size}, estimated (fused pointwise chains: autofit.knobs.compile)")


def _result(probed: _Probed, space: Any, engine: Any, outcome: Any, runner: Any, recorder: Any,
            key: str, whole: _WholeRun, kept: Any, max_seq_len: int | None,
            reasons: list[str]):
    """Stage 7: the ``FitResult`` (estimate, reasons, TrainingArguments, eval batch, the
    candidates), stored in the cache when confirmed; or "nothing fits" with suggestions."""
    from autofit.emit import training_arguments_dict
    from autofit.memory.ranked import estimate_analytic
    from autofit.preflight.cache import model_identity
    from autofit.probe.versions import library_versions
    from autofit.result import FitResult

    info, dev, seq = probed.info, probed.device, probed.seq_len
    base_args, opts = whole.base_args, whole.opts
    margin = kept.fraction
    if outcome.config is None:
        from autofit.search.suggest import nothing_fits

        raise nothing_fits(info, space, engine, seq, dev)
    config = outcome.config
    simulated = runner is not None and not dev.present
    if simulated:
        est = runner.simulator.simulate(config, seq_len=seq)  # memoised: no new run
        reasons.append(f"{len(outcome.trials)} configurations simulated; no trial on hardware")
    else:
        est = estimate_analytic(info, config, seq, dev, _layout_fields(opts))
    confirmed = outcome.confirmed and not simulated
    reasons = outcome.reasons + reasons
    reasons += [n for k in KNOBS if (n := _note(k, config, opts["trainer"]))]
    if confirmed and config.world_size > 1:
        reasons += _ranks_line(outcome, config)
    if config.chunked_loss:
        reasons.append(_chunked_loss_saving(info, config, seq, dev))
    if config.activation_offloading:
        reasons.append(_offloading_saving(info, config, seq, dev))
    if config.torch_compile:
        reasons.append(_compile_saving(info, config, seq))
    kwargs = training_arguments_dict(config, base=base_args, use_cpu=dev.kind == "cpu")
    _recipe_fields(kwargs, opts.get("_recipe"), config, base_args)
    eval_micro = whole.eval_batch(config, margin, reasons)
    eval_micro, eval_need, eval_how = _eval_from_trial(outcome, config, eval_micro, info, seq,
                                                       dev, margin, opts, reasons)
    if eval_micro is not None:
        kwargs["per_device_eval_batch_size"] = eval_micro
    at = next((i + 1 for i, r in enumerate(reasons) if r.startswith("margin:")), len(reasons))
    reasons.insert(at, kept.reason)  # why that margin, beside the engine's line
    est, predicted_run = _whole_run(probed, engine, outcome, est, kept, eval_micro, whole,
                                    reasons, eval_need, eval_how)
    rows = tuple(candidate_row(c) for c in outcome.candidates)
    model = probed.model
    adapter = None  # the PEFT config put on a model given by reference: check rebuilds it
    if not hasattr(model, "parameters") and getattr(probed.module, "peft_config", None):
        from autofit.probe.peft import config_dict

        adapter = config_dict(next(iter(probed.module.peft_config.values())))
    # how a base given by reference was quantized: check rebuilds the same quantized base
    quant = (opts.get("quantization_config").to_dict()
             if opts.get("quantization_config") is not None and not hasattr(model, "parameters")
             else None)
    meta = {"model": probed.name, "task": probed.task, "seq_len": seq, "device": dev.name,
            "margin": margin, "cache_key": key, "target_batch_size": space.target_batch_size,
            "max_seq_len": max_seq_len,
            "model_id": model_identity(probed.module if hasattr(model, "parameters") else model,
                                       adapter, quant),
            "versions": library_versions(), "predicted_run_bytes": predicted_run}
    meta["trainer"] = opts["trainer"]  # which trainer the file is for
    if adapter is not None:
        meta["adapter"] = adapter
    if opts.get("_script_data") is not None:  # packed: check re-derives the same blocks
        meta.update(opts["_script_data"].meta)
    if is_sft_config(opts.get("training_args")):  # emitted as the user's class: SFTConfig
        meta["arguments_class"] = SFT_CONFIG
    if quant is not None:
        meta["quantization"] = quant
    result = FitResult(config=config, estimate=est, trials=() if simulated else tuple(outcome.trials),
                       reasons=tuple(reasons), confirmed=confirmed, device=dev.name,
                       candidates=rows, training_arguments_kwargs=kwargs, meta=meta,
                       eval_micro_batch=eval_micro, predicted_run_bytes=predicted_run)
    from autofit.search.study import is_failed

    # an answer that rests on a failed trial (a crash, a timeout) is not kept: the next
    # run measures that trial again and answers then
    if (recorder is not None and confirmed and not outcome.stopped_early
            and not any(is_failed(t) for t in outcome.trials)):
        recorder.store_result({"config": config.to_dict(), "reasons": list(reasons),
                               "candidates": list(rows), "meta": meta,
                               "eval_micro_batch": eval_micro})
    return result


def _recipe_fields(kwargs: dict[str, Any], recipe: Any, config: TrainConfig,
                   base_args: dict[str, Any] | None) -> None:
    """The tuned file launches the user's recipe, not autofit's: a DeepSpeed config is the
    user's, its numeric batch fields set to the tuned ones (written beside the tuned file:
    ``<stem>-deepspeed.json``; the user's own file is never changed); FSDP fields given in
    ``training_args`` are kept as given."""
    if recipe is None:
        return
    if recipe.deepspeed is not None and config.strategy in ("zero1", "zero2", "zero3"):
        kwargs["deepspeed"] = recipe.deepspeed_for(config.micro_batch_size,
                                                   config.grad_accum_steps, config.world_size)
    elif base_args and base_args.get("fsdp") and "fsdp" in kwargs:
        kwargs["fsdp"] = base_args["fsdp"]
        if base_args.get("fsdp_config"):
            kwargs["fsdp_config"] = base_args["fsdp_config"]


def _note(k: Any, config: TrainConfig, trainer: str) -> str | None:
    """What the user must do besides the fields for knob ``k``'s chosen value; the chunked loss
    for a trainer that does not run it is carried by ``use_liger_kernel`` (the only way the
    search chose it then)."""
    if k.name == "chunked_loss" and config.chunked_loss and not runs_chunked_loss(trainer):
        return ("chunked loss: use_liger_kernel is set (liger-kernel's fused linear cross "
                "entropy, which the Trainer applies from that field)")
    return k.note(getattr(config, k.name))


def _ranks_line(outcome: Any, config: TrainConfig) -> list[str]:
    """``confirmed on every rank: rank 0 1.21 GiB, rank 1 1.23 GiB (rank 1 peaks)``: the
    chosen configuration's trial, rank by rank."""
    from autofit.probe.device import format_bytes

    ran = [t for t in outcome.trials if getattr(t, "per_rank", ()) and t.fits
           and t.config.get("micro_batch_size") == config.micro_batch_size
           and all(t.config.get(k.name) == getattr(config, k.name) for k in KNOBS)]
    if not ran:
        return []
    per = ran[-1].per_rank
    top = max(per, key=lambda r: r["device_total_bytes"] or 0)
    return [f"confirmed on every rank ({len(per)} processes): " + ", ".join(
        f"rank {r['rank']} {format_bytes(r['device_total_bytes'] or 0)}" for r in per)
        + f" (rank {top['rank']} peaks; its peak is the one kept within the budget)"]


def _whole_run(probed: _Probed, engine: Any, outcome: Any, est: MemoryEstimate, kept: Any,
               eval_micro: int | None, whole: _WholeRun, reasons: list[str],
               eval_need: int | None = None, eval_how: str = "") -> tuple[MemoryEstimate, int]:
    """The chosen configuration's whole run: ``est`` with its run fields (the estimate's
    step + what the modelled run adds; an evaluation when it needs more), and the
    predicted run need: the max over the training and the evaluation phases, each from
    the trial when it ran them (the measured step; ``eval_need``, the evaluation by the
    trial: ``_eval_from_trial``, described by ``eval_how``), else from the estimate."""
    import dataclasses

    from autofit.memory.eval import estimate_eval
    from autofit.probe.device import format_bytes

    config, dev, info, seq = outcome.config, probed.device, probed.info, probed.seq_len
    opts = whole.opts
    run = kept.run
    if dev.allocator == "cuda" and kept.config is not None and kept.config != config:
        run = whole.replay(config, eval_micro).run  # the chosen configuration's own run
    extra = run.fragmentation_bytes if run is not None else 0
    best = outcome.choice
    b = config.micro_batch_size
    measured = best.measured.get(b) if best is not None and outcome.confirmed else None
    step = measured if measured is not None else (
        engine.estimated(best, b) if best is not None else est.device_total_bytes)
    evaluation = (estimate_eval(info, eval_micro, seq, dev, training=config,
                                generate_max_new_tokens=opts.get("generate_max_new_tokens"))
                  .device_total_bytes if eval_micro is not None else 0)
    predicted = max(step + extra, eval_need if eval_need is not None else evaluation)
    total = max(est.device_total_bytes + extra, evaluation)
    est = dataclasses.replace(est, run_device_total_bytes=total,
                              run_peak_reserved_bytes=total - dev.overhead_bytes,
                              fits=total <= est.capacity_bytes)
    source = f"{'measured' if measured is not None else 'estimated'} step {format_bytes(step)}"
    parts = [source] + ([f"+ {format_bytes(extra)} over the run"] if extra else [])
    reasons.append(f"whole run: needs ~{format_bytes(predicted)} of "
                   f"{format_bytes(dev.capacity_bytes)} ({' '.join(parts)}"
                   + (f"; an evaluation at eval batch {eval_micro} "
                      + (eval_how if eval_need is not None
                         else f"needs ~{format_bytes(evaluation)}")
                      if eval_micro is not None else "")
                   + ")")
    return est, int(predicted)


def _eval_from_trial(outcome: Any, config: TrainConfig, eval_micro: int | None, info: Any,
                     seq: int, dev: DeviceInfo, margin: float, opts: dict[str, Any],
                     reasons: list[str]) -> tuple[int | None, int | None, str]:
    """The eval batch checked against the evaluation step the chosen configuration's trial
    ran (``trial_run``): kept when it fitted the budget, else re-tuned with the estimate
    scaled to what the trial measured. Returns the eval batch and what its evaluation
    needs by the trial: the measured bytes when the trial ran that batch, the re-tuned
    batch's estimate scaled by the same ratio when it did not (None when no trial ran an
    evaluation: the raw estimate is all there is), and how it was found, for the whole-run
    line ("measured 1013 MiB"; "" when None)."""
    from autofit.memory.eval import estimate_eval
    from autofit.probe.device import format_bytes

    ran = [t for t in outcome.trials if getattr(t, "eval_device_total_bytes", None) is not None
           and not t.oom and t.config.get("micro_batch_size") == config.micro_batch_size
           and all(t.config.get(k.name) == getattr(config, k.name) for k in KNOBS)]
    if eval_micro is None or not ran:
        return eval_micro, None, ""
    t = ran[-1]
    measured = int(t.eval_device_total_bytes)
    budget = int(dev.capacity_bytes * (1 - margin))
    if not t.eval_oom and measured <= budget:
        reasons.append(f"eval micro batch {eval_micro}: its evaluation step measured "
                       f"{format_bytes(measured)} in the trial, inside the run "
                       f"(≤ budget {format_bytes(budget)})")
        return eval_micro, measured, f"measured {format_bytes(measured)}"
    estimated = estimate_eval(info, eval_micro, seq, dev, training=config).device_total_bytes
    # what the trial saw, as a ratio to the estimate (an OOM: at least the capacity)
    ratio = max(1.0, (dev.capacity_bytes * 1.05 if t.eval_oom else measured) / estimated)
    scaled = 1 - (1 - margin) / ratio  # need x ratio <= budget  <=>  need <= cap x (1 - scaled)
    what = ("ran out of memory" if t.eval_oom else f"measured {format_bytes(measured)} > "
            f"budget {format_bytes(budget)}")
    smaller = _eval_micro_batch(info, config, seq, dev, min(scaled, 0.99),
                                min(eval_micro - 1, int(opts.get("max_micro_batch", 256)))
                                if eval_micro > 1 else 1, None, [])
    if smaller is None or smaller >= eval_micro:
        reasons.append(f"eval batch not tuned: the evaluation step at eval batch {eval_micro} "
                       f"{what} in the trial, and no smaller one is estimated to fit")
        return None, None, ""
    need = int(estimate_eval(info, smaller, seq, dev, training=config).device_total_bytes * ratio)
    reasons.append(f"eval micro batch {smaller}: the trial's evaluation step at {eval_micro} "
                   f"{what} inside the run; the estimate scaled x{ratio:.2f} to it "
                   f"(~{format_bytes(need)})")
    return smaller, need, (f"needs ~{format_bytes(need)} (its estimate x{ratio:.2f}, "
                           "the trial's ratio)")


def candidate_row(c: Any) -> dict[str, Any]:
    """One row of the candidates table (plain data, saved in the tuned file's metadata).

    ``estimate_bytes`` is the estimate as made, before any trial; ``calibrated_bytes``
    the same after the trials' calibration (``calibration`` = their ratio).
    """
    return {
        **c.choice, "micro_batch": c.micro_batch, "status": c.status,
        "estimate_bytes": c.raw_estimate_bytes, "calibrated_bytes": c.estimate_bytes,
        "calibration": c.applied_calibration, "measured_bytes": c.measured_bytes,
        "predicted_tokens_per_s": c.predicted_tokens_per_s,
        "measured_tokens_per_s": c.measured_tokens_per_s,
        "failed_micro_batch": c.failed_micro_batch, "reason": c.reason,
    }


def _result_from_cache(cached: dict, recorder: Any, probed: _Probed,
                       base_args: dict[str, Any] | None, trainer: str = "plain"):
    """The ``FitResult`` of the same question answered before (no trial)."""
    from autofit.emit import training_arguments_dict
    from autofit.memory.ranked import estimate_analytic
    from autofit.result import FitResult

    dev = probed.device
    config = TrainConfig(**cached["config"])
    reasons = ["answered from the cache: same model, data (the worst-case rows and the "
               "collator), device, library versions and constraints; no trial run"] + list(cached["reasons"])
    kwargs = training_arguments_dict(config, base=base_args, use_cpu=dev.kind == "cpu")
    eval_micro = cached.get("eval_micro_batch")
    if eval_micro is not None:
        kwargs["per_device_eval_batch_size"] = eval_micro
    return FitResult(
        config=config,
        estimate=estimate_analytic(probed.info, config, probed.seq_len, dev),
        trials=tuple(recorder.all_trials()),
        reasons=tuple(reasons),
        confirmed=True,
        device=dev.name,
        candidates=tuple(cached["candidates"]),
        training_arguments_kwargs=kwargs,
        meta={**cached["meta"], "trainer": trainer},  # the trainer asked now
        from_cache=True,
        eval_micro_batch=eval_micro,
        predicted_run_bytes=cached["meta"].get("predicted_run_bytes"),
    )


@dataclass(frozen=True)
class _SimulatedTrial:
    """What the engine reads from a trial, produced by simulating the step instead."""

    oom: bool
    device_total_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    tokens_per_s: float | None
    error: str | None = None


def _simulated_trials(module: Any, task: str, info: Any, dev: DeviceInfo, seq_len: int,
                      speed: Any, sharding: dict[str, Any] | None = None):
    """A trial function for a device that is not here: the simulated step on fake tensors.

    The engine brackets the limit with it exactly as with real trials (a few
    simulations for the best combinations, not one per micro batch); throughput
    is the model's prediction, since nothing runs on the target.
    """
    from autofit.memory.simulate import Simulator

    sim = Simulator(module, task=task, device=dev, model_name=info.name, sharding=sharding)

    def trial(config: TrainConfig) -> _SimulatedTrial:
        est = sim.simulate(config, seq_len=seq_len)
        total = est.device_total_bytes
        if total > dev.capacity_bytes:
            return _SimulatedTrial(True, None, None, None, None,
                                   f"simulated out of memory: {total} bytes > capacity")
        return _SimulatedTrial(False, total, est.peak_allocated_bytes, est.peak_reserved_bytes,
                               speed(config))

    trial.simulator = sim  # type: ignore[attr-defined]
    return trial


def _simulated_estimate(module: Any, task: str, info: Any, dev: DeviceInfo, seq_len: int,
                        progress: Any = None, sharding: dict[str, Any] | None = None):
    """``config -> device total bytes`` from the simulated step's peak line per combination."""
    from autofit.memory.simulate import Simulator

    sim = Simulator(module, task=task, device=dev, model_name=info.name, sharding=sharding)
    lines: dict[TrainConfig, Any] = {}

    def estimate_total(config: TrainConfig) -> int:
        base = config.replace(micro_batch_size=1, grad_accum_steps=min(config.grad_accum_steps, 2))
        if base not in lines:
            if progress is not None:
                progress(f"simulating {describe_choice(choice_of(base))} "
                         "at micro batches 1, 2 and 4")
            lines[base] = sim.peak_line(base, seq_len=seq_len, batches=(1, 2, 4))
        return lines[base].total(config.micro_batch_size)

    return estimate_total


def _eval_micro_batch(info: Any, config: TrainConfig, seq_len: int, dev: DeviceInfo,
                      margin: float, max_micro: int, generate_max_new_tokens: int | None,
                      reasons: list[str]) -> int | None:
    """per_device_eval_batch_size: tuned apart from training, so an eval OOM never shrinks it."""
    from autofit.errors import DoesNotFitError
    from autofit.memory.eval import tune_eval_batch

    try:
        b = tune_eval_batch(info, seq_len, dev, margin, training=config,
                            max_micro_batch=max_micro,
                            generate_max_new_tokens=generate_max_new_tokens)
    except (DoesNotFitError, BadInputError) as e:
        reasons.append(f"eval batch not tuned: {e}")
        return None
    reasons.append(f"eval micro batch {b}: the largest whose evaluation step inside the run "
                   f"(the {config.optimizer} states alive; no gradients or saved activations) "
                   "is estimated to fit the same budget"
                   + (f", generating {generate_max_new_tokens} tokens"
                      if generate_max_new_tokens else ""))
    return b


def _progress_printer(enabled: Any):
    if not enabled:
        return None
    if callable(enabled):
        return enabled
    from rich.console import Console

    console = Console(stderr=True)
    return lambda line: console.print(f"[dim]autofit:[/] {line}")
