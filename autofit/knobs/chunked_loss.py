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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.knobs.base import OnOffKnob, installed, training_arguments_fields

if TYPE_CHECKING:
    from autofit.config import TrainConfig
    from autofit.knobs.base import Costs
    from autofit.probe.device import DeviceInfo

__all__ = ["CHUNKED_LOSS", "ChunkedLossKnob", "TRAINER_NAME", "liger_offered"]

TRAINER_NAME = "autofit.ChunkedLossTrainer"
_LIGER = "use_liger_kernel"


def liger_offered(args: dict[str, object]) -> bool:
    """Whether ``use_liger_kernel`` is the field that turns the chunked loss on: liger-kernel
    installed, the installed TrainingArguments has the field, and the plan is not for a CPU
    (``use_cpu``: liger's Triton kernels need a GPU)."""
    return (not args.get("use_cpu") and installed("liger_kernel")
            and _LIGER in training_arguments_fields())


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

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        if getattr(config, "chunked_loss", False) and liger_offered(args):
            args[_LIGER] = True
        # otherwise the user's own use_liger_kernel (other fused kernels too) is left as is

    def read(self, args: dict[str, object]) -> bool:
        return bool(args.get(_LIGER))


CHUNKED_LOSS = ChunkedLossKnob()
