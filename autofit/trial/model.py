"""A model given by reference, and how a trial gives it real weights.

``ModelRef`` (``autofit.config.ModelSpec``: what the model is) is what travels to a trial
child instead of a pickled module: the child rebuilds the model itself. ``model_spec``
builds the spec from the public functions' keywords, validated. ``materialize`` builds the base with
``autofit.probe.model.build_model`` (meta device), then gives its tensors memory on the
device and runs the model's own initialisation (``init_weights``, which in
transformers 5 also recomputes non-persistent buffers such as rotary ``inv_freq``), so
no second copy of the weights is ever made; a PEFT adapter is then put on it by peft,
as a user's script does.

A quantized base (``ModelRef.quant``, an ``autofit.probe.quant.QuantSpec``) is built
directly on the device, never as a full-precision copy on the host:

* on a CUDA (accelerator) device, a directory with weights or a hub id whose weights
  are in the local cache is loaded as a user loads it: ``from_pretrained(ref,
  quantization_config=..., device_map={"": index}, dtype=compute dtype)``
  (bitsandbytes quantizes each tensor as it arrives on the device);
* otherwise (a config, a bundled name, no weights at hand, and every CPU trial) the
  base is built on the meta device with bitsandbytes' layers (``from_config`` +
  transformers' ``replace_with_bnb_linear``), its other tensors are given memory on the
  device and initialised, and each quantized layer's weight is drawn on the device in
  the compute dtype (``normal_(0, initializer_range)``, as ``_init_weights`` draws a
  Linear's) and quantized there, one layer at a time (``Params4bit.to(device)`` /
  ``int8_vectorwise_quant``): at most one layer's weight exists in full precision.

A quantized base is never cast afterwards (transformers refuses ``.to(dtype)`` on it):
it trains in the dtype it was loaded in.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import ModelSpec, QuantRequest

if TYPE_CHECKING:
    from peft import PeftConfig
    from transformers import BitsAndBytesConfig

    from autofit.config import ModelSource
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import LoraSpec
    from autofit.probe.quant import QuantSpec

__all__ = ["ModelRef", "ModelSpec", "model_spec", "for_device", "build_meta", "materialize",
           "is_quantized_model"]

_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")


# A model by name or path, with what ``build_model`` needs to rebuild it: the spec itself.
ModelRef = ModelSpec


def model_spec(model: ModelSource, *, task: str | None = None,
               attn_implementation: str | None = None,
               lora: LoraSpec | dict[str, object] | None = None,
               peft_config: PeftConfig | None = None, load_in_4bit: bool = False,
               load_in_8bit: bool = False,
               quantization_config: BitsAndBytesConfig | dict[str, object] | None = None,
               device: DeviceInfo | None = None) -> ModelSpec:
    """The ``ModelSpec`` of the public functions' model keywords, validated: one adapter
    request (``lora=`` or ``peft_config=``, not both) and the quantized base resolved
    (``autofit.probe.quant.resolve``; for ``device`` when given, else device-free: bad
    input is refused before anything is built).

    Raises:
        BadInputError: both adapter requests; conflicting or unsupported quantization.
    """
    from autofit.probe.model import adapter_request
    from autofit.probe.quant import resolve

    request = QuantRequest(load_in_4bit=bool(load_in_4bit), load_in_8bit=bool(load_in_8bit),
                           quantization_config=quantization_config)
    adapter = adapter_request(lora, peft_config)
    quant = resolve(load_in_4bit=request.load_in_4bit, load_in_8bit=request.load_in_8bit,
                    quantization_config=quantization_config, device=device)
    return ModelSpec(model, task=task, attn_implementation=attn_implementation, lora=adapter,
                     quant=quant, quant_request=request)


def for_device(spec: ModelSpec, device: DeviceInfo) -> ModelSpec:
    """``spec`` with its quantized base resolved for ``device`` (a ``DeviceInfo``)."""
    from autofit.probe.quant import resolve

    r = spec.quant_request
    quant = resolve(load_in_4bit=r.load_in_4bit, load_in_8bit=r.load_in_8bit,
                    quantization_config=r.quantization_config, device=device)
    return dataclasses.replace(spec, quant=quant)


def build_meta(spec: ModelSpec, *, adapter: bool = True) -> tuple[torch.nn.Module, str]:
    """``spec``'s model on the meta device and its task (``autofit.probe.model.build_model``);
    without its adapter when ``adapter`` is False."""
    from autofit.probe.model import build_model

    return build_model(spec.ref, task=spec.task, attn_implementation=spec.attn_implementation,
                       lora=spec.lora if adapter else None, quantization_config=spec.quant)


def is_quantized_model(model: torch.nn.Module) -> bool:
    """Whether bitsandbytes quantized some of ``model``'s weights (then it is never cast)."""
    return any(type(p).__name__ in {"Params4bit", "Int8Params"} for p in model.parameters())


def materialize(ref: ModelRef, device: torch.device) -> torch.nn.Module:
    """Build ``ref`` with initialised weights on ``device``: the base on the meta device,
    given memory there and initialised (a quantized base: see the module docstring), then
    the adapter put on it by peft itself (its own initialisation, on the device: index
    buffers and projections have real values)."""
    module = None
    if ref.quant is not None and device.type != "cpu":
        module = _load_quantized(ref, device)
    if module is None:
        module, _ = build_meta(ref, adapter=False)
        _materialize_meta(module, device)
        if ref.quant is not None:
            _quantize_layers(module, ref.quant, device)
    if ref.lora is not None:
        from autofit.probe.loading import module_task
        from autofit.probe.model import _peft_config
        from autofit.probe.peft import apply_peft

        task = ref.task or module_task(module)
        module = apply_peft(module, _peft_config(ref.lora, task), meta=False)
    return module


def _materialize_meta(module: torch.nn.Module, device: torch.device) -> None:
    """Give every meta tensor (but a quantized layer's weight, drawn later) memory on
    ``device`` — each storage once, so that tied weights stay tied — and initialise them
    as the model initialises itself."""
    memo: dict[int, torch.Tensor] = {}
    for m in module.modules():
        quantized = type(getattr(m, "weight", None)).__name__ in {"Params4bit", "Int8Params"}
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta or (quantized and name == "weight"):
                continue
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device),
                                                 requires_grad=p.requires_grad)
            m._parameters[name] = memo[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                if id(b) not in memo:
                    memo[id(b)] = torch.empty_like(b, device=device)
                m._buffers[name] = memo[id(b)]
    with torch.no_grad():
        for m in module.modules():  # torch layers first
            reset = getattr(m, "reset_parameters", None)
            if callable(reset) and not hasattr(m, "config"):
                with contextlib.suppress(RuntimeError, TypeError, NotImplementedError):
                    reset()
        init = getattr(module, "init_weights", None)
        if callable(init):
            init()


def _quantize_layers(module: torch.nn.Module, spec: QuantSpec, device: torch.device) -> None:
    """Draw each bitsandbytes layer's weight on ``device`` in the compute dtype and quantize
    it there, one layer at a time (module docstring)."""
    import bitsandbytes as bnb

    config = getattr(module, "config", None)
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    with torch.no_grad():
        for m in module.modules():
            w = getattr(m, "weight", None)
            kind = type(w).__name__
            if kind not in {"Params4bit", "Int8Params"} or not w.is_meta:
                continue
            full = torch.empty(tuple(w.shape), device=device, dtype=spec.torch_dtype)
            full.normal_(0.0, std)  # (out, in), what _init_weights draws for a Linear
            if kind == "Params4bit":
                m.weight = bnb.nn.Params4bit(
                    full, requires_grad=False, blocksize=w.blocksize,
                    compress_statistics=w.compress_statistics, quant_type=w.quant_type,
                    quant_storage=w.quant_storage, module=m).to(device)
            else:
                cb, scb, _ = bnb.functional.int8_vectorwise_quant(full.to(torch.float16))
                m.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False,
                                             CB=cb, SCB=scb)
            del full


def _has_weights(ref: str) -> bool:
    path = Path(ref).expanduser()
    return path.is_dir() and any(any(path.glob(p)) for p in _WEIGHT_FILES)


def _load_quantized(ref: ModelRef, device: torch.device) -> torch.nn.Module | None:
    """``from_pretrained`` straight onto the accelerator, quantized while loading, for a
    directory with weights or a hub id cached locally; None when there are no weights at
    hand (the base is then built from its config)."""
    import transformers

    from autofit.probe.loading import TASKS, _bundled_path, load_config
    from autofit.probe.model import default_task as task_of

    path = Path(ref.ref).expanduser()
    local = path.exists()
    if (local and not _has_weights(ref.ref)) or (not local and _bundled_path(ref.ref)):
        return None  # a config.json, a directory with the config only, a bundled config
    config = load_config(ref.ref) if ref.task is None else None
    auto = getattr(transformers, TASKS[ref.task or task_of(config)])
    kwargs: dict[str, Any] = {}
    if ref.attn_implementation:
        kwargs["attn_implementation"] = ref.attn_implementation
    try:
        return auto.from_pretrained(
            ref.ref, quantization_config=ref.quant.to_bnb_config(),
            device_map={"": device.index if device.index is not None else 0},
            dtype=ref.quant.torch_dtype, local_files_only=not local, **kwargs)
    except (OSError, ValueError):  # a hub id whose weights are not in the local cache
        if local:
            raise
        return None
