"""The optimizer knob: ``TrainingArguments.optim`` names (with ``optim_args``).

    >>> OPTIMIZER.changes_math("adamw_torch_fused"), OPTIMIZER.changes_math("sgd")
    (False, True)

The AdamW variants compute the same update (fused and foreach kernels; 8-bit
states quantize it) and are searched by default; any other optimizer changes
training and is tried only when asked. bitsandbytes optimizers need it installed.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from autofit.config import OPTIMIZERS, check_optimizer
from autofit.errors import MissingDependencyError, fix
from autofit.knobs import base

if TYPE_CHECKING:
    from autofit.config import TrainConfig
    from autofit.probe.device import DeviceInfo

__all__ = ["OPTIMIZER", "OptimizerKnob"]

_SHORT = {"adamw_torch_fused": "adamw fused", "adamw_torch": "adamw",
          "adamw_bnb_8bit": "adamw 8-bit", "paged_adamw_8bit": "paged adamw 8-bit"}


class OptimizerKnob:
    name = "optimizer"
    title = "optimizer"
    values = tuple(OPTIMIZERS)
    fields = ("optim", "optim_args")
    saving = None  # the ones that save memory change the update
    calibrates_apart = True  # its state and step dominate the estimate's error

    def normalize(self, value: object) -> str:
        return check_optimizer(value)

    def changes_math(self, value: str) -> bool:
        return OPTIMIZERS[value].family != "adamw"

    def defaults(self, device: DeviceInfo) -> tuple[tuple[str, ...], str]:
        opts = ["adamw_torch_fused", "adamw_torch"]
        if base.installed("bitsandbytes"):
            opts.append("adamw_bnb_8bit")
        return tuple(opts), ("optimizer: AdamW variants searched (" + ", ".join(opts) + "); "
                             "other optimizers change training and are tried only when asked")

    def check(self, device: DeviceInfo, value: str, run: bool = True) -> None:
        """Raise ``MissingDependencyError`` for a bitsandbytes optimizer without bitsandbytes."""
        if OPTIMIZERS[value].bnb and not base.installed("bitsandbytes"):
            raise MissingDependencyError(
                f"optimizer {value} needs bitsandbytes, which is not installed: pip install "
                "'autofit[bnb]' (or choose "
                + fix("--optim adamw_torch or adafactor", "optimizer='adamw_torch' or 'adafactor'")
                + ")")

    def describe(self, value: str) -> str:
        return value

    def short(self, value: str) -> str:
        return _SHORT.get(value, value)

    def flag(self, value: str) -> str:
        return f"--optim {value}"

    def suggest(self, device: DeviceInfo) -> tuple[str, ...]:
        return ("adamw_bnb_8bit",) if base.installed("bitsandbytes") else ()

    def note(self, value: str) -> str | None:
        return None

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        args["optim"] = config.optimizer
        if config.optim_args:
            args["optim_args"] = config.optim_args
        else:
            args.pop("optim_args", None)

    def read(self, args: dict[str, object]) -> str:
        optim = args.get("optim", "adamw_torch")
        return str(getattr(optim, "value", optim))

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--optim", nargs="+", default=None,
                            help="optimizers allowed (TrainingArguments.optim names)")

    def from_options(self, args: argparse.Namespace) -> Any:
        return args.optim

    def add_option(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--optim", default="adamw_torch",
                            help="a TrainingArguments.optim name (adamw_torch, adafactor, "
                                 "adamw_bnb_8bit, sgd, ...)")

    def option_value(self, args: argparse.Namespace) -> str:
        return args.optim


OPTIMIZER = OptimizerKnob()
