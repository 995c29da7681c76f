"""When nothing fits: say what would, with the estimated numbers.

PEFT, quantization and the knob values that change the math are never applied
silently; autofit estimates them and puts those that would fit in the error: each
knob's memory-saving value the search was not allowed to try and the values it
offers (``Knob.saving``, ``Knob.suggest``: e.g. bf16 weights, an 8-bit optimizer),
LoRA on every linear layer, QLoRA (a 4-bit base plus LoRA; for a model that
already has LoRA: its base in 4 bits), and the longest shorter sequence that would fit
(a real cut: at most ~90% of the samples' length, a multiple of 8, or of 64 from 512
tokens up; none when no such length fits).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import AutofitError, DoesNotFitError, fix
from autofit.knobs import KNOBS
from autofit.probe.device import format_bytes
from autofit.probe.model import ModelInfo, ParamGroup

if TYPE_CHECKING:
    from autofit.probe.device import DeviceInfo

__all__ = ["with_lora", "quantized_base", "nothing_fits"]

_LORA_R = 16
SEQ_CUT = 0.9  # a suggested max_seq_len cuts at least ~10% of the samples' length


def _block_linear(g: ParamGroup, info: ModelInfo) -> bool:
    """A transformer block's linear weight (not the embedding or the output head), the
    layers bitsandbytes quantizes."""
    return g.role == "linear" and info.vocab_size not in g.shape


def _qlora_spec() -> Any:
    """What ``load_in_4bit=True`` loads: nf4, the base in (and computing in) bfloat16."""
    from autofit.probe.quant import resolve

    return resolve(load_in_4bit=True)


def _in_4bit(g: ParamGroup, info: ModelInfo, dtype: str) -> ParamGroup:
    """A frozen group as QLoRA loads it: a block linear in 4 bits, the rest in ``dtype``."""
    if _block_linear(g, info) and not g.trainable:
        return replace(g, quantized="4bit", dtype=dtype)
    if g.trainable or g.quantized:
        return g
    return replace(g, dtype=dtype)


def with_lora(info: ModelInfo, r: int = _LORA_R, quantize: bool = False) -> ModelInfo:
    """``info`` as if LoRA (rank r, every block linear) were added; optionally a 4-bit base
    (``load_in_4bit=True``: nf4, the rest of the base in bfloat16)."""
    spec = _qlora_spec() if quantize else None
    params: list[ParamGroup] = []
    for g in info.params:
        g = replace(g, trainable=False)
        params.append(_in_4bit(g, info, spec.compute_dtype) if spec is not None else g)
    adapters: dict[tuple[int, ...], int] = {}
    for b in info.blocks:
        for _, i, o, _ in b.linears:
            adapters[(r, i)] = adapters.get((r, i), 0) + b.count
            adapters[(o, r)] = adapters.get((o, r), 0) + b.count
    for shape, count in adapters.items():
        params.append(ParamGroup(shape=shape, count=count, dtype="float32", trainable=True,
                                 role="lora"))
    trainable = sum(g.numel * g.count for g in params if g.trainable)
    num = info.num_params + trainable
    return replace(info, params=tuple(params), trainable_params=trainable, num_params=num,
                   frozen_params=num - trainable, peft="lora", lora_r=r,
                   lora_targets=("all-linear",),
                   quantization="4bit" if quantize else info.quantization,
                   quant=spec if quantize else info.quant,
                   dtype=spec.compute_dtype if quantize else info.dtype)


def quantized_base(info: ModelInfo) -> ModelInfo:
    """``info`` (a LoRA model) with its frozen block linears in 4 bits and the rest of its
    base in bfloat16, as ``load_in_4bit=True`` loads them."""
    spec = _qlora_spec()
    params = tuple(_in_4bit(g, info, spec.compute_dtype) for g in info.params)
    return replace(info, params=params, quantization="4bit", quant=spec,
                   dtype=spec.compute_dtype)


def _shorter_length(seq_len: int, positions: int | None, fits: Any) -> int | None:
    """The ``max_seq_len`` to suggest: the longest length that ``fits`` (a predicate,
    monotone in the length), at most ``SEQ_CUT`` of ``seq_len`` and of the model's
    positions, a multiple of 8 (of 64 from 512 tokens up); None when none of at least 16
    tokens fits.

    A cut of one token is no suggestion: 64 for 65-token samples saves nothing that
    matters, so a length within ~10% of ``seq_len`` is never offered.

        >>> _shorter_length(65, None, lambda n: True), _shorter_length(16, None, lambda n: True)
        (56, None)
        >>> _shorter_length(8192, None, lambda n: n <= 3000)
        2944
    """
    longest = int(seq_len * SEQ_CUT)
    if positions:
        longest = min(longest, int(positions))
    lo, hi = 0, longest // 8  # in multiples of 8: the largest that fits (lengths grow the need)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(8 * mid):
            lo = mid
        else:
            hi = mid - 1
    length = 8 * lo
    if length >= 512:
        length -= length % 64
    return length if length >= 16 else None


def nothing_fits(info: ModelInfo, space: Any, engine: Any, seq_len: int, dev: DeviceInfo
                 ) -> DoesNotFitError:
    """The DoesNotFitError for a search where no candidate fits, with suggestions.

    Every number is the engine's calibrated one: a trial's measured peak where a
    trial ran at that size, else the engine's estimate scaled as the trials calibrated
    it (said only when trials did). The alternatives (knob values, LoRA, QLoRA, a
    shorter sequence) are estimated analytically and scaled by the smallest
    candidate's need over its analytic estimate: the trials' calibration and the
    engine estimator's own difference from the closed form (the simulated step).
    Simulated trials (``engine.trial_word``) are called simulated, not measured.
    """
    from autofit.memory.ranks import estimate_analytic

    b0 = space.micro_batches[0]
    need_of = {c.key: c.measured.get(b0) or engine.estimated(c, b0) for c in engine._candidates}
    smallest = min(engine._candidates, key=lambda c: need_of[c.key])
    smallest_cfg = engine.config(smallest, b0)
    need = need_of[smallest.key]
    raw = estimate_analytic(info, smallest_cfg, seq_len, dev).device_total_bytes
    scale = need / raw if raw else 1.0
    # what the trials did to the engine's own estimate (1.0 when none ran)
    own = engine._raw_estimate(smallest, b0)
    calibration = need / own if own else 1.0
    word = engine.trial_word  # "measured", or "simulated" for simulated steps
    trials = "trials" if word == "measured" else "simulated steps"
    if b0 in smallest.measured:
        how = f"{word} {format_bytes(need)}"
    elif smallest.oom_micro_batch == b0:
        how = (f"ran out of memory in a {trials[:-1]} "
               f"(needs more than {format_bytes(engine.capacity)})")
    else:
        how = f"needs ~{format_bytes(need)}" + (
            f" (the estimate x{calibration:.2f}, as {trials} measured)"
            if engine.trials and abs(calibration - 1) > 0.01 else "")
    budget = engine.budget
    head = (f"no configuration fits in {format_bytes(budget)} "
            f"({100 * (1 - engine.margin):.0f}% of {format_bytes(engine.capacity)} on {dev.name}): "
            f"the smallest, {smallest.label()} at micro batch {b0}, {how}")

    def scaled(variant: ModelInfo, cfg: TrainConfig, length: int) -> int:
        return int(estimate_analytic(variant, cfg, length, dev).device_total_bytes * scale)

    ideas = []
    # a value of a knob that the search did not try: the one that saves memory, and those
    # that change the math (offered, never applied silently)
    for k in KNOBS:
        offered = ((k.saving,) if k.saving is not None else ()) + tuple(k.suggest(dev))
        for v in dict.fromkeys(offered):
            if v in space.choices.get(k.name, ()) or getattr(smallest_cfg, k.name) == v:
                continue
            try:
                k.check(dev, v)
                variant = smallest_cfg.replace(**{k.name: v})  # offloading: with checkpointing
            except AutofitError:
                continue
            n = scaled(info, variant, seq_len)
            if n <= budget:
                note = k.note(v)
                ideas.append(f"{k.describe(v)} ({fix(k.flag(v), f'{k.name}=[{v!r}]')}"
                             + (f"; {note}" if note else "") + f") ~{format_bytes(n)}")
    # the memory-saving value of every knob, with a change of the model (PEFT, quantization);
    # a value that saves nothing here is left out (a chunked loss over few tokens costs more)
    thrifty = smallest_cfg
    for k in KNOBS:
        if k.name == "chunked_loss" and True not in space.choices.get(k.name, (True,)):
            continue  # the trainer does not run it (autofit.knobs.trainer), or it was refused
        if k.saving is not None and getattr(thrifty, k.name) != k.saving:
            try:  # e.g. autofit's chunked loss beside TRL's (loss_impl="trl"): not a config
                other = thrifty.replace(**{k.name: k.saving})
            except AutofitError:
                continue
            if scaled(info, other, seq_len) <= scaled(info, thrifty, seq_len):
                thrifty = other
    if info.peft is not None and info.quantization is None and info.is_transformer:
        # a LoRA model whose frozen base is loaded in fp32 or 16 bits: a 4-bit base
        n = scaled(quantized_base(info), thrifty, seq_len)
        if n <= budget:
            ideas.append(f"QLoRA: the base in 4 bits ({fix('--load-in-4bit', 'load_in_4bit=True')}) "
                         f"~{format_bytes(n)}")
    if info.peft is None and info.is_transformer:
        for label, variant in ((f"LoRA r=16 on all linear layers "
                                f"({fix('--lora-r 16', 'lora=' + repr({'r': 16}))})",
                                with_lora(info)),
                               ("QLoRA: 4-bit base + LoRA r=16 ("
                                + fix("--lora-r 16 --load-in-4bit",
                                      "lora=" + repr({"r": 16}) + ", load_in_4bit=True") + ")",
                                with_lora(info, quantize=True))):
            n = scaled(variant, thrifty, seq_len)
            if n <= budget:
                ideas.append(f"{label} ~{format_bytes(n)}")
    # the longest sequence that fits with the smallest configuration: a real cut, never past
    # the positions the model has (learned: an IndexError; rotary: untrained)
    if info.is_transformer:
        length = _shorter_length(seq_len, info.max_position_embeddings,
                                 lambda n: scaled(info, smallest_cfg, n) <= budget)
        if length is not None:
            n = scaled(info, smallest_cfg, length)
            ideas.append(f"sequences of {length} tokens "
                         f"({fix(f'--max-seq-len {length}', f'max_seq_len={length}')}) "
                         f"~{format_bytes(n)}")
    tail = ("; would fit: " + "; ".join(ideas)) if ideas else "; try a larger device or a smaller model"
    return DoesNotFitError(head + tail)
