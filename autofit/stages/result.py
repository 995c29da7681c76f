"""Stage 7 of ``autofit()``: the ``FitResult`` of the search's outcome (estimate, reasons,
TrainingArguments, eval batch, the candidates), stored in the cache when confirmed; or
"nothing fits" with suggestions. ``result_from_cache``: the same question answered before.

    >>> from autofit.stages.result import fit_result  # autofit() calls it with what the stages made
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.knobs import KNOBS, notes, reason_lines
from autofit.knobs.trl_loss import SFT_CONFIG, is_sft_config
from autofit.stages.probed import Probed
from autofit.stages.run import WholeRun, eval_from_trial, whole_run

if TYPE_CHECKING:
    from autofit.memory.breakdown import MemoryEstimate
    from autofit.memory.simulate import Simulator
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo
    from autofit.result import FitResult
    from autofit.search.engine import Engine, SearchOutcome
    from autofit.search.margin import RunMargin
    from autofit.search.space import SearchSpace
    from autofit.search.study import TrialRecorder

__all__ = ["fit_result", "result_from_cache", "candidate_row", "simulator_of"]


def fit_result(probed: Probed, space: SearchSpace, engine: Engine, outcome: SearchOutcome,
               runner: Any, recorder: TrialRecorder | None, key: str, whole: WholeRun,
               kept: RunMargin, trainer: str, reasons: list[str]) -> FitResult:
    """Stage 7: the ``FitResult`` (estimate, reasons, TrainingArguments, eval batch, the
    candidates), stored in the cache when confirmed; or "nothing fits" with suggestions."""
    from autofit.emit import training_arguments_dict
    from autofit.memory.ranks import estimate_analytic
    from autofit.preflight.cache import model_identity
    from autofit.probe.versions import library_versions
    from autofit.result import FitResult

    info, dev, seq = probed.info, probed.device, probed.seq_len
    base_args, options = whole.base_args, whole.options
    margin = kept.fraction
    if outcome.config is None:
        from autofit.search.suggest import nothing_fits

        raise nothing_fits(info, space, engine, seq, dev)
    config = outcome.config
    simulated = runner is not None and not dev.present
    simulator = simulator_of(probed, runner, options)
    if simulated:
        reasons.append(f"{len(outcome.trials)} configurations simulated; no trial on hardware")
    est = (simulator.simulate(config, seq_len=seq) if simulator is not None  # memoised
           else estimate_analytic(info, config, seq, dev, options.layout_fields))
    confirmed = outcome.confirmed and not simulated
    reasons = outcome.reasons + reasons
    reasons += notes(config, trainer)
    if confirmed and config.world_size > 1:
        reasons += _ranks_line(outcome, config)
    reasons += reason_lines(config, ClosedForm(info, seq, dev, simulator))
    kwargs = training_arguments_dict(config, base=base_args, use_cpu=dev.kind == "cpu")
    _recipe_fields(kwargs, options.recipe, config, base_args)
    eval_micro = whole.eval_batch(config, margin, reasons)
    eval_micro, eval_need, eval_how = eval_from_trial(outcome, config, eval_micro, info, seq,
                                                      dev, margin, options.max_micro_batch,
                                                      reasons)
    if eval_micro is not None:
        kwargs["per_device_eval_batch_size"] = eval_micro
    at = next((i + 1 for i, r in enumerate(reasons) if r.startswith("margin:")), len(reasons))
    reasons.insert(at, kept.reason)  # why that margin, beside the engine's line
    est, predicted_run = whole_run(probed, engine, outcome, est, kept, eval_micro, whole,
                                    reasons, eval_need, eval_how)
    rows = tuple(candidate_row(c) for c in outcome.candidates)
    model = probed.model
    adapter = None  # the PEFT config put on a model given by reference: check rebuilds it
    if not hasattr(model, "parameters") and getattr(probed.module, "peft_config", None):
        from autofit.probe.peft import config_dict

        adapter = config_dict(next(iter(probed.module.peft_config.values())))
    # how a base given by reference was quantized: check rebuilds the same quantized base
    quant_spec = probed.model_spec.quant
    quant = (quant_spec.to_dict() if quant_spec is not None and not hasattr(model, "parameters")
             else None)
    meta = {"model": probed.name, "task": probed.task, "seq_len": seq, "device": dev.name,
            "margin": margin, "cache_key": key, "target_batch_size": space.target_batch_size,
            "max_seq_len": probed.max_seq_len,
            "model_id": model_identity(probed.module if hasattr(model, "parameters") else model,
                                       adapter, quant),
            "versions": library_versions(), "predicted_run_bytes": predicted_run}
    meta["trainer"] = trainer  # which trainer the file is for
    if adapter is not None:
        meta["adapter"] = adapter
    if probed.seen is not None:  # packed: check re-derives the same blocks
        meta.update(probed.seen.meta)
    if is_sft_config(options.training_args):  # emitted as the user's class: SFTConfig
        meta["arguments_class"] = SFT_CONFIG
    if quant is not None:
        meta["quantization"] = quant
    trials = () if simulated else tuple(outcome.trials)
    result = FitResult(config=config, estimate=est, trials=trials,
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


class ClosedForm:
    """The estimators a knob's reason line asks (``autofit.knobs.base.Costs``): the closed
    form's peaks and the speed model, for one model, sequence length and device (each
    configuration estimated once)."""

    def __init__(self, info: ModelInfo, seq: int, dev: DeviceInfo,
                 simulator: Simulator | None = None) -> None:
        self.info, self.seq, self.dev = info, seq, dev
        # method='simulate': where the closed form refuses the model (RWKV), the simulated
        # step's estimates (seconds each, so only there)
        self.simulator = simulator
        self._estimates: list[tuple[TrainConfig, MemoryEstimate]] = []  # a few, by equality

    def _estimate(self, config: TrainConfig) -> MemoryEstimate:
        for seen, est in self._estimates:
            if seen == config:
                return est
        from autofit.errors import BadInputError, UnmodelledStepError
        from autofit.memory.ranks import estimate_analytic

        try:
            est = estimate_analytic(self.info, config, self.seq, self.dev)
        except BadInputError as e:
            # (a step the estimates refuse, a CUDA graph's pool: the simulation refuses it too)
            if self.simulator is None or isinstance(e, UnmodelledStepError):
                raise
            est = self.simulator.simulate(config, seq_len=self.seq)
        self._estimates.append((config, est))
        return est

    def device_bytes(self, config: TrainConfig) -> int:
        return self._estimate(config).device_total_bytes

    def host_bytes(self, config: TrainConfig) -> int:
        return self._estimate(config).host_bytes

    def tokens_per_s(self, config: TrainConfig) -> float:
        from autofit.search.speed import predict_speed

        return predict_speed(self.info, config, self.seq, self.dev).tokens_per_s

    def compile_saving_bytes(self, config: TrainConfig) -> int:
        from autofit.memory.analytic import compile_saving_bytes

        return compile_saving_bytes(self.info, config, self.seq, self.dev)


def simulator_of(probed: Probed, runner: Any, options: Any) -> Simulator | None:
    """With ``method='simulate'``: the simulator whose estimates the result quotes (the
    trials' own for an absent card, whose runs it memoised); None for the closed form."""
    if options.method != "simulate":
        return None
    own = getattr(runner, "simulator", None)
    if own is not None:
        return own
    from autofit.memory.simulate import Simulator

    return Simulator(probed.module, task=probed.task, device=probed.device,
                     model_name=probed.info.name, sharding=options.layout_fields)


def _recipe_fields(kwargs: dict[str, object], recipe: Any, config: TrainConfig,
                   base_args: dict[str, object] | None) -> None:
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
            from autofit.knobs.strategy import fsdp_checkpoints

            if fsdp_checkpoints(config):
                # the plan checkpoints through FSDP's own (the training argument is off); a
                # path or JSON text of the user's is written inline with it
                from autofit.knobs.recipe import fsdp_config_dict

                kwargs["fsdp_config"] = {**fsdp_config_dict(kwargs["fsdp_config"]),
                                         "activation_checkpointing": True}


def _ranks_line(outcome: SearchOutcome, config: TrainConfig) -> list[str]:
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


def candidate_row(c: object) -> dict[str, Any]:
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


def result_from_cache(cached: dict, recorder: TrialRecorder | None, probed: Probed,
                      base_args: dict[str, object] | None, trainer: str = "plain",
                      simulator: Simulator | None = None):
    """The ``FitResult`` of the same question answered before (no trial); its estimate by
    ``simulator`` where given (``method='simulate'``), else the closed form's."""
    from autofit.emit import training_arguments_dict
    from autofit.memory.ranks import estimate_analytic
    from autofit.result import FitResult

    dev = probed.device
    config = TrainConfig(**cached["config"])
    reasons = ["answered from the cache: same model, data (the worst-case rows and the "
               "collator), device, library versions and constraints; no trial run",
               *cached["reasons"]]
    kwargs = training_arguments_dict(config, base=base_args, use_cpu=dev.kind == "cpu")
    eval_micro = cached.get("eval_micro_batch")
    if eval_micro is not None:
        kwargs["per_device_eval_batch_size"] = eval_micro
    return FitResult(
        config=config,
        estimate=(simulator.simulate(config, seq_len=probed.seq_len) if simulator is not None
                  else estimate_analytic(probed.info, config, probed.seq_len, dev)),
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
