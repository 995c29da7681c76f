"""Activations a block saves for backward: the fitted coefficients (``coefficients.json``)
or derived ones (``autofit.memory.analytic.derived``), per block family, precision,
attention and LoRA regime; what checkpointing and offloading keep of them."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.errors import BadInputError, fix
from autofit.knobs.registry import patching
from autofit.memory.analytic._states import _bytes
from autofit.probe.device import sm_version

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import BlockSpec, ModelInfo


@cache
def _coefficients() -> dict[str, dict]:
    with open(Path(__file__).with_name("coefficients.json")) as f:
        return json.load(f)


_FAMILY_OF = {
    # (not Gemma 2: its eager attention soft-caps the scores, which keeps more (T, T)
    # tensors than llama's -- fitted, the zoo's rows were 15.7% and 22.8% under; nor Qwen3
    # and OLMo 2: their per-head query and key norms keep their inputs -- 4.0% and 4.8%)
    # (not Phi-3: LoRA on its fused qkv and gate-up projections keeps other inputs than
    # llama's separate ones; the table's LoRA rows were 3.3% under)
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma": "llama",
    "olmo": "llama", "granite": "llama",
    # (not OPT, GPT-BigCode nor GPT-J: their blocks keep other tensors than GPT-2's;
    # fitted, the zoo's fp32 rows were +14.9%, +10.5% and +7.8%, derived +0.6%, +0.3%
    # and +1.1%; benchmarks/zoo.py)
    # (not GPT-Neo: its blocks keep other tensors than GPT-2's; fitted, the zoo's
    # classifiers in fp32 were +8.2..8.6%, derived -0.3..+0.2%)
    "gpt2": "gpt2",
    "bert": "bert", "roberta": "bert", "xlm-roberta": "bert",
    # (not ELECTRA: its embeddings are narrower than its blocks and projected up, and its
    # classifier head is no pooler; fitted, the zoo's classifiers were +6.3..13.1%,
    # derived +0.8..2.4%)
    # (not DistilBERT nor DeBERTa: fitted, the zoo's rows were 10.5-10.8% and 3.3% under;
    # DeBERTa's disentangled attention keeps its position scores too)
    "t5": "t5",  # (not mT5 / UMT5: their gated feed-forward keeps more; 9.1% under)
}


# the activations each family's table was fitted with: a one-op activation keeps one
# tensor (silu, gelu, gelu_pytorch_tanh: its input), GPT-2's gelu_new is written out in
# Python ops, each keeping its own (3 more intermediate-sized tensors a block)
_FITTED_ACTIVATIONS = {"llama": {"silu", "swish", "gelu_pytorch_tanh"}, "gpt2": {"gelu_new"},
                       "bert": {"gelu"}, "t5": {"relu"}}


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
    the model, ``autofit.memory.analytic.derived``): a quantized base (its layers keep other
    tensors than ``nn.Linear``: ``Linear8bitLt`` its input, whatever the weight's
    ``requires_grad``); any PEFT method, LoRA included (below); a family's
    model with another activation than the table's (``_FITTED_ACTIVATIONS``); or a
    decoder / encoder family the table was not fitted to."""
    if patching(config):
        # a knob swaps the model's code (liger's kernels): the table fitted the model's own
        # (a model it leaves as it is keeps its own path; a described one has no module)
        from autofit.knobs.registry import swaps
        from autofit.probe.model import module_of

        module = module_of(info)
        if module is None or swaps(config, module):
            return True
    if info.peft is not None or info.quant is not None:
        # LoRA too: the table's LoRA rows (tiny-llama's shapes, fp32 adapters on q/v or on
        # every linear layer, no dropout) miss what adapters keep elsewhere: a 16-bit
        # base's fp32 input copies, dropped-out copies, a llama sequence classifier's
        # ~3.6 MiB of 16.8 saved (the zoo's row 6.2% under; derived +5.0%), the GPT-2 and
        # BERT families' Conv1D inputs and LM-head transform (5.0% and 4.9% under, derived
        # +1.0% / +1.3%), and the llama family's own causal LMs with adapters on every
        # linear layer at other widths (the zoo's Gemma, Mistral, Llama, Qwen2, OLMo and
        # Granite rows -2.0..-3.2%, derived +0.5..+2.9%). The table stays for a model
        # described without its module (``_coef``).
        return True
    if info.model_type in _FAMILY_OF and any(
            b.activation not in _FITTED_ACTIVATIONS[_family(info)] for b in info.blocks):
        # another activation than the table's: GPT-2 with gelu_pytorch_tanh (one op) keeps
        # three intermediate-sized tensors a block fewer than its gelu_new (+78% on the
        # published GPT-2 row, which ran torch's tanh GELU)
        return True
    if info.model_type == "t5" and not info.is_encoder_decoder:
        # T5's table is per encoder + decoder pair: its encoder alone (the token
        # classifier) is derived (66% over with the pair's cost per encoder block)
        return True
    if info.is_encoder_decoder:
        # T5's fitted coefficients are T5's own: other encoder-decoders (mT5's gated
        # feed-forward, BART's, Pegasus-X's blocks) were -33%..+20% with them on the zoo
        return info.model_type != "t5"
    return info.model_type not in _FAMILY_OF


def _coef(info: ModelInfo, config: TrainConfig, device: DeviceInfo,
          seq_len: int | None = None) -> dict:
    if _needs_derived(info, config):
        from autofit.memory.analytic.derived import derived_coefficients
        from autofit.probe.model import module_of

        module = module_of(info)
        if module is not None:
            if config.loss_impl == "trl":  # no logits kept, as autofit's chunked loss
                config = config.replace(loss_impl="model", chunked_loss=True)
            return derived_coefficients(module, info, config, device, seq_len)
        if swapped := patching(config):
            raise BadInputError(f"no analytic coefficients for {info.name} with "
                                f"{', '.join(swapped)} from a description (they swap the "
                                "model's code): estimate the model itself")
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
    the last two only in derived coefficients (``autofit.memory.analytic.derived``)."""
    per_token = batch * seq_len * _layer_bytes_per_token(c, b, seq_len)
    return max(per_token + batch * c.get("s", 0.0), 0.0) + c.get("F", 0.0)


def _quantized_linears(info: ModelInfo, b: BlockSpec) -> list[tuple[str, int, int, bool]]:
    """The block's linears bitsandbytes quantized (all but ``skip_modules``)."""
    skip = set(info.quant.skip_modules) if info.quant is not None else set()
    return [lin for lin in b.linears if lin[0].rsplit(".", 1)[-1] not in skip
            and lin[0] not in skip]


def kept_input_bytes(info: ModelInfo, tokens: int, act: int, inner: int | None = None) -> int:
    """Bytes a quantized base's layers hold for backward per micro batch, outside what
    checkpointing can drop: every ``Linear8bitLt`` (LLM.int8) keeps its input ``A`` in its
    autograd node (``ctx.A`` on the CPU's ``MatMul8bitFp``, ``ctx.tensors`` on CUDA's
    ``MatMul8bitLt``, bitsandbytes 0.50), and so did every ``Linear4bit`` up to
    bitsandbytes 0.43.1 (``MatMul4Bit``'s ``ctx.tensors = (A, B)``;
    ``autofit.probe.versions.bnb_4bit_keeps_input``). Not through ``save_for_backward``,
    so it stays from the forward until the graph is freed after ``backward()`` — with
    gradient checkpointing too, and even where a frozen ``nn.Linear`` would keep nothing. Linears
    that read the same tensor (q/k/v, gate/up) hold it once: per block ``tokens`` x the
    in-features of each linear that does not share its input. Input projections read a
    norm's output, in the activations' dtype (``act`` bytes); output projections (o_proj,
    down_proj, c_proj, ...) read what attention and the MLP computed, in ``inner`` bytes
    (under autocast its dtype; default ``act``). 0 for any other base. Measured: real and
    simulated steps keep the same storages (``tests/memory/test_quantized_base.py``)."""
    from autofit.probe.versions import bnb_4bit_keeps_input

    if info.quant is None or (info.quant.bits == 4 and not bnb_4bit_keeps_input()):
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
