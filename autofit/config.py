"""The training configuration autofit chooses, and the names it accepts.

Precision names are Lightning's (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
``"16-true"``, ``"bf16-true"``); optimizer names are ``TrainingArguments.optim``
names (``"adamw_torch"``, ``"adafactor"``, ``"adamw_bnb_8bit"``, ...), so a chosen
configuration maps one to one onto a ``transformers.TrainingArguments``.

    >>> from autofit import TrainConfig
    >>> TrainConfig(micro_batch_size=4, precision="bf16-mixed").effective_batch_size
    4
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, replace
from typing import Any

from autofit.errors import InvalidConfigError, fix

__all__ = [
    "PRECISIONS",
    "OPTIMIZERS",
    "PrecisionSpec",
    "OptimizerSpec",
    "TrainConfig",
    "parse_optim_args",
    "offload_needs_checkpointing",
]


def offload_needs_checkpointing() -> str:
    """Why activation offloading without checkpointing is refused, and what to do: transformers
    offloads the inputs activation checkpointing keeps (``activation_checkpointing_kwargs=
    {"offload": True}``), nothing without it."""
    return ("activation offloading holds the inputs that gradient checkpointing keeps in host "
            "memory: add " + fix("--gradient-checkpointing", "gradient_checkpointing=True")
            + " or drop " + fix("--activation-offloading", "activation_offloading=True"))


@dataclass(frozen=True)
class PrecisionSpec:
    """What a precision name means for the tensors of a training step."""

    param_dtype: str  # dtype of the parameters the optimizer updates
    compute_dtype: str  # dtype matmuls run in
    autocast: bool  # torch.autocast(compute_dtype) around forward + loss
    grad_scaler: bool  # a GradScaler (fp16) scales the loss and unscales grads
    half: bool  # needs fp16 or bf16 support on the device


# Lightning's precision strings.
PRECISIONS: dict[str, PrecisionSpec] = {
    "32-true": PrecisionSpec("float32", "float32", autocast=False, grad_scaler=False, half=False),
    "16-mixed": PrecisionSpec("float32", "float16", autocast=True, grad_scaler=True, half=True),
    "bf16-mixed": PrecisionSpec("float32", "bfloat16", autocast=True, grad_scaler=False, half=True),
    "16-true": PrecisionSpec("float16", "float16", autocast=False, grad_scaler=False, half=True),
    "bf16-true": PrecisionSpec("bfloat16", "bfloat16", autocast=False, grad_scaler=False, half=True),
}

_PRECISION_ALIASES = {
    "32": "32-true",
    "fp32": "32-true",
    "float32": "32-true",
    "16": "16-mixed",
    "fp16": "16-mixed",
    "bf16": "bf16-mixed",
}


@dataclass(frozen=True)
class OptimizerSpec:
    """How an optimizer's state and step use memory.

    ``state_per_param`` counts full-size states (momentum, variance) kept per
    parameter element; ``state_bits`` is their width (None: the parameter's own
    dtype, as torch's optimizers create states with ``zeros_like(param)``).
    """

    family: str  # "adamw" | "adafactor" | "sgd" | "adagrad" | "rmsprop" | "lion"
    state_per_param: int
    state_bits: int | None = None  # 8 or 32 for bitsandbytes; None = param dtype
    bnb: bool = False  # implemented by bitsandbytes
    paged: bool = False  # states in unified memory that can spill to the host
    fused: bool = False


# TrainingArguments.optim names autofit models; transformers maps each to its class.
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw_torch": OptimizerSpec("adamw", 2),
    "adamw_torch_fused": OptimizerSpec("adamw", 2, fused=True),
    "adafactor": OptimizerSpec("adafactor", 0),  # factored; sized per matrix
    "adamw_bnb_8bit": OptimizerSpec("adamw", 2, state_bits=8, bnb=True),
    "adamw_8bit": OptimizerSpec("adamw", 2, state_bits=8, bnb=True),
    "paged_adamw_8bit": OptimizerSpec("adamw", 2, state_bits=8, bnb=True, paged=True),
    "paged_adamw_32bit": OptimizerSpec("adamw", 2, state_bits=32, bnb=True, paged=True),
    "lion_8bit": OptimizerSpec("lion", 1, state_bits=8, bnb=True),
    "lion_32bit": OptimizerSpec("lion", 1, state_bits=32, bnb=True),
    "paged_lion_8bit": OptimizerSpec("lion", 1, state_bits=8, bnb=True, paged=True),
    "paged_lion_32bit": OptimizerSpec("lion", 1, state_bits=32, bnb=True, paged=True),
    "sgd": OptimizerSpec("sgd", 0),  # 1 with momentum, see TrainConfig.optimizer_states_per_param
    "adagrad": OptimizerSpec("adagrad", 1),
    "rmsprop": OptimizerSpec("rmsprop", 1),  # +1 with momentum, +1 centered
}


def parse_optim_args(optim_args: str | None) -> dict[str, str]:
    """Parse TrainingArguments' ``optim_args`` string (``"momentum=0.9,nesterov=True"``)."""
    if not optim_args:
        return {}
    out: dict[str, str] = {}
    for item in optim_args.replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidConfigError(
                f"optim_args {optim_args!r} is not of the form 'key=value,key=value' "
                "(e.g. 'momentum=0.9')"
            )
        out[key] = value
    return out


def _close(name: str, names: list[str]) -> str:
    near = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    if near:
        return "did you mean " + " or ".join(repr(n) for n in near) + "?"
    return "choose one of " + ", ".join(names)


def normalize_precision(precision: str) -> str:
    """Return the Lightning name of ``precision`` or raise InvalidConfigError."""
    p = str(precision).strip().lower()
    p = _PRECISION_ALIASES.get(p, p)
    if p not in PRECISIONS:
        raise InvalidConfigError(
            f"unknown precision {precision!r}; {_close(p, list(PRECISIONS))}"
        )
    return p


def check_optimizer(optimizer: str) -> str:
    """Return ``optimizer`` if autofit models it, else raise InvalidConfigError."""
    o = str(optimizer).strip().lower()
    if o not in OPTIMIZERS:
        raise InvalidConfigError(
            f"unknown optimizer {optimizer!r}; {_close(o, list(OPTIMIZERS))}"
        )
    return o


@dataclass(frozen=True)
class TrainConfig:
    """One training configuration: what autofit estimates, measures and chooses.

    Args:
        micro_batch_size: samples per forward/backward on one device.
        grad_accum_steps: micro batches accumulated per optimizer step.
        precision: a Lightning precision string (see ``PRECISIONS``).
        gradient_checkpointing: recompute activations in backward (non-reentrant,
            as ``model.gradient_checkpointing_enable()`` does).
        optimizer: a ``TrainingArguments.optim`` name (see ``OPTIMIZERS``).
        optim_args: ``TrainingArguments.optim_args``, e.g. ``"momentum=0.9"``.
        seq_len: sequence length of the worst-case batch, when known.
        world_size: data-parallel processes; estimates are always per device.
        chunked_loss: compute the causal-LM loss without the full (B, T, V) logits
            (``autofit.causal_lm_chunked_loss``; train with ``autofit.ChunkedLossTrainer``).
        activation_offloading: hold the checkpointed blocks' saved inputs in pinned host
            memory (transformers' ``activation_checkpointing_kwargs={"offload": True}``):
            CUDA only, and only with ``gradient_checkpointing`` (transformers offloads
            what checkpointing keeps).
        torch_compile: run the step through ``torch.compile`` (inductor), as
            ``TrainingArguments(torch_compile=True)`` does.

    Example:
        >>> TrainConfig(micro_batch_size=2, grad_accum_steps=8).effective_batch_size
        16
    """

    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    precision: str = "32-true"
    gradient_checkpointing: bool = False
    optimizer: str = "adamw_torch"
    optim_args: str | None = None
    seq_len: int | None = None
    world_size: int = 1
    chunked_loss: bool = False
    activation_offloading: bool = False
    torch_compile: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in ("micro_batch_size", "grad_accum_steps", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.activation_offloading, bool):
            problems.append("activation_offloading must be True or False, "
                            f"got {self.activation_offloading!r}")
        elif self.activation_offloading and not self.gradient_checkpointing:
            problems.append(offload_needs_checkpointing())
        for name in ("chunked_loss", "torch_compile"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.seq_len is not None and (
            isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len <= 0
        ):
            problems.append(f"seq_len must be a positive integer, got {self.seq_len!r}")
        try:
            object.__setattr__(self, "precision", normalize_precision(self.precision))
        except InvalidConfigError as e:
            problems.append(str(e))
        try:
            object.__setattr__(self, "optimizer", check_optimizer(self.optimizer))
        except InvalidConfigError as e:
            problems.append(str(e))
        try:
            parse_optim_args(self.optim_args)
        except InvalidConfigError as e:
            problems.append(str(e))
        if problems:
            raise InvalidConfigError("; ".join(problems))

    @property
    def effective_batch_size(self) -> int:
        """Samples per optimizer step across all devices."""
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    @property
    def precision_spec(self) -> PrecisionSpec:
        return PRECISIONS[self.precision]

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        return OPTIMIZERS[self.optimizer]

    @property
    def optim_kwargs(self) -> dict[str, str]:
        return parse_optim_args(self.optim_args)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
