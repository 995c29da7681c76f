"""The pre-flight check itself: estimate, one confirming trial (or the cache), the verdict.

``run_check`` is what ``autofit check``, ``autofit.preflight`` and
``AutofitCallback`` share. For one exact configuration it

1. looks the configuration up in the check cache (``autofit.preflight.cache``) —
   a hit answers with no torch import, no model and no trial;
2. otherwise builds the model's description, estimates the step (and the eval step
   when an eval batch is given), lists what can never run (bf16 on a device
   without it, a missing bitsandbytes, sequences longer than the model's
   positions, checkpointing on a model without it), finds a tuning run's trial of
   exactly this configuration, or runs one trial on the worst-case batch — unless
   the estimate is so far over the capacity that no estimator error could
   rescue it (``CERTAIN_OVER``);
3. compares the measured (else estimated) need with ``capacity x (1 - margin)``;
4. with ``fix=True``, when only memory is the problem, tries smaller micro batches
   that divide ``micro x accumulation`` (so the effective batch is kept), largest
   first, each estimated (calibrated by the failed trial) and then confirmed by a
   trial; and a smaller eval batch by ``tune_eval_batch``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError
from autofit.errors import fix as how_to_fix
from autofit.memory.breakdown import MemoryEstimate
from autofit.probe.device import format_bytes
from autofit.trial.result import setup_left_out, with_run_additions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from autofit.config import Collator, ModelSource, Progress
    from autofit.knobs.recipe import Recipe
    from autofit.preflight.cache import CheckCache
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo
    from autofit.probe.packing import ScriptData
    from autofit.probe.run import RunPlan
    from autofit.trial.result import TrialResult

__all__ = ["run_check", "CERTAIN_OVER", "FIX_MARGIN", "MAX_FIX_TRIALS"]

# Estimated need / capacity above which no trial is run: the analytic estimate's
# largest error against measurement is 16% (benchmarks/results/accuracy.md).
CERTAIN_OVER = 1.25
FIX_MARGIN = 0.10  # what a fix keeps free, as `autofit tune` does
MAX_FIX_TRIALS = 3
TIGHT = 0.05  # headroom below this share of the capacity earns a warning


@dataclass
class _Assessment:
    config: TrainConfig
    estimate: MemoryEstimate | None
    trial: Any
    from_cache: bool
    static_problems: list[str]
    eval_estimate: MemoryEstimate | None
    notes: list[str] = field(default_factory=list)


def _estimate_from_dict(d: dict[str, object] | None) -> MemoryEstimate | None:
    if not d:
        return None
    from dataclasses import fields

    names = {f.name for f in fields(MemoryEstimate)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["notes"] = tuple(kw.get("notes", ()))
    return MemoryEstimate(**kw)


def _learned_positions(info: ModelInfo) -> bool:
    """A learned (max_positions, hidden) position table (GPT-2, BERT), not rotary/relative."""
    pos, vocab = info.max_position_embeddings, info.vocab_size
    return any(g.role == "embedding" and len(g.shape) == 2 and g.shape[0] == pos
               and g.shape[0] != vocab for g in info.params)


def _failed(trial: TrialResult | None) -> bool:
    """A trial that ran and failed for a reason other than memory (exit 4, never 3)."""
    return trial is not None and not trial.oom and trial.error is not None


def _divisors_below(n: int, below: int) -> list[int]:
    from autofit.search.space import divisors  # O(sqrt n): n comes from the user's file

    return [d for d in reversed(divisors(n)) if d < below]


class _Checker:
    """One check's context: the model (described lazily), the device, the data and the cache."""

    def __init__(self, model: ModelSource, *, device: DeviceInfo, seq_len: int, dataset: object,
                 task: str | None, margin: float, trial: bool, cache: CheckCache | None,
                 tune_meta: dict[str, object] | None, eval_batch_size: int | None,
                 eval_seq_len: int | None, generate_max_new_tokens: int | None,
                 max_seq_len: int | None, tokenizer: PreTrainedTokenizerBase | None,
                 collator: Collator | None, isolation: str, timeout_s: float | None,
                 progress: Progress | None, recipe: Recipe | None = None,
                 liger_loss: bool = False) -> None:
        from autofit.preflight.cache import model_identity
        from autofit.probe.loading import module_task
        from autofit.probe.versions import library_versions

        self.model = model
        self.dev = device
        self.seq_len = seq_len
        self.dataset = dataset
        self.task = task
        self.margin = margin
        self.run_trials = trial
        self.cache = cache
        self.tune_meta = tune_meta or {}
        self.eval_batch_size = eval_batch_size
        self.eval_seq_len = eval_seq_len or seq_len
        self.generate = generate_max_new_tokens
        self.max_seq_len = max_seq_len
        self.tokenizer = tokenizer
        self.collator = collator
        self.isolation = isolation
        self.timeout_s = timeout_s
        self.progress = progress or (lambda _: None)
        self.recipe = recipe  # the user's launch recipe (autofit.knobs.recipe), or None
        self.refusal: str | None = None  # why the estimate refused the step, where it did
        self.step_fails = False  # ... because the step fails whatever its memory
        self.liger_loss = liger_loss  # the config's chunked loss is liger's (use_liger_kernel)
        # the run's sample lengths and plan (run_check sets them from the dataset): what its
        # other shapes add to a trial of the longest batch on a CPU (``run_growth``)
        self.run: tuple[tuple[int, ...], RunPlan, bool] | None = None  # (+ padding-free)
        self.versions = library_versions()
        # the PEFT config a tune put on a model given by reference (its file's metadata)
        self.adapter = (self.tune_meta.get("adapter")
                        if isinstance(model, (str, os.PathLike)) else None)
        # how a tune quantized a base given by reference: the same quantized base again
        self.quantization = (self.tune_meta.get("quantization")
                             if isinstance(model, (str, os.PathLike)) else None)
        self.model_id = model_identity(model, self.adapter, self.quantization)
        # the task as the key knows it: fixed now (building the model later may resolve it)
        self.task_key = (task if task is not None or not hasattr(model, "parameters")
                         else module_task(model))
        self._info = None
        self.trials_run = 0

    # -- the model, lazily (a cache hit never builds it) ------------------------------
    @property
    def info(self) -> Any:
        if self._info is None:
            from autofit.probe.model import build_model, describe

            module, task = build_model(self.model, task=self.task, peft_config=self.adapter,
                                       quantization_config=self.quantization)
            self.task = task
            self._module = module  # kept: the analytic model may derive coefficients from it
            name = self.model if isinstance(self.model, str) else None
            self._info = describe(module, task=task, name=name)
        return self._info

    @property
    def budget(self) -> int:
        return int(self.dev.capacity_bytes * (1 - self.margin))

    def key(self, config: TrainConfig) -> str:
        from autofit.preflight.cache import check_key

        return check_key(self.model_id, self.task_key, config, self.seq_len, self.dev,
                         self.versions,
                         {"eval_batch_size": self.eval_batch_size, "eval_seq_len": self.eval_seq_len,
                          "generate_max_new_tokens": self.generate,
                          # a stored trial holds what the run's other shapes add (CPU)
                          **({"run_growth": g} if (g := self.run_growth(config)[0]) else {}),
                          **({"recipe": [list(kv) for kv in self.recipe.sharding],
                              "deepspeed": self.recipe.deepspeed}
                             if self.recipe is not None else {})})

    # -- what never runs, whatever the memory -------------------------------------------
    def static_problems(self, config: TrainConfig) -> list[str]:
        from autofit.errors import AutofitError
        from autofit.knobs import KNOBS

        out = []
        for k in KNOBS:  # what the device and the installed libraries allow
            value = getattr(config, k.name)
            try:
                k.check(self.dev, value)
            except AutofitError as e:
                out.append(f"{k.describe(value)} requested: {e}")
        from autofit.knobs import conflict  # a combination no run takes (FSDP2 + bnb optim)

        if (why := conflict({k.name: getattr(config, k.name) for k in KNOBS})) is not None:
            out.append(why)
        info = self.info
        pos = info.max_position_embeddings
        if pos and self.seq_len > pos and _learned_positions(info):
            out.append(f"the longest sample has {self.seq_len} tokens, more than the model's "
                       f"{pos} learned positions (an index error at the first long batch): "
                       f"truncate to max_seq_len={pos} (SFTConfig.max_length)")
        from autofit.probe.quant import check_precision

        try:
            check_precision(info.quant, info.dtype, config.precision)
        except AutofitError as e:
            out.append(str(e))
        if config.gradient_checkpointing and not info.supports_gradient_checkpointing:
            out.append(f"gradient_checkpointing requested, but {info.architecture} does not "
                       "support it: turn it off")
        return out

    def warnings(self) -> list[str]:
        """What may go wrong without stopping the run (needs the model: slow path only)."""
        info = self.info
        pos = info.max_position_embeddings
        if pos and self.seq_len > pos and not _learned_positions(info) and info.blocks:
            return [f"warning: the longest sample has {self.seq_len} tokens, more than the "
                    f"model's max_position_embeddings {pos} (rotary/relative positions run, "
                    "but past what the model was trained on)"]
        return []

    # -- one configuration ---------------------------------------------------------------
    def as_run(self, config: TrainConfig) -> tuple[TrainConfig, str | None]:
        """``config`` as the file's trainer runs it on this model, and why it differs (None:
        it does not): liger's kernels and fused loss only where liger patches the model
        (``autofit.knobs.liger.liger_as_run``)."""
        if not ((self.liger_loss and config.chunked_loss) or config.liger_kernels):
            return config, None
        from autofit.knobs.liger import liger_as_run

        info = self.info  # (builds the model: self._module)
        return liger_as_run(config, self._module, info.name, liger_loss=self.liger_loss)

    def assess(self, config: TrainConfig) -> _Assessment:
        key = self.key(config)
        if self.cache is not None:
            entry = self.cache.lookup(key)
            from autofit.preflight.cache import reusable

            if entry is not None and reusable(entry["trial"], self.dev):
                return _Assessment(config, _estimate_from_dict(entry.get("estimate")),
                                   entry["trial"], True, list(entry.get("static_problems", [])),
                                   _estimate_from_dict(entry.get("eval_estimate")),
                                   ["answered from the check cache: a trial of exactly this "
                                    "configuration, model, data shape, device and library "
                                    "versions; no trial run"])
        static = self.static_problems(config)
        est = self._estimate(config)
        eval_est = self._eval_estimate(config)
        notes: list[str] = self.warnings()
        trial = None
        from_cache = False
        if self.cache is not None and self.tune_meta.get("cache_key"):
            trial = self._tune_trial(config)
            if trial is not None:
                from_cache = True
                notes.append("answered from the tuning run's study: a trial of exactly this "
                             "configuration on this device; no trial run")
        if trial is None:
            trial, why = self._maybe_trial(config, est, static)
            if why:
                notes.append(why)
        if trial is not None and self.cache is not None and (trial.oom or trial.error is None):
            # a tuning trial is copied too, so that the next check needs no model at all
            self.cache.store(key, {"trial": trial, "estimate": est.to_dict() if est else None,
                                   "eval_estimate": eval_est.to_dict() if eval_est else None,
                                   "static_problems": static})
        return _Assessment(config, est, trial, from_cache, static, eval_est, notes)

    def _estimate(self, config: TrainConfig) -> MemoryEstimate | None:
        from autofit.errors import UnmodelledStepError
        from autofit.memory.ranks import estimate_analytic

        try:
            est = estimate_analytic(self.info, config, self.seq_len, self.dev,
                                    self.recipe.layout_fields if self.recipe else None)
        except UnmodelledStepError as e:  # memory it does not model (CUDA graphs): say so
            from autofit.errors import StepFailsError

            self.step_fails = isinstance(e, StepFailsError)
            self.refusal = (f"the step fails whatever its memory, as the run's would: {e}"
                            if self.step_fails else f"cannot tell: {e}")
            return None
        except BadInputError:
            return None  # not a transformer autofit recognises: the trial decides
        extra, _ = self.run_growth(config)
        if not extra:
            return est
        import dataclasses

        total = est.device_total_bytes + extra  # the run's, as the tune's estimate holds it
        return dataclasses.replace(est, run_device_total_bytes=total,
                                   run_peak_reserved_bytes=total - self.dev.overhead_bytes,
                                   fits=total <= est.capacity_bytes)

    def _eval_estimate(self, config: TrainConfig) -> MemoryEstimate | None:
        if not self.eval_batch_size:
            return None
        from autofit.memory.eval import estimate_eval

        try:
            e = estimate_eval(self.info, self.eval_batch_size, self.eval_seq_len, self.dev,
                              training=config,  # evaluation inside the training run
                              generate_max_new_tokens=self.generate)
        except BadInputError:
            return None
        extra, _ = self.run_growth(config)  # beside the kernels the run's shapes left
        if not extra:
            return e
        import dataclasses

        total = e.device_total_bytes + extra
        return dataclasses.replace(e, run_device_total_bytes=total,
                                   run_peak_reserved_bytes=total - self.dev.overhead_bytes,
                                   fits=total <= e.capacity_bytes)

    def _tune_trial(self, config: TrainConfig) -> Any:
        meta = self.tune_meta
        if meta.get("model_id") != self.model_id or meta.get("versions") != self.versions:
            return None
        return self.cache.lookup_tune(meta["cache_key"], config, self.seq_len, self.dev)

    def _maybe_trial(self, config: TrainConfig, est: MemoryEstimate | None,
                     static: list[str]) -> tuple[Any, str | None]:
        if not self.run_trials:
            return None, "no trial (trial=False): the verdict is the estimate's"
        if not self.dev.present:
            return None, (f"{self.dev.name} is not present here: the verdict is the estimate's "
                          "(run the check on the target to confirm)")
        if static:
            return None, "no trial: the configuration cannot run here as it is"
        if config.world_size > 1:
            from autofit.errors import AutofitError
            from autofit.trial.ranks import check_ranks

            try:
                check_ranks(config, self.dev)
            except AutofitError as e:
                return None, f"no trial: {e}; the verdict is the estimate's"
        if est is not None and est.device_total_bytes > CERTAIN_OVER * self.dev.capacity_bytes:
            over = est.device_total_bytes / self.dev.capacity_bytes - 1
            return None, (f"no trial: the estimate is {over:.0%} over the capacity, beyond the "
                          f"estimator's error ({CERTAIN_OVER - 1:.0%} allowed)")
        from autofit.trial import measure

        self.progress(f"trial: micro batch {config.micro_batch_size} x {self.seq_len} tokens on "
                      f"{self.dev.name}")
        self.trials_run += 1
        result = measure(self.model, config, self.dataset, device=self.dev, task=self.task,
                         peft_config=self.adapter, quantization_config=self.quantization,
                         seq_len=self.max_seq_len if self.dataset is not None else self.seq_len,
                         isolation=self.isolation, timeout_s=self.timeout_s,
                         tokenizer=self.tokenizer, collator=self.collator,
                         progress=self.progress if config.world_size > 1 else None,
                         **({"deepspeed_config": self.recipe.deepspeed}
                            if self.recipe is not None and self.recipe.deepspeed is not None
                            else {}))
        return self.as_run_counts(result, config), None

    def run_growth(self, config: TrainConfig) -> tuple[int, int]:
        """(bytes, shapes): what the run's other micro-batch shapes leave above a step of
        its longest batch on a CPU whose 16-bit matmuls keep their oneDNN kernels
        (``memory.analytic.cpu_half_run_growth``); (0, 0) elsewhere or without the run."""
        if self.run is None or self.dev.allocator == "cuda":
            return 0, 0
        from autofit.memory.analytic import cpu_half_run_growth

        lengths, plan, padding_free = self.run
        shapes, _ = plan.order(lengths, config, self.max_seq_len).other_shapes(padding_free)
        return cpu_half_run_growth(self.info, config, self.dev, shapes,
                                   evaluates=plan.eval_steps is not None), shapes

    def as_run_counts(self, result: Any, config: TrainConfig) -> Any:
        """This check's trial as the run counts it (a tuning run's trials are already):
        on a CPU, what the run's other micro-batch shapes leave of oneDNN's 16-bit kernels
        (``memory.analytic.cpu_half_run_growth``, as the tune's ``WholeRun.with_growth``)
        and what the set-up step left resident (``setup_counted``), with a note."""
        if result.device_total_bytes is None or self.dev.allocator == "cuda":
            return result
        extra, shapes = self.run_growth(config)
        once = setup_left_out(result)
        if not extra and not once:
            return result
        notes = [f"+ {format_bytes(extra)} for the run's {shapes} other micro-batch shapes: on "
                 "this CPU oneDNN keeps its 16-bit kernels of every matmul shape for good"
                 ] if extra else []
        if once:
            notes.append(f"+ {format_bytes(once)} that the trial's set-up step left resident "
                         "(one-time set-up), which a run counts")
        return with_run_additions(result, extra, notes)

    # -- the verdict ---------------------------------------------------------------------
    def need(self, a: _Assessment) -> tuple[int | None, str]:
        """(bytes needed, where the number comes from)."""
        if a.trial is not None and a.trial.fits and a.trial.device_total_bytes is not None:
            # + what the trial's set-up step left resident on a CPU: the run counts it
            return int(a.trial.device_total_bytes) + setup_left_out(a.trial), "measured"
        if a.trial is not None and a.trial.oom:
            return None, "out of memory in a trial"
        if a.estimate is not None:
            return _run_total(a.estimate), "estimated"
        return None, "unknown"

    def memory_problem(self, a: _Assessment) -> str | None:
        c = a.config
        where = f"micro batch {c.micro_batch_size} x {self.seq_len} tokens"
        if a.trial is not None and a.trial.oom:
            est = (f" (estimate {format_bytes(a.estimate.device_total_bytes)})"
                   if a.estimate else "")
            return (f"does not fit: {where} ran out of memory in a trial on {self.dev.name} "
                    f"({format_bytes(self.dev.capacity_bytes)}){est}")
        if _failed(a.trial):  # never a memory verdict: the cause, and no smaller micro batch
            return (f"the trial failed for a reason other than memory: {a.trial.error}; "
                    "fix that cause (the memory is not measured)")
        if a.trial is not None and not a.trial.fits:
            return f"the trial failed ({a.trial.error}); the configuration is not confirmed"
        need, source = self.need(a)
        if need is None:
            if self.refusal:
                return self.refusal
            return "cannot tell: no estimate for this model and no trial"
        if need > self.budget:
            kept = f" less a {self.margin:.0%} margin" if self.margin else ""
            return (f"does not fit by {format_bytes(need - self.budget)} at {where}: {source} "
                    f"{format_bytes(need)} > {format_bytes(self.budget)} ({self.dev.name}{kept})")
        return None

    def eval_problem(self, a: _Assessment) -> str | None:
        e = a.eval_estimate
        if e is None or _run_total(e) <= self.budget:
            return None
        return (f"evaluation does not fit: per_device_eval_batch_size {self.eval_batch_size} x "
                f"{self.eval_seq_len} tokens needs ~{format_bytes(_run_total(e))} > "
                f"{format_bytes(self.budget)} (estimate)")

    def calibration(self, a: _Assessment) -> float:
        if a.estimate is None:
            return 1.0
        raw = _run_total(a.estimate)
        if a.trial is not None and a.trial.fits and a.trial.device_total_bytes:
            return a.trial.device_total_bytes / raw
        if a.trial is not None and a.trial.oom:
            return max(1.0, self.dev.capacity_bytes / raw)
        return 1.0

    # -- the fix -------------------------------------------------------------------------
    def split_batch(self, first: _Assessment) -> tuple[_Assessment | None, list[str]]:
        """The largest smaller micro batch (same effective batch) that fits, or None."""
        c = first.config
        product = c.micro_batch_size * c.grad_accum_steps
        ratio = self.calibration(first)
        budget = int(self.dev.capacity_bytes * (1 - max(self.margin, FIX_MARGIN)))
        notes: list[str] = []
        tried = 0
        for m in _divisors_below(product, c.micro_batch_size):
            candidate = c.replace(micro_batch_size=m, grad_accum_steps=product // m)
            est = self._estimate(candidate)
            if est is not None and _run_total(est) * ratio > budget:
                continue
            if tried >= MAX_FIX_TRIALS:
                notes.append(f"stopped after {MAX_FIX_TRIALS} fix trials")
                break
            tried += 1
            a = self.assess(candidate)
            if a.trial is not None and a.trial.fits:
                ratio = max(ratio, self.calibration(a))
            if self.memory_problem(a) is None:
                return a, notes
        return None, notes

    def suggestion(self, first: _Assessment) -> str | None:
        """Estimate-only: the micro batch a fix would try first (for the error message)."""
        c = first.config
        product = c.micro_batch_size * c.grad_accum_steps
        ratio = self.calibration(first)
        budget = int(self.dev.capacity_bytes * (1 - max(self.margin, FIX_MARGIN)))
        for m in _divisors_below(product, c.micro_batch_size):
            est = self._estimate(c.replace(micro_batch_size=m, grad_accum_steps=product // m))
            if est is not None and _run_total(est) * ratio <= budget:
                how = how_to_fix(f"set per_device_train_batch_size: {m} and "
                          f"gradient_accumulation_steps: {product // m} in the file",
                          "pass fix=True")
                return (f"micro batch {m} x accumulation {product // m} keeps the effective batch "
                        f"{c.effective_batch_size} and is estimated to fit: {how}")
        return None


def run_check(
    model: ModelSource,
    config: TrainConfig,
    *,
    seq_len: int | None = None,
    dataset: object = None,
    device: str | DeviceInfo = "auto",
    task: str | None = None,
    margin: float = 0.0,
    trial: bool = True,
    cache: bool | str = True,
    tune_meta: dict[str, object] | None = None,
    eval_batch_size: int | None = None,
    eval_seq_len: int | None = None,
    generate_max_new_tokens: int | None = None,
    fix: bool = False,
    eval_required: bool = True,
    seq_len_source: str = "as given",
    max_seq_len: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    collator: Collator | None = None,
    isolation: str = "auto",
    timeout_s: float | None = 600.0,
    progress: Progress | None = None,
    block_size: int | None = None,
    packing: str | None = None,
    recipe: Recipe | None = None,
    trainer: str | None = None,
    liger_loss: bool = False,
    sft: Any = None,
    run_args: dict[str, object] | None = None,
) -> Any:
    """Check one configuration (see the module docstring); returns a ``PreflightReport``.

    ``block_size`` packs the dataset into blocks of that many tokens first (``packing``: how,
    default ``group_texts``; ``autofit.probe.packing``). ``recipe``: the user's launch recipe
    (``autofit.knobs.recipe.Recipe``, already applied to ``config``): its sizes and DeepSpeed
    config are what is estimated and tried.

    ``eval_required=False`` reports an eval batch that would not fit as a reason
    (a warning), not a problem: the run may never evaluate. ``seq_len_source`` says
    where ``seq_len`` came from, for the reasons. ``trainer`` (``"plain"``, ``"autofit"``,
    ``"trl"``; default: the one ``config`` implies) is what will run it: a lever it does not
    run (the chunked loss outside ``autofit``) is bad input (``autofit.knobs.trainer``).
    ``sft``: an ``SFTConfig`` (or a ``trl sft --config`` file's fields) whose trainer
    prepares ``dataset`` (each text ending in EOS, truncated at ``max_length`` or packed),
    as the tune planned it (``autofit.probe.packing.as_script_sees``).
    ``run_args``: the TrainingArguments fields of the run (its order, evaluations): on a
    CPU whose 16-bit matmuls keep their oneDNN kernels, a trial of the longest batch is
    short of what the run's other shapes leave (``memory.analytic.cpu_half_run_growth``),
    which the check adds to its own trials as the tune adds it to its (None: the Trainer's
    defaults, an evaluation assumed).
    ``liger_loss``: ``config``'s chunked loss is liger's fused loss (a file's
    ``use_liger_kernel`` under a plain or TRL trainer), which runs only on the model types
    liger patches: on another the model's own loss is checked (``_Checker.as_run``).

    Raises:
        AutofitError: bad input (unknown model or device, no sequence length ...).
    """
    from autofit.preflight.verdict import PreflightReport

    config, trainer, dev, reasons = _checked_request(config, margin, trainer, device, recipe)
    seen, dataset, max_seq_len, seq_len, lengths = _sequence_length(
        dataset, seq_len, reasons, block_size=block_size, max_seq_len=max_seq_len,
        packing=packing, tokenizer=tokenizer, seq_len_source=seq_len_source, sft=sft)
    store = None
    if cache:
        from autofit.preflight.cache import CheckCache

        store = CheckCache(cache if isinstance(cache, str) else None)
    checker = _Checker(model, device=dev, seq_len=int(seq_len), dataset=dataset, task=task,
                       margin=margin, trial=trial, cache=store, tune_meta=tune_meta,
                       eval_batch_size=eval_batch_size, eval_seq_len=eval_seq_len,
                       generate_max_new_tokens=generate_max_new_tokens,
                       max_seq_len=max_seq_len, tokenizer=tokenizer, collator=collator,
                       isolation=isolation, timeout_s=timeout_s, progress=progress,
                       recipe=recipe, liger_loss=liger_loss)
    if seen is not None and seen.block_size is not None:  # a block past the positions: exit 2
        from autofit.probe.packing import check_block_size

        info = checker.info
        check_block_size(seen.block_size, name=seen.source, max_positions=(
            info.max_position_embeddings if _learned_positions(info) else None))
    config, why = checker.as_run(config)  # (what the file's trainer runs on this model)
    if why:
        reasons.append(why)
    padding_free = bool(seen is not None and seen.padding_free)
    if lengths is not None and (len(set(lengths)) > 1 or padding_free):
        from autofit.probe.run import RunPlan

        checker.run = (tuple(lengths), RunPlan.of(run_args), padding_free)
    first = checker.assess(config)
    changes: dict[str, tuple[int | None, int | None]] = {}
    final, fix_notes = _fixed_training_batch(checker, first, fix, changes, reasons)
    problems = list(final.static_problems)
    mem = checker.memory_problem(final)
    if mem:
        hint = (checker.suggestion(final) if not fix and final.config.micro_batch_size > 1
                and not _failed(final.trial) else None)
        problems.append(mem + (f"; {hint}" if hint else ""))
    eval_batch = _fixed_eval_batch(checker, final, fix, eval_required, changes, problems,
                                   reasons, eval_batch_size=eval_batch_size, margin=margin,
                                   generate_max_new_tokens=generate_max_new_tokens)
    reasons += first.notes + (final.notes if final is not first else []) + fix_notes
    if not problems:
        reasons += _fit_lines(checker, final)
    return PreflightReport(
        fits=not problems,
        config=final.config,
        requested=first.config,
        estimate=final.estimate,
        trial=final.trial,
        from_cache=final.from_cache,
        problems=tuple(problems),
        reasons=tuple(reasons),
        changes=changes,
        device=dev.name,
        capacity_bytes=dev.capacity_bytes,
        seq_len=int(seq_len),
        eval_estimate=final.eval_estimate,
        eval_batch_size=eval_batch,
        trials_run=checker.trials_run,
        step_fails=bool(problems) and checker.step_fails and final.trial is None,
    )


def _run_total(est: MemoryEstimate) -> int:
    """An estimate's device total as the run counts it (``run_device_total_bytes``: with what
    the run's other shapes leave on a CPU, ``_Checker.run_growth``), else its step's."""
    return int(est.run_device_total_bytes or est.device_total_bytes)


def _checked_request(config: TrainConfig, margin: float, trainer: str | None,
                     device: str | DeviceInfo, recipe: Recipe | None,
                     ) -> tuple[TrainConfig, str, DeviceInfo, list[str]]:
    """Step 1 of ``run_check``: the margin and config checked, the levers the trainer runs,
    the device (one per rank): ``(config, trainer, device, the request's reason lines)``."""
    from autofit.probe.device import resolve_device

    if not 0 <= margin < 1:
        raise BadInputError(f"margin must be in [0, 1), got {margin}")
    if not isinstance(config, TrainConfig):
        raise BadInputError(f"config must be a TrainConfig, got {type(config).__name__}")
    from autofit.knobs.trainer import CLASS_NAME, Trainer, for_trainer

    named = trainer is not None
    config, trainer = for_trainer(config, trainer)
    dev = resolve_device(device)
    if config.world_size > 1:  # each rank a device like this one
        import dataclasses

        from autofit.probe.device import check_ranks_per_node

        # the ranks come from a flag, the launch file or the tuned file's metadata (edited)
        check_ranks_per_node(config.nproc_per_node, dev, "nproc_per_node")

        dev = dataclasses.replace(dev, nproc_per_node=config.nproc_per_node, nnodes=config.nnodes)
    reasons: list[str] = []
    if recipe is not None:
        reasons += recipe.lines(config.world_size)
    if named:
        reasons.append(f"checked for {CLASS_NAME[Trainer(trainer)]} (trainer {trainer})")
    if config.world_size > 1:
        reasons.append(f"{config.world_size} ranks ({config.strategy}"
                       + (f", offload {config.offload}" if config.offload != "none" else "")
                       + f"), each on a {dev.name}: the verdict is the peaking rank's")
    return config, trainer, dev, reasons


def _sequence_length(dataset: object, seq_len: int | None, reasons: list[str], *,
                     block_size: int | None, max_seq_len: int | None, packing: str | None,
                     tokenizer: PreTrainedTokenizerBase | None, seq_len_source: str,
                     sft: Any = None,
                     ) -> tuple[ScriptData | None, object, int | None, int, list[int] | None]:
    """Step 2 of ``run_check``: the sequence length checked, the longest sample of the
    dataset as the script sees it (packed, truncated) or ``seq_len`` as given, its reason
    appended: ``(what the script sees, the dataset, max_seq_len, seq_len, every sample's
    length or None)``."""
    seen = None
    lengths = None
    if dataset is not None:
        from autofit.probe.data import probe_data
        from autofit.probe.packing import as_script_sees

        seen = as_script_sees(dataset, block_size=block_size, max_seq_len=max_seq_len,
                              packing=packing, sft=sft, tokenizer=tokenizer)
        dataset, max_seq_len = seen.dataset, seen.max_seq_len
        reasons += seen.reasons
        data = probe_data(dataset, max_seq_len=max_seq_len, tokenizer=tokenizer)
        seq_len = data.length_max
        lengths = list(data.lengths)
        reasons.append(f"sequence length {seq_len}: the longest sample"
                       + (f" after truncation at {max_seq_len}" if data.num_truncated else "")
                       + f" (p50 {data.length_p50}, p99 {data.length_p99})")
    elif seq_len is None:
        raise BadInputError("give a dataset or seq_len (tokens of the longest sample)")
    elif block_size is not None:
        raise BadInputError("block_size packs a dataset: give the dataset too")
    else:
        reasons.append(f"sequence length {seq_len}: {seq_len_source} (no dataset: the trial "
                       "batch is random tokens of that length)")
    return seen, dataset, max_seq_len, seq_len, lengths


def _fixed_training_batch(checker: _Checker, first: _Assessment, fix: bool,
                          changes: dict[str, tuple[int | None, int | None]],
                          reasons: list[str]) -> tuple[_Assessment, list[str]]:
    """Step 3 of ``run_check``: with ``fix``, a training batch that does not fit split into a
    smaller micro batch and more accumulation (the change and its reason recorded):
    ``(the assessment kept, the fix's notes)``."""
    mem = checker.memory_problem(first)
    if not (mem and fix and not first.static_problems and not _failed(first.trial)):
        return first, []
    fixed, fix_notes = checker.split_batch(first)
    if fixed is None:
        return first, fix_notes
    c0, c1 = first.config, fixed.config
    changes["per_device_train_batch_size"] = (c0.micro_batch_size, c1.micro_batch_size)
    changes["gradient_accumulation_steps"] = (c0.grad_accum_steps, c1.grad_accum_steps)
    reasons.append(f"fixed: {mem}; micro batch {c1.micro_batch_size} x accumulation "
                   f"{c1.grad_accum_steps} fits and keeps the effective batch "
                   f"{c1.effective_batch_size}")
    return fixed, fix_notes


def _fixed_eval_batch(checker: _Checker, final: _Assessment, fix: bool, eval_required: bool,
                      changes: dict[str, tuple[int | None, int | None]], problems: list[str],
                      reasons: list[str], *, eval_batch_size: int | None, margin: float,
                      generate_max_new_tokens: int | None) -> int | None:
    """Step 4 of ``run_check``: an eval batch that does not fit is fixed (``fix``), a
    problem (``eval_required``) or a warning; the eval batch kept."""
    eval_batch = eval_batch_size
    ev = checker.eval_problem(final)
    if ev and fix:
        from autofit.errors import DoesNotFitError
        from autofit.memory.eval import tune_eval_batch

        try:
            eval_batch = tune_eval_batch(checker.info, checker.eval_seq_len, checker.dev,
                                         max(margin, FIX_MARGIN), training=final.config,
                                         max_micro_batch=max(1, eval_batch_size - 1),
                                         generate_max_new_tokens=generate_max_new_tokens)
        except DoesNotFitError as e:
            problems.append(f"{ev}; {e}")
        else:
            changes["per_device_eval_batch_size"] = (eval_batch_size, eval_batch)
            reasons.append(f"fixed: {ev}; per_device_eval_batch_size {eval_batch} fits "
                           "(the training batch is untouched)")
    elif ev and eval_required:
        problems.append(ev)
    elif ev:
        reasons.append(f"warning, if the run evaluates: {ev}")
    return eval_batch


def _fit_lines(checker: _Checker, final: _Assessment) -> list[str]:
    """Step 5 of ``run_check``, when it fits: what it needs of the device, and ``tight`` when
    little is left."""
    dev = checker.dev
    need, source = checker.need(final)
    if need is None:
        return []
    head = dev.capacity_bytes - need
    out = [f"fits: {source} {format_bytes(need)} of {format_bytes(dev.capacity_bytes)} "
           f"on {dev.name} ({format_bytes(head)} headroom)"]
    if head < TIGHT * dev.capacity_bytes:
        out.append(f"tight: less than {TIGHT:.0%} headroom; fragmentation over a long run "
                   "may need more (tune with a margin: autofit tune)")
    return out
