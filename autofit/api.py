"""The public functions: they resolve names, validate, and call the stages.

    >>> from autofit import estimate, TrainConfig
    >>> est = estimate("tiny-llama", TrainConfig(micro_batch_size=4), seq_len=512, device="cpu")
    >>> sorted(est.breakdown)
    ['activations', 'gradients', 'optimizer_states', 'overhead', 'temporaries', 'weights']
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError, MissingDependencyError
from autofit.memory.breakdown import MemoryEstimate
from autofit.probe.device import DeviceInfo, check_precision, resolve_device

__all__ = ["estimate", "METHODS"]

METHODS = ("analytic", "simulate")


def _check_dependencies(config: TrainConfig) -> None:
    if config.optimizer_spec.bnb and importlib.util.find_spec("bitsandbytes") is None:
        raise MissingDependencyError(
            f"optimizer {config.optimizer} needs bitsandbytes: pip install 'autofit[bnb]' "
            "(or choose --optim adamw_torch / adafactor)"
        )


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
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
) -> MemoryEstimate:
    """Estimate the device memory of one training step.

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
        load_in_4bit: QLoRA-style 4-bit base (bitsandbytes), for a model built by name.

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
    from autofit.memory.analytic import estimate_analytic
    from autofit.probe.model import build_model, describe

    config = config if config is not None else TrainConfig()
    if not isinstance(config, TrainConfig):
        raise BadInputError(f"config must be a TrainConfig, got {type(config).__name__}")
    if method not in METHODS:
        raise BadInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    seq = seq_len if seq_len is not None else config.seq_len
    if seq is None:
        raise BadInputError("give seq_len (tokens per sample), e.g. seq_len=1024")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise BadInputError(f"seq_len must be a positive integer, got {seq!r}")
    dev = resolve_device(device)
    check_precision(dev, config.precision)
    _check_dependencies(config)
    module, t = build_model(
        model,
        task=task,
        attn_implementation=attn_implementation,
        lora=lora,
        load_in_4bit=load_in_4bit,
        load_in_8bit=load_in_8bit,
    )
    name = model if isinstance(model, str) else None
    info = describe(module, task=t, name=str(name) if name else None)
    if method == "simulate":
        from autofit.memory.simulate import simulate

        return simulate(module, config, seq_len=seq, device=dev, task=t, model_name=info.name)
    return estimate_analytic(info, config, seq, dev)


_CONSTRAINTS = {
    "precision", "optimizer", "gradient_checkpointing", "max_micro_batch", "training_args",
    "method", "task", "tokenizer", "collator", "text_column", "cache", "confirm_top",
    "max_trials", "progress", "isolation", "trial_timeout_s", "attn_implementation", "lora",
    "load_in_4bit", "optim_args", "world_size", "generate_max_new_tokens",
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

    Estimates every candidate (precision x checkpointing x optimizer x micro batch),
    ranks them by predicted throughput, confirms the best few with real micro-steps
    on the worst-case batch of ``dataset``, and returns the fastest measured one.

    Args:
        model: as for ``estimate`` (a module, a hub id, a directory, a config).
        dataset: a ``datasets.Dataset`` (tokenized, or text + ``tokenizer=``), a
            torch ``Dataset`` or a list of dicts with ``input_ids``.
        device: ``auto``, ``cpu``, ``cpu:4GiB``, ``cuda``, ``cuda:N`` or a catalog card
            (planned from the estimate alone when the card is not present).
        target_batch_size: the effective batch to keep (micro x accumulation x
            devices); default: a user's ``training_args=`` batch, else none.
        max_seq_len: truncation length of the samples.
        margin: fraction of the capacity kept free (default 10%, above the
            allocated peak plus the fragmentation measured in trials).
        objective: ``"throughput"`` (the only one so far).
        time_budget_s: stop starting trials after this long; the best confirmed
            candidate so far is returned.
        **constraints: ``precision=[...]``, ``optimizer=[...]``,
            ``gradient_checkpointing=False``, ``max_micro_batch=``,
            ``training_args=`` (a ``TrainingArguments``, only the tuned fields
            change), ``method=`` (``analytic``; ``simulate``: on a device that is not
            here, the best candidates are bracketed by simulating their step instead of
            planning from the closed form; on one that is, the simulated step is the
            estimate the trials start from), ``tokenizer=``, ``collator=``,
            ``task=``, ``cache=`` (False, True or a storage URL), ``confirm_top=``,
            ``max_trials=``, ``progress=``, ``isolation=``, ``trial_timeout_s=``,
            ``generate_max_new_tokens=`` (eval by generation: sizes the eval batch's
            KV cache).

    Returns:
        A ``FitResult``.

    Raises:
        DoesNotFitError: nothing fits; the message says what would (LoRA, QLoRA or
            a shorter sequence), with the estimated numbers.
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
    from autofit.memory.analytic import estimate_analytic
    from autofit.probe.data import probe_data
    from autofit.probe.model import build_model, describe, fingerprint
    from autofit.probe.versions import library_versions
    from autofit.result import FitResult
    from autofit.search import DEFAULT_MARGIN, ENGINE_VERSION, Engine, build_space, cache_key
    from autofit.search.speed import predict_speed

    unknown = set(constraints) - _CONSTRAINTS
    if unknown:
        raise BadInputError(
            f"unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_CONSTRAINTS))}"
        )
    if objective != "throughput":
        raise BadInputError(f"unknown objective {objective!r}; use 'throughput'")
    method = constraints.get("method", "analytic")
    if method not in METHODS:
        raise BadInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    reasons: list[str] = []
    dev = resolve_device(device)
    module, task = build_model(
        model,
        task=constraints.get("task"),
        attn_implementation=constraints.get("attn_implementation"),
        lora=constraints.get("lora"),
        load_in_4bit=constraints.get("load_in_4bit", False),
    )
    info = describe(module, task=task, name=model if isinstance(model, str) else None)
    if info.trainable_params == 0:
        from autofit.errors import NoTrainableParametersError

        raise NoTrainableParametersError(
            f"{info.name} has no trainable parameter; unfreeze some or add LoRA (lora={{'r': 8}})"
        )
    data = probe_data(dataset, max_seq_len=max_seq_len, tokenizer=constraints.get("tokenizer"),
                      text_column=constraints.get("text_column"))
    seq_len = data.length_max
    reasons.append(f"sequence length {seq_len}: the longest sample"
                   + (f" after truncation at {max_seq_len}" if data.num_truncated else "")
                   + f" (p50 {data.length_p50}, p99 {data.length_p99})")

    training_args = constraints.get("training_args")
    base_args: dict[str, Any] | None = None
    world_size = int(constraints.get("world_size", 1))
    if training_args is not None:
        base_args = training_args.to_dict() if hasattr(training_args, "to_dict") else dict(training_args)
        if target_batch_size is None:
            target_batch_size = (int(base_args.get("per_device_train_batch_size", 8))
                                 * int(base_args.get("gradient_accumulation_steps", 1)) * world_size)
            reasons.append(f"target batch {target_batch_size}: from training_args "
                           "(per-device batch × accumulation × devices)")
    add_fragmentation = margin is None  # the default margin also keeps measured fragmentation
    if margin is None:
        margin = DEFAULT_MARGIN
    max_micro = int(constraints.get("max_micro_batch", 256))
    space = build_space(
        dev,
        precision=constraints.get("precision"),
        optimizer=constraints.get("optimizer"),
        gradient_checkpointing=constraints.get("gradient_checkpointing"),
        max_micro_batch=min(max_micro, max(data.num_samples, 1)) if target_batch_size is None else max_micro,
        target_batch_size=target_batch_size,
        world_size=world_size,
        optim_args=constraints.get("optim_args"),
        bnb_available=importlib.util.find_spec("bitsandbytes") is not None,
        reasons=reasons,
    )

    def estimate_total(config: TrainConfig) -> int:
        return estimate_analytic(info, config, seq_len, dev).device_total_bytes

    def speed(config: TrainConfig) -> float:
        return predict_speed(info, config, seq_len, dev).tokens_per_s

    trial_fn = None
    if dev.present and constraints.get("load_in_4bit") and isinstance(model, str | os.PathLike):
        raise BadInputError(
            "load_in_4bit=True with a model given by name can only be planned for a card "
            "(device='A100-40GB', ...): a trial cannot build a 4-bit base from a config. To "
            "tune on this device, pass the quantized model itself (from_pretrained(..., "
            "quantization_config=BitsAndBytesConfig(load_in_4bit=True)) + peft.get_peft_model)")
    if dev.present:
        from autofit.probe.data import worst_case_batch
        from autofit.trial import measure

        batches: dict[int, Any] = {}

        def trial_fn(config: TrainConfig):
            b = config.micro_batch_size
            if b not in batches:
                batches[b] = worst_case_batch(
                    dataset, b, max_seq_len=max_seq_len, tokenizer=constraints.get("tokenizer"),
                    collator=constraints.get("collator"), task=task,
                    text_column=constraints.get("text_column"))
            return measure(model, config, batches[b], device=dev, task=task,
                           isolation=constraints.get("isolation", "auto"),
                           timeout_s=constraints.get("trial_timeout_s", 600.0),
                           attn_implementation=constraints.get("attn_implementation"),
                           lora=constraints.get("lora"))
    elif method == "simulate":
        trial_fn = _simulated_trials(module, task, info, dev, seq_len, speed)
        reasons.append(f"{dev.name} is not present here: the best candidates were bracketed by "
                       "simulating their training step on fake tensors with the allocator "
                       "model of the target (unconfirmed on hardware); run autofit on the "
                       "target to confirm")
    else:
        reasons.append(f"{dev.name} is not present here: planned from the estimate alone "
                       "(unconfirmed); run autofit on the target to confirm (or "
                       "method='simulate' for an exact plan of the simulated step)")
    simulated = trial_fn is not None and not dev.present
    progress = _progress_printer(constraints.get("progress", False))
    if method == "simulate" and dev.present:
        estimate_total = _simulated_estimate(module, task, info, dev, seq_len, progress)
        reasons.append("estimates: the simulated step (a line through micro batches 1, 2 and "
                       "4 per combination), confirmed by trials")

    recorder = None
    cache = constraints.get("cache", True)
    key = cache_key({
        "model": fingerprint(info), "seq_len": seq_len, "samples": data.num_samples,
        "device": [dev.name, dev.product, dev.capacity_bytes], "versions": library_versions(),
        "space": [space.precisions, space.gradient_checkpointing, space.optimizers,
                  space.micro_batches[-1], space.target_batch_size, space.world_size,
                  space.optim_args],
        "margin": margin, "method": method, "objective": objective, "engine": ENGINE_VERSION,
    })
    if cache and trial_fn is not None and not simulated:
        from autofit.search.study import TrialRecorder, default_storage

        storage = cache if isinstance(cache, str) else default_storage()
        recorder = TrialRecorder(key, storage=storage, precisions=space.precisions,
                                 optimizers=space.optimizers, max_micro_batch=space.micro_batches[-1],
                                 capacity_bytes=dev.capacity_bytes)
        cached = recorder.cached_result()
        if cached is not None:
            return _from_cache(cached, recorder, info, seq_len, dev, base_args)

    engine = Engine(space, dev.capacity_bytes, estimate=estimate_total, speed=speed,
                    trial=trial_fn, seq_len=seq_len, margin=margin,
                    confirm_top=int(constraints.get("confirm_top", 3)),
                    max_trials=int(constraints.get("max_trials", 12)),
                    time_budget_s=time_budget_s, recorder=recorder, progress=progress,
                    started_at=started_at, add_fragmentation=add_fragmentation,
                    trial_word="simulated" if simulated else "measured")
    outcome = engine.run()
    if outcome.config is None:
        from autofit.search.suggest import nothing_fits

        raise nothing_fits(info, space, engine, seq_len, dev)
    config = outcome.config
    if simulated:
        est = trial_fn.simulator.simulate(config, seq_len=seq_len)  # memoised: no new run
        reasons.append(f"{len(outcome.trials)} configurations simulated; no trial on hardware")
    else:
        est = estimate_analytic(info, config, seq_len, dev)
    confirmed = outcome.confirmed and not simulated
    trials = () if simulated else tuple(outcome.trials)
    reasons = outcome.reasons + reasons
    from autofit.emit import training_arguments_dict

    kwargs = training_arguments_dict(config, base=base_args, use_cpu=dev.kind == "cpu")
    if config.precision in ("bf16-true", "16-true"):
        reasons.append(f"{config.precision}: load the model in that dtype "
                       "(torch_dtype=torch.bfloat16 / float16); TrainingArguments has no flag for it")
    eval_micro = _eval_micro_batch(info, config, seq_len, dev, margin, max_micro,
                                   constraints.get("generate_max_new_tokens"), reasons)
    if eval_micro is not None:
        kwargs["per_device_eval_batch_size"] = eval_micro
    rows = tuple(_candidate_row(c) for c in outcome.candidates)
    from autofit.preflight.cache import model_identity

    meta = {"model": model if isinstance(model, str) else info.name, "task": task,
            "seq_len": seq_len, "device": dev.name, "margin": margin, "cache_key": key,
            "target_batch_size": space.target_batch_size, "max_seq_len": max_seq_len,
            "model_id": model_identity(module if hasattr(model, "parameters") else model),
            "versions": library_versions()}
    result = FitResult(config=config, estimate=est, trials=trials,
                       reasons=tuple(reasons), confirmed=confirmed, device=dev.name,
                       candidates=rows, training_arguments_kwargs=kwargs, meta=meta,
                       eval_micro_batch=eval_micro)
    if recorder is not None and confirmed and not outcome.stopped_early:
        recorder.store_result({"config": config.to_dict(), "reasons": list(reasons),
                               "candidates": list(rows), "meta": meta,
                               "eval_micro_batch": eval_micro})
    return result


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
                      speed: Any):
    """A trial function for a device that is not here: the simulated step on fake tensors.

    The engine brackets the limit with it exactly as with real trials (a few
    simulations for the best combinations, not one per micro batch); throughput
    is the model's prediction, since nothing runs on the target.
    """
    from autofit.memory.simulate import Simulator

    sim = Simulator(module, task=task, device=dev, model_name=info.name)

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
                        progress: Any = None):
    """``config -> device total bytes`` from the simulated step's peak line per combination."""
    from autofit.memory.simulate import Simulator

    sim = Simulator(module, task=task, device=dev, model_name=info.name)
    lines: dict[TrainConfig, Any] = {}

    def estimate_total(config: TrainConfig) -> int:
        base = config.replace(micro_batch_size=1, grad_accum_steps=min(config.grad_accum_steps, 2))
        if base not in lines:
            if progress is not None:
                progress(f"simulating {base.precision}"
                         f"{', checkpointing' if base.gradient_checkpointing else ''}, "
                         f"{base.optimizer} at micro batches 1, 2 and 4")
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
        b = tune_eval_batch(info, seq_len, dev, margin, precision=config.precision,
                            max_micro_batch=max_micro,
                            generate_max_new_tokens=generate_max_new_tokens)
    except (DoesNotFitError, BadInputError) as e:
        reasons.append(f"eval batch not tuned: {e}")
        return None
    reasons.append(f"eval micro batch {b}: the largest whose evaluation step (no gradients, "
                   "optimizer states or saved activations) is estimated to fit the same budget"
                   + (f", generating {generate_max_new_tokens} tokens"
                      if generate_max_new_tokens else ""))
    return b


def _candidate_row(c: Any) -> dict[str, Any]:
    return {
        "precision": c.precision, "gradient_checkpointing": c.gradient_checkpointing,
        "optimizer": c.optimizer, "micro_batch": c.micro_batch, "status": c.status,
        "estimate_bytes": c.estimate_bytes, "measured_bytes": c.measured_bytes,
        "predicted_tokens_per_s": c.predicted_tokens_per_s,
        "measured_tokens_per_s": c.measured_tokens_per_s, "calibration": c.calibration,
        "failed_micro_batch": c.failed_micro_batch, "reason": c.reason,
    }


def _from_cache(cached: dict, recorder: Any, info: Any, seq_len: int, dev: DeviceInfo,
                base_args: dict | None):
    from autofit.emit import training_arguments_dict
    from autofit.memory.analytic import estimate_analytic
    from autofit.result import FitResult

    config = TrainConfig(**cached["config"])
    reasons = ["answered from the cache: same model, data shape, device, library versions "
               "and constraints; no trial run"] + list(cached["reasons"])
    kwargs = training_arguments_dict(config, base=base_args, use_cpu=dev.kind == "cpu")
    eval_micro = cached.get("eval_micro_batch")
    if eval_micro is not None:
        kwargs["per_device_eval_batch_size"] = eval_micro
    return FitResult(
        config=config,
        estimate=estimate_analytic(info, config, seq_len, dev),
        trials=tuple(recorder.all_trials()),
        reasons=tuple(reasons),
        confirmed=True,
        device=dev.name,
        candidates=tuple(cached["candidates"]),
        training_arguments_kwargs=kwargs,
        meta=cached["meta"],
        from_cache=True,
        eval_micro_batch=eval_micro,
    )


def _progress_printer(enabled: Any):
    if not enabled:
        return None
    if callable(enabled):
        return enabled
    from rich.console import Console

    console = Console(stderr=True)
    return lambda line: console.print(f"[dim]autofit:[/] {line}")
