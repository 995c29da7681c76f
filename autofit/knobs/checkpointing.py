"""The gradient checkpointing knob: recompute activations in backward (non-reentrant).

    >>> args = {}; CHECKPOINTING.emit(type("C", (), {"gradient_checkpointing": True})(), args)
    >>> sorted(args)  # transformers 5.x names (4.x: gradient_checkpointing)
    ['activation_checkpointing', 'activation_checkpointing_kwargs']

It changes no math (the same gradients, one more forward per step), so both values
are searched by default; on is the value that saves memory.
"""

from __future__ import annotations

import argparse
from typing import Any

from autofit.knobs.base import training_arguments_fields

__all__ = ["CHECKPOINTING", "CheckpointingKnob"]

_NEW, _OLD = "activation_checkpointing", "gradient_checkpointing"  # transformers 5.x / 4.x


def field_name() -> str:
    """The installed transformers' name of the checkpointing field (5.x renamed it)."""
    return _NEW if _NEW in training_arguments_fields() else _OLD


class CheckpointingKnob:
    name = "gradient_checkpointing"
    title = "ckpt"
    values = (False, True)
    fields = (_OLD, f"{_OLD}_kwargs", _NEW, f"{_NEW}_kwargs")
    saving = True
    calibrates_apart = False

    def normalize(self, value: Any) -> bool:
        return bool(value)

    def changes_math(self, value: bool) -> bool:
        return False

    def defaults(self, device: Any) -> tuple[tuple[bool, ...], str | None]:
        return (False, True), None

    def check(self, device: Any, value: bool) -> None:
        return None  # every device runs it; whether the *model* supports it is the model's

    def describe(self, value: bool) -> str:
        return "checkpointing" if value else "no checkpointing"

    def short(self, value: bool) -> str:
        return "yes" if value else "no"

    def flag(self, value: bool) -> str:
        return "--gradient-checkpointing" if value else "--no-gradient-checkpointing"

    def suggest(self, device: Any) -> tuple[bool, ...]:
        return ()

    def note(self, value: bool) -> str | None:
        return None

    def emit(self, config: Any, args: dict[str, Any]) -> None:
        name = field_name()
        for old in {_OLD, f"{_OLD}_kwargs", _NEW, f"{_NEW}_kwargs"} - {name}:
            args.pop(old, None)  # the deprecated alias (5.x) would say something else
        args[name] = bool(config.gradient_checkpointing)
        if config.gradient_checkpointing:
            args[f"{name}_kwargs"] = {"use_reentrant": False}
        else:
            args.pop(f"{name}_kwargs", None)

    def read(self, args: dict[str, Any]) -> bool:
        return bool(args.get(_NEW) or args.get(_OLD))

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_mutually_exclusive_group()
        g.add_argument("--gradient-checkpointing", dest="gradient_checkpointing",
                       action="store_const", const=True, help="always checkpoint")
        g.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing",
                       action="store_const", const=False, help="never checkpoint")

    def from_options(self, args: argparse.Namespace) -> Any:
        return args.gradient_checkpointing

    def add_option(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--gradient-checkpointing", action="store_true",
                            help="recompute activations in backward")

    def option_value(self, args: argparse.Namespace) -> bool:
        return bool(args.gradient_checkpointing)


CHECKPOINTING = CheckpointingKnob()
