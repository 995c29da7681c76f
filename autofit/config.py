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
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, TypeAlias

from autofit.errors import InvalidConfigError, fix

if TYPE_CHECKING:
    import torch

__all__ = [
    "PRECISIONS",
    "OPTIMIZERS",
    "UNSIZED_OPTIMIZERS",
    "PrecisionSpec",
    "OptimizerSpec",
    "TrainConfig",
    "parse_optim_args",
    "offload_needs_checkpointing",
    "STRATEGIES",
    "OFFLOADS",
    "normalize_strategy",
    "normalize_offload",
    "strategy_conflict",
    "one_process_strategy",
    "LOSS_IMPLS",
    "COMPILE_MODES",
    "QuantRequest",
    "ModelSpec",
    "Batch",
    "ModelSource",
    "Progress",
    "Collator",
]

# The types the stages hand each other besides the dataclasses below (annotations only:
# naming them imports neither torch nor transformers).
Batch: TypeAlias = "dict[str, torch.Tensor]"  # one micro batch: (B, T) input_ids, labels, ...
ModelSource: TypeAlias = "str | os.PathLike[str] | torch.nn.Module"  # a reference or a module
Progress: TypeAlias = Callable[[str], None]  # hears one line at a time
Collator: TypeAlias = "Callable[[list[dict[str, object]]], dict[str, torch.Tensor]]"  # rows -> Batch


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

    family: str  # "adamw" | "adafactor" | "sgd" | "adagrad" | "rmsprop" | "lion" | "ademamix"
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
    "rmsprop_bnb": OptimizerSpec("rmsprop", 1, state_bits=32, bnb=True),
    "rmsprop_bnb_32bit": OptimizerSpec("rmsprop", 1, state_bits=32, bnb=True),
    "rmsprop_bnb_8bit": OptimizerSpec("rmsprop", 1, state_bits=8, bnb=True),
    # AdEMAMix: two first moments (fast and slow, one (2, *shape) state) and the variance
    "ademamix": OptimizerSpec("ademamix", 3, state_bits=32, bnb=True),
    "ademamix_8bit": OptimizerSpec("ademamix", 3, state_bits=8, bnb=True),
    "paged_ademamix_32bit": OptimizerSpec("ademamix", 3, state_bits=32, bnb=True, paged=True),
    "paged_ademamix_8bit": OptimizerSpec("ademamix", 3, state_bits=8, bnb=True, paged=True),
}

# TrainingArguments.optim names autofit does not size, and why: a user's file naming one
# is refused in one line that says so (not "unknown"). With OPTIMIZERS, every name of
# transformers' OptimizerNames (tests/test_config.py holds the two to it).
UNSIZED_OPTIMIZERS: dict[str, str] = {
    **dict.fromkeys(("galore_adamw", "galore_adamw_8bit", "galore_adafactor",
                     "galore_adamw_layerwise", "galore_adamw_8bit_layerwise",
                     "galore_adafactor_layerwise", "apollo_adamw", "apollo_adamw_layerwise"),
                    "its states are low-rank projections per target module"),
    **dict.fromkeys(("lomo", "adalomo"), "it updates the weights inside the backward pass"),
    **dict.fromkeys(("adamw_torch_4bit", "adamw_torch_8bit"), "its states are torchao's "
                    "quantized tensors"),
    **dict.fromkeys(("schedule_free_adamw", "schedule_free_radam", "schedule_free_sgd",
                     "grokadamw", "stable_adamw", "adamw_anyprecision"),
                    "its package's states and step were never measured"),
    **dict.fromkeys(("adamw_torch_xla", "adamw_torch_npu_fused"),
                    "it runs on devices autofit does not plan for"),
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


# How the ranks hold the model: name -> (family, what each rank keeps whole). "ddp" is also
# the single process (nothing is sharded).
STRATEGIES: dict[str, str] = {
    "ddp": "DDP: a full replica of parameters, gradients and optimizer states per rank",
    "fsdp": "FSDP2 fully_shard: parameters, gradients and optimizer states sharded; each "
            "unit's parameters gathered for its forward and again for its backward",
    "fsdp-shard-grad-op": "FSDP2 fully_shard(reshard_after_forward=False): sharded, but "
                          "each unit keeps its gathered parameters from forward to backward",
    "hsdp": "FSDP2 hybrid: sharded within a node, replicated across nodes",
    "zero1": "DeepSpeed ZeRO-1: optimizer states partitioned",
    "zero2": "DeepSpeed ZeRO-2: optimizer states and gradients partitioned",
    "zero3": "DeepSpeed ZeRO-3: optimizer states, gradients and parameters partitioned",
}
_STRATEGY_ALIASES = {"fsdp2": "fsdp", "full_shard": "fsdp", "full-shard": "fsdp",
                     "shard_grad_op": "fsdp-shard-grad-op", "shard-grad-op": "fsdp-shard-grad-op",
                     "hybrid_shard": "hsdp", "hybrid": "hsdp", "no_shard": "ddp",
                     "zero-1": "zero1", "zero-2": "zero2", "zero-3": "zero3"}
# whose loss the step computes: the model's (or autofit's chunked one), or TRL's fused LM head
LOSS_IMPLS: tuple[str, ...] = ("model", "trl")
# torch.compile's modes (TrainingArguments.torch_compile_mode); None: inductor's default
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune",
                                  "max-autotune-no-cudagraphs")
# what a sharded strategy keeps in host memory
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
_OFFLOAD_ALIASES = {"": "none", "no": "none", "false": "none", "cpu": "optimizer+params",
                    "params": "optimizer+params", "optimizer+param": "optimizer+params",
                    "param+optimizer": "optimizer+params", "params+optimizer": "optimizer+params"}


def normalize_strategy(strategy: str) -> str:
    """The name of ``strategy`` in ``STRATEGIES`` or raise InvalidConfigError.

        >>> normalize_strategy("ZeRO-3"), normalize_strategy("full_shard")
        ('zero3', 'fsdp')
    """
    s = str(strategy).strip().lower()
    s = _STRATEGY_ALIASES.get(s, s)
    if s not in STRATEGIES:
        raise InvalidConfigError(f"unknown strategy {strategy!r}; {_close(s, list(STRATEGIES))}")
    return s


def normalize_offload(offload: str | None) -> str:
    """The name of ``offload`` in ``OFFLOADS`` or raise InvalidConfigError."""
    o = "none" if offload is None or offload is False else str(offload).strip().lower()
    o = _OFFLOAD_ALIASES.get(o, o)
    if o not in OFFLOADS:
        raise InvalidConfigError(f"unknown offload {offload!r}; {_close(o, list(OFFLOADS))}")
    return o


def strategy_conflict(strategy: str, offload: str, nnodes: int = 1) -> str | None:
    """Why ``strategy`` cannot run with ``offload`` (on ``nnodes`` nodes), or None.

        >>> strategy_conflict("zero2", "optimizer+params")
        "offloading parameters needs ZeRO-3: use strategy='zero3' or offload='optimizer'"
    """
    if offload == "none":
        return None
    if strategy == "ddp":
        return (f"DDP keeps everything on the device; offloading ({offload}) needs a sharded "
                "strategy: use " + fix("--strategy zero2 or fsdp", "strategy='zero2' or 'fsdp'")
                + " or " + fix("--offload none", "offload='none'"))
    if strategy in ("zero1", "zero2") and offload == "optimizer+params":
        return ("offloading parameters needs ZeRO-3: use "
                + fix("--strategy zero3", "strategy='zero3'") + " or "
                + fix("--offload optimizer", "offload='optimizer'"))
    if strategy.startswith(("fsdp", "hsdp")) and offload == "optimizer":
        return ("FSDP2 offloads parameters, gradients and optimizer states together "
                "(CPUOffloadPolicy): use " + fix("--offload optimizer+params",
                                                 "offload='optimizer+params'")
                + ", or a ZeRO strategy to offload the optimizer alone")
    return None


def one_process_strategy(strategy: str | Sequence[str] | None, world_size: int) -> None:
    """Raise when a sharding strategy is asked for one process (nothing to shard: the run
    would be DDP of one, silently).

        >>> one_process_strategy("ddp", 1)
        >>> one_process_strategy("fsdp", 2)
    """
    names = [strategy] if isinstance(strategy, str) else list(strategy or ())
    asked = [normalize_strategy(s) for s in names]
    if world_size == 1 and any(s != "ddp" for s in asked):
        shown = ", ".join(s for s in asked if s != "ddp")
        raise InvalidConfigError(
            f"strategy {shown} shards over several processes, but the run has one: add "
            + fix("--nproc-per-node N", "nproc_per_node=N") + " (the processes torchrun "
            "starts), or drop " + fix("--strategy", "strategy="))


def check_optimizer(optimizer: str) -> str:
    """Return ``optimizer`` if autofit models it, else raise InvalidConfigError."""
    o = str(optimizer).strip().lower()
    if o in UNSIZED_OPTIMIZERS:
        raise InvalidConfigError(
            f"optimizer {o!r} is one autofit cannot size yet ({UNSIZED_OPTIMIZERS[o]}): "
            "tune with one it sizes (adamw_torch_fused, adamw_bnb_8bit, adafactor, "
            "lion_8bit, ...)")
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
        world_size: data-parallel processes in all (``nproc_per_node * nnodes``; given
            alone, it is that many processes on one node); estimates are per device (rank).
        nproc_per_node: processes (devices) per node, as ``torchrun --nproc-per-node``.
        nnodes: nodes, as ``torchrun --nnodes``.
        strategy: how the ranks hold the model (see ``STRATEGIES``): ``"ddp"`` (a full
            replica per rank; also a single process), ``"fsdp"`` (FSDP2 ``fully_shard``,
            resharded after forward), ``"fsdp-shard-grad-op"`` (FSDP2 keeping the
            unsharded parameters from forward to backward), ``"hsdp"`` (FSDP2 sharded
            within a node, replicated across nodes), ``"zero1"`` / ``"zero2"`` /
            ``"zero3"`` (DeepSpeed ZeRO stages).
        offload: what a sharded strategy keeps in host memory (see ``OFFLOADS``):
            ``"none"``, ``"optimizer"`` (ZeRO ``offload_optimizer``), or
            ``"optimizer+params"`` (ZeRO-3 ``offload_param`` too; FSDP2's
            ``CPUOffloadPolicy``, which offloads parameters, gradients and states).
        chunked_loss: compute the causal-LM loss without the full (B, T, V) logits
            (``autofit.causal_lm_chunked_loss``; train with ``autofit.ChunkedLossTrainer``).
        activation_offloading: hold the checkpointed blocks' saved inputs in pinned host
            memory (transformers' ``activation_checkpointing_kwargs={"offload": True}``):
            CUDA only, and only with ``gradient_checkpointing`` (transformers offloads
            what checkpointing keeps).
        torch_compile: run the step through ``torch.compile`` (inductor), as
            ``TrainingArguments(torch_compile=True)`` does.
        torch_compile_mode: its mode (``COMPILE_MODES``; None: the default), as
            ``TrainingArguments.torch_compile_mode``. Not searched: the user's (their
            ``training_args``, ``--torch-compile-mode``). On a CUDA card the modes that
            capture CUDA graphs (``reduce-overhead``, ``max-autotune``) keep a private memory
            pool that the estimates do not model: refused there (``UnmodelledStepError``).
        torch_compile_regional: compile each repeated block apart (accelerate's regional
            compilation, ``compile_regions``: an accelerate config's
            ``dynamo_use_regional_compilation: true`` or ``accelerate launch
            --dynamo_use_regional_compilation``, which the Trainer follows): the blocks save
            what a whole compile saves, but the head, the loss and the model's own code run
            eagerly, keeping the eager loss's buffers (a whole compile fuses them). Not
            searched: the user's launch recipe. Needs ``torch_compile``.
        liger_kernels: liger-kernel's RMSNorm, SwiGLU and RoPE kernels in the model's place
            (``use_liger_kernel`` with ``liger_kernel_config``; ``autofit.knobs.liger``):
            CUDA only, llama / mistral / qwen2 / qwen3 decoders.
        loss_impl: whose loss the step computes: ``"model"`` (the model's forward with
            labels, or autofit's chunked loss) or ``"trl"`` (TRL's fused LM head, as
            ``trl.SFTTrainer`` runs it: ``autofit.knobs.trl_loss``). Not searched: set from
            the user's ``training_args`` (an ``SFTConfig``).

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
    torch_compile_mode: str | None = None
    torch_compile_regional: bool = False
    liger_kernels: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    strategy: str = "ddp"
    offload: str = "none"
    loss_impl: str = "model"

    def __post_init__(self) -> None:
        problems = []
        for name in ("micro_batch_size", "grad_accum_steps", "world_size", "nproc_per_node",
                     "nnodes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                problems.append(f"{name} must be a positive integer, got {v!r}")
        if not problems:
            problems += self._check_ranks()
        if not isinstance(self.activation_offloading, bool):
            problems.append("activation_offloading must be True or False, "
                            f"got {self.activation_offloading!r}")
        elif self.activation_offloading and not self.gradient_checkpointing:
            problems.append(offload_needs_checkpointing())
        for name in ("chunked_loss", "torch_compile", "torch_compile_regional", "liger_kernels"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.torch_compile_regional is True and self.torch_compile is not True:
            problems.append("torch_compile_regional=True needs torch_compile=True")
        if self.torch_compile_mode is not None:
            if self.torch_compile_mode not in COMPILE_MODES:
                problems.append(f"torch_compile_mode must be one of {', '.join(COMPILE_MODES)}, "
                                f"got {self.torch_compile_mode!r}")
            elif self.torch_compile is not True:
                problems.append(f"torch_compile_mode={self.torch_compile_mode!r} needs "
                                "torch_compile=True")
        if self.loss_impl not in LOSS_IMPLS:
            problems.append(f"loss_impl must be one of {', '.join(LOSS_IMPLS)}, "
                            f"got {self.loss_impl!r}")
        elif self.loss_impl == "trl" and self.chunked_loss:
            problems.append("chunked_loss cannot be combined with loss_impl='trl' (TRL's "
                            "fused LM head already computes the loss without full logits)")
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

    def _check_ranks(self) -> list[str]:
        """Reconcile ``world_size`` with ``nproc_per_node * nnodes`` and check the strategy
        and its offload (problems as lines)."""
        ranks = self.nproc_per_node * self.nnodes
        if ranks == 1 and self.world_size > 1:  # world_size alone: one node
            object.__setattr__(self, "nproc_per_node", self.world_size)
        elif self.world_size == 1 and ranks > 1:
            object.__setattr__(self, "world_size", ranks)
        elif self.world_size != ranks:
            return [f"world_size {self.world_size} is not nproc_per_node x nnodes = "
                    f"{self.nproc_per_node} x {self.nnodes}; give one or the other"]
        try:
            object.__setattr__(self, "strategy", normalize_strategy(self.strategy))
            object.__setattr__(self, "offload", normalize_offload(self.offload))
        except InvalidConfigError as e:
            return [str(e)]
        why = strategy_conflict(self.strategy, self.offload, self.nnodes)
        return [why] if why else []

    @property
    def sharded(self) -> bool:
        """Whether the ranks shard model state (FSDP or ZeRO) across more than one rank."""
        return self.world_size > 1 and self.strategy != "ddp"

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


@dataclass(frozen=True)
class QuantRequest:
    """How the caller asked for the base to be quantized, as given (``load_in_4bit=``,
    ``load_in_8bit=``, ``quantization_config=``): ``autofit.probe.quant.resolve`` turns it
    into a ``QuantSpec`` for a device (a 4-bit base computes in fp16 without bf16)."""

    load_in_4bit: bool = False
    load_in_8bit: bool = False
    quantization_config: Any = None  # BitsAndBytesConfig | dict | path to a JSON file


@dataclass(frozen=True)
class ModelSpec:
    """What the model is: the reference and how to build it (task, attention, PEFT adapter,
    quantized base). The public functions build it once from their keywords
    (``autofit.trial.model.model_spec``, which validates them); every stage reads it, and
    a trial child rebuilds the model from it (``autofit.trial.model.materialize``).

        >>> ModelSpec("tiny-llama", task="causal-lm").lora is None
        True
    """

    ref: Any  # a name, hub id, directory or config.json path (str), or an nn.Module
    task: str | None = None  # None: from the model's config
    attn_implementation: str | None = None  # "eager" / "sdpa", for a model built by name
    lora: Any = None  # an adapter request: LoraSpec | dict | PeftConfig | path (probe.model)
    quant: Any = None  # autofit.probe.quant.QuantSpec of a quantized base, or None
    quant_request: QuantRequest = QuantRequest()  # what ``quant`` was resolved from
