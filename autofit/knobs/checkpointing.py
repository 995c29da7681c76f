"""The gradient checkpointing knob: recompute activations in backward (non-reentrant).

    >>> args = {}; CHECKPOINTING.emit(type("C", (), {"gradient_checkpointing": True})(), args)
    >>> sorted(args)  # transformers 5.x names (4.x: gradient_checkpointing)
    ['activation_checkpointing', 'activation_checkpointing_kwargs']

It changes no math (the same gradients, one more forward per step), so both values
are searched by default; on is the value that saves memory.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from autofit.knobs.base import OnOffKnob, asks_on, training_arguments_fields, truthy

if TYPE_CHECKING:
    import torch

    from autofit.config import TrainConfig
    from autofit.knobs.base import Scope

__all__ = ["CHECKPOINTING", "CheckpointingKnob", "fsdp_checkpointing", "clear_fields",
           "every_n_layers", "every_n_layers_note", "checkpoint_kwargs", "unsupported_reason"]

_NEW, _OLD = "activation_checkpointing", "gradient_checkpointing"  # transformers 5.x / 4.x


def field_name() -> str:
    """The installed transformers' name of the checkpointing field (5.x renamed it)."""
    return _NEW if _NEW in training_arguments_fields() else _OLD


def checkpoint_kwargs(args: dict[str, object], name: str) -> dict[str, Any]:
    """``args[name]`` as a dict (a file may hold the JSON string TrainingArguments accepts)."""
    v = args.get(name)
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return {}
    return dict(v) if isinstance(v, dict) else {}


def every_n_layers(args: dict[str, object]) -> int:
    """``every_n_layers`` of the training arguments' checkpointing kwargs (transformers 5.x:
    only every n-th decoder layer checkpointed, the others keep their activations); 1 when
    not given."""
    for name in (f"{_NEW}_kwargs", f"{_OLD}_kwargs"):
        n = checkpoint_kwargs(args, name).get("every_n_layers")
        if n not in (None, ""):
            try:
                return max(1, int(n))
            except (TypeError, ValueError):
                return 1
    return 1


def every_n_layers_note(args: dict[str, object]) -> list[str]:
    """The reason line of a tune whose training arguments checkpoint every n-th layer only
    (not modelled: what is tuned, and written, checkpoints every layer); none otherwise."""
    n = every_n_layers(args)
    return ([f"activation_checkpointing_kwargs every_n_layers {n}: not modelled; where the "
             "tuned file checkpoints, it checkpoints every layer"] if n > 1 else [])


def fsdp_checkpointing(args: dict[str, object]) -> bool:
    """Whether TrainingArguments fields checkpoint through FSDP's own activation
    checkpointing (``fsdp`` with ``fsdp_config`` ``activation_checkpointing``)."""
    cfg = args.get("fsdp_config")
    if not args.get("fsdp") or not isinstance(cfg, dict):
        return False
    return truthy(cfg.get("activation_checkpointing",
                          cfg.get("fsdp_activation_checkpointing", False)))


def clear_fields(args: dict[str, object]) -> None:
    """``args`` without the checkpointing training argument (off: FSDP checkpoints)."""
    for f in (_OLD, f"{_OLD}_kwargs", _NEW, f"{_NEW}_kwargs"):
        args.pop(f, None)
    args[field_name()] = False


class CheckpointingKnob(OnOffKnob):
    name = "gradient_checkpointing"
    title = "ckpt"
    fields = (_OLD, f"{_OLD}_kwargs", _NEW, f"{_NEW}_kwargs")
    calibrates_apart = False
    option = "gradient-checkpointing"
    help_on, help_off = "always checkpoint", "never checkpoint"
    help_one = "recompute activations in backward"

    def describe(self, value: bool) -> str:
        return "checkpointing" if value else "no checkpointing"

    def short(self, value: bool) -> str:
        return "yes" if value else "no"

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        name = field_name()
        for old in {_OLD, f"{_OLD}_kwargs", _NEW, f"{_NEW}_kwargs"} - {name}:
            args.pop(old, None)  # the deprecated alias (5.x) would say something else
        args[name] = bool(config.gradient_checkpointing)
        if config.gradient_checkpointing:
            args[f"{name}_kwargs"] = {"use_reentrant": False}
        else:
            args.pop(f"{name}_kwargs", None)

    def read(self, args: dict[str, object]) -> bool:
        return bool(args.get(_NEW) or args.get(_OLD)) or fsdp_checkpointing(args)

    def narrow(self, asked: object, scope: Scope) -> object:
        """Off only, with the reason, for a model that cannot checkpoint (its class says
        ``supports_gradient_checkpointing = False``: ALBERT, CTRL, XLM, MPNet, ...: the
        Trainer's ``gradient_checkpointing_enable`` raises at start); asked for such a
        model: ``BadInputError``. As asked otherwise."""
        why = unsupported_reason(scope.module)
        if why is None:
            return asked
        self.check_model(asks_on(asked), scope.module, scope.task)
        scope.reasons.append(f"no gradient checkpointing: {why}")
        return False

    def check_model(self, value: bool, module: torch.nn.Module, task: str) -> None:
        """Raise ``BadInputError`` for checkpointing asked of a model that cannot run it."""
        why = unsupported_reason(module) if value else None
        if why is not None:
            from autofit.errors import BadInputError, fix

            raise BadInputError(f"gradient checkpointing: {why}; drop "
                                + fix("--gradient-checkpointing", "gradient_checkpointing=True"))


def unsupported_reason(module: torch.nn.Module) -> str | None:
    """Why ``module`` (a PEFT model: its base) cannot checkpoint, or None when it can."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    if getattr(base, "supports_gradient_checkpointing", True):
        return None
    return f"{type(base).__name__} does not support it (transformers refuses it at start)"


CHECKPOINTING = CheckpointingKnob()
