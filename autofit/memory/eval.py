"""Analytic memory of one evaluation / prediction step: no gradients, no optimizer.

The training estimate (``autofit.memory.analytic``) keeps every activation for the
backward; an evaluation step runs the forward under ``torch.no_grad()``, so a
block's tensors die as soon as the next block starts. What is left is:

* **weights** — as in training (fp32 master weights under mixed precision, plus
  the 16-bit copies autocast caches for the forward: its cache keys on
  ``requires_grad`` leaves, which parameters are even under ``no_grad``);
* **activations** — the KV cache a decoder's forward returns (``use_cache``: made
  even when nothing reads it), the residual stream plus the working set of the widest block
  (attention: normed input, q/k/v, rotary copies, output; MLP: ``3 x (N, I)`` for
  gated MLPs, ``2 x (N, I)`` otherwise; eager attention adds the ``(B, H, T, T)``
  scores and probabilities and the ``(B, 1, T, T)`` mask);
* **temporaries** — the logits and the loss of the batch: ``(N, V)`` logits in the
  compute dtype, the fp32 upcast ``ForCausalLMLoss`` makes of 16-bit logits, and the
  fp32 ``log_softmax`` of ``cross_entropy``; plus, when ``compute_metrics`` keeps
  them, the logits of earlier batches (``kept_logit_batches``);
* **the training run around it** (``training=``, the evaluation ``Trainer`` runs
  every ``eval_steps``): the optimizer states stay alive between the training steps
  and the evaluation (gradients do not: ``zero_grad(set_to_none=True)`` freed them),
  so they count against the same capacity. An eval batch tuned without them is the
  one that died at the first evaluation of a real epoch;
* **generation** (``predict_with_generate``) — the KV cache
  ``2 x layers x (B x beams) x (prompt + new tokens) x kv_heads x head_dim x dtype``,
  one layer's copy while ``DynamicCache`` concatenates, and the prefill's working
  set; ``Seq2SeqTrainer`` then runs a forward with labels for the loss, so the
  peak is the larger of the two.

    >>> from autofit.probe.model import probe_model
    >>> from autofit.probe.device import resolve_device
    >>> est = estimate_eval(probe_model("tiny-llama"), 8, 512, resolve_device("cpu"))
    >>> est.breakdown["gradients"], est.breakdown["optimizer_states"]
    (0, 0)
    >>> tune_eval_batch("tiny-llama", 512, "cpu:4GiB") >= 1
    True

Known limitations:
    NB: logits of every position are counted (``logits_to_keep=0``, what
    ``Trainer.evaluate`` computes); prediction with ``logits_to_keep=1`` needs less.
    NB: ``kept_logit_batches`` is the caller's: ``Trainer`` with ``compute_metrics``
    and no ``eval_accumulation_steps`` keeps the logits of the whole eval set on the
    device (``preprocess_logits_for_metrics`` can shrink them).
    NB: encoder-decoder generation counts the encoder output and the cross-attention
    cache at the prompt length; beam search reorders the cache in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.errors import BadInputError, DoesNotFitError
from autofit.knobs.trl_loss import trl_forward_bytes
from autofit.memory.analytic._activations import _dequantized_bytes
from autofit.memory.analytic._reserved import _CUDA_FRAGMENTATION
from autofit.memory.analytic._states import _bytes, _linear_weight_numel, optimizer_state_bytes
from autofit.memory.analytic._states import weights_bytes as _train_weights_bytes
from autofit.memory.breakdown import Component, MemoryEstimate

if TYPE_CHECKING:  # pragma: no cover
    from autofit.config import ModelSource
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import BlockSpec, ModelInfo

__all__ = ["estimate_eval", "tune_eval_batch", "kv_cache_bytes"]

_GEN_TASKS = ("causal-lm", "seq2seq")
# fp32 copies of the last position's logits during decoding: the step's logits, the
# processed scores and (sampling / beams) their softmax, per sequence
_DECODE_LOGIT_COPIES = 3


def _decoder_blocks(info: ModelInfo) -> list[BlockSpec]:
    dec = [b for b in info.blocks if b.role != "encoder"]
    return dec or list(info.blocks)


def kv_cache_bytes(info: ModelInfo, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """Bytes of a full KV cache: 2 (K and V) x decoder layers x sequences x tokens x kv width.

    Example:
        >>> from autofit.probe.model import probe_model
        >>> kv_cache_bytes(probe_model("tiny-llama"), 1, 1, 4)  # 2 x 4 layers x 4 heads x 64 x 4 B
        8192
    """
    return sum(
        2 * b.count * sequences * tokens * b.num_kv_heads * b.head_dim * dtype_bytes
        for b in _decoder_blocks(info)
    )


def _block_working_set(b: BlockSpec, tokens: int, seq_len: int, batch: int, act: int, cb: int,
                       eager: bool) -> int:
    """Bytes alive inside one block under no_grad, residual stream included."""
    h, kv, inter = b.hidden_size, b.num_kv_heads * b.head_dim, b.intermediate_size
    stream = 3 * h * act  # the residual, the block's input and the normed input
    # q, k, v, rotary q/k copies, the attention output (+ k/v repeated to all heads)
    attn = (3 * h + 4 * kv) * cb
    # eager: two (B, H, T, T) tensors at once (scores and their softmax, fp32 from the
    # softmax on) + the additive (B, 1, T, T) causal mask in the model's dtype;
    # SDPA: no (T, T) tensor, the causal mask is implicit
    per_pair = b.num_heads * (4 + cb) + act
    attn_scores = batch * seq_len * seq_len * per_pair if eager else 0
    # gated: act(gate), up and their product; otherwise fc output and activation
    mlp = (3 if b.gated_mlp else 2) * inter * cb
    return max(tokens * (stream + attn) + attn_scores, tokens * (stream + mlp))


def _logits_bytes(tokens: int, vocab: int, logit_bytes: int, loss: bool) -> int:
    """Logits (N, V) in their dtype; with a loss, the fp32 upcast and log_softmax."""
    out = tokens * vocab * logit_bytes
    if loss:
        out += tokens * vocab * 4  # log_softmax inside cross_entropy
        if logit_bytes != 4:
            out += tokens * vocab * 4  # logits.float() in the loss
    return out


def _head_bytes(tokens: int, vocab: int, cb: int, loss: bool, training: TrainConfig | None,
                device: DeviceInfo, hidden: int, weight_bytes: int) -> int:
    """The LM head's and the loss's bytes in an evaluation step: the logits in the compute
    dtype (``_logits_bytes``), or where SFTTrainer evaluates (``training.loss_impl`` "trl")
    TRL's fused LM head: its tiles, no full logits (``trl_forward_bytes``; the head's weight
    in ``weight_bytes`` per element)."""
    if loss and training is not None and training.loss_impl == "trl":
        return trl_forward_bytes(tokens, vocab, cb, cuda=device.allocator == "cuda",
                                 hidden=hidden, weight_act=weight_bytes)
    return _logits_bytes(tokens, vocab, cb, loss)


def estimate_eval(
    info: ModelInfo,
    micro_batch_size: int,
    seq_len: int,
    device: DeviceInfo,
    *,
    precision: str = "32-true",
    generate_max_new_tokens: int | None = None,
    num_beams: int = 1,
    kept_logit_batches: int = 0,
    with_loss: bool = True,
    training: TrainConfig | None = None,
) -> MemoryEstimate:
    """Device memory of one evaluation step (see the module docstring).

    Args:
        info: the model (``autofit.probe.model.probe_model``).
        micro_batch_size: ``per_device_eval_batch_size``.
        seq_len: tokens per sample of the longest eval batch (the prompt, when generating).
        device: a ``DeviceInfo`` (``autofit.probe.device.resolve_device``).
        precision: the training precision; eval runs under the same autocast.
        generate_max_new_tokens: ``predict_with_generate``: tokens generated per sample.
        num_beams: beams per sample when generating.
        kept_logit_batches: earlier batches whose logits stay on the device
            (``compute_metrics`` without ``eval_accumulation_steps``).
        with_loss: the batch has labels, so the loss is computed.
        training: the training configuration when the evaluation runs inside a
            training run (``Trainer`` with ``eval_steps``): its optimizer states stay
            alive and its precision applies; None for a standalone evaluation.

    Returns:
        A ``MemoryEstimate`` (``method="analytic-eval"``; gradients 0, optimizer
        states 0 unless ``training`` is given).

    Raises:
        BadInputError: bad sizes, an unknown precision, generation on a model that
            does not generate, or a model whose blocks autofit does not recognise.
    """
    _check_eval_args(info, micro_batch_size, seq_len, num_beams, generate_max_new_tokens)
    if training is not None:
        precision = training.precision
    config = TrainConfig(micro_batch_size=micro_batch_size, precision=precision, seq_len=seq_len)
    spec = config.precision_spec
    act = _bytes(spec.param_dtype)  # residual stream: the parameters' dtype
    cb = _bytes(spec.compute_dtype)  # matmul outputs: the compute dtype
    if info.quant is not None:  # a quantized base is never cast: its own dtype throughout
        act = _bytes(info.dtype)
        cb = cb if spec.autocast else act
    B, T = micro_batch_size, seq_len
    N = B * T
    h = info.hidden_size or 0
    lm = info.lm_logits
    V = info.vocab_size if lm else 0
    eager = info.attn_implementation == "eager"

    W = _train_weights_bytes(info, config) + _dequantized_bytes(info)
    if spec.autocast and (info.quant is None or info.dtype == "float32"):
        linear = _linear_weight_numel(info)
        if info.peft is not None:  # frozen weights are cast per op, not cached: one at a time
            linear = max((i * o for b in info.blocks for _, i, o, _ in b.linears), default=0)
        W += 2 * linear

    # -- forward with labels: the widest block, then the logits and the loss ------------
    encoder_out = N * h * act if info.is_encoder_decoder else 0
    # a decoder's forward returns its KV cache (use_cache) even when nothing reads it
    fwd_cache = kv_cache_bytes(info, B, T, cb) if info.task in _GEN_TASKS else 0
    block = max(_block_working_set(b, N, T, B, act, cb, eager) for b in info.blocks)
    logit_bytes = cb if lm else 0
    logits = _head_bytes(N, V, cb, with_loss, training, device, h, act) if lm else 0
    kept = kept_logit_batches * N * V * (4 if spec.autocast else logit_bytes)
    A_fwd = encoder_out + fwd_cache + max(block, N * h * act + logits)
    phases = {"forward": (A_fwd, kept)}

    # -- generation: the KV cache at the last token, and the prefill --------------------
    if generate_max_new_tokens:
        gen_total = _generation_bytes(info, B * num_beams, T, generate_max_new_tokens, act, cb,
                                      eager, V * (logit_bytes + _DECODE_LOGIT_COPIES * 4))
        phases["generate"] = (gen_total, kept)

    phase, (A, temps) = max(phases.items(), key=lambda kv: kv[1][0] + kv[1][1])
    # inside a training run the optimizer states outlive the step (gradients do not)
    S = optimizer_state_bytes(info, training) if training is not None else 0
    peak_alloc = int(W + S + A + temps)
    if device.allocator == "cuda":
        peak_reserved = int(peak_alloc * (1 + _CUDA_FRAGMENTATION) + 8 * 2**20)
    else:
        peak_reserved = peak_alloc
    total = peak_reserved + device.overhead_bytes
    # activations = what the forward keeps alive; temporaries = logits/loss kept beyond it
    if phase == "forward":
        act_part = encoder_out + fwd_cache + (block if block >= N * h * act + logits
                                              else N * h * act)
        temp_part = A - act_part + temps
    else:
        act_part, temp_part = A, temps
    notes = [f"evaluation step ({'generation' if phase == 'generate' else 'forward + loss'}"
             f" under no_grad)"]
    if training is not None:
        notes.append(f"inside a training run: the {training.optimizer} states stay alive")
    if spec.autocast:
        notes.append("weights include autocast's 16-bit copies cached during the forward")
    return MemoryEstimate(
        peak_allocated_bytes=peak_alloc,
        peak_reserved_bytes=peak_reserved,
        device_total_bytes=total,
        capacity_bytes=device.capacity_bytes,
        fits=total <= device.capacity_bytes,
        breakdown={
            Component.WEIGHTS: int(W),
            Component.GRADIENTS: 0,
            Component.OPTIMIZER_STATES: int(S),
            Component.ACTIVATIONS: int(act_part),
            Component.TEMPORARIES: int(temp_part),
            Component.OVERHEAD: total - peak_alloc,
        },
        method="analytic-eval",
        device=device.name,
        peak_phase="forward",
        model=info.name,
        num_params=info.num_params,
        trainable_params=info.trainable_params,
        seq_len=seq_len,
        config=config.to_dict(),
        notes=tuple(notes),
    )


def _check_eval_args(info: ModelInfo, micro_batch_size: int, seq_len: int, num_beams: int,
                     generate_max_new_tokens: int | None) -> None:
    """``estimate_eval``'s first step: positive sizes, a model that generates when asked
    to, blocks autofit recognises (else ``BadInputError``)."""
    for name, v in (("micro_batch_size", micro_batch_size), ("seq_len", seq_len),
                    ("num_beams", num_beams)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise BadInputError(f"{name} must be a positive integer, got {v!r}")
    if generate_max_new_tokens is not None and (
        isinstance(generate_max_new_tokens, bool) or not isinstance(generate_max_new_tokens, int)
        or generate_max_new_tokens <= 0
    ):
        raise BadInputError(
            f"generate_max_new_tokens must be a positive integer, got {generate_max_new_tokens!r}"
        )
    if generate_max_new_tokens and info.task not in _GEN_TASKS:
        raise BadInputError(f"generation needs a causal-lm or seq2seq model; {info.name} is "
                            f"{info.task}")
    if not info.is_transformer:
        raise BadInputError(f"{info.name} is not a transformer autofit recognises")


def _generation_bytes(info: ModelInfo, S: int, T: int, M: int, act: int, cb: int, eager: bool,
                      logit_row: int) -> int:
    """The generation phase's activations: the larger of the prefill and the last token's
    step (the KV cache of ``T + M`` tokens, one layer's ``torch.cat`` copy and the decode
    logits, ``logit_row`` bytes a sequence) over ``S`` sequences (batch x beams)."""
    h = info.hidden_size or 0
    if info.is_encoder_decoder:
        cache = kv_cache_bytes(info, S, T + M, cb)  # cross (prompt) + self (new tokens)
        enc = S * T * h * act
        prefill_ws = max(_block_working_set(b, S * T, T, S, act, cb, eager)
                         for b in info.blocks)
        prefill = enc + prefill_ws + kv_cache_bytes(info, S, T, cb)
    else:
        cache = kv_cache_bytes(info, S, T + M, cb)
        enc = 0
        prefill_ws = max(_block_working_set(b, S * T, T, S, act, cb, eager)
                         for b in _decoder_blocks(info))
        prefill = prefill_ws + kv_cache_bytes(info, S, T, cb)
    layers = sum(b.count for b in _decoder_blocks(info))
    concat = cache // max(layers, 1)  # DynamicCache: torch.cat makes a new layer tensor
    decode_logits = S * logit_row
    return max(prefill, enc + cache + concat + decode_logits)


def tune_eval_batch(
    model: ModelSource,
    seq_len: int,
    device: str | DeviceInfo = "auto",
    margin: float = 0.10,
    *,
    precision: str = "32-true",
    max_micro_batch: int = 256,
    generate_max_new_tokens: int | None = None,
    num_beams: int = 1,
    kept_logit_batches: int = 0,
    task: str | None = None,
    training: TrainConfig | None = None,
) -> int:
    """The largest eval micro batch whose estimated step fits ``capacity x (1 - margin)``.

    Tuned apart from the training batch: an evaluation step holds no gradients and
    no saved activations, so its batch is usually larger, and an eval OOM never needs
    a smaller training batch. Inside a training run (``training=``) the optimizer
    states are still there and count.

    Args:
        model: a ``ModelInfo``, an ``nn.Module`` or a model reference (bundled name,
            hub id, directory, config.json).
        seq_len: tokens per sample of the longest eval batch (the prompt, when generating).
        device: a device name or ``DeviceInfo``.
        margin: fraction of the capacity kept free.
        precision: the run's precision (eval runs under the same autocast).
        max_micro_batch: the largest batch considered.
        generate_max_new_tokens: ``predict_with_generate``: new tokens per sample.
        num_beams: beams per sample when generating.
        kept_logit_batches: see ``estimate_eval``.
        task: the model's task for a reference (default: from its config).
        training: the training configuration, when the evaluation runs inside the
            training run (its optimizer states stay alive; see ``estimate_eval``).

    Returns:
        ``per_device_eval_batch_size``.

    Raises:
        DoesNotFitError: not even a batch of 1 fits; the message has the numbers.
        BadInputError: bad arguments.

    Example:
        >>> tune_eval_batch("tiny-gpt2", 256, "cpu:2GiB", generate_max_new_tokens=64) >= 1
        True
    """
    from autofit.probe.device import format_bytes, resolve_device
    from autofit.probe.model import ModelInfo, probe_model

    if not 0 <= margin < 1:
        raise BadInputError(f"margin must be in [0, 1), got {margin}")
    if isinstance(max_micro_batch, bool) or not isinstance(max_micro_batch, int) or max_micro_batch < 1:
        raise BadInputError(f"max_micro_batch must be a positive integer, got {max_micro_batch!r}")
    info = model if isinstance(model, ModelInfo) else probe_model(model, task=task)
    dev = resolve_device(device)
    budget = int(dev.capacity_bytes * (1 - margin))

    def need(b: int) -> int:
        return estimate_eval(info, b, seq_len, dev, precision=precision,
                             generate_max_new_tokens=generate_max_new_tokens,
                             num_beams=num_beams, kept_logit_batches=kept_logit_batches,
                             training=training).device_total_bytes

    if need(1) > budget:
        raise DoesNotFitError(
            f"no eval batch fits: batch 1 x {seq_len} tokens needs ~{format_bytes(need(1))} > "
            f"{format_bytes(budget)} ({dev.name} less a {margin:.0%} margin); evaluate shorter "
            "sequences" + (" or generate fewer tokens" if generate_max_new_tokens else "")
        )
    lo, hi = 1, max_micro_batch  # need() grows with the batch: binary search
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
