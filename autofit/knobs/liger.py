"""The Liger kernels knob: liger-kernel's Triton RMSNorm, SwiGLU and RoPE in the model's place.

    >>> class C: liger_kernels, chunked_loss = True, False
    >>> args = {}; LIGER.emit(C(), args); args["use_liger_kernel"]
    True
    >>> sorted(k for k, v in args["liger_kernel_config"].items() if v)  # the rest named off
    ['rms_norm', 'rope', 'swiglu']
    >>> LIGER.read(args), LIGER.read({"use_liger_kernel": True})
    (True, True)

What ``TrainingArguments(use_liger_kernel=True, liger_kernel_config={...})`` makes every
``transformers.Trainer`` do before training (``transformers.integrations.liger.
apply_liger_kernel``, liger's ``_apply_liger_kernel_to_instance``) to the decoders autofit
models it for (``MODEL_TYPES``: llama, mistral, qwen2, qwen3, whose liger patch is the same):

* every RMSNorm of the decoder (each layer's two and the final norm) runs
  ``LigerRMSNormFunction``: one output in the input's dtype and a float32 ``rstd`` per row,
  saving the input, the weight and ``rstd`` (transformers' RMSNorm keeps a float32 copy of a
  16-bit input, the normalised float32 tensor and its 16-bit cast); its backward writes the
  input's gradient into the incoming gradient (``in_place``) and sums the weight's gradient
  from an (SMs, h) float32 scratch;
* every MLP runs ``down_proj(LigerSiLUMulFunction(gate_proj(x), up_proj(x)))``: the product
  in one kernel that saves the two projections only (``act_fn(gate) * up`` keeps the
  activation's output too), whose backward writes both gradients into their storage;
* the rotary embedding rotates q and k in place (``LigerRopeFunction``, saving ``cos`` and
  ``sin``), without ``rotate_half``'s copies (liger replaces the modeling module's
  ``apply_rotary_pos_emb``: for the whole process).

**The memory rule** is those allocations: the simulated step, and the analytic
coefficients derived from it, run the model with stand-ins (``emulated``) that allocate
and save what liger's functions do, checked against liger's own published per-kernel
measurements (``benchmarks/liger_check.py``, ``benchmarks/results/liger_check.md``). A
trial on a CUDA card runs liger itself, as the Trainer applies it, in a subprocess (liger
patches transformers' modules for the whole process: ``isolates``).

The fused linear cross entropy (no (B, T, V) logits) is the chunked loss knob's value on a
GPU (``autofit.knobs.chunked_loss``); both write their keys of one ``liger_kernel_config``,
this knob last (registry order), so the file turns on exactly the kernels chosen.

It computes the same functions (rounding aside), so both values are searched where it can
run: a CUDA device with liger-kernel installed. On a CPU it is refused (Triton GPU
kernels); for a card planned from a machine without liger it is estimated when asked
(``--liger-kernels``) and the note says to install it where the run trains. The speed model
gives it no term (the fused kernels' saved memory passes are not modelled): the search
picks it for the batch it lets fit, not for speed.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

from autofit.errors import BadInputError, MissingDependencyError, fix
from autofit.knobs.base import OnOffKnob, asks_on, installed, training_arguments_fields

if TYPE_CHECKING:
    import torch

    from autofit.config import TrainConfig
    from autofit.knobs.base import Costs, Scope
    from autofit.probe.device import DeviceInfo

__all__ = ["FLAGS", "LIGER", "LigerKnob", "MODEL_TYPES", "emulated", "liger_keys",
           "liger_as_run", "patches_loss", "unsupported_reason"]

USE, CONFIG = "use_liger_kernel", "liger_kernel_config"
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # liger patches each alike (monkey_patch.py)
_KERNELS = ("rms_norm", "swiglu", "rope")  # this knob's keys; the loss's is the chunked loss's


# every kernel flag of liger's apply_liger_kernel_to_* functions (monkey_patch.py, 2026), most
# on by default: the file names each, so that only the kernels planned run (Gemma's GeGLU
# too when only the fused loss is chosen)
FLAGS = ("fused_linear_cross_entropy", "cross_entropy", "rms_norm", "swiglu", "rope",
         "layer_norm", "geglu", "relu_squared")


def liger_keys(args: dict[str, object], *, keep: tuple[str, ...] = (), **keys: bool) -> None:
    """Set ``keys`` in ``args``' ``liger_kernel_config`` and every other flag liger has to off,
    but those named in ``keep`` (what another knob wrote), with ``use_liger_kernel`` on while
    any kernel is; none on: both fields dropped. The user's own flags are replaced: the
    file runs the kernels planned."""
    old = _config_of(args)
    cfg = {k: old[k] for k in keep if k in old}
    cfg.update(keys)
    for flag in FLAGS:
        cfg.setdefault(flag, False)
    on = [k for k in FLAGS if cfg.get(k)]
    if on:
        args[USE], args[CONFIG] = True, cfg
    else:
        args.pop(USE, None)
        args.pop(CONFIG, None)


def _config_of(args: dict[str, object]) -> dict[str, object]:
    cfg = args.get(CONFIG)
    if isinstance(cfg, str):
        import json

        with contextlib.suppress(ValueError):
            cfg = json.loads(cfg)
    return cfg if isinstance(cfg, dict) else {}


def kernel_on(args: dict[str, object], key: str) -> bool:
    """Whether ``args`` run liger's ``key`` kernel (liger's default for a missing key: on)."""
    return bool(args.get(USE)) and bool(_config_of(args).get(key, True))


def _base(module: torch.nn.Module) -> torch.nn.Module:
    """The decoder liger patches: the PEFT wrapper's model, then its ``base_model_prefix``."""
    get_base = getattr(module, "get_base_model", None)
    model = get_base() if callable(get_base) else module
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


def _model_type(module: torch.nn.Module) -> str | None:
    """The model type of the decoder liger patches (None: no config says)."""
    return getattr(getattr(_base(module), "config", None), "model_type", None)


def unsupported_reason(module: torch.nn.Module) -> str | None:
    """Why autofit cannot model liger's kernels for ``module`` (None: it can)."""
    config = getattr(_base(module), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return (f"autofit models liger's kernels for {', '.join(MODEL_TYPES)}, not model type "
                f"{model_type!r}")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"liger's SwiGLU needs a silu activation, not {config.hidden_act!r}"
    return None


def patches_loss(module: torch.nn.Module) -> bool:
    """Whether ``use_liger_kernel`` swaps ``module``'s loss for liger's fused linear cross
    entropy: liger patches a model type of its own table
    (``liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN``, where
    liger-kernel is installed; else the types autofit models liger for, the safe side) and
    leaves any other as it is, computing the model's own loss over the full logits
    (GPT-2's, BERT's).

        >>> from autofit.probe.model import build_model
        >>> patches_loss(build_model("tiny-llama")[0]), patches_loss(build_model("tiny-gpt2")[0])
        (True, False)
    """
    model_type = _model_type(module)
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return model_type in MODEL_TYPES
    return model_type in MODEL_TYPE_TO_APPLY_LIGER_FN


def liger_as_run(config: TrainConfig, module: torch.nn.Module, name: str, *,
                 liger_loss: bool) -> tuple[TrainConfig, str | None]:
    """``config`` as a file's ``use_liger_kernel`` runs on ``module`` (named ``name``), and
    why it differs (None: it does not). ``liger_loss``: ``config``'s chunked loss is liger's
    fused loss (under a plain or TRL trainer; ChunkedLossTrainer's runs on any model). On a
    model liger patches nothing in, neither liger's kernels nor its loss run: the model's
    own loss over the full logits does (GPT-2 in bf16 at 8 x 512 tokens: 2.9 GiB, where the
    chunked loss would hold 0.6)."""
    loss = liger_loss and config.chunked_loss
    if not (loss or config.liger_kernels) or patches_loss(module):
        return config, None
    model_type = _model_type(module)
    return config.replace(chunked_loss=config.chunked_loss and not loss, liger_kernels=False), (
        f"use_liger_kernel: liger patches nothing in {name} (model type {model_type!r}), "
        "so its own loss over the full logits runs: estimated so")


@contextlib.contextmanager
def emulated(module: torch.nn.Module, *, rms_norm: bool = True, swiglu: bool = True,
             rope: bool = True) -> Iterator[None]:
    """While inside, ``module`` (autofit's own copy: the simulated step's fake clone) runs
    the stand-ins of liger's kernels where liger's patch puts them (the final norm, each
    layer's two norms and MLP; the modeling module's ``apply_rotary_pos_emb``); everything
    is put back on the way out.

        >>> from autofit.probe.model import build_model
        >>> m, _ = build_model("tiny-llama")
        >>> with emulated(m):
        ...     type(m.model.layers[0].mlp.forward).__name__
        'method'
        >>> "forward" in vars(m.model.layers[0].mlp)
        False
    """
    if (why := unsupported_reason(module)) is not None:
        raise BadInputError(f"liger kernels: {why}; drop "
                            + fix("--liger-kernels", "liger_kernels=True"))
    from autofit.knobs._liger_stand_ins import rms_norm_forward, rope, swiglu_forward

    base = _base(module)
    bound: list[torch.nn.Module] = []

    def bind(m: torch.nn.Module, fn: types.FunctionType) -> None:
        m.forward = types.MethodType(fn, m)
        bound.append(m)

    modeling = importlib.import_module(f"transformers.models.{base.config.model_type}."
                                       f"modeling_{base.config.model_type}")
    old_rope = modeling.apply_rotary_pos_emb
    try:
        if rms_norm:
            bind(base.norm, rms_norm_forward)
        for layer in base.layers:
            if swiglu:
                bind(layer.mlp, swiglu_forward)
            if rms_norm:
                bind(layer.input_layernorm, rms_norm_forward)
                bind(layer.post_attention_layernorm, rms_norm_forward)
        if rope:
            modeling.apply_rotary_pos_emb = rope
        yield
    finally:
        modeling.apply_rotary_pos_emb = old_rope
        for m in bound:
            vars(m).pop("forward", None)


class LigerKnob(OnOffKnob):
    name = "liger_kernels"
    title = "lgr"  # the candidates table (narrow: 80 columns in all)
    fields = (USE, CONFIG)
    saving = None  # it needs liger-kernel and a CUDA card: offered (suggest), never assumed
    calibrates_apart = True  # the activations' share of the peak differs with and without it
    option = "liger-kernels"
    help_on = "always use liger's RMSNorm / SwiGLU / RoPE kernels (CUDA, liger-kernel)"
    help_off = "never use liger's kernels"
    help_one = "liger's RMSNorm / SwiGLU / RoPE kernels (use_liger_kernel; CUDA)"

    def defaults(self, device: DeviceInfo) -> tuple[tuple[bool, ...], str | None]:
        if device.kind == "cuda" and installed("liger_kernel") and CONFIG in training_arguments_fields():
            return (False, True), None
        return (False,), None

    def check(self, device: DeviceInfo, value: bool, run: bool = True) -> None:
        """Raise ``BadInputError`` for liger on a device that is not a CUDA GPU,
        ``MissingDependencyError`` for a trial (on a present card) without liger-kernel or
        for a transformers without ``liger_kernel_config``."""
        if not value:
            return
        if device.kind != "cuda":
            raise BadInputError(
                f"liger's kernels are Triton GPU kernels; {device.name} cannot run them: drop "
                + fix("--liger-kernels", "liger_kernels=True") + " (or plan for a card: "
                + fix("--device H100-80GB", "device='H100-80GB'") + ")")
        if CONFIG not in training_arguments_fields():
            import transformers

            raise MissingDependencyError(
                f"transformers {transformers.__version__} has no liger_kernel_config (the kernels "
                "cannot be chosen one by one): upgrade it or drop "
                + fix("--liger-kernels", "liger_kernels=True"))
        if run and getattr(device, "present", False) and not installed("liger_kernel"):
            raise MissingDependencyError(
                "a trial of liger's kernels needs liger-kernel: pip install 'autofit[liger]' "
                "(or estimate only: " + fix("--method analytic", "method='analytic'") + ")")

    def is_choice(self, loss_impl: str = "model", trainer: str | None = None) -> bool:
        """Not where TRL's loss runs (SFTTrainer turns liger's loss on with the same field)."""
        return loss_impl != "trl"

    def narrow(self, asked: object, scope: Scope) -> object:
        """As asked, or False (with the reason) for a model autofit cannot model liger for
        (asked for such a model: ``BadInputError``) or where TRL's loss runs."""
        wants = asks_on(asked)
        if scope.loss_impl == "trl":
            if wants:
                raise BadInputError("liger kernels: training_args is an SFTConfig, whose "
                                    "SFTTrainer also swaps its loss for liger's with "
                                    "use_liger_kernel; drop "
                                    + fix("--liger-kernels", "liger_kernels=True"))
            return False
        if (why := unsupported_reason(scope.module)) is not None:
            self.check_model(wants, scope.module, scope.task)
            if scope.device.kind == "cuda":
                scope.reasons.append(f"no liger kernels: {why}")
            return False
        return asked

    def check_model(self, value: bool, module: torch.nn.Module, task: str) -> None:
        """Raise ``BadInputError`` when liger's kernels are asked for a model autofit cannot
        model them for."""
        if value and (why := unsupported_reason(module)) is not None:
            raise BadInputError(f"liger kernels: {why}; drop "
                                + fix("--liger-kernels", "liger_kernels=True"))

    def suggest(self, device: DeviceInfo) -> tuple[bool, ...]:
        return (True,) if device.kind == "cuda" and installed("liger_kernel") else ()

    def describe(self, value: bool) -> str:
        return "liger kernels" if value else "no liger kernels"

    def short(self, value: bool) -> str:
        return "yes" if value else "no"

    def note(self, value: bool) -> str | None:
        if not value:
            return None
        return ("liger kernels: the Trainer applies them from use_liger_kernel / "
                "liger_kernel_config; pip install liger-kernel where the run trains")

    def reason(self, config: TrainConfig, costs: Costs) -> str | None:
        """What chosen liger kernels save, by the closed form."""
        if not config.liger_kernels:
            return None
        from autofit.probe.device import format_bytes as _gib

        on = costs.device_bytes(config)
        off = costs.device_bytes(config.replace(liger_kernels=False))
        return (f"liger kernels: save ~{_gib(off - on)} at micro batch {config.micro_batch_size} "
                f"(estimated {_gib(off)} -> {_gib(on)}: RMSNorm, SwiGLU and RoPE keep fewer "
                "activations)")

    def stand_ins(self, config: TrainConfig, module: torch.nn.Module
                  ) -> contextlib.AbstractContextManager[None] | None:
        """The memory rule: liger's stand-ins on autofit's simulated copy of the model while
        inside (None: off, or a model autofit does not model liger for, estimated as it is:
        liger applies nothing to a model type outside its table, and its kernels only ever
        keep less, so a user's ``use_liger_kernel`` there is planned on the safe side)."""
        if not getattr(config, self.name, False) or unsupported_reason(module) is not None:
            return None
        return emulated(module)

    def prepare(self, config: TrainConfig, module: torch.nn.Module) -> None:
        """What the Trainer does to the model with this value: liger itself on a trial's own
        copy (``transformers.integrations.liger.apply_liger_kernel``), not undone (liger
        has no undo, and patches transformers' modules for the whole process: ``isolates``)."""
        if not getattr(config, self.name, False):
            return
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(module, {"rms_norm": True, "swiglu": True, "rope": True,
                                    "fused_linear_cross_entropy": False, "cross_entropy": False})

    def isolates(self, config: TrainConfig) -> bool:
        """A trial with liger runs in its own process (``prepare`` is not undone)."""
        return bool(getattr(config, self.name, False))

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        # after the chunked loss (registry order), which writes its key of the same config
        if CONFIG not in training_arguments_fields():
            return
        on = bool(getattr(config, self.name, False))
        if on or args.get(USE) or CONFIG in args:
            # the chunked loss's key (written before, registry order) is kept
            liger_keys(args, keep=("fused_linear_cross_entropy",), **dict.fromkeys(_KERNELS, on))

    def read(self, args: dict[str, object]) -> bool:
        return any(kernel_on(args, k) for k in ("rms_norm", "swiglu"))


LIGER = LigerKnob()
