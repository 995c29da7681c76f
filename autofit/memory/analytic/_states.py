"""What the parameters hold on the device: weights (quantized ones too), gradients,
optimizer states and the optimizer step's own temporaries, in bytes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.errors import BadInputError

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo, ParamGroup
    from autofit.probe.quant import QuantSpec

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float64": 8, "uint8": 1, "int8": 1, "float8_e4m3fn": 1,
}

# bitsandbytes: 8-bit states for tensors of at least this many elements, fp32 below.
_BNB_MIN_8BIT_SIZE = 4096
_BNB_BLOCK = 256  # blockwise quantization: one fp32 absmax per 256 elements
_NF4_BLOCK = 64  # 4-bit base weights: one fp32 absmax per 64 elements
_NESTED_BLOCK = 256  # double quantization: one fp32 absmax per 256 8-bit absmax


def _bytes(dtype: str) -> int:
    return _DTYPE_BYTES.get(dtype, 4)


def _param_dtype_bytes(g: ParamGroup, config: TrainConfig, quantized: bool = False) -> int:
    """Bytes per element of a (non-quantized) parameter during training. A quantized
    base is never cast: its parameters keep the dtype they were loaded in."""
    if quantized:
        return _bytes(g.dtype)
    spec = config.precision_spec
    if spec.param_dtype != "float32":  # *-true: the whole model is cast
        if g.role == "lora" or (g.role == "adapter" and g.trainable):
            return 4  # but peft's adapter layers, kept in fp32 (upcast_adapters)
        return _bytes(spec.param_dtype)
    return max(_bytes(g.dtype), 2) if g.dtype != "float32" and not g.trainable else 4


def quantized_weight_bytes(g: ParamGroup, quant: QuantSpec | None) -> int:
    """Bytes one quantized weight of ``g`` holds on the device (bitsandbytes 0.50):

    * 4 bits (nf4 and fp4 alike): the packed weight, two values per byte, and its
      ``QuantState``: one fp32 absmax per 64 values and the 16-entry fp32 code; with
      double quantization one uint8 absmax per 64 values, one fp32 absmax per 256 of
      those, the 256-entry fp32 code of that second level and an fp32 offset;
    * 8 bits: the int8 weight and one fp32 scale per output row (``SCB``).

    A meta-built ``Params4bit`` has every element; a loaded one is packed (uint8).
    """
    n = g.numel
    if g.quantized == "8bit":
        return n + g.shape[0] * 4
    values = 2 * n if g.dtype == "uint8" else n
    blocks = math.ceil(values / _NF4_BLOCK)
    if quant is not None and quant.double_quant:
        absmax = blocks + math.ceil(blocks / _NESTED_BLOCK) * 4 + 256 * 4 + 4
    else:
        absmax = blocks * 4
    return (values + 1) // 2 + absmax + 16 * 4


def weights_bytes(info: ModelInfo, config: TrainConfig) -> int:
    """Bytes of the parameters as they sit on the device during training (quantized
    weights as ``quantized_weight_bytes`` says; a quantized base's other weights in the
    dtype it was loaded in)."""
    total = 0
    quantized = info.quant is not None
    for g in info.params:
        if g.quantized:
            total += quantized_weight_bytes(g, info.quant) * g.count
        else:
            total += g.numel * g.count * _param_dtype_bytes(g, config, quantized)
    # a PEFT method's float buffers (VeRA's projections, BOFT's permutations), cast with
    # the model for the "-true" precisions
    half = config.precision_spec.param_dtype in ("bfloat16", "float16") and not quantized
    floats = info.adapter_buffer_bytes + info.buffer_bytes
    # the model's own buffers too (I-BERT's quantization state: 12 MiB on a 3 M-parameter
    # model, its zoo rows 8.8% / 14.0% under without them)
    return total + (floats // 2 if half else floats) + info.int_buffer_bytes


def gradients_bytes(info: ModelInfo, config: TrainConfig) -> int:
    """Bytes of ``.grad`` of every trainable parameter (same dtype as the parameter)."""
    quantized = info.quant is not None
    return sum(g.numel * g.count * _param_dtype_bytes(g, config, quantized)
               for g in info.params if g.trainable)


def _momentum(config: TrainConfig) -> float:
    try:
        return float(config.optim_kwargs.get("momentum", 0.0))
    except ValueError:
        raise BadInputError(f"optim_args momentum must be a number: {config.optim_args!r}") from None


def _states_per_element(config: TrainConfig) -> int:
    spec = config.optimizer_spec
    kw = config.optim_kwargs
    if spec.family == "sgd":
        return 1 if _momentum(config) > 0 else 0
    if spec.family == "rmsprop":
        return 1 + (_momentum(config) > 0) + (kw.get("centered", "False").lower() == "true")
    return spec.state_per_param


def _bnb_8bit_states(g: ParamGroup, config: TrainConfig) -> bool:
    """Whether bitsandbytes keeps 8-bit states for this parameter (else fp32 states)."""
    spec = config.optimizer_spec
    return (
        spec.bnb
        and spec.state_bits == 8
        and g.numel >= _BNB_MIN_8BIT_SIZE
        and g.role != "embedding"  # Trainer.create_optimizer: embeddings in 32-bit states
    )


def optimizer_state_bytes(info: ModelInfo, config: TrainConfig) -> int:
    """Bytes of the optimizer's state after its first step."""
    spec = config.optimizer_spec
    total = 0
    for g in info.params:
        if not g.trainable:
            continue
        n = g.numel
        if spec.family == "adafactor":
            # transformers' Adafactor: factored second moment for >= 2-D tensors,
            # states in fp32 (grads are upcast before the states are created)
            if len(g.shape) >= 2:
                rows = n // g.shape[-1]
                cols = n // g.shape[-2]
                per = (rows + cols) * 4
            else:
                per = n * 4
            if "beta1" in config.optim_kwargs:
                per += n * 4  # first moment when beta1 is set
        elif _bnb_8bit_states(g, config):
            k = spec.state_per_param
            per = k * (n + math.ceil(n / _BNB_BLOCK) * 4)
        elif spec.bnb:
            per = spec.state_per_param * n * 4
        else:
            # torch optimizers: zeros_like(param), so states take the param's dtype
            per = (_states_per_element(config) * n
                   * _param_dtype_bytes(g, config, info.quant is not None))
        total += per * g.count
    return total


def _stepped(info: ModelInfo, no_grad_shapes: frozenset[tuple[int, ...]] = frozenset()
             ) -> list[ParamGroup]:
    """The trainable groups the optimizer steps: not those of a shape no gradient reaches
    (``no_grad_shapes``, derived: GLM-MoE-DSA's indexer)."""
    return [g for g in info.params if g.trainable and tuple(g.shape) not in no_grad_shapes]


def _optimizer_step_temporaries(info: ModelInfo, config: TrainConfig, device: DeviceInfo,
                                no_grad_shapes: frozenset[tuple[int, ...]] = frozenset()
                                ) -> int:
    """Peak bytes the optimizer step allocates beyond states and gradients (an optimizer
    skips a parameter without a gradient: ``no_grad_shapes``, the shapes of the trainable
    parameters the loss never reaches; GLM-MoE-DSA's indexer, its largest tensors: 8-bit
    AdamW's CPU scratch of them put it 32% over)."""
    spec = config.optimizer_spec
    stepped = _stepped(info, no_grad_shapes)
    largest = max((g.numel for g in stepped), default=0)
    # a quantized base is never cast: its adapters stay fp32
    elem = 4 if info.quant is not None else _bytes(config.precision_spec.param_dtype)
    trainable_bytes = sum(g.numel * g.count * elem for g in stepped)
    if spec.family == "adamw" and not spec.bnb:
        if spec.fused:
            return 0  # one kernel per tensor list, in place
        if device.allocator == "cuda":
            # foreach=True on CUDA: _foreach_sqrt(exp_avg_sq) is one full copy
            return trainable_bytes
        # foreach=False on the CPU: sqrt(v) then / bias_correction -> 2 temporaries
        return 2 * largest * elem
    if spec.family == "adafactor":
        # grad**2 + eps, the factored approximation and -update: ~2 full fp32 copies; a
        # 16-bit parameter's fp32 gradient and fp32 parameter beside them (transformers'
        # Adafactor upcasts both: a bf16-true phi3 draw of random_sweep.py 11% under with
        # the gradient's alone)
        upcast = 2 * largest * 4 if elem == 2 else 0
        return 2 * largest * 4 + upcast
    if spec.family in ("adagrad", "rmsprop") and not spec.bnb:
        if device.allocator == "cuda":
            # foreach on CUDA: the denominators (_foreach_sqrt) are one full copy, Adagrad's
            # numerators (grads x -lr) a second
            return (2 if spec.family == "adagrad" else 1) * trainable_bytes
        # one tensor at a time on the CPU: its denominator (sqrt(state) + eps)
        return largest * elem
    if spec.bnb and device.allocator == "cpu":
        # NB: bitsandbytes' CPU path works in fp32 temporaries: ~5 fp32 copies of the
        # largest tensor with 8-bit states (it dequantizes them) and ~3 of the largest
        # with 32-bit states (embeddings, small tensors) — measured 5.2x and 3.0x on
        # llama-b4s256-bnb8 and gpt2-b1s128-bnb8; 8-bit AdEMAMix dequantizes its two
        # first moments apart, stacks them, and stacks them again after its update, which
        # takes three more: 9.5x (llama-b4s256-ademamix8: 9.3x); with 32-bit states its
        # mixed momentum and denominator take 4x (gpt2-b1s128-ademamix8's tied embedding);
        # 8-bit RMSprop holds one state and its denominator: 3x, as its 32-bit states (5x
        # was 20% over on tiny-llama's optimizer step). Its CUDA kernels update in place.
        eight = thirty_two = 0
        for g in stepped:
            if _bnb_8bit_states(g, config):
                eight = max(eight, g.numel)
            else:
                thirty_two = max(thirty_two, g.numel)
        copies8, copies32 = {"ademamix": (9.5, 4), "rmsprop": (3, 3)}.get(spec.family, (5, 3))
        # a 16-bit parameter's update takes one more fp32 copy of it (bf16-true: every
        # bitsandbytes optimizer's CPU step 4-12% under its simulation without it; a
        # bf16-true qwen2 with 8-bit AdEMAMix drawn by random_sweep.py 4.5% under)
        up = 1 if elem == 2 else 0
        return int(max((copies8 + up) * eight, (copies32 + up) * thirty_two) * 4)
    return 0  # SGD and bitsandbytes' CUDA kernels update in place


def _linear_weight_numel(info: ModelInfo) -> int:
    """Elements of the matmul weights autocast copies (blocks + output head)."""
    return info.block_matmul_numel + info.head_numel
