"""The precision knob: Lightning's precision names, written as TrainingArguments' bf16 / fp16.

    >>> from autofit.probe.device import resolve_device
    >>> PRECISION.defaults(resolve_device("A100-80GB"))[0]
    ('bf16-mixed', '32-true')
    >>> args = {}; PRECISION.emit(type("C", (), {"precision": "bf16-mixed"})(), args); args
    {'bf16': True, 'fp16': False}

Mixed precisions keep fp32 weights and optimizer states and change only the
compute dtype: searched by default (bf16 where the device has it, else fp16).
``*-true`` precisions store the weights in half precision (the optimizer updates
half-precision weights): they change the math and are searched only when asked,
and the model must be loaded in that dtype (TrainingArguments has no flag for it).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from autofit.config import PRECISIONS, normalize_precision
from autofit.errors import UnsupportedPrecisionError, fix

if TYPE_CHECKING:
    from autofit.config import TrainConfig
    from autofit.probe.device import DeviceInfo

__all__ = ["PRECISION", "PrecisionKnob"]


class PrecisionKnob:
    name = "precision"
    title = "precision"
    values = tuple(PRECISIONS)
    fields = ("bf16", "fp16")
    saving = None  # mixed precisions trade memory both ways (autocast copies vs activations)
    calibrates_apart = False

    def normalize(self, value: object) -> str:
        return normalize_precision(value)

    def changes_math(self, value: str) -> bool:
        return value in ("bf16-true", "16-true")

    def defaults(self, device: DeviceInfo) -> tuple[tuple[str, ...], str]:
        if device.bf16:
            return ("bf16-mixed", "32-true"), ("precision: bf16-mixed and 32-true searched "
                                               "(device supports bf16; fp16 only when asked)")
        return ("16-mixed", "32-true"), ("precision: 16-mixed and 32-true searched "
                                         "(device has no bf16)")

    def check(self, device: DeviceInfo, value: str, run: bool = True) -> None:
        """Raise ``UnsupportedPrecisionError`` when ``device`` cannot run ``value``."""
        name = device.product or device.name
        if value.startswith("bf16") and not device.bf16:
            raise UnsupportedPrecisionError(
                f"{name} does not support bf16 (it needs Ampere or newer); use "
                + fix("--precision 16-mixed or 32-true", "precision='16-mixed' or '32-true'"))
        if value.startswith("16") and not device.fp16:
            raise UnsupportedPrecisionError(
                f"{name} does not support fp16; use {fix('--precision 32-true', 'precision=' + repr('32-true'))}")

    def describe(self, value: str) -> str:
        return value

    def short(self, value: str) -> str:
        return value

    def flag(self, value: str) -> str:
        return f"--precision {value}"

    def suggest(self, device: DeviceInfo) -> tuple[str, ...]:
        return ("bf16-true",) if device.bf16 else ()

    def note(self, value: str) -> str | None:
        if value in ("bf16-true", "16-true"):
            dtype = "bfloat16" if value.startswith("bf16") else "float16"
            return (f"{value}: load the model in that dtype (torch_dtype=torch.{dtype}); "
                    "TrainingArguments has no flag for it")
        return None

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        args["bf16"] = config.precision == "bf16-mixed"
        args["fp16"] = config.precision == "16-mixed"

    def read(self, args: dict[str, object]) -> str:
        return "bf16-mixed" if args.get("bf16") else "16-mixed" if args.get("fp16") else "32-true"

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--precision", nargs="+", default=None,
                            help=f"precisions allowed ({', '.join(PRECISIONS)})")

    def from_options(self, args: argparse.Namespace) -> Any:
        return args.precision

    def add_option(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--precision", default="32-true", help=f"one of {', '.join(PRECISIONS)}")

    def option_value(self, args: argparse.Namespace) -> str:
        return args.precision


PRECISION = PrecisionKnob()
