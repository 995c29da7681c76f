"""Analytic coefficients derived from the simulator, for what the fitted table lacks.

``coefficients.json`` holds activation coefficients fitted per block family
(llama-like, GPT-2, BERT, T5), precision, attention and LoRA regime. A model or a
PEFT method outside it — IA3, prefix tuning, DoRA, an OPT or GPT-NeoX block — gets
coefficients of the same form derived from its own forward: the model is cloned on
fake tensors (``_sim_model``) and run forward only, at four small shapes
(micro batch 1 at ``T1 < T2 < T3`` tokens, and 2 at ``T1``), with each block's
allocations told apart by forward hooks. What is still alive when the loss is
computed is what backward needs (the saved activations, the adapters' dtype casts
and dropout copies, virtual tokens, merged delta weights); it splits exactly into

    per block:  F + B * (s + a*T + b*T^2)        outside the blocks: the same form

(``F``: the same for every micro batch, e.g. DoRA's weight norms; autocast's weight
copies are taken out, the analytic model counts them apart), which the four shapes
determine. The forward of a 70B model at these shapes takes about a second on fake
tensors; results are cached per (model, precision, attention, chunked loss, target).

    >>> from autofit import TrainConfig
    >>> from autofit.probe.model import build_model, describe
    >>> from autofit.probe.device import resolve_device
    >>> module, task = build_model("tiny-llama", peft_config={"peft_type": "IA3"})
    >>> c = derived_coefficients(module, describe(module, task=task), TrainConfig(),
    ...                          resolve_device("cpu"))
    >>> c["layer"]["c0"] > 0
    True
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo

__all__ = ["derived_coefficients", "SHAPES"]

# (micro batch, tokens) of the four forwards: three lengths fix a quadratic per sample,
# the second batch size separates what every micro batch shares.
SHAPES = ((1, 32), (1, 64), (1, 128), (2, 32))

_CACHE: dict[str, dict[str, Any]] = {}


def _key(info: ModelInfo, config: TrainConfig, device: DeviceInfo) -> str:
    from autofit.probe.model import fingerprint

    target = device.name if device.allocator == "cuda" else "cpu"
    return json.dumps([fingerprint(info), config.precision, config.chunked_loss, target],
                      sort_keys=True, default=str)


def _forward_saved(module: torch.nn.Module, config: TrainConfig, task: str,
                   device: DeviceInfo, batch: int, seq_len: int) -> tuple[list[int], int]:
    """Bytes alive at the loss, per block (forward order) and in all, weights excluded."""
    import contextlib
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.memory._sim_model import (
        fake_clone,
        make_batch,
        prepare_for_training,
        unpacked_batches,
        unwrap,
        weight_tensors,
    )
    from autofit.memory._sim_recorder import StorageRecorder
    from autofit.memory._sim_step import _autocast, chunked_loss_kernels
    from autofit.probe.model import _layer_lists

    spec = config.precision_spec
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    rec = StorageRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake_mode:
            model = fake_clone(module, float_dtype=getattr(torch, spec.param_dtype))
            prepare_for_training(model, gradient_checkpointing=False)
        for t in weight_tensors(model):
            rec.track(t, "weights")
        base = unwrap(model)
        lists = _layer_lists(base)
        blocks = [m for _, layers in lists for m in layers]
        spans: list[list[int]] = [[0, 0] for _ in blocks]
        handles = []
        for i, blk in enumerate(blocks):
            handles.append(blk.register_forward_pre_hook(
                lambda _m, _a, i=i: spans[i].__setitem__(0, len(rec._log))))
            handles.append(blk.register_forward_hook(
                lambda _m, _a, _o, i=i: spans[i].__setitem__(1, len(rec._log))))
        ctx: Any = contextlib.nullcontext()
        if device.allocator == "cuda":
            from autofit.memory._sim_cuda import CudaSemantics

            ctx = CudaSemantics(device)
        if config.chunked_loss:
            rec.decompositions.update(chunked_loss_kernels())
        with fake_mode, rec, ctx:
            rec.phase = "forward"
            data = make_batch(base, task, batch, seq_len)
            for v in data.values():
                if isinstance(v, torch.Tensor):
                    rec.track(v, "activations")
            kwargs = {k: data[k] for k in data["_model_kwargs"]}
            with _autocast(config), unpacked_batches():
                if config.chunked_loss:
                    from autofit.knobs.loss import causal_lm_chunked_loss

                    loss = causal_lm_chunked_loss(model, kwargs)
                else:
                    out = model(**kwargs)
                    loss = out.loss
                    del out
            alive = {id(r) for r in rec.live_records() if r.category != "weights"}
            log = rec.events()
            per_block = [
                sum(r.size for kind, r, _ in log[a:b] if kind == "alloc" and id(r) in alive)
                for a, b in spans
            ]
            total = sum(r.size for r in rec.live_records() if id(r) in alive)
            del loss, data, kwargs
        for h in handles:
            h.remove()
    return per_block, total


def _solve(values: list[float]) -> dict[str, float]:
    """``F, s, a, b`` of ``F + B*(s + a*T + b*T^2)`` from the values at ``SHAPES``."""
    (_, t1), (_, t2), (_, t3), _ = SHAPES
    v11, v12, v13, v21 = values
    p1 = v21 - v11  # one sample at T1
    fixed = v11 - p1
    p2, p3 = v12 - fixed, v13 - fixed
    # p(T) = s + a*T + b*T^2 through (t1, p1), (t2, p2), (t3, p3)
    d12 = (p2 - p1) / (t2 - t1)
    d23 = (p3 - p2) / (t3 - t2)
    b = (d23 - d12) / (t3 - t1)
    a = d12 - b * (t1 + t2)
    s = p1 - a * t1 - b * t1 * t1
    return {"F": fixed, "s": s, "a": a, "b": b}


def derived_coefficients(module: torch.nn.Module, info: ModelInfo, config: TrainConfig,
                         device: DeviceInfo) -> dict[str, Any]:
    """Coefficients for ``estimate_analytic`` in the form of a ``coefficients.json``
    entry (``layer``: per block, ``base``: outside the blocks), derived from ``module``'s
    own forward (see the module docstring)."""
    if info.is_encoder_decoder:
        raise BadInputError(f"{info.name}: analytic coefficients are not derived for "
                            "encoder-decoder models; use method='simulate'")
    key = _key(info, config, device)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    blocks_at, totals = [], []
    limit = info.max_position_embeddings
    for b, t in SHAPES:
        if isinstance(limit, int) and t > limit:
            raise BadInputError(f"{info.name} takes at most {limit} positions; "
                                "use method='simulate'")
        per_block, total = _forward_saved(module, config, info.task, device, b, t)
        blocks_at.append(per_block)
        totals.append(total)
    n = len(blocks_at[0])
    if n == 0:
        raise BadInputError(f"{info.name}: no transformer blocks found; use method='simulate'")
    layer_vals = [sum(pb) / n for pb in blocks_at]
    base_vals = [tot - sum(pb) for tot, pb in zip(totals, blocks_at, strict=True)]
    lay, bas = _solve(layer_vals), _solve(base_vals)
    if config.precision_spec.autocast:
        # autocast's 16-bit weight copies, alive at the loss, are counted apart
        from autofit.memory.analytic import _linear_weight_numel

        per_layer = (_linear_weight_numel(info) - _head_numel(info)) * 2 / max(n, 1)
        lay["F"] -= per_layer
        if not config.chunked_loss:
            bas["F"] -= _head_numel(info) * 2
    coef = {
        "layer": {"h": 0.0, "kv": 0.0, "i": 0.0, "H": 0.0, "HT": 0.0, "c0": lay["a"],
                  "T": lay["b"], "s": lay["s"], "F": max(lay["F"], 0.0)},
        "base": {"h": 0.0, "V": 0.0, "c0": bas["a"], "T": bas["b"], "s": bas["s"],
                 "F": max(bas["F"], 0.0)},
        "derived": True,
    }
    _CACHE[key] = coef
    return coef


def _head_numel(info: ModelInfo) -> int:
    if info.vocab_size and info.hidden_size and info.task != "seq-cls":
        return info.vocab_size * info.hidden_size
    return 0
