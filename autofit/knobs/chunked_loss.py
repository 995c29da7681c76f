"""The chunked loss knob: the causal-LM loss without the full (B, T, V) logits.

    >>> CHUNKED_LOSS.note(True)
    'chunked loss: train with autofit.ChunkedLossTrainer (a transformers.Trainer whose compute_loss runs autofit.causal_lm_chunked_loss); TrainingArguments has no field for it'

It changes no math (the same loss and gradients, computed chunk by chunk with torch's
``linear_cross_entropy``: ``autofit.knobs.loss``), so both values are searched by
default where it applies: causal-LM models with an output embedding (the search is
told so by ``restrict_to_model``; elsewhere its only value is False). On is the value
that saves memory.

``TrainingArguments`` has no field for torch's chunked loss: the user trains with
``autofit.ChunkedLossTrainer`` (``note``). Where liger-kernel is installed and the
plan is for a GPU, ``use_liger_kernel=True`` (its fused linear cross entropy) is the
field written instead; on a CPU it is never offered (liger's kernels need a GPU).

Where ``use_liger_kernel`` carries it (a CUDA plan, liger-kernel installed here: the
field is written), the estimate holds liger's one buffer torch's op lacks
(``liger_weight_grad_transient``): liger (ops/fused_linear_cross_entropy.py, 2026) adds
each chunk's weight gradient with ``addmm`` into float32 only for a float32 weight under
16-bit autocast on an sm >= 8 card (bf16-mixed on an A100 / H100); otherwise through
``torch.mm(...).float()``, a (V, h) product and its float32 copy for a moment (6 V h
bytes with 16-bit logits, 4 V h in float32). The rest (the (B*T, h) and (V, h) gradients
made in the forward, a logits chunk of about the input's size) is torch's op's. With
``autofit.ChunkedLossTrainer`` (which runs torch's op whatever the field) this holds a
little more than runs.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from autofit.knobs.base import OnOffKnob, asks_on, installed, training_arguments_fields
from autofit.probe.device import sm_version

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch

    from autofit.config import TrainConfig
    from autofit.knobs.base import Costs, Scope, StepContext
    from autofit.probe.device import DeviceInfo

__all__ = ["CHUNKED_LOSS", "ChunkedLossKnob", "TRAINER_NAME", "chunked_loss_bytes",
           "chunked_loss_kernels", "liger_carries", "liger_moment_bytes", "liger_offered",
           "liger_weight_grad_transient", "loss_chunk_rows"]

TRAINER_NAME = "autofit.ChunkedLossTrainer"
_LIGER = "use_liger_kernel"


def liger_offered(args: dict[str, object]) -> bool:
    """Whether ``use_liger_kernel`` is the field that turns the chunked loss on: liger-kernel
    installed, the installed TrainingArguments has the field, and the plan is not for a CPU
    (``use_cpu``: liger's Triton kernels need a GPU)."""
    return (not args.get("use_cpu") and installed("liger_kernel")
            and _LIGER in training_arguments_fields())


# The chunked loss on a CPU: +0.68x the head's training FLOPs (6 V h per token). Measured side
# by side on tiny-gpt2 (V 50257, h 256: the head is 79% of the step's FLOPs), micro batch
# 8 x 256 from tiny-samples, one thread (the trial child), median of 2 runs x 3 timed steps:
# 26.2 s full logits, 40.2 s chunked, 1.53x, under a load average of ~10 on 2 cores:
#   python -m autofit measure tiny-gpt2 --dataset tiny-samples --batch-size 8 \
#       --device cpu:4GiB --measure-steps 3 [--chunked-loss] --json
_CPU_CHUNKED_LOSS = 0.68


def loss_chunk_rows(tokens: int, vocab: int, hidden: int, *, halved: bool) -> int:
    """Rows of torch's chunked ``linear_cross_entropy`` per chunk (``aspect_ratio``): a
    (rows, V) logits chunk about the size of the (B*T, h) input, rounded up to a power of
    two, halved by ``aspect_ratio:2`` (the default but on a CPU with 16-bit inputs)."""
    inc = -(-vocab // max(hidden, 1))
    target = -(-tokens // inc)
    rows = 1 << (target - 1).bit_length()
    return max(1, min(rows // (2 if halved else 1), tokens))


def chunked_loss_bytes(tokens: int, vocab: int, hidden: int, act: int, device: DeviceInfo,
                       *, accumulating: bool = False, head_trainable: bool = True,
                       autocast: bool = False) -> int:
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

    Where liger's field carries the loss (``liger_carries``): at the end of the op, beside
    the two gradients, liger's weight-gradient moment and one logits chunk in the logits'
    dtype (``liger_moment_bytes``: 16-bit under ``autocast``) in place of torch's chunk.
    """
    cuda = device.allocator == "cuda"
    half = act == 2
    rows = loss_chunk_rows(tokens, vocab, hidden, halved=cuda or not half)
    chunk = rows * vocab * 4 + rows * hidden * 4
    grad_in = tokens * hidden * (4 if half and not cuda else act)  # CPU 16-bit: fp32
    grad_w = vocab * hidden * act if head_trainable else 0
    handed = (1 if accumulating else 2) * grad_w + grad_in  # backward start
    if cuda and liger_carries(device):
        moment = liger_moment_bytes(tokens, vocab, hidden, weight_bytes=4 if autocast else act,
                                    logit_bytes=2 if autocast else act, sm=sm_version(device),
                                    head_trainable=head_trainable)
        return max(grad_in + grad_w + max(chunk, moment), handed)
    if not half or cuda:
        return max(grad_in + grad_w + chunk, handed)
    # CPU, 16-bit input ("accurate"): + an fp32 copy of the weight; with a weight gradient an
    # fp32 scratch, and per chunk the scratch subtracted from the 16-bit gradient, which the
    # CPU kernel does through two fp32 (V, h) temporaries
    extra = (4 if head_trainable else 1) * vocab * hidden * 4
    return max(grad_in + grad_w + extra + chunk, handed)


def liger_carries(device: DeviceInfo) -> bool:
    """Whether liger's fused loss runs the chunked loss on ``device``: a CUDA plan with
    liger-kernel installed here, where ``use_liger_kernel`` is the field written."""
    return device.allocator == "cuda" and liger_offered({})


def liger_weight_grad_transient(vocab: int, hidden: int, *, weight_bytes: int,
                                logit_bytes: int, sm: int, head_trainable: bool = True) -> int:
    """Bytes liger's fused loss holds for a moment per chunk to add the chunk's (V, h) weight
    gradient: none with ``addmm`` into a float32 gradient (a float32 weight, 16-bit logits,
    sm >= 8), else the ``torch.mm`` product in the logits' dtype and its ``.float()`` copy
    (none when the product is float32 already); a frozen head has no weight gradient.

        >>> liger_weight_grad_transient(10, 4, weight_bytes=4, logit_bytes=2, sm=90)
        0
        >>> liger_weight_grad_transient(10, 4, weight_bytes=2, logit_bytes=2, sm=90)
        240
        >>> liger_weight_grad_transient(10, 4, weight_bytes=4, logit_bytes=4, sm=90)
        160
    """
    if not head_trainable or (weight_bytes == 4 and logit_bytes == 2 and sm >= 80):
        return 0
    return vocab * hidden * (logit_bytes + (4 if logit_bytes < 4 else 0))


def liger_moment_bytes(tokens: int, vocab: int, hidden: int, *, weight_bytes: int,
                       logit_bytes: int, sm: int, head_trainable: bool = True) -> int:
    """What liger's fused loss holds beside its two gradients at its highest moment: the
    weight-gradient transient (``liger_weight_grad_transient``) and a (rows, V) logits
    chunk in the logits' dtype (0 when there is no transient: torch's float32 chunk is
    the larger then)."""
    extra = liger_weight_grad_transient(vocab, hidden, weight_bytes=weight_bytes,
                                        logit_bytes=logit_bytes, sm=sm,
                                        head_trainable=head_trainable)
    if not extra:
        return 0
    return extra + loss_chunk_rows(tokens, vocab, hidden, halved=False) * vocab * logit_bytes


def chunked_loss_kernels() -> dict[object, Callable[..., object]]:
    """torch's chunked linear cross entropy op -> its implementation (Python over torch ops),
    so that its per-chunk temporaries are recorded rather than only its outputs."""
    import torch
    from torch.nn.modules import linear_cross_entropy as lce

    op = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default

    def run(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
            label_smoothing, batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
            compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad):
        with _first_chunks_only(lce):
            return lce._linear_cross_entropy_batch_chunked_accumulator(
                input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                label_smoothing, batch_chunk_size, acc_policy, acc_dtype, compute_input_grad,
                compute_linear_weight_grad, compute_linear_bias_grad)

    return {op: run}


@contextlib.contextmanager
def _first_chunks_only(lce: object) -> Iterator[None]:
    """Run the first two chunks and the last of torch's chunk loop, not all of them.

    Every chunk works in the same buffers (allocated once, before the loop) and allocates
    and frees the same temporaries, so chunks 3..n-1 repeat chunk 2's allocation stream;
    on fake tensors each chunk costs ~15 ms of dispatch (a (B*T)/chunk of 256 chunks made
    one simulated step 35 s). The last chunk may be shorter, so it runs too. The loop is
    ``_ChunkContext.chunks`` of torch 2.13 with fewer starts; on another torch whose context
    lacks the pieces it uses, every chunk runs.
    """
    ctx_cls = getattr(lce, "_ChunkContext", None)
    needed = ("chunks", "bind_chunk")
    if ctx_cls is None or not all(hasattr(ctx_cls, n) for n in needed):
        yield
        return
    original = ctx_cls.chunks

    def chunks(self: object) -> Iterator[object]:
        size = self.logits_buf.shape[0]
        starts = list(range(0, self.num_batches, size))
        for start in starts[:2] + starts[2:][-1:]:
            n = min(size, self.num_batches - start)
            chunk = self.bind_chunk(start, n)
            yield chunk
            if self.alloc_input_grad_acc_buf:  # the same commits as torch's loop
                self.grad_input.narrow(0, start, n).copy_(chunk.grad_input_chunk)
            if self.alloc_linear_bias_grad_chunk:
                self.grad_linear_bias.add_(chunk.bias_grad_acc.to(self.grad_linear_bias.dtype))
                chunk.bias_grad_acc.zero_()

    ctx_cls.chunks = chunks
    try:
        yield
    finally:
        ctx_cls.chunks = original


def _on_cuda(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters sit on a CUDA device (a trial on a card)."""
    first = next(iter(module.parameters()), None)
    return first is not None and first.device.type == "cuda"


def _with_liger_moment(run: Callable[..., object], recorder: object, config: TrainConfig,
                       sm: int) -> Callable[..., object]:
    """``run`` (torch's chunked op, recorded), then liger's moment (``liger_moment_bytes``)
    held and released while the op's outputs, the two gradients, are alive."""
    def run_then_hold(input, linear_weight, *args):  # noqa: A002 - torch's op's names
        out = run(input, linear_weight, *args)
        vocab, hidden = linear_weight.shape
        weight_bytes = linear_weight.element_size()
        held = liger_moment_bytes(
            input.shape[0], vocab, hidden, weight_bytes=weight_bytes,
            logit_bytes=2 if config.precision_spec.autocast else weight_bytes, sm=sm,
            head_trainable=linear_weight.requires_grad)
        if held:
            recorder.release(recorder.hold(held, "temporaries"))
        return out

    return run_then_hold


# NB: found by trials on two ranks (CPU, gloo): the gradients of a ChunkedLossTrainer step
# under DDP differ between ranks; FSDP2 raises "FSDP requires a single root module".
SEVERAL_RANKS = ("one rank only: autofit's ChunkedLossTrainer runs the backbone and the head "
                 "apart, around the DDP / FSDP wrapper (DDP leaves the gradients unsynced, "
                 "FSDP2 refuses)")


def _several_ranks(device: DeviceInfo) -> bool:
    return (int(getattr(device, "nproc_per_node", 1) or 1)
            * int(getattr(device, "nnodes", 1) or 1)) > 1


class ChunkedLossKnob(OnOffKnob):
    name = "chunked_loss"
    title = "loss"  # the candidates table: 4 columns wide, as "ckpt" (80 columns in all)
    fields = (_LIGER,)
    calibrates_apart = True  # the logits' share of the peak differs with and without it
    option = "chunked-loss"
    help_on = "always compute the causal-LM loss in chunks (no full logits)"
    help_off = "never chunk the loss"
    help_one = "compute the causal-LM loss in chunks (no full logits)"

    def defaults(self, device: DeviceInfo) -> tuple[tuple[bool, ...], str | None]:
        if _several_ranks(device):
            return (False,), "no chunked loss: " + SEVERAL_RANKS
        return (False, True), None

    def check(self, device: DeviceInfo, value: bool, run: bool = True) -> None:
        """Raise ``BadInputError`` for the chunked loss on a device with several ranks."""
        if value and _several_ranks(device):
            from autofit.errors import BadInputError

            raise BadInputError(f"chunked loss: {SEVERAL_RANKS}; drop --chunked-loss")

    def is_choice(self, loss_impl: str = "model", trainer: str | None = None) -> bool:
        """Not a choice where TRL's loss runs (SFTTrainer computes its own: "full logits"
        would describe nothing), nor in a trainer that does not run it (the plain
        Trainer, TRL's)."""
        from autofit.knobs.trainer import runs_chunked_loss

        return loss_impl != "trl" and (trainer is None or runs_chunked_loss(trainer))

    def narrow(self, asked: object, scope: Scope) -> object:
        """The chunked loss's values for one tune: as asked, or False (with the reason)
        when TRL's loss runs, when neither the trainer nor a field runs it, or when the
        model cannot (asked for such a model: ``BadInputError``)."""
        from autofit.errors import BadInputError, fix
        from autofit.knobs.loss import unsupported_reason
        from autofit.knobs.trainer import not_searched_reason, runs_chunked_loss
        from autofit.knobs.trl_loss import trl_loss_reason, trl_loss_type

        wants = asks_on(asked)
        if scope.loss_impl == "trl":  # SFTTrainer computes its own loss: not autofit's
            if wants:
                raise BadInputError("chunked loss: training_args is an SFTConfig, whose "
                                    "SFTTrainer computes TRL's fused LM-head loss; drop "
                                    + fix("--chunked-loss", "chunked_loss=True"))
            scope.reasons.append(trl_loss_reason(trl_loss_type(scope.training_args) or "nll"))
            return False
        if not runs_chunked_loss(scope.trainer) and not liger_offered(
                {"use_cpu": scope.device.kind == "cpu"}):
            scope.reasons.append(not_searched_reason(scope.trainer))  # nothing runs it
            return False
        why = unsupported_reason(scope.module, scope.task)
        if why is not None:  # one value for this model: say why
            self.check_model(wants, scope.module, scope.task)
            scope.reasons.append(f"no chunked loss: {why}")
            return False
        return asked

    def check_model(self, value: bool, module: torch.nn.Module, task: str) -> None:
        """Raise ``BadInputError`` when the chunked loss is asked for a model that cannot
        use it (no output embedding, not a causal LM)."""
        if not value:
            return
        from autofit.errors import BadInputError, fix
        from autofit.knobs.loss import unsupported_reason

        why = unsupported_reason(module, task)
        if why is not None:
            raise BadInputError(f"chunked loss: {why}; drop "
                                + fix("--chunked-loss", "chunked_loss=True"))

    def describe(self, value: bool) -> str:
        return "chunked loss" if value else "full logits"

    def short(self, value: bool) -> str:
        return "chnk" if value else "full"

    def note(self, value: bool) -> str | None:
        if not value:
            return None
        return (f"chunked loss: train with {TRAINER_NAME} (a transformers.Trainer whose "
                "compute_loss runs autofit.causal_lm_chunked_loss); TrainingArguments has no "
                "field for it")

    def trainer_note(self, value: bool, trainer: str) -> str | None:
        """``note``; for a trainer that does not run autofit's chunked loss the chunked loss
        is carried by ``use_liger_kernel`` (the only way the search chose it then)."""
        from autofit.knobs.trainer import runs_chunked_loss

        if value and not runs_chunked_loss(trainer):
            return ("chunked loss: use_liger_kernel is set (liger-kernel's fused linear cross "
                    "entropy, which the Trainer applies from that field)")
        return self.note(value)

    def reason(self, config: TrainConfig, costs: Costs) -> str | None:
        """What a chosen chunked loss saves, by the closed form."""
        if not config.chunked_loss:
            return None
        from autofit.probe.device import format_bytes as _gib

        on = costs.device_bytes(config)
        off = costs.device_bytes(config.replace(chunked_loss=False))
        return (f"chunked loss: saves ~{_gib(off - on)} at micro batch "
                f"{config.micro_batch_size} (estimated {_gib(off)} -> {_gib(on)}: no (B, T, V) "
                "logits, their fp32 log-softmax or their gradients)")

    def step_seconds(self, ctx: StepContext) -> float:
        """The chunked loss's loop: on a CUDA card the bytes it moves per micro batch (each
        chunk reads the head's weight twice, reads and writes its fp32 weight gradient); on
        a CPU its measured cost, ``_CPU_CHUNKED_LOSS`` x the head's training FLOPs."""
        info, config = ctx.info, ctx.config
        if not config.chunked_loss or not info.vocab_size or not info.hidden_size:
            return 0.0
        V, h = info.vocab_size, info.hidden_size
        tokens = config.micro_batch_size * ctx.seq_len
        if ctx.device.kind == "cpu":
            return _CPU_CHUNKED_LOSS * 6.0 * V * h * tokens / ctx.flops
        e = 2 if config.precision.endswith("-true") and config.precision != "32-true" else 4
        rows = loss_chunk_rows(tokens, V, h, halved=ctx.device.allocator == "cuda" or e == 4)
        chunks = -(-tokens // rows)
        return chunks * V * h * (2 * e + 2 * 4) / ctx.bandwidth

    def step_loss(self, config: TrainConfig) -> Callable[..., torch.Tensor] | None:
        """``ChunkedLossTrainer.compute_loss``'s loss when on: the backbone, then torch's
        chunked linear cross entropy over the head (no full logits)."""
        if not config.chunked_loss:
            return None
        from autofit.knobs.loss import causal_lm_chunked_loss

        return causal_lm_chunked_loss

    def trial_loss(self, config: TrainConfig, device_kind: str
                   ) -> Callable[..., torch.Tensor] | None:
        """A trial's loss when on: on a card where liger's field carries it, the model's own
        forward (None), which ``prepare`` made liger's (its fused linear cross entropy, as
        the user's Trainer applies it); elsewhere ``step_loss``'s."""
        if config.chunked_loss and device_kind == "cuda" and liger_offered({}):
            return None
        return self.step_loss(config)

    def prepare(self, config: TrainConfig, module: torch.nn.Module) -> None:
        """On a trial's copy on a card where liger's field carries the chunked loss: liger's
        fused linear cross entropy applied as the Trainer applies it (its other kernels are
        the liger knob's: off here)."""
        if not (config.chunked_loss and _on_cuda(module) and liger_offered({})):
            return
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(module, {"fused_linear_cross_entropy": True, "cross_entropy": False,
                                    "rms_norm": False, "swiglu": False, "rope": False})

    def isolates(self, config: TrainConfig) -> bool:
        """A trial that applies liger (``prepare``) runs in its own process."""
        return bool(config.chunked_loss) and liger_offered({})

    def recorded(self, config: TrainConfig, recorder: object, target: object) -> None:
        """The simulated step's memory rule when on: torch's chunked op recorded as its
        Python implementation (``chunked_loss_kernels``: every chunk's logits and the
        gradients it accumulates; on a CPU the fp32 temporaries of its mixed-dtype ``sub_``
        are the recorder's type-promotion rule's, ``simulate._cpu_kernels``: counted here
        too, they were twice, 16% over); on a CUDA step where liger's field carries
        it, liger's weight-gradient moment held at the op's end (``_with_liger_moment``).
        ``recorder``: the simulation's ``StorageRecorder`` (its ``decompositions``,
        ``workspaces``, ``hold``); ``target``: the step's (``kind``, ``sm``) or a kind."""
        if not getattr(config, self.name, False):
            return
        kernels = chunked_loss_kernels()
        sm = getattr(target, "sm", None)  # a whole step's target (the derivation: none)
        target = getattr(target, "kind", target)
        if target == "cuda" and sm is not None and liger_offered({}):
            kernels = {op: _with_liger_moment(run, recorder, config, sm)
                       for op, run in kernels.items()}
        recorder.decompositions.update(kernels)

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        from autofit.knobs.liger import CONFIG, liger_keys

        on = bool(getattr(config, "chunked_loss", False)) and liger_offered(args)
        if CONFIG not in training_arguments_fields():  # no per-kernel config: all of liger
            if on:
                args[_LIGER] = True
        elif on or args.get(_LIGER):
            # liger's fused linear cross entropy; its other kernels are the liger knob's keys
            liger_keys(args, fused_linear_cross_entropy=on)

    def read(self, args: dict[str, object]) -> bool:
        from autofit.knobs.liger import kernel_on

        return kernel_on(args, "fused_linear_cross_entropy")


CHUNKED_LOSS = ChunkedLossKnob()
