"""The activation offloading knob: the checkpointed blocks' saved inputs in pinned host memory.

    >>> class C: gradient_checkpointing = activation_offloading = True
    >>> args = {"activation_checkpointing_kwargs": {"use_reentrant": False}}
    >>> OFFLOADING.emit(C(), args); args["activation_checkpointing_kwargs"]
    {'use_reentrant': False, 'offload': True}
    >>> OFFLOADING.read(dict(args, activation_checkpointing=True))
    True

What transformers (5.x) does with ``activation_checkpointing_kwargs={"offload": True}``
(``PreTrainedModel.activation_checkpointing_enable(offload=True)``): every checkpointed
call runs under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so what the
checkpoint saves — the tensors passed positionally to each checkpointed block, i.e. its
(B, T, h) input hidden states — is copied into pinned host memory in the forward and back
onto the device, one block at a time, when backward recomputes that block (T5 blocks
also take the encoder's output and the position biases positionally: those are packed
too, one copy per block). Everything else stays on the device: the recomputed activations
(one block at a time, as with checkpointing alone), the keyword inputs (position
embeddings, masks), the loss's activations outside the blocks, and a tensor something
else still holds (with a frozen embedding, the embedding's output, which autograd keeps
as a leaf, is a llama-like first block's input: packed, yet still on the device). Pinned
memory comes from torch's host caching allocator, which rounds every block up to a power
of two and keeps it for the next step.

It needs gradient checkpointing (transformers offloads nothing without it:
``TrainConfig`` refuses the combination, the search never builds it) and a CUDA device
(on a CPU the activations are in host memory already: ``check`` refuses it with one line).

It changes no math, but every step copies the offloaded inputs to the host and back over
the host link, on the compute stream (``autofit.search.speed``): it is searched only when
asked (``activation_offloading=True`` / ``[False, True]``, ``--activation-offloading``),
and offered by "nothing fits" on a CUDA device (``suggest``). It is not a ``saving``
value: the "nothing fits" estimates of LoRA and the like do not assume it.

TRL's ``SFTConfig(activation_offloading=True)`` is another mechanism (every saved tensor
of the step above 1 KiB, parameters excepted, streamed to the host, without
checkpointing); autofit does not model it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from autofit.errors import BadInputError, MissingDependencyError, fix
from autofit.knobs.base import OnOffKnob
from autofit.knobs.checkpointing import checkpoint_kwargs as _kwargs
from autofit.knobs.checkpointing import field_name

if TYPE_CHECKING:
    from autofit.config import TrainConfig
    from autofit.knobs.base import Costs, KnobValue, StepContext
    from autofit.probe.device import DeviceInfo

__all__ = ["OFFLOADING", "OffloadingKnob", "transformers_offloads"]

_KEY = "offload"  # the key of activation_checkpointing_kwargs transformers pops


@lru_cache(maxsize=1)
def transformers_offloads() -> bool:
    """Whether the installed transformers' ``activation_checkpointing_enable`` takes ``offload``."""
    import inspect

    from transformers import PreTrainedModel

    enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None)
    return enable is not None and "offload" in inspect.signature(enable).parameters


class OffloadingKnob(OnOffKnob):
    name = "activation_offloading"
    title = "offl"  # the candidates table: 4 columns wide, as "ckpt"
    # it writes a key ("offload") into the checkpointing knob's kwargs field (5.x / 4.x name)
    fields = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
    saving = None  # it costs speed: offered when nothing fits (suggest), never assumed
    calibrates_apart = True  # the activations' share of the peak differs with and without it
    option = "activation-offloading"
    help_on = "always offload the checkpointed activations to host memory (CUDA)"
    help_off = "never offload activations"
    help_one = "hold the checkpointed activations in host memory (CUDA, with checkpointing)"

    def defaults(self, device: DeviceInfo) -> tuple[tuple[bool, ...], str | None]:
        return (False,), None  # only when asked: it costs host transfers every step

    def check(self, device: DeviceInfo, value: bool, run: bool = True) -> None:
        """Raise ``BadInputError`` when ``value`` is on and ``device`` is not a CUDA device,
        ``MissingDependencyError`` when the installed transformers cannot offload."""
        if not value:
            return
        if device.kind != "cuda":
            raise BadInputError(
                f"activation offloading moves activations from a CUDA device to host memory; "
                f"on {device.name} they are in host memory already: drop "
                + fix("--activation-offloading", "activation_offloading=True")
                + " (or plan for a card: " + fix("--device H100-80GB", "device='H100-80GB'") + ")")
        if not transformers_offloads():
            import transformers

            raise MissingDependencyError(
                f"transformers {transformers.__version__} cannot offload activations "
                "(activation_checkpointing_kwargs 'offload' came with transformers 5): upgrade "
                "it or drop " + fix("--activation-offloading", "activation_offloading=True"))

    def conflict(self, choice: dict[str, KnobValue]) -> str | None:
        """Why ``choice`` (knob name -> value) cannot be trained, or None."""
        if choice.get(self.name) and not choice.get("gradient_checkpointing", False):
            from autofit.config import offload_needs_checkpointing

            return offload_needs_checkpointing()
        return None

    def suggest(self, device: DeviceInfo) -> tuple[bool, ...]:
        return (True,) if device.kind == "cuda" else ()

    def describe(self, value: bool) -> str:
        return "activations offloaded" if value else "activations on device"

    def short(self, value: bool) -> str:
        return "yes" if value else "no"

    def note(self, value: bool) -> str | None:
        if not value:
            return None
        return ("activation offloading: the checkpointed activations live in pinned host "
                "memory (the estimate's host_bytes); each step copies them to the host and back")

    def reason(self, config: TrainConfig, costs: Costs) -> str | None:
        """What chosen activation offloading saves on the device, the host memory it needs
        and the time its copies take, by the closed form and the speed model."""
        if not config.activation_offloading:
            return None
        from autofit.probe.device import format_bytes as _gib

        on = costs.device_bytes(config)
        off_cfg = config.replace(activation_offloading=False)
        off = costs.device_bytes(off_cfg)
        slower = 1 - costs.tokens_per_s(config) / max(costs.tokens_per_s(off_cfg), 1e-9)
        return (f"activation offloading: saves ~{_gib(off - on)} of device memory "
                f"at micro batch {config.micro_batch_size} (estimated {_gib(off)} -> "
                f"{_gib(on)}), needs ~{_gib(costs.host_bytes(config))} of pinned host memory, "
                f"~{100 * slower:.0f}% slower (host copies)")

    def step_seconds(self, ctx: StepContext) -> float:
        """Each checkpointed block's input to pinned host memory and back, on the compute
        stream (0 without offloading: nothing is offloaded)."""
        return 2 * ctx.offloaded_bytes / ctx.host_link

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        # after the checkpointing knob (registry order), which writes the kwargs afresh
        name = f"{field_name()}_kwargs"
        if getattr(config, self.name, False) and getattr(config, "gradient_checkpointing", False):
            args[name] = {**_kwargs(args, name), _KEY: True}
        elif isinstance(args.get(name), (dict, str)):
            kw = _kwargs(args, name)
            if kw.pop(_KEY, None) is not None:
                args[name] = kw

    def read(self, args: dict[str, object]) -> bool:
        # transformers offloads only where it checkpoints
        for ckpt in ("activation_checkpointing", "gradient_checkpointing"):
            if args.get(ckpt) and _kwargs(args, f"{ckpt}_kwargs").get(_KEY):
                return True
        return False


OFFLOADING = OffloadingKnob()
