"""Analytic memory model: a closed form per component, microseconds per candidate.

``estimate_analytic(info, config, seq_len, device)`` is a pure function of a
``ModelInfo`` (see ``autofit.probe.model``), a ``TrainConfig``, the sequence
length and a ``DeviceInfo``. It models the steady training step (the second one:
optimizer states exist, gradients were freed by ``zero_grad(set_to_none=True)``)
at its three candidate peaks and reports the largest:

* **backward start** — weights + autocast weight copies + optimizer states +
  every activation saved by the forward + the loss gradients (two fp32
  ``(B, T, V)`` tensors: d log_softmax and d logits) + the output head's weight
  gradient; with gradient accumulation, + the gradients of the earlier micro
  batches, held through this one;
* **backward end** — weights + optimizer states + all gradients + the activations
  still alive (embedding side) + one block's backward temporaries;
* with ``chunked_loss`` no (B, T, V) tensor exists: the logits' saved activations,
  their loss gradients and the head's autocast copy are gone; the loss holds its
  precomputed input and head-weight gradients and one (rows, V) chunk
  (``chunked_loss_bytes``) at the end of the forward;
* with ``loss_impl="trl"`` (TRL's fused LM head, ``trl.SFTTrainer``) no (B, T, V) tensor
  exists either: the loss saves a copy of the shifted hidden states and a few values per
  token, and its backward holds fp32 input and head-weight gradients, one (4096, 32768)
  tile buffer and, on a CPU, TRL's torch temporaries per tile (``trl_loss_bytes``);
* with ``activation_offloading`` (and checkpointing) the blocks' inputs are in pinned
  host memory (``host_bytes``: one power-of-two block each) instead of on the device;
  the recompute holds one of them, copied back;
* on a CPU, every phase + the math libraries' buffer caches (``cpu_library_cache_bytes``:
  MKL / oneDNN, created by the first full-size step and kept; not tensors);
* without a (B, T, V) loss (sequence classification) the backward start holds the first
  block's backward temporaries instead of the loss gradients;
* **optimizer step** — weights + gradients + optimizer states + the step's own
  temporaries (e.g. ``foreach`` AdamW's full copy of ``sqrt(v)`` on CUDA).
* with ``torch_compile`` the blocks keep fewer activations: the eager estimate less
  ``compile_saving_bytes`` (the rule of ``autofit.knobs.compile``: inductor's min-cut
  partitioner recomputes pointwise chains in the backward instead of saving them).

A quantized base (bitsandbytes; ``ModelInfo.quant``) keeps its weights as
``quantized_weight_bytes`` says and its other weights in the dtype it was loaded in (its
compute dtype, never cast); its activations come from coefficients derived from its
own forward (``autofit.memory.derived``: bitsandbytes' layers keep other tensors than
``nn.Linear``), an 8-bit base's layers hold their inputs past checkpointing and until
the end of backward (``int8_kept_bytes``), and a layer's backward dequantizes its
weight (the largest, in the base's dtype, is a temporary). Measured on nine quantized
configurations by ``benchmarks/measure_cpu.py`` (within 2.4%).

Activations per block come from ``coefficients.json``: bytes per token as a linear
function of hidden size, KV width, intermediate size, heads and heads × seq,
fitted per block family, precision, attention implementation and LoRA regime by
``benchmarks/calibrate_analytic.py``: for the CPU on real models (saved-tensor
hooks), for CUDA targets from the simulator's CUDA semantics (flash /
memory-efficient SDPA keeps no (T, T) probabilities even with dropout; fused
dropout keeps a bool mask). The accuracy benchmark checks the CPU estimates
against peak RSS of real training steps, which shares no code with either;
``benchmarks/gpu_check.py`` checks the CUDA ones on a GPU.

Known limitations:
    * NB: dropout masks are calibrated at the architectures' default dropout
      probabilities (0.1 for GPT-2/BERT/T5); a model trained with dropout 0 keeps
      ~1 byte/element less per dropout.
    * NB: block families other than llama-like, GPT-2, BERT and T5 use the
      coefficients of the closest family (same norm, gated MLP or not); the
      ``simulate`` method has no such approximation.
    * NB: CUDA reserved memory is allocated + a fragmentation allowance (6%, 20%
      with checkpointing, fitted to the simulate method's allocator replays, which
      ranged 1.6-28%); the simulate method replays the real allocation stream.
    * On a CUDA target, grouped-query attention in SDPA runs in flash attention
      (16-bit, sm80+) or else in the math kernel ((T, T) scores: fp32, or a T4 /
      V100 in fp16), which is estimated with the eager coefficients (within 0.3% of
      the simulator on tiny-llama, T4 and V100, fp16 and fp32).
    * NB: paged optimizers (``paged_*``) keep their states in unified memory that
      can spill to the host: they are counted on the device, as when resident.
    * NB: activation offloading's host memory (``host_bytes``) is one step's; torch's
      pinned cache keeps a block per power-of-two size, so a run of varying lengths can
      hold more. On T5 its device saving is the encoder inputs' only (2.0 MiB where the
      simulate method finds 5.5 on tiny-t5: the checkpointing rule counts one input per
      encoder + decoder pair); its host memory follows the 21 tensors T5 packs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.errors import BadInputError, NoTrainableParametersError, fix
from autofit.knobs.trl_loss import trl_loss_bytes
from autofit.memory.allocator._common import pinned_bytes
from autofit.memory.breakdown import MemoryEstimate
from autofit.probe.device import sm_version

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import BlockSpec, ModelInfo, ParamGroup
    from autofit.probe.quant import QuantSpec

__all__ = ["estimate_analytic", "weights_bytes", "gradients_bytes", "optimizer_state_bytes",
           "quantized_weight_bytes", "int8_kept_bytes",
           "chunked_loss_bytes", "loss_chunk_rows", "pinned_bytes", "offload_note", "offloaded_bytes",
           "compile_saving_bytes", "cpu_library_cache_bytes"]

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "float64": 8, "uint8": 1, "int8": 1, "float8_e4m3fn": 1,
}
# CUDA: reserved above allocated for a training step's mix of sizes (best-fit
# caching allocator, 20 MiB segments for 1-10 MiB requests, no merging across
# segments). Calibrated against the simulate method's allocator replay (Llama-3.2-1B,
# GPT-2, BERT, T5 and tiny models on an H100 target: 1.6-12.5% without
# checkpointing, 16-28% with it: recomputed activations interleave with gradients).
_CUDA_FRAGMENTATION = 0.06
# TRL's fused loss (autofit.knobs.trl_loss): fp32 (rows, cols) temporaries of TRL's torch
# fallback (CPU) alive at once in a tile's backward (TRL 1.16 _backward_tile at
# ``grad += g * (is_target.float() - p)``: y, z, log_p, p, grad, the difference and the
# product, + the bool one-hot, a quarter; measured llama-b4s256-trl); bytes per token it
# saves besides the hidden states (fp32 log Z and entropy, int64 labels, the clamped copy)
TRL_CPU_TILE_TEMPS = 7.25
TRL_SAVED_PER_TOKEN = 4 + 4 + 8 + 8
_CUDA_FRAGMENTATION_CHECKPOINTING = 0.20


def cuda_reserved_bytes(phases: dict[str, tuple[float, dict[str, float]]],
                        config: TrainConfig) -> int:
    """The caching allocator's reserved peak over a step's candidate phases: each phase's
    allocated bytes with the fragmentation of what it interleaves. Recomputed activations
    interleave with gradients in a checkpointed backward (``_CUDA_FRAGMENTATION_CHECKPOINTING``);
    the optimizer step does not (a bert-large full fine-tune with checkpointing peaks in
    it: simulate's allocator replay +0.3%, the step's 20% applied there +17.8% over a
    published V100 measurement)."""
    def frag(phase: str) -> float:
        if config.gradient_checkpointing and phase != "optimizer":
            return _CUDA_FRAGMENTATION_CHECKPOINTING
        return _CUDA_FRAGMENTATION

    return int(max(b * (1 + frag(p)) for p, (b, _) in phases.items()))

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


def _largest_trainable(info: ModelInfo) -> int:
    return max((g.numel for g in info.params if g.trainable), default=0)


def _optimizer_step_temporaries(info: ModelInfo, config: TrainConfig, device: DeviceInfo) -> int:
    """Peak bytes the optimizer step allocates beyond states and gradients."""
    spec = config.optimizer_spec
    largest = _largest_trainable(info)
    # a quantized base is never cast: its adapters stay fp32
    elem = 4 if info.quant is not None else _bytes(config.precision_spec.param_dtype)
    trainable_bytes = sum(g.numel * g.count * elem for g in info.params if g.trainable)
    if spec.family == "adamw" and not spec.bnb:
        if spec.fused:
            return 0  # one kernel per tensor list, in place
        if device.allocator == "cuda":
            # foreach=True on CUDA: _foreach_sqrt(exp_avg_sq) is one full copy
            return trainable_bytes
        # foreach=False on the CPU: sqrt(v) then / bias_correction -> 2 temporaries
        return 2 * largest * elem
    if spec.family == "adafactor":
        # grad**2 + eps, the factored approximation and -update: ~2 full fp32 copies
        upcast = largest * 4 if elem == 2 else 0
        return 2 * largest * 4 + upcast
    if spec.family in ("adagrad", "rmsprop") and not spec.bnb:
        return 2 * largest * elem
    if spec.bnb and device.allocator == "cpu":
        # NB: bitsandbytes' CPU path works in fp32 temporaries: ~5 fp32 copies of the
        # largest tensor with 8-bit states (it dequantizes them) and ~3 of the largest
        # with 32-bit states (embeddings, small tensors) — measured 5.2x and 3.0x on
        # llama-b4s256-bnb8 and gpt2-b1s128-bnb8; its CUDA kernels update in place
        eight = thirty_two = 0
        for g in info.params:
            if not g.trainable:
                continue
            if _bnb_8bit_states(g, config):
                eight = max(eight, g.numel)
            else:
                thirty_two = max(thirty_two, g.numel)
        return max(5 * eight, 3 * thirty_two) * 4
    return 0  # SGD and bitsandbytes' CUDA kernels update in place


@cache
def _coefficients() -> dict[str, dict]:
    with open(Path(__file__).with_name("coefficients.json")) as f:
        return json.load(f)


_FAMILY_OF = {
    # (not Gemma 2: its eager attention soft-caps the scores, which keeps more (T, T)
    # tensors than llama's -- fitted, the zoo's rows were 15.7% and 22.8% under; nor Qwen3
    # and OLMo 2: their per-head query and key norms keep their inputs -- 4.0% and 4.8%)
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma": "llama",
    "phi3": "llama", "olmo": "llama", "granite": "llama",
    # (not OPT, GPT-BigCode nor GPT-J: their blocks keep other tensors than GPT-2's;
    # fitted, the zoo's fp32 rows were +14.9%, +10.5% and +7.8%, derived +0.6%, +0.3%
    # and +1.1%; benchmarks/zoo.py)
    "gpt2": "gpt2", "gpt_neo": "gpt2",
    "bert": "bert", "roberta": "bert", "xlm-roberta": "bert", "electra": "bert",
    "deberta": "bert",  # (not DistilBERT: fitted, the zoo's rows were 10.5-10.8% under)
    "t5": "t5",  # (not mT5 / UMT5: their gated feed-forward keeps more; 9.1% under)
}


def _family(info: ModelInfo) -> str:
    fam = _FAMILY_OF.get(info.model_type)
    if fam:
        return fam
    b = info.blocks[0]
    if info.is_encoder_decoder:
        return "t5"
    if b.role == "encoder":
        return "bert"
    return "llama" if (b.gated_mlp or b.norm == "rmsnorm") else "gpt2"


def _lora_regime(info: ModelInfo) -> str:
    if info.peft is None:
        return "none"
    linears = {lin[0].rsplit(".", 1)[-1] for b in info.blocks for lin in b.linears}
    targets = set(info.lora_targets)
    if "all-linear" in targets or linears <= targets:
        return "all"
    return "attn"


def _cuda_sdpa_is_math(info: ModelInfo, config: TrainConfig, device: DeviceInfo) -> bool:
    """Whether torch's CUDA SDPA falls back to the math kernel for this model.

    transformers passes grouped-query attention to SDPA as is (``enable_gqa``);
    the memory-efficient kernel does not take it, so it runs in flash attention
    (16-bit inputs on sm80+, head dim <= 256 and a multiple of 8) or in the math
    kernel, which materializes the (T, T) scores (the rules of sdp_utils.cpp, as
    ``memory/simulate/_cuda.py`` applies them).
    """
    if device.allocator != "cuda" or not info.blocks:
        return False
    b = info.blocks[0]
    if not b.num_kv_heads or b.num_kv_heads == b.num_heads:
        return False  # the memory-efficient kernel takes it (sm50+)
    low = config.precision != "32-true"
    d = b.head_dim or 0
    flash = low and sm_version(device) >= 80 and 0 < d <= 256 and d % 8 == 0
    return not flash


def _needs_derived(info: ModelInfo, config: TrainConfig) -> bool:
    """Whether the fitted table lacks this model (its coefficients are then derived from
    the model, ``autofit.memory.derived``): a quantized base (its layers keep other
    tensors than ``nn.Linear``: ``Linear8bitLt`` its input, whatever the weight's
    ``requires_grad``); a PEFT method other than LoRA; LoRA other
    than the table's (fp32 adapters on a base of the same dtype, no dropout, no trainable
    tokens) — on a 16-bit base ("-true") peft keeps the adapters in fp32 and each adapted
    layer saves an fp32 copy of its input, a dropout saves a dropped-out copy; or a
    decoder / encoder family the table was not fitted to."""
    if info.peft not in (None, "lora") or info.quant is not None:
        return True
    if info.peft == "lora":
        lora = json.loads(info.peft_config) if info.peft_config else {}
        if (config.precision_spec.param_dtype != "float32" or lora.get("lora_dropout")
                or lora.get("trainable_token_indices")):
            return True
        if info.task != "causal-lm":
            # the table's LoRA rows are causal LMs': on a llama sequence classifier they
            # missed ~3.6 MiB of 16.8 saved (the zoo's row 6.2% under; derived +5.0%)
            return True
        if _family(info) != "llama":
            # the table's LoRA rows of the GPT-2 and BERT families miss what adapters on
            # every linear layer keep (Conv1D inputs, the LM head's transform): the zoo's
            # gpt2 and bert LoRA rows were 5.0% and 4.9% under, derived +1.0% / +1.3%
            return True
    if info.is_encoder_decoder:
        # T5's fitted coefficients are T5's own: other encoder-decoders (mT5's gated
        # feed-forward, BART's, Pegasus-X's blocks) were -33%..+20% with them on the zoo
        return info.model_type != "t5"
    return info.model_type not in _FAMILY_OF


def _coef(info: ModelInfo, config: TrainConfig, device: DeviceInfo) -> dict:
    if _needs_derived(info, config):
        from autofit.memory.derived import derived_coefficients
        from autofit.probe.model import module_of

        module = module_of(info)
        if module is not None:
            if config.loss_impl == "trl":  # no logits kept, as autofit's chunked loss
                config = config.replace(loss_impl="model", chunked_loss=True)
            return derived_coefficients(module, info, config, device)
        if info.peft not in (None, "lora"):  # (a LoRA or family falls back to the table)
            raise BadInputError(f"no analytic coefficients for {info.name} "
                                f"({info.peft}) without its module; use "
                                + fix("--method simulate", "method='simulate'"))
    prec = config.precision
    prec_key = {"16-mixed": "bf16-mixed", "16-true": "bf16-true"}.get(prec, prec)
    if info.quant is not None and info.dtype != "float32" and not config.precision_spec.autocast:
        prec_key = "bf16-true"  # (no module to derive from) a 16-bit base, never cast
    attn = "eager" if info.attn_implementation == "eager" else "sdpa"
    if attn == "sdpa" and _cuda_sdpa_is_math(info, config, device):
        attn = "eager"  # the math kernel saves the (T, T) scores as eager attention does
    key = f"{_family(info)}/{prec_key}/{attn}/{_lora_regime(info)}"
    table = _coefficients()
    if device.allocator == "cuda" and key + "/cuda" in table:
        # CUDA kernels save other tensors than the CPU's (SDPA backends, fused dropout)
        key += "/cuda"
    if key not in table:
        raise BadInputError(f"no analytic coefficients for {key}; use "
                            + fix("--method simulate", "method='simulate'"))
    return table[key]


def _checkpointed_blocks(info: ModelInfo) -> int:
    """Blocks whose inputs checkpointing keeps, as the activation rule counts them (an
    encoder-decoder's coefficients are per encoder + decoder pair)."""
    return sum(b.count for b in info.blocks
               if not (info.is_encoder_decoder and b.role != "encoder"))


def _packed(info: ModelInfo, config: TrainConfig, seq_len: int) -> list[tuple[int, int]]:
    """What transformers' offloading packs per micro batch, as (bytes, how many): the
    tensors passed positionally to each checkpointed block. A decoder or encoder block
    takes its (B*T, h) input; a T5 decoder block also the encoder's output, and every T5
    block but the first of a stack the (1, H, T, T) position bias(es) computed by the first
    (one in the encoder, self- and cross-attention ones in the decoder; measured on
    tiny-t5: 21 tensors, ``benchmarks/offload_check.py``)."""
    if not (config.activation_offloading and config.gradient_checkpointing):
        return []
    act = _bytes(config.precision_spec.param_dtype)
    one = config.micro_batch_size * seq_len * (info.hidden_size or 0) * act
    if not (info.is_encoder_decoder and _family(info) == "t5"):
        return [(one, _checkpointed_blocks(info))]
    enc = sum(b.count for b in info.blocks if b.role == "encoder")
    dec = sum(b.count for b in info.blocks if b.role != "encoder")
    bias = info.blocks[0].num_heads * seq_len * seq_len * act
    return [(one, enc + 2 * dec), (bias, max(enc - 1, 0) + 2 * max(dec - 1, 0))]


def offloaded_bytes(info: ModelInfo, config: TrainConfig, seq_len: int) -> int:
    """Bytes activation offloading copies to the host per micro batch (and back in backward);
    0 without offloading."""
    return sum(n * c for n, c in _packed(info, config, seq_len))


def _first_input_stays(info: ModelInfo) -> bool:
    """Whether the first block's input stays on the device when offloaded: with a frozen
    input embedding, transformers makes the embedding's output a leaf that requires grad
    (``enable_input_require_grads``), which its ``AccumulateGrad`` node holds for the whole
    step; llama-like models pass that very tensor to the first block (``hidden_states =
    inputs_embeds``; Gemma scales it first, GPT-2, BERT and T5 add or drop out)."""
    frozen = any(g.role == "embedding" and not g.trainable for g in info.params)
    return frozen and _family(info) == "llama" and not info.model_type.startswith("gemma")


def _layer_bytes_per_token(c: dict, b: BlockSpec, seq_len: int) -> float:
    kv = b.num_kv_heads * b.head_dim
    v = (
        c["h"] * b.hidden_size
        + c["kv"] * kv
        + c["i"] * b.intermediate_size
        + c["H"] * b.num_heads
        + c["HT"] * b.num_heads * seq_len
        + c["c0"]
        + c.get("T", 0.0) * seq_len
    )
    return max(v, 0.0)


def _layer_bytes(c: dict, b: BlockSpec, batch: int, seq_len: int) -> float:
    """One block's saved bytes: per token, per sample (``s``) and per micro batch (``F``);
    the last two only in derived coefficients (``autofit.memory.derived``)."""
    per_token = batch * seq_len * _layer_bytes_per_token(c, b, seq_len)
    return max(per_token + batch * c.get("s", 0.0), 0.0) + c.get("F", 0.0)


def _quantized_linears(info: ModelInfo, b: BlockSpec) -> list[tuple[str, int, int, bool]]:
    """The block's linears bitsandbytes quantized (all but ``skip_modules``)."""
    skip = set(info.quant.skip_modules) if info.quant is not None else set()
    return [lin for lin in b.linears if lin[0].rsplit(".", 1)[-1] not in skip
            and lin[0] not in skip]


def int8_kept_bytes(info: ModelInfo, tokens: int, act: int, inner: int | None = None) -> int:
    """Bytes an 8-bit (LLM.int8) base's layers hold for backward per micro batch, outside
    what checkpointing can drop: every ``Linear8bitLt`` keeps its input ``A`` in its
    autograd node (``ctx.A`` on the CPU's ``MatMul8bitFp``, ``ctx.tensors`` on CUDA's
    ``MatMul8bitLt``, bitsandbytes 0.50), not through ``save_for_backward``, so it stays
    from the forward until the graph is freed after ``backward()`` — with gradient
    checkpointing too, and even where a frozen ``nn.Linear`` would keep nothing. Linears
    that read the same tensor (q/k/v, gate/up) hold it once: per block ``tokens`` x the
    in-features of each linear that does not share its input. Input projections read a
    norm's output, in the activations' dtype (``act`` bytes); output projections (o_proj,
    down_proj, c_proj, ...) read what attention and the MLP computed, in ``inner`` bytes
    (under autocast its dtype; default ``act``). 0 for any other base. Measured: real and
    simulated steps keep the same storages (``tests/memory/test_quantized_base.py``)."""
    if info.quant is None or info.quant.bits != 8:
        return 0
    from autofit.probe.model import OUTPUT_PROJECTIONS

    inner = act if inner is None else inner
    total = 0
    for b in info.blocks:
        for name, i, _, shares in _quantized_linears(info, b):
            if not shares:
                out_proj = name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS
                total += b.count * i * (inner if out_proj else act)
    return tokens * total


def _dequantized_bytes(info: ModelInfo) -> int:
    """The largest quantized weight dequantized (in the base's dtype): what a quantized
    layer's backward (and, on the CPU, its forward) holds besides its gradients."""
    if info.quant is None:
        return 0
    largest = max((i * o for b in info.blocks for _, i, o, _ in _quantized_linears(info, b)),
                  default=0)
    return largest * _bytes(info.dtype)


# CPU: the math libraries' buffer caches, created by the first full-size step and kept for
# the run: not tensors, measured as what a step's matmuls leave resident beyond the tensors
# (one thread, glibc's thresholds fixed as autofit measures; ``benchmarks/cpu_cache.py``
# measures them on the machine at hand). They depend on the instruction set the kernels use:
# * AVX2 (MKL's fp32 GEMM buffers, oneDNN's for 16-bit): about half the widest matmul
#   output, at most ~14 MiB, less at short steps (~1-2 MiB at 128 tokens);
# * AVX512 (AMX-capable Xeons too), an upper bound of what ``benchmarks/cpu_cache.py``
#   measured: MKL packs an fp32 weight once the rows pass ~400 (384: not; 448: packed),
#   in a buffer of up to ~15 MiB that a later, smaller weight reuses: a step keeps one
#   buffer per weight larger than every weight before it (attention, feed-forward, head:
#   a 3 MiB feed-forward then an 8 MiB head leave 12.4 MiB), at 1024 rows and more one for
#   the packed activations too; below ~400 rows at most 2 MiB x rows / 384 per such
#   weight and half the floor (an 8-bit LoRA trial at 128 rows: within 0.6%). 16-bit
#   matmuls go to oneDNN: ~10 MiB of primitive cache and scratch + the weights it
#   reorders, at most 9 MiB of them (10.5-18.3 MiB measured on one block and a head).
# An unknown instruction set takes the larger of the two rules.
_CPU_LIB_CACHE_MAX = 14 << 20  # bytes (AVX2)
_CPU_LIB_CACHE_SHARE = 0.5  # of the widest matmul output (AVX2)
_CPU_LIB_CACHE_FULL_TOKENS = 1024  # tokens per micro batch from which the cache is full size
_AVX512_PACK_ROWS = 385  # rows from which MKL packs an fp32 weight (384: not; 448: packed)
_AVX512_PACK_MAX = 15 << 20  # bytes of one packing buffer, at most
_AVX512_SMALL_MAX = 2 << 20  # ... at 384 rows (less below: 128 rows kept 1.7 MiB in all)
_AVX512_FLOOR = 2 << 20  # what any fp32 step leaves
_AVX512_ACT_ROWS = 1024  # rows from which the activations are packed too
_AVX512_HALF = 10 << 20  # oneDNN's primitive cache and scratch for 16-bit matmuls
_AVX512_HALF_WEIGHTS = 9 << 20  # + the 16-bit weights it reorders, at most


def cpu_library_cache_bytes(info: ModelInfo, config: TrainConfig, seq_len: int,
                            device: DeviceInfo, capability: str | None = None) -> int:
    """Bytes the CPU's math libraries keep cached through a training step (0 on CUDA), by
    this CPU's instruction set (``capability``: ``autofit.probe.device.cpu_capability()``
    when ``None``; the rules are in the comment above). Not a tensor, so neither the
    analytic closed form nor the simulated allocation stream sees it otherwise (up to 7%
    of a small model's step: issue 25).

        >>> from autofit.probe.model import probe_model
        >>> from autofit.probe.device import resolve_device
        >>> info = probe_model("tiny-llama")
        >>> cpu_library_cache_bytes(info, TrainConfig(micro_batch_size=4), 256,
        ...                         resolve_device("cpu")) > 0
        True
    """
    if device.allocator == "cuda":
        return 0
    if capability is None:
        from autofit.probe.device import cpu_capability

        capability = cpu_capability()
    tokens = config.micro_batch_size * seq_len
    lm = (info.task != "seq-cls" and info.vocab_size is not None and not config.chunked_loss
          and config.loss_impl != "trl")
    if info.is_transformer:
        # the matmul weights of a step in the order it first uses them: attention,
        # feed-forward in and out, head (a quantized base's layers run bitsandbytes'
        # kernels, not MKL's)
        weights = [k * n for b in info.blocks for k, n in
                   ((b.hidden_size or 0, b.hidden_size or 0),
                    (b.hidden_size or 0, b.intermediate_size or b.hidden_size or 0),
                    (b.intermediate_size or b.hidden_size or 0, b.hidden_size or 0))
                   if info.quant is None]
        if lm:
            weights.append((info.hidden_size or 0) * info.vocab_size)
        widest = max([info.vocab_size if lm else 0]
                     + [b.intermediate_size or b.hidden_size or 0 for b in info.blocks])
    else:
        # blocks not recognised (FNet: 9.0% under without this): the 2-D linear weights,
        # in module order, and the widest of their outputs
        linears = [g for g in info.params if g.role == "linear" and len(g.shape) == 2]
        if not linears:
            return 0
        weights = [g.numel for g in linears]
        widest = max(g.shape[0] for g in linears)
        head = [g.numel for g in info.params if lm and g.role == "embedding"
                and g.shape[0] == info.vocab_size]
        if head and info.tie_word_embeddings:  # the LM head is the input embedding
            weights.append(max(head))
            widest = max(widest, info.vocab_size)
    spec = config.precision_spec
    half = bool(spec.autocast or spec.param_dtype != "float32")
    elem = 2 if half else 4
    avx2 = int(min(_CPU_LIB_CACHE_MAX, _CPU_LIB_CACHE_SHARE * tokens * widest * elem)
               * min(1.0, tokens / _CPU_LIB_CACHE_FULL_TOKENS))
    if half:
        avx512 = _AVX512_HALF + min(_AVX512_HALF_WEIGHTS, sum(2 * w for w in set(weights)))
    else:
        if tokens >= _AVX512_PACK_ROWS:
            cap, avx512 = _AVX512_PACK_MAX, _AVX512_FLOOR
        else:  # short steps: less kept, the less the fewer rows
            cap = int(_AVX512_SMALL_MAX * tokens / (_AVX512_PACK_ROWS - 1))
            avx512 = _AVX512_FLOOR // 2
        largest = 0
        for w in weights:  # a buffer per weight larger than all before it
            if w > largest:
                avx512, largest = avx512 + min(cap, 4 * w), w
        if tokens >= _AVX512_ACT_ROWS:
            avx512 += min(_AVX512_PACK_MAX, 4 * tokens * (info.hidden_size or 0))
    if capability == "AVX2":
        return avx2
    if capability.startswith("AVX512"):
        return avx512
    return max(avx2, avx512)


def _linear_weight_numel(info: ModelInfo) -> int:
    """Elements of the matmul weights autocast copies (blocks + output head)."""
    n = info.block_matmul_numel
    if info.vocab_size and info.hidden_size and info.task != "seq-cls":
        n += info.vocab_size * info.hidden_size
    return n


def loss_chunk_rows(tokens: int, vocab: int, hidden: int, *, halved: bool) -> int:
    """Rows of torch's chunked ``linear_cross_entropy`` per chunk (``aspect_ratio``): a
    (rows, V) logits chunk about the size of the (B*T, h) input, rounded up to a power of
    two, halved by ``aspect_ratio:2`` (the default but on a CPU with 16-bit inputs)."""
    inc = -(-vocab // max(hidden, 1))
    target = -(-tokens // inc)
    rows = 1 << (target - 1).bit_length()
    return max(1, min(rows // (2 if halved else 1), tokens))


def chunked_loss_bytes(tokens: int, vocab: int, hidden: int, act: int, device: DeviceInfo,
                       *, accumulating: bool = False, head_trainable: bool = True) -> int:
    """Bytes the chunked causal-LM loss holds at its peak: the end of its forward, or the
    start of backward, where the precomputed head-weight gradient is handed to autograd,
    which copies it into ``.grad`` (it cannot steal a tensor the op still references: two
    (V, h) gradients for a moment; with accumulation it is added into the existing
    ``.grad``: one) beside the (B*T, h) input gradient. A frozen head (LoRA) has no
    weight gradient. For few tokens this is more than the full logits' need (the (V, h)
    gradient is precomputed): torch's chunking pays off from about B*T >= h tokens.

    torch's chunked op computes the gradients of its input (B*T, h) and of the head's
    weight (V, h) in the forward and keeps them until backward, and works in one (rows, V)
    logits buffer (``autofit.knobs.loss``; torch 2.13's ``_AUTO_DEFAULTS``):

    * fp32 input (fp32 and the mixed precisions: the final norm's output is fp32):
      "compact", no accumulation dtype: the two gradients + the fp32 chunk;
    * 16-bit input on CUDA: "compact" with fp32 accumulation: 16-bit gradients, fp32 chunk;
    * 16-bit input on a CPU: "accurate": an fp32 input gradient, a 16-bit weight gradient,
      an fp32 copy of the weight, an fp32 weight-gradient scratch, the fp32 chunk, and
      the two fp32 (V, h) temporaries of the CPU's mixed-dtype ``sub_`` (measured).
    """
    cuda = device.allocator == "cuda"
    half = act == 2
    rows = loss_chunk_rows(tokens, vocab, hidden, halved=cuda or not half)
    chunk = rows * vocab * 4 + rows * hidden * 4
    grad_in = tokens * hidden * (4 if half and not cuda else act)  # CPU 16-bit: fp32
    grad_w = vocab * hidden * act if head_trainable else 0
    handed = (1 if accumulating else 2) * grad_w + grad_in  # backward start
    if not half or cuda:
        return max(grad_in + grad_w + chunk, handed)
    # CPU, 16-bit input ("accurate"): + an fp32 copy of the weight; with a weight gradient an
    # fp32 scratch, and per chunk the scratch subtracted from the 16-bit gradient, which the
    # CPU kernel does through two fp32 (V, h) temporaries
    extra = (4 if head_trainable else 1) * vocab * hidden * 4
    return max(grad_in + grad_w + extra + chunk, handed)


def offload_note(host: int, tensors: int) -> str:
    """The note of an estimate with activation offloading: what lives in host memory."""
    from autofit.probe.device import format_bytes

    return (f"activation offloading: {format_bytes(host)} of pinned host memory holds the "
            f"{tensors} inputs the checkpointed blocks save (host_bytes); backward copies "
            "them back one block at a time")
# torch.compile (inductor, default partitioner): per block and token, the elements eager
# autograd saves for backward that the compiled step does not, as a linear function of the
# block's widths (h: hidden, kv: key/value width, i: intermediate), per block family. Read
# off the tensors each step saves (saved_tensors_hooks around eager and compiled steps of
# small llama and GPT-2 models) and checked against measured peaks
# (benchmarks/measure_cpu.py, "torch_compile"):
# * llama: the gated MLP's product silu(gate) * up (down_proj's input) is recomputed (-i),
#   and of the attention's inputs only the (B, H, T, d) tensors SDPA's backward reads are
#   kept: -2 kv net (the key/value heads are kept repeated to all heads, but the norms'
#   and rotary embedding's hidden-sized outputs are recomputed); the graph materialises
#   the causal mask once, (B, 1, T, T) in the compute dtype, which eager SDPA gets as
#   ``is_causal`` (``mask``: elements per token and key position, once per step);
# * gpt2: of the MLP's five (B, T, i) tensors (fc output, GELU's inner terms, its output,
#   c_proj's input) two are kept (-3i).
# Every dropout keeps a bool mask (1 byte) instead of eager's mask in the activation dtype
# (its hidden-sized dropouts, attention's heads x T per token, the embeddings').
# The loss: eager keeps the fp32 log-softmax and makes two fp32 (B, T, V) gradients at the
# start of backward; the compiled graph fuses the upcast, the log-softmax and the loss's
# backward. ``loss`` / ``loss_mixed``: how many fp32 (B, T, V) buffers fewer are alive at
# the backward peak, without / with autocast (measured; the "-true" precisions take the
# former): llama 0 in fp32 (the compiled backward still holds two), 1.75 in bf16-mixed (it
# keeps the bf16 logits, and its fused backward ~0.8 fp32 buffer); GPT-2 1 in fp32, and
# 1.5 with autocast (the fp32 value and the half buffer bf16 logits save; not pinned down:
# its measured bf16-mixed configuration peaks in the optimizer step).
# NB: families without a measured rule (BERT, T5, ...) get no saving (the eager estimate,
# on the safe side).
_COMPILE_FUSED: dict[str, dict[str, float]] = {
    "llama": {"h": 0.0, "kv": 2.0, "i": 1.0, "mask": 1.0, "loss": 0.0, "loss_mixed": 1.75},
    "gpt2": {"h": 0.0, "kv": 0.0, "i": 3.0, "mask": 0.0, "loss": 1.0, "loss_mixed": 1.5},
}


def compile_saving_bytes(info: ModelInfo, config: TrainConfig, seq_len: int) -> int:
    """Bytes of activations a ``torch_compile`` step does not keep at its backward peak,
    against the eager step's (0 without ``torch_compile``; see ``autofit.knobs.compile``
    for the rule and its limits). With gradient checkpointing only the block recomputed
    at a time gains (the checkpointed inputs are kept either way). With the chunked loss
    nothing: ``ChunkedLossTrainer``'s loss runs the backbone itself, uncompiled.

        >>> from autofit.probe.model import probe_model
        >>> info = probe_model("tiny-llama")
        >>> compile_saving_bytes(info, TrainConfig(torch_compile=True), 256) > 0
        True
        >>> compile_saving_bytes(info, TrainConfig(), 256)
        0
    """
    return sum(_compile_parts(info, config, seq_len))


def _compile_parts(info: ModelInfo, config: TrainConfig, seq_len: int) -> tuple[int, int]:
    """(blocks, the rest) of ``compile_saving_bytes``: what the blocks' saved activations
    lose (one block with checkpointing), and the masks and loss buffers outside them."""
    if not config.torch_compile or config.chunked_loss or not info.is_transformer:
        return 0, 0
    c = _COMPILE_FUSED.get(_family(info))
    if c is None:
        return 0, 0
    e = _bytes(config.precision_spec.compute_dtype)  # element size of the saved activations
    mask = e - 1  # a dropout's bool mask instead of one in the activation dtype
    per_layer = []
    for b in info.blocks:
        if info.is_encoder_decoder and b.role != "encoder":
            continue
        kv = b.num_kv_heads * b.head_dim
        el = c["h"] * b.hidden_size + c["kv"] * kv + c["i"] * b.intermediate_size
        masks = (b.num_dropouts * b.hidden_size
                 + (b.num_heads * seq_len if b.attention_dropout > 0 else 0))
        per_layer.append((max(el, 0.0) * e + mask * masks, b.count))
    if not per_layer:
        return 0, 0
    tokens = config.micro_batch_size * seq_len
    causal_mask = tokens * seq_len * c["mask"] * e  # kept by the compiled step, not by eager
    # the embeddings' dropout (outside the blocks): its mask too
    base = tokens * mask * (info.hidden_size or 0) * (info.embedding_dropout > 0) - causal_mask
    lm = info.task != "seq-cls" and info.vocab_size is not None
    loss = c["loss_mixed"] if config.precision_spec.autocast else c["loss"]
    base += loss * tokens * (info.vocab_size if lm else 0) * 4  # fp32 (B, T, V) buffers
    if config.gradient_checkpointing:
        return int(tokens * max(x for x, _ in per_layer)), int(base)
    return int(tokens * sum(x * n for x, n in per_layer)), int(base)


@dataclass(frozen=True)
class AnalyticTerms:
    """The closed form's pieces for one rank holding everything (``analytic_phases``).

    Attributes:
        phases: candidate peak -> (bytes, component -> bytes): ``"backward"`` (its start),
            ``"backward-end"``, ``"optimizer"``, with checkpointing ``"recompute"`` and,
            with derived coefficients, ``"forward"``.
        host: pinned host bytes (activation offloading).
        W, copies, copies_head, G, S, G_held, opt_temp, A, A_base, A_transient, loss_temp,
        block_bwd_temp: the terms the phases add up (bytes; see ``estimate_analytic``).
    """

    phases: dict[str, tuple[float, dict[str, float]]]
    host: int
    W: int
    copies: int
    copies_head: int
    G: int
    S: int
    G_held: int
    opt_temp: int
    A: float
    A_base: float
    A_transient: float
    loss_temp: float
    block_bwd_temp: float
    derived: bool = False  # coefficients derived from the model, not the fitted table


def analytic_phases(info: ModelInfo, config: TrainConfig, seq_len: int,
                    device: DeviceInfo) -> AnalyticTerms:
    """The candidate peaks of one rank holding the whole model (``estimate_analytic``'s
    closed form before it picks the largest; the several-rank rules of
    ``autofit.memory.sharding`` rework them)."""
    B, T = config.micro_batch_size, seq_len
    N = B * T  # tokens in the micro batch
    spec = config.precision_spec
    # residual-stream element size (a quantized base is never cast: its own dtype)
    act = _bytes(info.dtype) if info.quant is not None else _bytes(spec.param_dtype)
    # what 8-bit layers hold past checkpointing
    kept8 = int8_kept_bytes(info, N, act, _bytes(spec.compute_dtype) if spec.autocast else act)
    c = _coef(info, config, device)
    layer_c, base_c = c["layer"], c["base"]
    decoder_c = c.get("layer_decoder")  # derived for an encoder-decoder: its decoder's

    W = weights_bytes(info, config)
    G = gradients_bytes(info, config)
    S = optimizer_state_bytes(info, config)
    dead = c.get("no_grad_numel", 0)  # derived: trainable elements the loss never reaches
    if dead and info.trainable_params:
        # no gradient, so no optimizer state (DeepSeek sparse attention's indexer: 55% over)
        live = max(0.0, 1.0 - dead / info.trainable_params)
        G, S = int(G * live), int(S * live)
    lm = info.task != "seq-cls" and info.vocab_size is not None
    V = info.vocab_size if lm else 0
    h = info.hidden_size or 0

    # -- activations saved by the forward ------------------------------------
    layer_costs = []  # (bytes per layer, count)
    for b in info.blocks:
        if info.is_encoder_decoder and b.role != "encoder":
            if decoder_c is not None:
                layer_costs.append((_layer_bytes(decoder_c, b, B, T), b.count))
            continue  # T5's fitted coefficients are per encoder+decoder pair (calibration)
        layer_costs.append((_layer_bytes(layer_c, b, B, T), b.count))
    A_layers_full = sum(x * n for x, n in layer_costs)
    A_layer_max = max((x for x, _ in layer_costs), default=0)
    num_layers = sum(n for _, n in layer_costs)
    trl = config.loss_impl == "trl" and lm  # TRL's fused LM head (SFTTrainer)
    chunked = (config.chunked_loss or trl) and lm
    # the V term is the logits the loss keeps for backward; a chunked loss keeps none
    A_base = N * max(base_c["h"] * h + (0 if chunked else base_c["V"] * V) + base_c["c0"]
                     + base_c.get("T", 0.0) * T, 0.0)
    A_base = max(A_base + B * base_c.get("s", 0.0), 0.0) + base_c.get("F", 0.0)
    if trl:  # TRL saves the shifted hidden states (a copy) and per token log Z, entropy, labels
        A_base += N * (h * act + TRL_SAVED_PER_TOKEN)

    # autocast keeps a 16-bit copy of every matmul weight from its forward to its backward
    # (none of a weight already 16-bit: a quantized base loaded in its 16-bit compute dtype)
    cast = spec.autocast and (info.quant is None or info.dtype == "float32")
    copies_all = 2 * _linear_weight_numel(info) if cast else 0
    copies_head = 2 * V * h if cast else 0
    if chunked:  # torch's chunked op is not autocast: the head's weight is used as it is
        copies_all -= copies_head
        copies_head = 0

    host = 0  # pinned host bytes (activation offloading)
    if config.gradient_checkpointing:
        # each checkpointed block keeps its input (and an 8-bit base's layers their inputs);
        # backward recomputes one block at a time
        A_layers = num_layers * N * h * act + kept8
        A_transient = A_layer_max
        copies = copies_head + (copies_all - copies_head) // max(num_layers, 1)
        A_kept = A_layers  # the inputs on the device while backward recomputes
        if config.activation_offloading and device.allocator == "cuda":
            # the inputs are in pinned host memory; backward copies one back at a time
            # (a CPU target, which autofit refuses it for, has nothing to offload)
            host = sum(pinned_bytes(n) * c for n, c in _packed(info, config, T))
            A_layers = N * h * act if _first_input_stays(info) else 0
            A_kept = A_layers + N * h * act
    else:
        A_layers = A_layers_full
        A_transient = 0
        copies = copies_all
    # torch.compile: what the partitioner recomputes instead of saving (the block
    # recomputed at a time with checkpointing, every block without)
    fused, fused_base = _compile_parts(info, config, T)
    if config.gradient_checkpointing:
        A_transient = max(A_transient - fused, 0)
    else:
        A_layers = max(A_layers - fused, 0)
    A_base -= fused_base  # masks (the causal one: more) and the loss's buffers
    A = A_layers + A_base

    # -- temporaries ---------------------------------------------------------
    NL = B * (T + info.virtual_tokens)  # the logits' rows: prompt tuning's tokens too
    loss_grads = 2 * NL * V * 4  # fp32 d log_softmax and d logits at the loss backward
    head_grad = V * h * act if lm else 0
    head_grad_in_G = min(head_grad, G)
    # one block's backward: grads of its widest activations (e.g. MLP: 2 x (N, i))
    inter = max((b.intermediate_size for b in info.blocks), default=0)
    block_bwd_temp = 2 * N * inter * act + 2 * N * h * act + _dequantized_bytes(info)
    opt_temp = _optimizer_step_temporaries(info, config, device)

    # with accumulation, the gradients of the earlier micro batches are held through
    # the next forward and backward
    G_held = G if config.grad_accum_steps > 1 else 0
    loss_temp = max(loss_grads, (0 if G_held else head_grad_in_G) + NL * V * 4)
    if trl:
        head_trainable = any(g.trainable and tuple(g.shape) == (V, h) for g in info.params)
        loss_temp = trl_loss_bytes(NL, V, h, 2 if spec.autocast else act,
                                   cuda=device.allocator == "cuda", head_trainable=head_trainable,
                                   accumulating=bool(G_held), tile_temps=TRL_CPU_TILE_TEMPS)
    elif chunked:
        head_trainable = any(g.trainable and tuple(g.shape) == (V, h) for g in info.params)
        loss_temp = chunked_loss_bytes(NL, V, h, act, device, accumulating=bool(G_held),
                                       head_trainable=head_trainable)
    phases = {
        # all activations alive; the loss backward's fp32 (N, V) gradients
        # (without a (B, T, V) loss, e.g. sequence classification, the first block's
        # backward temporaries are the larger: all activations are still alive then)
        "backward": (W + copies + S + A + G_held + max(loss_temp, block_bwd_temp),
                     {"weights": W + copies, "optimizer_states": S, "activations": A,
                      "gradients": G_held, "temporaries": max(loss_temp, block_bwd_temp)}),
        # gradients complete, the embedding side's activations and one block's temporaries
        # (an 8-bit base's layers still hold their inputs: the graph is freed after backward)
        "backward-end": (W + S + G + A_base // 2 + kept8 + block_bwd_temp + A_transient,
                         {"weights": W, "optimizer_states": S, "gradients": G,
                          "activations": A_base // 2 + kept8 + A_transient,
                          "temporaries": block_bwd_temp}),
        "optimizer": (W + S + G + opt_temp,
                      {"weights": W, "optimizer_states": S, "gradients": G, "activations": 0,
                       "temporaries": opt_temp}),
    }
    fwd_c = c.get("forward")  # derived: the forward's transient above what it keeps
    if fwd_c is not None:
        # the forward's highest point: an op's or a block's scratch (AXK2's indexer scores
        # on a sequence classifier: 9.3% under without it) above the activations made by
        # then (all of them, or an encoder-decoder's encoder's share: see
        # ``autofit.memory.derived``; all with checkpointing, whose forward keeps other
        # tensors than derived)
        fwd_temp = max(N * (fwd_c["c0"] + fwd_c["T"] * T) + B * fwd_c["s"], 0.0) + fwd_c["F"]
        share = 1.0 if config.gradient_checkpointing else fwd_c.get("share", 1.0)
        phases["forward"] = (W + copies + S + G_held + share * A + fwd_temp,
                             {"weights": W + copies, "optimizer_states": S,
                              "gradients": G_held, "activations": share * A,
                              "temporaries": fwd_temp})
    if config.gradient_checkpointing:
        # after the loss and head backward, each block is recomputed in turn: its full
        # activations and autocast copies exist again while the gradients accumulate
        # (at the last block recomputed, about all of them)
        copies_layer = copies - copies_head
        phases["recompute"] = (
            W + copies_layer + S + G + A_kept + A_transient + block_bwd_temp,
            {"weights": W + copies_layer, "optimizer_states": S, "gradients": G,
             "activations": A_kept + A_transient, "temporaries": block_bwd_temp})
    return AnalyticTerms(phases=phases, host=int(host), W=W, copies=copies,
                         copies_head=copies_head, G=G, S=S, G_held=G_held, opt_temp=opt_temp,
                         A=A, A_base=A_base, A_transient=A_transient, loss_temp=loss_temp,
                         block_bwd_temp=block_bwd_temp, derived=bool(c.get("derived")))


def estimate_analytic(
    info: ModelInfo, config: TrainConfig, seq_len: int, device: DeviceInfo
) -> MemoryEstimate:
    """Estimate one training step's memory in closed form (see the module docstring).

    Example:
        >>> from autofit.probe.model import probe_model
        >>> from autofit.probe.device import resolve_device
        >>> est = estimate_analytic(probe_model("tiny-llama"), TrainConfig(micro_batch_size=2),
        ...                         512, resolve_device("cpu"))
        >>> est.peak_allocated_bytes > 0
        True
    """
    if seq_len <= 0:
        raise BadInputError(f"seq_len must be positive, got {seq_len}")
    if info.trainable_params == 0:
        raise NoTrainableParametersError(
            f"{info.name} has no trainable parameter; unfreeze some or add LoRA "
            f"({fix('--lora-r 8', 'lora={' + repr('r') + ': 8}')})"
        )
    if not info.is_transformer:
        raise BadInputError(
            f"{info.name} is not a transformer autofit recognises; use "
            + fix("--method simulate", "method='simulate'")
        )
    if config.world_size > 1:  # the ranks' estimate builds on this one, not the reverse
        raise ValueError("estimate_analytic of autofit.memory.analytic is one rank's; "
                         "use autofit.memory.ranked.estimate_analytic for several")
    terms = analytic_phases(info, config, seq_len, device)
    phases, host = terms.phases, terms.host
    T = seq_len
    phase, (peak_alloc, parts) = max(phases.items(), key=lambda kv: kv[1][0])
    parts = {k: int(v) for k, v in parts.items()}
    lib_cache = cpu_library_cache_bytes(info, config, seq_len, device)  # the whole step
    parts["temporaries"] += lib_cache
    peak_alloc = int(peak_alloc) + lib_cache

    if device.allocator == "cuda":
        peak_reserved = cuda_reserved_bytes(phases, config)
    else:
        peak_reserved = peak_alloc
    total = peak_reserved + device.overhead_bytes
    breakdown = {
        "weights": parts["weights"],
        "gradients": parts["gradients"],
        "optimizer_states": parts["optimizer_states"],
        "activations": parts["activations"],
        "temporaries": parts["temporaries"],
        "overhead": total - peak_alloc,
    }
    notes = []
    if info.is_encoder_decoder and info.model_type != "t5" and not terms.derived:
        notes.append(f"{info.model_type}: T5's fitted coefficients stand in (the zoo measured "
                     "other encoder-decoders at -33%..+20% with them: LED, Pegasus-X under); "
                     "prefer " + fix("--method simulate", "method='simulate'"))
    if config.optimizer_spec.paged:
        notes.append("paged optimizer: states may spill to host memory under pressure")
    if terms.copies:
        notes.append("weights include autocast's 16-bit copies kept from forward to backward")
    if host:
        notes.append(offload_note(host, sum(c for _, c in _packed(info, config, T))))
    return MemoryEstimate(
        peak_allocated_bytes=peak_alloc,
        peak_reserved_bytes=peak_reserved,
        device_total_bytes=total,
        capacity_bytes=device.capacity_bytes,
        fits=total <= device.capacity_bytes,
        breakdown=breakdown,
        method="analytic",
        device=device.name,
        peak_phase=phase if phase in ("optimizer", "forward") else "backward",
        model=info.name,
        num_params=info.num_params,
        trainable_params=info.trainable_params,
        seq_len=seq_len,
        config=config.to_dict(),
        notes=tuple(notes),
        host_bytes=int(host),
    )
