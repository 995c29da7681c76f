"""Compare PEFT methods on the user's own model, data and device.

The PEFT seed's advice — "not all PEFT methods are built alike: filter the comparison
by peak accelerator memory" — done for you. ``compare_peft`` puts each method on the
model (peft's defaults unless a config is given), and for each reports

* the trainable parameters,
* the estimated device total of one training step at ``micro_batch_size``,
* the largest micro batch whose estimate fits the device with the margin,
* the predicted throughput there (``autofit.search.speed``),

estimated for every method (the analytic model, whose coefficients for a method
outside its table are derived from the method's own forward; or the simulator) and,
on a present device, confirmed by trials for the ``confirm_top`` fastest. autofit
never switches the method itself — it changes what is trained — the comparison is
for the user to choose.

    >>> c = compare_peft("tiny-llama", seq_len=64, device="cpu:2GiB",
    ...                  methods=["lora", "ia3"], confirm_top=0)
    >>> [r.method for r in c.rows], c.rows[0].max_micro_batch > 0
    (['lora', 'ia3'], True)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.config import ModelSpec, TrainConfig
from autofit.errors import AutofitError, BadInputError, fix

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from autofit.config import ModelSource
    from autofit.probe.device import DeviceInfo

__all__ = ["DEFAULT_METHODS", "PeftRow", "PeftComparison", "compare_peft"]

# Compared when no methods are named: every method autofit models that needs no
# per-model setting beyond peft's defaults (adaption prompt is for Llama-like models
# only; a method that cannot be put on the model gets a row that says why).
DEFAULT_METHODS = ("lora", "dora", "ia3", "loha", "lokr", "vera", "oft", "boft", "adalora",
                   "fourierft", "vblora", "randlora", "hra", "prefix_tuning", "prompt_tuning",
                   "p_tuning", "adaption_prompt", "ln_tuning", "trainable_tokens")


@dataclass(frozen=True)
class PeftRow:
    """One method on the model. ``error`` says why it could not be estimated (then the
    numbers are None); ``measured_*`` are set for the methods a trial confirmed."""

    method: str
    peft_config: dict[str, Any] | None = None
    trainable_params: int | None = None
    peak_bytes: int | None = None  # estimated device total at the compared micro batch
    max_micro_batch: int | None = None  # largest that fits (0: not even 1)
    tokens_per_s: float | None = None  # predicted at max_micro_batch
    measured_bytes: int | None = None  # a trial's device total at max_micro_batch
    measured_oom: bool | None = None
    measured_tokens_per_s: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class PeftComparison:
    """The rows of ``compare_peft``, with what they were computed for."""

    model: str
    device: str
    capacity_bytes: int
    budget_bytes: int  # capacity less the margin: what "fits" means
    seq_len: int
    micro_batch_size: int
    config: TrainConfig
    method: str  # "analytic" | "simulate"
    rows: tuple[PeftRow, ...] = field(default=())

    @property
    def best(self) -> PeftRow | None:
        """The method predicted fastest among those that fit (a trial's OOM rules one
        out); ties go to the larger micro batch, then the smaller peak. Predictions rank
        every row alike; measured speeds exist only for the confirmed few."""
        ok = [r for r in self.rows if r.error is None and (r.max_micro_batch or 0) > 0
              and not r.measured_oom]
        return max(ok, key=lambda r: (round(r.tokens_per_s or 0.0, 6), r.max_micro_batch or 0,
                                      -(r.peak_bytes or 0)), default=None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = self.config.to_dict()
        d["best"] = self.best.method if self.best else None
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def table(self, width: int = 110) -> str:
        """The rows as a terminal table (rich)."""
        from autofit.report.compare import render_comparison

        return render_comparison(self, width=width)

    def plot(self, path: str | Path) -> Path:
        """Draw the comparison as a PNG (peak memory and largest micro batch per method)."""
        from autofit.report.compare import plot_comparison

        return plot_comparison(self, path)


def _method_config(m: str | dict[str, object]) -> tuple[str, Any]:
    """(the row's name, the request) of one named or configured method; an unknown name or a
    method autofit refuses is bad input here, before any estimate (did-you-mean)."""
    from autofit.probe.peft import _ALIASES, default_config, method_name, methods, peft_config

    if isinstance(m, dict) or not isinstance(m, str):
        cfg = peft_config(m, "causal-lm")  # named by its type; the task is set again later
        return method_name(cfg), m
    name = m.strip().lower()
    names = (*methods(), *_ALIASES)
    request = default_config(name)
    if name not in names and request["peft_type"].lower() not in methods():
        from difflib import get_close_matches

        close = get_close_matches(name, names, 1)
        try:  # peft's own word for a method autofit refuses (cpt: reads tensor values)
            peft_config(request, "causal-lm")
        except BadInputError as e:
            if "cannot model" in str(e):
                raise
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise BadInputError(f"unknown PEFT method {m!r}: {hint}choose from "
                            + ", ".join(sorted(names)))
    peft_config(request, "causal-lm")  # a method peft refuses with its defaults: one line
    return name, request


def _largest(fits: Callable[[int], bool], limit: int) -> int:
    """Largest b in [1, limit] with fits(b) (0 if none); fits is monotone."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def compare_peft(
    model: ModelSource,
    dataset: object = None,
    *,
    device: str | DeviceInfo = "auto",
    methods: Sequence[str | dict[str, object]] | None = None,
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    max_seq_len: int | None = None,
    precision: str | None = None,
    gradient_checkpointing: bool = False,
    optimizer: str = "adamw_torch",
    task: str | None = None,
    margin: float = 0.10,
    method: str = "analytic",
    confirm_top: int = 2,
    max_micro_batch: int = 1024,
    tokenizer: PreTrainedTokenizerBase | None = None,
    progress: Callable[[str], None] | None = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    quantization_config: Any = None,
) -> PeftComparison:
    """Compare PEFT methods on ``model`` (see the module docstring).

    Args:
        model: a bundled name, hub id, model directory or config.json path (each
            method is put on the base as peft does; a module already wrapped by peft
            cannot be compared).
        dataset: the training samples: the step is the longest one's (``seq_len``
            otherwise); trials use its worst-case batch.
        device: as for ``autofit()``; on a present device the ``confirm_top`` fastest
            methods are confirmed by trials.
        methods: method names (``"lora"``, ``"dora"``, ``"ia3"``, ``"prefix_tuning"``,
            ... — peft's defaults, see ``autofit.probe.peft.default_config``) or full
            PEFT configs (dicts with ``peft_type``); default ``DEFAULT_METHODS``.
        micro_batch_size: the micro batch the peak column is for.
        precision: a precision name (default: the device's first choice, bf16-mixed
            where the device runs bf16, else 32-true).
        margin: fraction of the device kept free when deciding what fits.
        method: ``"analytic"`` or ``"simulate"`` for the estimates.
        load_in_4bit, load_in_8bit, quantization_config: every method on the same
            quantized base (``autofit.probe.quant``).

    Raises:
        AutofitError: bad input (a module, an unknown method name, no sequence length).
    """
    import torch

    from autofit.api import METHODS
    from autofit.knobs import KNOBS
    from autofit.probe.device import resolve_device

    say = progress or (lambda _m: None)
    if isinstance(model, torch.nn.Module):
        raise BadInputError("compare-peft puts each method on the base model itself: give the "
                            "model by name, directory or config.json, not a module")
    if method not in METHODS:
        raise BadInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) \
            or micro_batch_size < 1:
        raise BadInputError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    if not 0 <= margin < 1:
        raise BadInputError(f"margin must be in [0, 1), got {margin!r}")
    if isinstance(confirm_top, bool) or not isinstance(confirm_top, int) or confirm_top < 0:
        raise BadInputError(f"{fix('--confirm-top', 'confirm_top')} must be 0 (no trial) or a "
                            f"positive integer, got {confirm_top!r}")
    if isinstance(methods, str):  # "lora" or "lora,ia3": names, never characters
        methods = [n for n in methods.split(",") if n.strip()]
    chosen = [_method_config(m) for m in (methods if methods else DEFAULT_METHODS)]
    if not chosen:
        raise BadInputError("no PEFT method to compare")
    from autofit.trial.model import model_spec

    dev = resolve_device(device)
    base = model_spec(model, task=task, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
                      quantization_config=quantization_config, device=dev)  # each method's base
    if precision is None:
        values, _ = next(k for k in KNOBS if k.name == "precision").defaults(dev)
        precision = "bf16-mixed" if "bf16-mixed" in values else values[0]
    config = TrainConfig(micro_batch_size=micro_batch_size, precision=precision,
                         gradient_checkpointing=gradient_checkpointing, optimizer=optimizer)
    for k in KNOBS:
        k.check(dev, getattr(config, k.name))
    data = None
    if dataset is not None:
        from autofit.probe.data import probe_data

        data = probe_data(dataset, max_seq_len=max_seq_len, tokenizer=tokenizer)
        from autofit.api import check_positions
        from autofit.probe.model import build_model

        check_positions(data, build_model(model, task=task, quantization_config=base.quant)[0])
    seq = seq_len if seq_len is not None else (data.length_max if data is not None else None)
    if seq is None:
        raise BadInputError("give " + fix("--dataset or --seq-len", "dataset= or seq_len="))
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise BadInputError(f"seq_len must be a positive integer, got {seq!r}")
    budget = int(dev.capacity_bytes * (1 - margin))

    rows: list[PeftRow] = []
    for i, (name, request) in enumerate(chosen, 1):
        say(f"[{i}/{len(chosen)}] {name}: estimating")
        rows.append(_row(base, name, request, config, seq, dev, budget, method,
                         max_micro_batch))
    if dev.present and confirm_top > 0:
        order = sorted((r for r in rows if r.error is None and (r.max_micro_batch or 0) > 0),
                       key=lambda r: -(r.tokens_per_s or 0.0))[:confirm_top]
        for r in order:
            say(f"confirming {r.method} at micro batch {r.max_micro_batch} with a trial")
            rows[rows.index(r)] = _confirm(base, r, config, data, dataset, seq, dev, tokenizer)
    return PeftComparison(model=str(model), device=dev.name, capacity_bytes=int(dev.capacity_bytes),
                          budget_bytes=budget, seq_len=seq, micro_batch_size=micro_batch_size,
                          config=config, method=method, rows=tuple(rows))


def _row(base: ModelSpec, name: str, request: Any, config: TrainConfig, seq: int, dev: DeviceInfo,
         budget: int, method: str, limit: int) -> PeftRow:
    """``base`` with the PEFT method ``request`` put on it: its peak at the micro batch
    compared, the largest micro batch within ``budget`` and its predicted speed."""
    from autofit.memory.ranks import estimate_analytic
    from autofit.probe.model import build_model, describe
    from autofit.search.speed import predict_speed

    try:
        module, t = build_model(base.ref, task=base.task, peft_config=request,
                                quantization_config=base.quant)
        info = describe(module, task=t, name=str(base.ref))
        from autofit.probe.quant import check_precision

        check_precision(info.quant, info.dtype, config.precision)
        if method == "simulate":
            from autofit.memory.simulate import Simulator

            sim = Simulator(module, task=t, device=dev, model_name=info.name)

            def total(b: int) -> int:
                return sim.simulate(config.replace(micro_batch_size=b),
                                    seq_len=seq).device_total_bytes

            largest = sim.max_micro_batch(config, budget, seq_len=seq, limit=limit)
        else:
            def total(b: int) -> int:
                return estimate_analytic(info, config.replace(micro_batch_size=b), seq,
                                         dev).device_total_bytes

            largest = _largest(lambda b: total(b) <= budget, limit)
        peak = total(config.micro_batch_size)
        speed = None
        if largest > 0:
            speed = predict_speed(info, config.replace(micro_batch_size=largest),
                                  seq + info.virtual_tokens, dev).tokens_per_s * (
                seq / (seq + info.virtual_tokens))  # the virtual tokens are not the data's
        from autofit.probe.peft import config_dict, peft_config

        return PeftRow(method=name, peft_config=config_dict(peft_config(request, t)),
                       trainable_params=info.trainable_params, peak_bytes=peak,
                       max_micro_batch=largest, tokens_per_s=speed)
    except AutofitError as e:
        return PeftRow(method=name, peft_config=request if isinstance(request, dict) else None,
                       error=str(e).splitlines()[0])


def _confirm(base: ModelSpec, row: PeftRow, config: TrainConfig, data: object, dataset: object,
             seq: int, dev: DeviceInfo, tokenizer: PreTrainedTokenizerBase | None) -> PeftRow:
    """``row`` with what a trial of its method at its largest micro batch measured."""
    from dataclasses import replace

    from autofit.trial import measure

    try:
        trial = measure(base.ref, config.replace(micro_batch_size=row.max_micro_batch),
                        dataset if data is not None else None, device=dev,
                        seq_len=None if data is not None else seq, task=base.task,
                        tokenizer=tokenizer, peft_config=row.peft_config,
                        quantization_config=base.quant)
    except AutofitError as e:
        return replace(row, error=f"trial: {str(e).splitlines()[0]}")
    return replace(row, measured_bytes=int(trial.device_total_bytes), measured_oom=bool(trial.oom),
                   measured_tokens_per_s=trial.tokens_per_s if not trial.oom else None)
