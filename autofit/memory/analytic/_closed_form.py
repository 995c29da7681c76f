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
* **forward end**, with checkpointing under autocast — weights + the 16-bit copy of
  every block's weights (autocast caches them until the forward leaves it; the backward
  recomputes one block at a time) + optimizer states + the earlier micro batches'
  gradients + all the forward keeps + the loss's 16-bit logits and their fp32 upcast:
  with gradient accumulation often the step's peak (a derived forward moment, where
  there is one, stands beside the same copies).
* with ``torch_compile`` the blocks keep fewer activations: the eager estimate less
  ``compile_saving_bytes`` (the rule of ``autofit.knobs.compile``: inductor's min-cut
  partitioner recomputes pointwise chains in the backward instead of saving them).

A quantized base (bitsandbytes; ``ModelInfo.quant``) keeps its weights as
``quantized_weight_bytes`` says and its other weights in the dtype it was loaded in (its
compute dtype, never cast); its activations come from coefficients derived from its
own forward (``autofit.memory.analytic.derived``: bitsandbytes' layers keep other tensors than
``nn.Linear``), an 8-bit base's layers hold their inputs past checkpointing and until
the end of backward (``kept_input_bytes``), and a layer's backward dequantizes its
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
    * NB: CUDA reserved memory is allocated + 2-3% + what the caching allocator can
      strand (``cuda_reserved_bytes``: the step's largest transient buffers and a few
      shared segments), fitted to the least capacity the simulate method's allocator
      replays run in (``benchmarks/cuda_reserved.py``); the simulate method replays the
      real allocation stream.
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

from dataclasses import dataclass
from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.errors import BadInputError, NoTrainableParametersError, fix
from autofit.knobs.trl_loss import trl_loss_bytes
from autofit.memory.allocator._common import pinned_bytes
from autofit.memory.analytic._activations import (
    _coef,
    _dequantized_bytes,
    _family,
    _first_input_stays,
    _layer_bytes,
    _packed,
    kept_input_bytes,
)
from autofit.memory.analytic._cpu_cache import cpu_library_cache_bytes, cpu_library_once_bytes
from autofit.memory.analytic._levers import _compile_parts, chunked_loss_bytes, offload_note
from autofit.memory.analytic._reserved import cuda_reserved_bytes, stranded_bytes
from autofit.memory.analytic._states import (
    _bytes,
    _linear_weight_numel,
    _optimizer_step_temporaries,
    _param_dtype_bytes,
    gradients_bytes,
    optimizer_state_bytes,
    weights_bytes,
)
from autofit.memory.breakdown import Component, MemoryEstimate

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import BlockSpec, ModelInfo

__all__ = ["estimate_analytic", "analytic_phases", "AnalyticTerms"]

# TRL's fused loss (autofit.knobs.trl_loss): fp32 (rows, cols) temporaries of TRL's torch
# fallback (CPU) alive at once in a tile's backward (TRL 1.16 _backward_tile at
# ``grad += g * (is_target.float() - p)``: y, z, log_p, p, grad, the difference and the
# product, + the bool one-hot, a quarter; measured llama-b4s256-trl); bytes per token it
# saves besides the hidden states (fp32 log Z and entropy, int64 labels, the clamped copy)
TRL_CPU_TILE_TEMPS = 7.25
TRL_SAVED_PER_TOKEN = 4 + 4 + 8 + 8
@dataclass(frozen=True)
class AnalyticTerms:
    """The closed form's pieces for one rank holding everything (``analytic_phases``).

    Attributes:
        phases: candidate peak -> (bytes, component -> bytes): ``"backward"`` (its start),
            ``"backward-end"``, ``"embedding-sum"`` (a tied head's gradients,
            ``_tied_gradient_sum``), ``"optimizer"``, with checkpointing ``"recompute"``
            and, with derived coefficients, ``"forward"``.
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
    # derived: the 16-bit matmuls of distinct shapes the model's step runs (its PEFT
    # method's own among them: DoRA's norms, LoHa's and OFT's products); None: from the
    # weights (``cpu_library_cache_bytes``)
    half_matmuls: int | None = None
    # derived: the step's oneDNN primitives and whether it runs a 16-bit flash attention
    # (``cpu_library_cache_bytes``'s ``half_step``); None: not known
    half_step: tuple[int, bool] | None = None
    # what the CUDA caching allocator can strand above the live bytes (``_reserved.stranded_bytes``)
    stranded: int = 0


@dataclass(frozen=True)
class _Saved:
    """What the forward leaves for backward (``analytic_phases``' second step), bytes."""

    A: float  # activations at the start of backward (blocks + outside them)
    A_base: float  # outside the blocks (embeddings, head, loss)
    A_transient: float  # the block recomputed at a time (checkpointing)
    A_kept: float  # checkpointing: the inputs on the device while backward recomputes
    copies: int  # autocast's 16-bit weight copies alive at the backward start
    copies_head: int  # ... of the output head
    host: int  # pinned host bytes (activation offloading)
    # ... at the forward's end with checkpointing: the head's and every block weight's that
    # autocast caches until the forward leaves it (``_cached_copies``)
    copies_fwd: int = 0


def analytic_phases(info: ModelInfo, config: TrainConfig, seq_len: int,
                    device: DeviceInfo) -> AnalyticTerms:
    """The candidate peaks of one rank holding the whole model (``estimate_analytic``'s
    closed form before it picks the largest; the several-rank rules of
    ``autofit.memory.ranks`` rework them): the model state, the activations saved, the
    step's temporaries, then the phases they add up to."""
    N = config.micro_batch_size * seq_len  # tokens in the micro batch
    spec = config.precision_spec
    # residual-stream element size (a quantized base is never cast: its own dtype)
    act = _bytes(info.dtype) if info.quant is not None else _bytes(spec.param_dtype)
    # what 8-bit layers hold past checkpointing
    kept8 = kept_input_bytes(info, N, act, _bytes(spec.compute_dtype) if spec.autocast else act)
    c = _coef(info, config, device, seq_len)
    W, G, S = _model_state(info, config, c)
    saved = _saved_activations(info, config, seq_len, device, c, act, kept8)
    G_held, loss_temp, block_bwd_temp, opt_temp = _temporaries(
        info, config, seq_len, device, act, G,
        frozenset(tuple(s) for s in c.get("no_grad_shapes", ())), _loss_elem(info, config, c, act))
    derived_bwd = _derived_block_backward(info, config, seq_len, c)
    block_bwd_temp = max(block_bwd_temp, derived_bwd)
    # with checkpointing, a recomputed block's backward stands beside its recomputed
    # activations: its own scratch as derived, where it is (the standard block's rule, two
    # of its widest activations' gradients and two of its inputs', is an upper bound:
    # ELECTRA's medium classifier's block makes 3.0 MiB above them, the rule says 12)
    recompute_bwd_temp = (max(derived_bwd, _dequantized_bytes(info))
                          if c.get("derived") and config.gradient_checkpointing
                          else block_bwd_temp)
    phases = _phases(info, config, seq_len, c, saved, kept8, W=W, G=G, S=S, G_held=G_held,
                     loss_temp=loss_temp, block_bwd_temp=block_bwd_temp, opt_temp=opt_temp,
                     recompute_bwd_temp=recompute_bwd_temp)
    return AnalyticTerms(phases=phases, host=int(saved.host), W=W, copies=saved.copies,
                         copies_head=saved.copies_head, G=G, S=S, G_held=G_held,
                         opt_temp=opt_temp, A=saved.A, A_base=saved.A_base,
                         A_transient=saved.A_transient, loss_temp=loss_temp,
                         block_bwd_temp=block_bwd_temp, derived=bool(c.get("derived")),
                         half_matmuls=c.get("half_matmuls"),
                         half_step=(int(c["half_step"][0]), bool(c["half_step"][1]))
                         if c.get("half_step") else None,
                         stranded=stranded_bytes(info, config, seq_len, _full_logits(info, config)))


def _derived_block_backward(info: ModelInfo, config: TrainConfig, T: int, c: dict) -> float:
    """A block backward's scratch as derived from the model (0 with the fitted table):
    Kimi-Linear's chunked delta rule makes 1.5 GiB at 4 x 128 tokens where the standard
    block's rule says 0.3 (21.6% under without it). An encoder's blocks run their backward
    after the decoder's activations are freed (Pegasus-X's encoder: 95 MiB of scratch, 25%
    over on top of them), unless checkpointing keeps none of them anyway."""
    enc_c, dec_c = c.get("block_backward"), c.get("block_backward_decoder")
    if enc_c is None:
        return 0.0
    B = config.micro_batch_size

    def highest(fit: dict[str, float], moments: list[dict[str, float]] | None) -> float:
        # the highest of its moments at this shape, where they were told apart (Ergo's
        # dense first block: its weight's gradient at 64 tokens, its squared ReLU's
        # backward at 512; 3.9% under with one fit of both)
        return max([_fitted(fit, B, T)] if not moments else
                   [_signed(m, B, T) for m in moments])

    scratch = highest(enc_c, c.get("block_backward_moments"))
    if dec_c is None:
        return scratch
    freed = 0.0
    if not config.gradient_checkpointing and c.get("layer_decoder") is not None:
        freed = sum(_layer_bytes(c["layer_decoder"], b, B, T) * b.count for b in info.blocks
                    if b.role != "encoder")
    return max(highest(dec_c, c.get("block_backward_decoder_moments")), scratch - freed)


_PAIR_DECODER_SHARE = 2 / 3  # of a fitted encoder + decoder pair: its decoder block, at most


def _fitted(c: dict[str, float], batch: int, T: int) -> float:
    """``F + B * (s + c0 * T + T_coef * T^2)`` of derived coefficients (never below F)."""
    return max(batch * T * (c["c0"] + c["T"] * T) + batch * c["s"], 0.0) + c["F"]


def _signed(c: dict[str, float], batch: int, T: int) -> float:
    """``F + B * (s + c0 * T + T_coef * T^2)`` of derived coefficients as it is: a difference,
    below 0 where it is one (``_fitted`` holds a size: never below ``F``)."""
    return c["F"] + batch * (c["s"] + T * (c["c0"] + c["T"] * T))


def _share(moment: dict, c: dict, config: TrainConfig, T: int) -> float:
    """The share of the activations a forward moment stands beside at this shape: what it
    has made of them over all the forward keeps, both fitted (a moment's ``kept`` and
    ``forward_kept``); else its largest share at the four probe shapes."""
    if "kept" not in moment or "forward_kept" not in c:
        return float(moment.get("share", 1.0))
    B = config.micro_batch_size
    total = _signed(c["forward_kept"], B, T)
    if total <= 0:
        return float(moment.get("share", 1.0))
    return min(max(_signed(moment["kept"], B, T) / total, 0.0), 1.0)


def _checkpointed_share(moment: dict, config: TrainConfig, T: int, A: float,
                        A_base: float) -> float:
    """With checkpointing, the share of the activations ``A`` (the blocks' inputs and
    all outside them, ``A_base``) a forward moment stands beside: all but what the forward
    keeps outside the blocks after it, where derived (``kept_base``: made outside the
    blocks by then). A moment at the head precedes the loss's fp32 log-softmax: BART's
    masked LM at 4 x 256 tokens in bf16, whose bf16 logits plus its fp32 bias make an
    fp32 copy on a CPU, 8.7% over beside all of it; else all (1.0)."""
    if "kept_base" not in moment or A <= 0:
        return 1.0
    after = max(A_base - _signed(moment["kept_base"], config.micro_batch_size, T), 0.0)
    return min(max((A - after) / A, 0.0), 1.0)


def _lm(info: ModelInfo, config: TrainConfig) -> tuple[int, bool, bool]:
    """(V: the logits' width, 0 without a (B, T, V) loss; TRL's fused LM head; a chunked
    loss, which keeps no logits)."""
    lm = info.lm_logits
    trl = config.loss_impl == "trl" and lm  # TRL's fused LM head (SFTTrainer)
    chunked = (config.chunked_loss or trl) and lm
    return (info.vocab_size if lm else 0), trl, chunked


def _full_logits(info: ModelInfo, config: TrainConfig) -> int:
    """The width of the (B, T, V) logits the step's loss makes whole (0: none, or chunked)."""
    V, _, chunked = _lm(info, config)
    return 0 if chunked else V


def _model_state(info: ModelInfo, config: TrainConfig, c: dict) -> tuple[int, int, int]:
    """Step 1: weights, gradients and optimizer states (W, G, S), bytes."""
    W = weights_bytes(info, config)
    G = gradients_bytes(info, config)
    S = optimizer_state_bytes(info, config)
    dead = c.get("no_grad_numel", 0)  # derived: trainable elements the loss never reaches
    if dead and info.trainable_params:
        # no gradient, so no optimizer state (DeepSeek sparse attention's indexer: 55% over),
        # each taken off at the cheapest state of any trainable weight: which weights they
        # are is not known here, and 8-bit AdamW keeps an embedding's states in 32 bits
        # (NeoBERT's unreached 1.7M elements, taken off pro rata: 3.5% under)
        live = max(0.0, 1.0 - dead / info.trainable_params)
        G = int(G * live)
        S = max(0, S - dead * _cheapest_state(info, config))
    return W, G, S


def _cheapest_state(info: ModelInfo, config: TrainConfig) -> float:
    """The fewest optimizer-state bytes per element of any trainable weight."""
    import dataclasses

    return min((optimizer_state_bytes(dataclasses.replace(info, params=(g,)), config)
                / (g.numel * g.count) for g in info.params if g.trainable and g.numel),
               default=0.0)


def _saved_activations(info: ModelInfo, config: TrainConfig, T: int, device: DeviceInfo,
                       c: dict, act: int, kept8: int) -> _Saved:
    """Step 2: the activations the forward saves, autocast's weight copies, and what
    checkpointing, offloading and ``torch_compile`` change of them."""
    B = config.micro_batch_size
    N = B * T
    spec = config.precision_spec
    layer_c, base_c = c["layer"], c["base"]
    decoder_c = c.get("layer_decoder")  # derived for an encoder-decoder: its decoder's
    V, trl, chunked = _lm(info, config)
    h = info.hidden_size or 0
    # the forward runs of a block (derived; a looped model's blocks run twice: Dory), per
    # stack: each run keeps its activations, or with checkpointing its input
    runs = c.get("layer_runs") or [1.0, 1.0]
    # (bytes per layer run, layers, runs of a layer, bytes checkpointing keeps of a run:
    # where derived the hidden states it takes in -- Longformer pads them to its attention
    # window, 4x the step's tokens at 128 --, else one residual stream)
    layer_costs = []
    for b in info.blocks:
        if info.is_encoder_decoder and b.role != "encoder":
            if decoder_c is not None:
                layer_costs.append((_layer_bytes(decoder_c, b, B, T), b.count, runs[-1],
                                    _block_input(c, "block_input_decoder", B, T, h * act)))
            continue  # T5's fitted coefficients are per encoder+decoder pair (calibration)
        layer_costs.append((_layer_bytes(layer_c, b, B, T), b.count, runs[0],
                            _block_input(c, "block_input", B, T, h * act)))
    A_layers_full = sum(x * n * r for x, n, r, _ in layer_costs)
    # the largest block: derived per kind of block where a stack mixes kinds (a hybrid's
    # linear-attention block keeps ten times its full-attention block: Qwen3-Next)
    A_layer_max = max([x for x, _, _, _ in layer_costs]
                      + [_fitted(c[k], B, T) for k in ("layer_largest", "layer_largest_decoder")
                         if k in c], default=0)
    if _paired(info, c):
        # T5's fitted cost is an encoder + decoder pair's; checkpointing recomputes one block
        # at a time, the larger its decoder block: self- and cross-attention beside the
        # encoder's one, the same feed-forward, so at most 2/3 of the pair (derived at 4 x
        # 128: 16.7 of 26.5 MiB; the pair put T5's classifier in bf16-mixed 23% over)
        A_layer_max *= _PAIR_DECODER_SHARE
    modules = sum(n for _, n, _, _ in layer_costs)  # (blocks: a fitted pair's encoder ones)
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
    A_kept = 0
    if config.gradient_checkpointing:
        # each checkpointed block keeps its input (and an 8-bit base's layers their inputs);
        # backward recomputes one block at a time
        A_layers = sum(i * n * r for _, n, r, i in layer_costs) + kept8
        A_transient = A_layer_max
        # (one block's copies: autocast casts a weight once however often its block runs)
        copies = copies_head + (copies_all - copies_head) // max(modules, 1)
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
    fused, fused_base = _compile_parts(info, config, T, device)
    if config.gradient_checkpointing:
        A_transient = max(A_transient - fused, 0)
    else:
        A_layers = max(A_layers - fused, 0)
    A_base -= fused_base  # masks (the causal one: more) and the loss's buffers
    return _Saved(A=A_layers + A_base, A_base=A_base, A_transient=A_transient, A_kept=A_kept,
                  copies=copies, copies_head=copies_head, host=host,
                  copies_fwd=(copies_head + _cached_copies(info, copies_all - copies_head)
                              if cast and config.gradient_checkpointing else 0))


def _cached_copies(info: ModelInfo, block_copies: int) -> int:
    """Of the blocks' 16-bit weight copies (``block_copies``: every matmul weight's), those
    autocast caches through a checkpointed forward: it caches a copy of a weight that
    requires grad, and casts a frozen one again at each use (a LoRA base's: the forward's
    end was 36% over with them), + the trainable fp32 adapters' matrices' copies."""
    linear = [g for g in info.params if g.role == "linear" and len(g.shape) == 2
              and g.quantized is None]
    total = sum(g.numel * g.count for g in linear)
    frozen = sum(g.numel * g.count for g in linear if not g.trainable)
    adapters = sum(g.numel * g.count for g in info.params if g.role == "lora" and g.trainable
                   and len(g.shape) == 2 and g.dtype == "float32")
    return int(block_copies * (1 - frozen / total if total else 1.0)) + 2 * adapters


def _block_input(c: dict, key: str, B: int, T: int, per_token: int) -> float:
    """The bytes of the hidden states a block run takes in: derived (``c[key]``), else
    one residual stream of ``per_token`` bytes a token (the fitted table's models)."""
    fit = c.get(key)
    return _fitted(fit, B, T) if fit is not None else float(B * T * per_token)


# the table's families whose head takes its loss on the logits as they are (BERT's masked
# LM and T5 call CrossEntropyLoss; llama's and GPT-2's transformers loss upcasts them)
_LOSS_AS_LOGITS = frozenset({"bert", "t5"})


def _loss_elem(info: ModelInfo, config: TrainConfig, c: dict, act: int) -> int:
    """Bytes of one element of the loss backward's (N, V) gradients: fp32 under autocast
    (the log-softmax runs in fp32), on fp32 logits, or where the model upcasts its logits
    (transformers' loss functions); a 16-bit model's own where its head calls
    CrossEntropyLoss on its 16-bit logits (derived: the dtype of the step's largest
    log-softmax; a DeBERTa masked LM in bf16-true drawn by ``benchmarks/random_sweep.py``
    was 29% over with fp32 ones, BERT's 35%, T5's 18%, against their simulations)."""
    if config.precision_spec.autocast or act == 4:
        return 4
    if "loss_elem" in c:
        return int(c["loss_elem"])
    return act if not c.get("derived") and _family(info) in _LOSS_AS_LOGITS else 4


def _temporaries(info: ModelInfo, config: TrainConfig, T: int, device: DeviceInfo, act: int,
                 G: int, no_grad_shapes: frozenset[tuple[int, ...]] = frozenset(),
                 loss_elem: int = 4) -> tuple[int, float, float, int]:
    """Step 3: (G_held, loss_temp, block_bwd_temp, opt_temp): the earlier micro batches'
    gradients held, the loss's backward (its gradients ``loss_elem`` bytes an element:
    ``_loss_elem``), one block's backward, the optimizer step's (of the parameters a
    gradient reaches: not ``no_grad_shapes``)."""
    B = config.micro_batch_size
    N = B * T
    spec = config.precision_spec
    V, trl, chunked = _lm(info, config)
    h = info.hidden_size or 0
    NL = B * (T + info.virtual_tokens)  # the logits' rows: prompt tuning's tokens too
    loss_grads = 2 * NL * V * loss_elem  # d log_softmax and d logits at the loss backward
    head_grad = V * h * act if V else 0
    head_grad_in_G = min(head_grad, G)
    # one block's backward: grads of its widest activations (e.g. MLP: 2 x (N, i)), those
    # of its matmuls' outputs in the compute dtype under autocast (the residual stream's
    # stay in the parameters'): a 2-layer qwen2 classifier in bf16-mixed with
    # checkpointing at 1,024 tokens, drawn by random_sweep.py, 13% over with fp32 ones
    inter = max((b.intermediate_size for b in info.blocks), default=0)
    inter_elem = _bytes(spec.compute_dtype) if spec.autocast else act
    block_bwd_temp = 2 * N * inter * inter_elem + 2 * N * h * act + _dequantized_bytes(info)
    opt_temp = _optimizer_step_temporaries(info, config, device, no_grad_shapes)

    # with accumulation, the gradients of the earlier micro batches are held through
    # the next forward and backward; the head's backward still makes its weight's
    # gradient anew (autograd adds it to the held ``.grad`` after), beside the logits'
    # gradient where the loss's log-softmax is freed (a 1B llama's 128k x 2048 head at
    # 1 x 512 tokens and 4 micro batches on a card: simulated 3.4% above the closed form
    # that took it as the held one, +0.0% with it)
    G_held = G if config.grad_accum_steps > 1 else 0
    loss_temp = max(loss_grads, head_grad_in_G + (0 if G_held else NL * V * loss_elem))
    if trl:
        head_trainable = any(g.trainable and tuple(g.shape) == (V, h) for g in info.params)
        loss_temp = trl_loss_bytes(NL, V, h, 2 if spec.autocast else act,
                                   cuda=device.allocator == "cuda", head_trainable=head_trainable,
                                   accumulating=bool(G_held), tile_temps=TRL_CPU_TILE_TEMPS)
    elif chunked:
        head_trainable = any(g.trainable and tuple(g.shape) == (V, h) for g in info.params)
        loss_temp = chunked_loss_bytes(NL, V, h, act, device, accumulating=bool(G_held),
                                       head_trainable=head_trainable, autocast=spec.autocast)
    return G_held, loss_temp, block_bwd_temp, opt_temp


def _tied_gradient_sum(info: ModelInfo, config: TrainConfig) -> int:
    """What a trainable embedding tied to the LM head holds at the end of backward beyond
    its gradient: autograd sums the head's (V, h) gradient and the embedding's in a new
    tensor (measured: tiny-gpt2 with SGD held three (V, h) gradients at the end of its
    backward, 222 MiB in all, where the closed form had one: 34% under; with AdamW the
    optimizer step is the higher), beside the ``.grad`` of an earlier micro batch when
    gradients accumulate. 0 for an untied, frozen or absent head."""
    if not info.tie_word_embeddings or not any(
            g.role == "embedding" and g.trainable and g.shape[0] == info.vocab_size
            for g in info.params):
        return 0
    held = 3 if config.grad_accum_steps > 1 else 2
    return held * info.head_numel * _bytes(config.precision_spec.param_dtype)


def _late_embedding_gradients(info: ModelInfo, config: TrainConfig) -> int:
    """Gradient bytes made only after every block's backward: a single stack's trainable
    input embeddings (word, position, token type; not one tied to the LM head, whose
    gradient the head's backward makes first). They do not exist while backward recomputes
    a block: a small BERT-style classifier's 8k x 256 word embedding is 8 MiB of its 112
    (DistilBERT's token classifier in bf16 with checkpointing: 17.6% over with them)."""
    if info.is_encoder_decoder:  # a shared embedding's decoder side comes before the encoder
        return 0
    tied = info.tie_word_embeddings and info.lm_logits
    quantized = info.quant is not None
    return sum(g.numel * _param_dtype_bytes(g, config, quantized) for g in info.params
               if g.role == "embedding" and g.trainable and g.count == 1
               and not (tied and g.shape[0] == info.vocab_size))


def _first_block_gradients(info: ModelInfo, config: TrainConfig) -> int:
    """Gradient bytes of the first block that its own backward has not made yet when
    backward recomputes it, the last block recomputed: its linear weights' but the
    largest's (its last linear's gradient comes first in its backward, beside the whole
    recomputed block). A full fine-tune of a one-stack model only (adapters', a quantized
    or frozen base's gradients are another's; an encoder-decoder's last recomputed block
    is its encoder's). ELECTRA's two-block classifier in bf16 with checkpointing counted
    both blocks' gradients beside the first's recompute (8.4 MB of 154.5 measured)."""
    if info.is_encoder_decoder or not info.blocks or not _full_fine_tune(info):
        return 0
    sizes = [k * n for _, k, n, _ in info.blocks[0].linears]
    if len(sizes) < 2:
        return 0
    return (sum(sizes) - max(sizes)) * _grad_bytes(config)


def _full_fine_tune(info: ModelInfo) -> bool:
    """Whether every linear weight is trained in full (no adapter, no quantized or frozen
    base): the blocks' gradients are then their linear weights'."""
    return info.quant is None and not any(
        g.role in ("lora", "adapter", "prompt") or not g.trainable
        for g in info.params if g.role == "linear")


def _grad_bytes(config: TrainConfig) -> int:
    """Bytes of a gradient element: the parameters' dtype's."""
    return 2 if config.precision_spec.param_dtype in ("bfloat16", "float16") else 4


def _paired(info: ModelInfo, c: dict) -> bool:
    """Whether an encoder-decoder's blocks are costed as T5's fitted encoder + decoder pairs
    (no decoder coefficients of its own)."""
    return info.is_encoder_decoder and c.get("layer_decoder") is None


def _pair_encoder_share(A_decoder: float) -> float:
    """A fitted pair's encoder block, from its decoder block's share of the pair."""
    return A_decoder * (1 - _PAIR_DECODER_SHARE) / _PAIR_DECODER_SHARE


def _last_recomputed(info: ModelInfo, config: TrainConfig, c: dict, T: int,
                     A_transient: float) -> float:
    """What the last block checkpointing recomputes keeps: an encoder-decoder's is an
    encoder block (a fitted pair's encoder share; with derived coefficients the encoder's
    largest block, ``layer_largest``: UMT5's classifier's decoder block is the larger), else
    the largest block."""
    if _paired(info, c):
        return _pair_encoder_share(A_transient)
    if info.is_encoder_decoder and "layer_largest" in c:
        return min(A_transient, _fitted(c["layer_largest"], config.micro_batch_size, T))
    return A_transient


def _recompute_moments(info: ModelInfo, config: TrainConfig, c: dict, T: int, G: int,
                       G_late: int, G_own: int, A_transient: float
                       ) -> list[tuple[float, float, float]]:
    """(gradients, recomputed block's activations, the block forward's highest point) at
    the recomputes that can peak: an encoder-decoder's top decoder block, then its top
    encoder block, each beside the gradients made by then (``_pair_moments``; with derived
    coefficients each stack's largest block, ``layer_largest_decoder`` and
    ``layer_largest``, reaching its own stack's highest point: UMT5's and mT5's
    classifiers in bf16 with checkpointing were 10.6-12.8% over with the larger block
    beside every gradient, and the decoder's highest point put the encoder's moment 43
    MiB high); else the largest block, recomputed last, beside all gradients but the input
    embeddings' and its own. The highest point is derived (0 with the fitted table)."""
    B = config.micro_batch_size
    high = max((_fitted(c[k], B, T)
                for k in ("block_forward", "block_forward_decoder") if k in c), default=0.0)
    if _paired(info, c):
        return [(g, a, high) for g, a in _pair_moments(info, config, G, A_transient)]
    if info.is_encoder_decoder and "layer_largest_decoder" in c and "layer_largest" in c:
        A_dec = min(A_transient, _fitted(c["layer_largest_decoder"], B, T))
        A_enc = min(A_transient, _fitted(c["layer_largest"], B, T))
        (g_dec, _), (g_enc, _) = _stack_moments(info, config, G, A_dec, A_enc,
                                                c.get("encoder_grads_outside"))
        return [(g_dec, A_dec, _fitted(c["block_forward_decoder"], B, T)
                 if "block_forward_decoder" in c else high),
                (g_enc, A_enc, _fitted(c["block_forward"], B, T)
                 if "block_forward" in c else high)]
    return [(G - G_late - G_own, A_transient, high)]


def _pair_moments(info: ModelInfo, config: TrainConfig, G: int,
                  A_decoder: float) -> list[tuple[float, float]]:
    """(gradients, recomputed block's activations) where checkpointing recomputes the top
    decoder block, then the top encoder block, of an encoder-decoder costed by fitted
    pairs. Backward recomputes the decoder's blocks first: beside the larger block are the
    gradients of what comes after the blocks (the head, final norms; an LM head tied to
    the embedding: the embedding's) and of the block itself as its backward makes them;
    beside the smaller encoder block, every gradient but the encoder blocks' below it.
    T5's classifier in bf16 with checkpointing: torch.profiler's timeline peaks at the
    decoder's top block beside 14 MiB of its 73 MiB of gradients (365.0 MiB), at the
    encoder's beside 66 (357.1); the pair's block beside all of them put it 13.6% over.
    Every gradient stands where they are not a full fine-tune's, or accumulate."""
    return _stack_moments(info, config, G, A_decoder, _pair_encoder_share(A_decoder))


def _stack_moments(info: ModelInfo, config: TrainConfig, G: int, A_decoder: float,
                   A_encoder: float, outside: float | None = None
                   ) -> list[tuple[float, float]]:
    """``_pair_moments`` of an encoder-decoder whose top decoder and encoder blocks keep
    ``A_decoder`` and ``A_encoder``; ``outside``: where derived, the gradients of the
    parameters outside the blocks made by the encoder's top block's backward (LED's
    shared embedding gets its gradient only at the end: 16 MiB of its 35 counted beside
    its encoder's recompute put it 9.8% over)."""
    if config.grad_accum_steps > 1 or not _full_fine_tune(info):
        return [(G, A_decoder), (G, A_encoder)]
    grad = _grad_bytes(config)

    def one(b: BlockSpec) -> int:
        return sum(i * o for _, i, o, _ in b.linears) * grad

    enc = [b for b in info.blocks if b.role == "encoder"]
    dec = [b for b in info.blocks if b.role != "encoder"]
    if not enc or not dec:
        return [(G, A_decoder), (G, A_encoder)]
    blocks_enc = sum(one(b) * b.count for b in enc)
    blocks_dec = sum(one(b) * b.count for b in dec)
    tied = info.tie_word_embeddings and info.lm_logits
    embeddings = sum(g.numel * grad for g in info.params if g.role == "embedding"
                     and g.trainable and not (tied and g.shape[0] == info.vocab_size))
    G_decoder = max(G - blocks_enc - blocks_dec - embeddings, 0) + max(one(b) for b in dec)
    G_encoder = (max(G - blocks_enc, 0) if outside is None
                 else blocks_dec + outside) + max(one(b) for b in enc)
    return [(min(G, G_decoder), A_decoder), (min(G, G_encoder), A_encoder)]


def _phases(info: ModelInfo, config: TrainConfig, T: int, c: dict, saved: _Saved, kept8: int,
            *, W: int, G: int, S: int, G_held: int, loss_temp: float, block_bwd_temp: float,
            opt_temp: int, recompute_bwd_temp: float | None = None,
            ) -> dict[str, tuple[float, dict[str, float]]]:
    """Step 4: the candidate peaks, phase -> (bytes, component -> bytes)."""
    A, A_base, A_transient = saved.A, saved.A_base, saved.A_transient
    copies, copies_head = saved.copies, saved.copies_head
    tied = _tied_gradient_sum(info, config)
    # the input embeddings' gradients come after the last block's backward: never beside a
    # recomputed block's activations (A_transient, checkpointing only) -- unless gradients
    # accumulate, when the earlier micro batch's are there all along
    G_late = (min(G, _late_embedding_gradients(info, config))
              if A_transient and not G_held else 0)
    # ... nor the last recomputed block's own (most of them) beside its recompute
    G_own = (min(G - G_late, _first_block_gradients(info, config))
             if A_transient and not G_held else 0)
    # (the last block recomputed: an encoder's, where a fitted pair stands for both)
    A_last = _last_recomputed(info, config, c, T, A_transient)
    # (a block's backward beside a recomputed block: its scratch, ``recompute_bwd_temp``)
    end_bwd = block_bwd_temp if recompute_bwd_temp is None else recompute_bwd_temp
    # (the last recomputed block's activations never stand beside its own gradients nor
    # the embeddings', made after them; with checkpointing, what stays below the blocks is
    # derived, where half of what the forward keeps outside them counted the head's: a
    # DistilBERT masked LM at 1,024 tokens with eager attention, 81 MiB a block and a 32
    # MiB head, drawn by random_sweep.py, was 17% over)
    below_end = (_fitted(c["below_kept"], config.micro_batch_size, T)
                 if config.gradient_checkpointing and "below_kept" in c else A_base // 2)
    end = W + S + G + below_end + kept8 + end_bwd + max(A_last - G_late - G_own, 0)
    # the top block's backward beside all activations: derived, what it makes above what
    # was alive at the loss (the head's backward freed some: a classifier's input), else the
    # standard block's rule (two of its widest activations' gradients, two of its inputs')
    # (the highest of its moments at this shape, where they were told apart)
    tops = c.get("top_backward_moments") or ([c["top_backward"]] if "top_backward" in c else [])
    top_bwd = (max(_signed(m, config.micro_batch_size, T) for m in tops)
               if tops and not config.gradient_checkpointing else block_bwd_temp)
    phases = {
        # all activations alive; the loss backward's fp32 (N, V) gradients
        # (without a (B, T, V) loss, e.g. sequence classification, the top block's
        # backward is the larger: all activations are still alive then)
        "backward": (W + copies + S + A + G_held + max(loss_temp, top_bwd),
                     {Component.WEIGHTS: W + copies, Component.OPTIMIZER_STATES: S,
                      Component.ACTIVATIONS: A, Component.GRADIENTS: G_held,
                      Component.TEMPORARIES: max(loss_temp, top_bwd)}),
        # gradients complete, the embedding side's activations and one block's temporaries
        # (an 8-bit base's layers still hold their inputs: the graph is freed after backward)
        "backward-end": (end,
                         {Component.WEIGHTS: W, Component.OPTIMIZER_STATES: S,
                          Component.GRADIENTS: G,
                          Component.ACTIVATIONS: end - W - S - G - end_bwd,
                          Component.TEMPORARIES: end_bwd}),
        # a tied head and embedding: their two gradients and the sum, the embedding's
        # backward being the last (the activations are gone by then)
        "embedding-sum": (W + S + G + kept8 + tied,
                          {Component.WEIGHTS: W, Component.OPTIMIZER_STATES: S,
                           Component.GRADIENTS: G, Component.ACTIVATIONS: kept8,
                           Component.TEMPORARIES: tied}),
        "optimizer": (W + S + G + opt_temp,
                      {Component.WEIGHTS: W, Component.OPTIMIZER_STATES: S,
                       Component.GRADIENTS: G, Component.ACTIVATIONS: 0,
                       Component.TEMPORARIES: opt_temp}),
    }
    forward = _forward_phase(info, config, T, c, saved, W=W, S=S, G_held=G_held)
    if forward is not None:
        phases["forward"] = forward
    if config.gradient_checkpointing:
        # after the loss and head backward, each block is recomputed in turn: its full
        # activations and autocast copies exist again while the gradients accumulate
        # (at the last block recomputed, about all of them)
        copies_layer = copies - copies_head
        # derived: the recompute reaches a block forward's highest point again, what the
        # block keeps and its scratch together (Qwen3-Next's chunked delta rule: 21% above
        # what it keeps); an encoder-decoder's top decoder block, then its top encoder
        # block, each beside the gradients made by then
        moments = _recompute_moments(info, config, c, T, G, G_late, G_own, A_transient)
        G_r, A_r, temp = max(((g, a, max(end_bwd, h - a)) for g, a, h in moments),
                             key=lambda m: sum(m))
        # beside every recompute, what stays below the blocks (derived: the embeddings'
        # norm input and dropout mask, the blocks' 4-D mask, which the checkpoints keep;
        # Longformer's classifier 8.1 MiB)
        below = (_fitted(c["below_kept"], config.micro_batch_size, T)
                 if "below_kept" in c else 0.0)
        kept = saved.A_kept + A_r + below
        phases["recompute"] = (
            W + copies_layer + S + G_r + kept + temp,
            {Component.WEIGHTS: W + copies_layer, Component.OPTIMIZER_STATES: S,
             Component.GRADIENTS: G_r, Component.ACTIVATIONS: kept,
             Component.TEMPORARIES: temp})
    return phases


def _forward_phase(info: ModelInfo, config: TrainConfig, T: int, c: dict, saved: _Saved,
                   *, W: int, S: int, G_held: int) -> tuple[float, dict[str, float]] | None:
    """The forward's highest point (None where no rule gives one): a derived forward
    moment, and with checkpointing under autocast the forward's end."""
    A, A_base, copies = saved.A, saved.A_base, saved.copies
    # autocast caches each weight's 16-bit copy until the forward leaves autocast: with
    # checkpointing the forward casts every block's (the backward start keeps the head's
    # and its recompute one block's at a time), beside the gradients of earlier micro
    # batches with accumulation (bf16-mixed, checkpointing, 4 micro batches: measured on
    # the CPU 16.0% under without this, llamaw-b1s256-bf16m-gc-ga4-adafactor, -1.2% with
    # it; simulated 1B llama / GPT-2 / BERT-large steps on a card 6.9-15.7% under)
    # (a frozen weight's copy, made at its use, is one block's at a time: ``copies``)
    fwd_copies = max(copies, saved.copies_fwd)  # (copies_fwd: 0 without checkpointing)
    fwd_c = c.get("forward")  # derived: the forward's transient above what it keeps
    forward = None
    if fwd_c is not None:
        # the forward's highest point: an op's or a block's scratch (AXK2's indexer scores
        # on a sequence classifier: 9.3% under without it) above the activations made by
        # then (all of them, or an encoder-decoder's encoder's share: see
        # ``autofit.memory.analytic.derived``; all with checkpointing, whose forward keeps
        # other tensors than derived); the highest of the forward's moments at this shape
        # where they were told apart (``forward_moments``)
        moments = [(_fitted(f, config.micro_batch_size, T),
                    _checkpointed_share(f, config, T, A, A_base)
                    if config.gradient_checkpointing else _share(f, c, config, T))
                   for f in c.get("forward_moments") or [fwd_c]]
        fwd_temp, share = max(moments, key=lambda m: m[0] + m[1] * A)
        forward = (W + fwd_copies + S + G_held + share * A + fwd_temp,
                   {Component.WEIGHTS: W + fwd_copies, Component.OPTIMIZER_STATES: S,
                    Component.GRADIENTS: G_held, Component.ACTIVATIONS: share * A,
                    Component.TEMPORARIES: fwd_temp})
    if fwd_copies > copies:
        # the forward's end (fitted coefficients have no forward moment of their own): the
        # checkpointed blocks' copies still cached beside all it keeps for backward, and the
        # loss's 16-bit logits with their fp32 upcast while it makes the log-softmax it keeps
        V, _, chunked = _lm(info, config)
        logits = (0 if chunked
                  else config.micro_batch_size * (T + info.virtual_tokens) * V * (2 + 4))
        end_fwd = W + fwd_copies + S + G_held + A + logits
        if forward is None or end_fwd > forward[0]:
            forward = (end_fwd, {Component.WEIGHTS: W + fwd_copies,
                                 Component.OPTIMIZER_STATES: S, Component.GRADIENTS: G_held,
                                 Component.ACTIVATIONS: A, Component.TEMPORARIES: logits})
    return forward


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
                         "use autofit.memory.ranks.estimate_analytic for several")
    terms = analytic_phases(info, config, seq_len, device)
    phases, host = terms.phases, terms.host
    T = seq_len
    phase, (peak_alloc, parts) = max(phases.items(), key=lambda kv: kv[1][0])
    parts = {k: int(v) for k, v in parts.items()}
    lib_cache = cpu_library_cache_bytes(info, config, seq_len, device,  # the whole step
                                        half_matmuls=terms.half_matmuls,
                                        half_step=terms.half_step, probed=True)
    parts[Component.TEMPORARIES] += lib_cache
    peak_alloc = int(peak_alloc) + lib_cache

    if device.allocator == "cuda":
        peak_reserved = cuda_reserved_bytes(phases, terms.stranded)
    else:
        peak_reserved = peak_alloc
    # what the CPU's libraries keep once per process, where told apart: overhead
    once = cpu_library_once_bytes(info, config, seq_len, device, half_step=terms.half_step)
    total = peak_reserved + device.overhead_bytes + once
    breakdown = {
        Component.WEIGHTS: parts[Component.WEIGHTS],
        Component.GRADIENTS: parts[Component.GRADIENTS],
        Component.OPTIMIZER_STATES: parts[Component.OPTIMIZER_STATES],
        Component.ACTIVATIONS: parts[Component.ACTIVATIONS],
        Component.TEMPORARIES: parts[Component.TEMPORARIES],
        Component.OVERHEAD: total - peak_alloc,
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
