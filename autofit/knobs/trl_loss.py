"""TRL's SFT loss: the fused LM head ``trl.SFTTrainer`` trains with, recognised from its ``SFTConfig``.

TRL (>= 1.16) computes the SFT loss (``SFTConfig.loss_type`` ``"nll"``, the default, or
``"dft"``) without the full (B, T, V) logits: ``trl.trainer.utils.add_fused_lm_head``
patches the model's forward, and ``model(**inputs, fused_lm_head=True)`` runs the
backbone, then TRL's ``ChunkedLogProbFunction`` over the LM head in tiles of
``TOKEN_CHUNK_SIZE`` (4096) tokens x ``_CHUNKED_LOGPROB_CHUNK_SIZE`` (32768) vocabulary
columns, in the compute dtype; ``SFTTrainer`` asks for the ``entropy`` and ``is_top1``
outputs too (its metrics). When ``training_args`` is such an ``SFTConfig``, autofit's
estimate, simulated step and trials run this loss (``TrainConfig.loss_impl="trl"``),
and its own chunked loss is not searched (``ChunkedLossTrainer`` is not what runs).

    >>> trl_loss_type({"loss_type": "nll", "label_smoothing_factor": 0.0}, sft=True)
    'nll'
    >>> trl_loss_type({"loss_type": "nll", "label_smoothing_factor": 0.1}, sft=True) is None
    True

TRL falls back to the full logits (the model's own loss) with label smoothing
(``label_smoothing_factor > 0``), DeepSpeed Ulysses sequence parallelism, or a
``compute_loss_func`` given to the trainer (not part of the arguments autofit sees).

Known limitations:
    * NB: on CUDA with Triton TRL scores only the positions whose label is not -100;
      autofit counts every position (the worst case: a batch without prompt masking).
    * NB: a CUDA target is simulated on fake CPU tensors with TRL's torch folds and its
      fp32 accumulation replaced by no-ops (``triton_folds``: on CUDA the Triton kernels
      and ``addmm(out_dtype=float32)`` work in place); not checked on a GPU here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch
    from transformers import TrainingArguments

    from autofit.config import Batch

__all__ = ["SFT_CONFIG", "SFTConfigFields", "TRL_OUTPUTS", "TOKEN_TILE", "VOCAB_TILE", "is_sft_config", "trl_loss_type",
           "loss_impl_of", "fused_lm_head", "trl_sft_loss", "triton_folds", "trl_loss_reason", "trl_loss_bytes",
           "trl_forward_bytes"]

TRL_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what SFTTrainer asks add_fused_lm_head for
TOKEN_TILE = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE (TRL 1.16)
VOCAB_TILE = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE (TRL 1.16)
LOSS_TYPES = ("nll", "dft")
SFT_CONFIG = "trl.SFTConfig"  # FitResult.meta["arguments_class"]: emit the user's class
# fp32 (rows, cols) temporaries of TRL's torch fallback (CPU) alive at once in a tile's
# forward (TRL 1.16 _forward_tile: z, z - max and its exp, with is_top1's bool masks): a tiny
# Qwen2's fused forward under no_grad (V 32,000, 8-24 x 115 tokens) held 4.25 fp32 (N, V)
# in fp32 (the fp32 tile buffer + 3.25), 3.75 under bf16 autocast (a bf16 buffer + 3.25)
TRL_CPU_FORWARD_TILE_TEMPS = 3.25


class SFTConfigFields(dict):
    """An ``SFTConfig``'s fields as a file holds them (a ``trl sft --config`` file given to
    ``autofit tune --training-args``): a dict of fields that ``SFTTrainer`` runs."""


def is_sft_config(args: TrainingArguments | Mapping[str, object] | None) -> bool:
    """Whether ``args`` is a ``trl.SFTConfig`` (by class name, so trl need not be imported)
    or ``SFTConfigFields``."""
    return isinstance(args, SFTConfigFields) or any(
        c.__name__ == "SFTConfig" for c in type(args).__mro__)


def trl_loss_type(args: TrainingArguments | Mapping[str, object] | None, *, sft: bool | None = None
                  ) -> str | None:
    """The ``loss_type`` SFTTrainer computes through the fused LM head for ``args`` (an
    ``SFTConfig`` or a dict of its fields with ``sft=True``), None when it is not TRL's
    fused loss: not an SFTConfig, label smoothing, Ulysses sequence parallelism."""
    if sft is None:
        sft = is_sft_config(args)
    if not sft:
        return None
    get = args.get if isinstance(args, dict) else (lambda k, d=None: getattr(args, k, d))
    loss_type = get("loss_type", "nll") or "nll"
    if loss_type not in LOSS_TYPES or float(get("label_smoothing_factor", 0.0) or 0.0) > 0:
        return None
    pc = get("parallelism_config", None)
    if pc is not None and getattr(pc, "sp_backend", None) == "deepspeed" \
            and getattr(pc, "sp_enabled", False):
        return None
    return loss_type


def loss_impl_of(args: TrainingArguments | Mapping[str, object] | None) -> str:
    """``TrainConfig.loss_impl`` for the user's training arguments: "trl" or "model"."""
    return "model" if args is None or trl_loss_type(args) is None else "trl"


def trl_loss_reason(loss_type: str) -> str:
    """The reason line of a run whose loss is TRL's."""
    return (f"TRL's fused LM-head loss (SFTConfig loss_type={loss_type}): no full logits; "
            "autofit's chunked loss not searched (SFTTrainer computes its own)")


@contextlib.contextmanager
def fused_lm_head(model: torch.nn.Module) -> Iterator[Any]:
    """``model`` with TRL's fused LM head added as SFTTrainer adds it (to the PEFT base
    model), undone on exit: the instance's ``forward`` is restored, so no model is left
    patched (autofit patches only its own copies, and only for the call)."""
    from trl.trainer.utils import add_fused_lm_head

    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    had = "forward" in vars(target)
    old = vars(target).get("forward")
    add_fused_lm_head(target, outputs=TRL_OUTPUTS)
    try:
        yield model
    finally:
        if had:
            target.forward = old
        else:
            del target.forward


@contextlib.contextmanager
def _vocab_tile(model: torch.nn.Module) -> Iterator[None]:
    """TRL's vocabulary tile narrowed to the vocabulary (at most 32768) for the call: the
    tiles and the loop are TRL's; its buffer is only as wide as the columns it writes."""
    import trl.trainer.utils as tu

    old = tu._CHUNKED_LOGPROB_CHUNK_SIZE
    vocab = model.get_output_embeddings().weight.shape[0]
    tu._CHUNKED_LOGPROB_CHUNK_SIZE = min(old, vocab)
    try:
        yield
    finally:
        tu._CHUNKED_LOGPROB_CHUNK_SIZE = old


def _noop_fold(*args: object, **kwargs: object) -> None:
    """A tile's fold as TRL's Triton kernels do it for memory: in place, nothing allocated."""


@contextlib.contextmanager
def triton_folds() -> Iterator[None]:
    """TRL's torch fallback folds replaced by no-ops for the call (a CUDA target simulated on
    fake CPU tensors: the Triton kernels write the tile and the per-token statistics in
    place; the values of fake tensors do not matter)."""
    import trl.kernels.chunked_logprob as ck

    old = ck._forward_tile, ck._backward_tile, ck._addmm_fp32
    # CUDA's _addmm_fp32 accumulates 16-bit products into fp32 by addmm(out_dtype=float32)
    # in place; the CPU's upcasts both operands first (an fp32 tile and weight chunk)
    ck._forward_tile = ck._backward_tile = ck._addmm_fp32 = _noop_fold
    try:
        yield
    finally:
        ck._forward_tile, ck._backward_tile, ck._addmm_fp32 = old


def trl_sft_loss(model: torch.nn.Module, inputs: Batch, loss_type: str = "nll", *,
                 resident_only: bool = False) -> Any:
    """The loss ``SFTTrainer.compute_loss`` returns (no ``num_items_in_batch``): the fused
    forward, ``-log_probs`` (times ``exp(log_probs)`` for DFT) summed over the labelled
    tokens, divided by their count; the outputs are dropped as compute_loss drops them.

    ``resident_only`` (the simulated step for a CPU): TRL's (rows, 32768) buffer is made
    only as wide as the vocabulary: on a CPU the columns past it are never written, so
    their pages never become resident (measured: a 16000 vocabulary's step is 10% below
    the full buffer's count); CUDA's allocator holds the whole buffer (a CUDA target is
    simulated under ``triton_folds``, forward and backward)."""
    narrow = _vocab_tile(model) if resident_only else contextlib.nullcontext()
    with fused_lm_head(model), narrow:
        out = model(**inputs, use_cache=False, fused_lm_head=True)
    per_token = -out.log_probs
    if loss_type == "dft":
        per_token = per_token * out.log_probs.exp().detach()
    loss = per_token.sum() / out.label_mask.sum().clamp(min=1)
    del out, per_token
    return loss


def trl_forward_bytes(tokens: int, vocab: int, act: int, *, cuda: bool, hidden: int = 0,
                      weight_act: int | None = None) -> int:
    """Bytes TRL's fused loss holds in its forward (the peak of an evaluation step under
    ``no_grad``, which ``SFTTrainer.prediction_step`` runs through the same fused head): one
    (rows, cols) tile buffer in the compute dtype (``act``; VOCAB_TILE wide on CUDA, only
    the vocabulary's columns resident on a CPU) and its seven fp32 per-token accumulators;
    beside the buffer, the larger of the head's chunk cast to the compute dtype for the
    matmul (``hidden`` wide, when the weight's dtype, ``weight_act`` bytes, is another; freed
    when the matmul returns) and the torch fallback's fp32 tile temporaries on a CPU
    (``TRL_CPU_FORWARD_TILE_TEMPS``; none on CUDA: the Triton kernel folds in place). No
    (N, V) logits exist."""
    rows, cols = min(tokens, TOKEN_TILE), min(vocab, VOCAB_TILE)
    tile = rows * (VOCAB_TILE if cuda else cols) * act
    w_copy = cols * hidden * act if weight_act not in (None, act) else 0
    temps = 0 if cuda else int(TRL_CPU_FORWARD_TILE_TEMPS * rows * cols * 4)
    return tile + max(w_copy, temps) + 7 * tokens * 4


def trl_loss_bytes(tokens: int, vocab: int, hidden: int, act: int, *, cuda: bool,
                   head_trainable: bool = True, accumulating: bool = False,
                   tile_temps: float = 0.0) -> int:
    """Bytes TRL's fused loss holds at its peak, the tiles' backward (TRL 1.16's
    ``ChunkedLogProbFunction.backward``): the fp32 (N, h) input gradient and fp32 (V, h)
    weight gradient it accumulates into, one (rows, cols) tile in the compute dtype
    (``act``), the head's weight copied to the compute dtype chunk by chunk (16-bit
    only), and ``tile_temps`` fp32 tiles of the torch fallback's temporaries (0 on CUDA:
    the Triton kernel works in place; the tiles are (rows, min(V, 32768)) views of the
    buffer, which is allocated (min(N, 4096), 32768) whatever the vocabulary). Then the gradients handed to autograd: with a
    16-bit head a 16-bit copy of the weight gradient, and ``.grad`` (added into the
    existing one when accumulating)."""
    rows, cols = min(tokens, TOKEN_TILE), min(vocab, VOCAB_TILE)
    # the buffer is VOCAB_TILE wide whatever the vocabulary; on a CPU only the columns TRL
    # writes become resident (trl_sft_loss's resident_only)
    tile = rows * (VOCAB_TILE if cuda else cols) * act
    grad_in = tokens * hidden * 4
    grad_w = vocab * hidden * 4 if head_trainable else 0
    w_copy = cols * hidden * act if act != 4 else 0
    temps = 0 if cuda else int(tile_temps * rows * cols * 4)
    loop = grad_in + grad_w + tile + w_copy + temps
    handed = grad_in + grad_w + (vocab * hidden * act if head_trainable and act != 4 else 0)
    if head_trainable and not accumulating:
        handed += vocab * hidden * act  # .grad beside the op's own, for a moment
    return max(loop, handed)
