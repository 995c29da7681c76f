"""The levers' terms of the closed form: the chunked loss's buffers, activation
offloading's note, and the activations a ``torch_compile`` step does not keep."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.memory.analytic._activations import _family
from autofit.memory.analytic._states import _bytes

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo


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
