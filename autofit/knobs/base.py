"""What a knob is: one lever the search may turn, and everything autofit says about it.

A knob declares

* ``name``: the ``TrainConfig`` field it sets (also the optuna parameter and the
  keyword that restricts it: ``autofit(..., precision=["bf16-mixed"])``);
* ``values``: every value it may take, and ``changes_math(value)``: whether a
  value changes what training computes (such values are searched only when the
  user asks for them, like SGD instead of AdamW);
* ``defaults(device)``: the values searched when the user does not restrict the
  knob, with the reason shown to the user; ``check(device, value, run=True)``: raises
  an ``AutofitError`` naming what to do when the device or the installed libraries
  cannot run a value (``run=False``: the value is only estimated, so a library that
  only running it needs, such as DeepSpeed or a C++ compiler, is not asked for);
* ``emit(config, args)`` / ``read(args)``: how its value is written into (and read
  back from) ``TrainingArguments`` fields, with the field names of the installed
  transformers; ``fields``: the fields it owns;
* ``describe(value)`` / ``short(value)``: how the value reads in reasons and in the
  candidates table (column ``title``); ``flag(value)``: the ``autofit tune`` option
  that asks for it; ``add_options(parser)`` / ``from_options(args)``: those options
  (values allowed, for ``tune``), ``add_option(parser)`` / ``option_value(args)``: the
  option of one configuration (for ``estimate``, ``measure``);
* ``saving``: the value that needs the least memory without changing the math
  (None when no value does, or when it is searched only when asked, like activation
  offloading), and ``suggest(device)``: values that save memory but change the math or
  are searched only when asked, offered when nothing fits; ``note(value)``: what the user must do besides the emitted fields when
  the value is chosen (or None);
* ``conflict(choice)`` (optional): why a combination of knob values cannot be trained
  (None when it can); the search leaves such combinations out;
* ``calibrates_apart``: the estimate's error depends on the value (trials measured
  with one value do not calibrate the estimate of another);
* ``reason(config, costs)`` (optional): the reason line of the chosen configuration's
  value (what it saves, what it costs), asked of the estimators through ``Costs``;
  ``trainer_note(value, trainer)`` (optional): ``note`` for a given trainer;
* ``narrow(asked, scope)`` (optional): the values allowed in one tune, from what was
  asked and the tune's ``Scope`` (the model, the trainer that will run the file and the
  loss it computes), a reason appended where it narrows; ``check_model(value, module,
  task)`` (optional): raises ``BadInputError`` for a value the model cannot run;
* ``is_choice(loss_impl, trainer)`` (optional): whether the knob is a choice at all when
  that loss runs (``"trl"``: SFTTrainer's own) in that trainer (None: any); a knob
  that is none is left out of the space, the tables and the suggestions;
* ``step_seconds(ctx)`` (optional): the seconds its value adds to one micro batch beyond
  the step's FLOPs (``StepContext``: the model, the configuration, the rates it runs
  at); the speed model sums the registered knobs' terms and names none;
* ``step_loss(config)`` (optional): the loss its value makes the trainer compute, a
  function ``(model, batch) -> loss`` (None: the model's own, forward with labels); the
  trials and the simulated step call what the registry returns and name no knob;
* ``stand_ins(config, module)`` (optional): for a value that swaps the model's code (liger's
  kernels), a context manager under which autofit's simulated copy runs stand-ins that
  allocate and save what that code does: the knob's memory rule, which the simulated step
  and the derived analytic coefficients enter through ``registry.patched`` (None: off);
  ``prepare(config, module)`` (optional): what the trainer does to a trial's own copy for
  the value (liger applied); ``isolates(config)`` (optional): that copy needs a process of
  its own (a patch that cannot be undone);
* ``recorded(config, recorder, target)`` (optional): what the value runs that a dispatch
  mode would not see whole, told to the simulation's recorder (its ``decompositions`` and
  ``workspaces``: the chunked loss's op recorded as its Python implementation).

The registry (``autofit.knobs.registry``) asks every registered knob for these: the
pipeline never names a knob to write its fields, its notes or its reason lines.

A knob's memory rule is a function of the knob's module where it needs only what the
probes describe (the chunked loss's buffers: ``autofit.knobs.chunked_loss``), which the
estimators (``autofit.memory``, a layer above this one) call; where it is a term of
the closed form's phases it lives there. What the reason line asks of the estimators
goes through ``Costs``, what the step-time term reads through ``StepContext``.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch

    from autofit.config import TrainConfig
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo

__all__ = ["Costs", "Knob", "KnobValue", "OnOffKnob", "Scope", "StepContext", "installed", "truthy",
           "asks_on", "training_arguments_fields", "restrict"]

# A knob's value: on/off levers a bool, the others a name (``"bf16-mixed"``, ``"zero2"``).
KnobValue: TypeAlias = bool | str


class Costs(Protocol):
    """What a knob's reason line may ask the estimators about a configuration (the knobs sit
    below ``autofit.memory`` and ``autofit.search``: the caller hands them in)."""

    def device_bytes(self, config: TrainConfig) -> int:
        """The closed form's device peak of ``config``, bytes."""
        ...

    def host_bytes(self, config: TrainConfig) -> int:
        """The host memory ``config`` needs besides the device's (offloading), bytes."""
        ...

    def tokens_per_s(self, config: TrainConfig) -> float:
        """The speed model's tokens per second of ``config``."""
        ...

    def compile_saving_bytes(self, config: TrainConfig) -> int:
        """Activation bytes torch.compile's rule takes off the eager step (< 0: adds)."""
        ...


class Scope(NamedTuple):
    """What a knob's ``narrow`` reads to settle its values for one tune: the model (its
    module and task), the device, the trainer that will run the file and the loss it
    computes (``"model"``: the model's own; ``"trl"``: SFTTrainer's), the user's training
    arguments (or None), and the tune's reasons, which it may append to."""

    module: torch.nn.Module
    task: str
    device: DeviceInfo
    trainer: str
    loss_impl: str
    training_args: object
    reasons: list[str]


class StepContext(NamedTuple):
    """What a knob's step-time term (``step_seconds``) reads of one micro batch: the model,
    the configuration, its sequence length and device, the rates it runs at (FLOP/s
    achieved, device-memory and host-link bytes/s: ``autofit.search.speed``), and the
    activation bytes offloading moves to the host per micro batch (0 without it)."""

    info: ModelInfo
    config: TrainConfig
    seq_len: int
    device: DeviceInfo
    flops: float
    bandwidth: float
    host_link: float
    offloaded_bytes: int


class Knob(Protocol):
    """One lever of the search (see the module docstring)."""

    name: str
    title: str
    values: tuple[Any, ...]
    fields: tuple[str, ...]
    saving: Any
    calibrates_apart: bool

    def normalize(self, value: object) -> Any: ...

    def changes_math(self, value: KnobValue) -> bool: ...

    def defaults(self, device: DeviceInfo) -> tuple[tuple[Any, ...], str | None]: ...

    def check(self, device: DeviceInfo, value: KnobValue, run: bool = True) -> None: ...

    def describe(self, value: KnobValue) -> str: ...

    def short(self, value: KnobValue) -> str: ...

    def flag(self, value: KnobValue) -> str: ...

    def suggest(self, device: DeviceInfo) -> tuple[Any, ...]: ...

    def note(self, value: KnobValue) -> str | None: ...

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None: ...

    def read(self, args: dict[str, object]) -> Any: ...

    def add_options(self, parser: argparse.ArgumentParser) -> None: ...

    def from_options(self, args: argparse.Namespace) -> Any: ...

    def add_option(self, parser: argparse.ArgumentParser) -> None: ...

    def option_value(self, args: argparse.Namespace) -> Any: ...


class OnOffKnob:
    """What an on/off lever that changes no math shares: both values searched by default,
    on saves memory, every device runs it, nothing to suggest; ``--OPTION`` /
    ``--no-OPTION`` for ``tune`` and ``--OPTION`` for one configuration. A subclass
    sets ``name``, ``title``, ``fields``, ``option`` (the flag without dashes), the
    help texts, ``describe``/``short``, ``emit``/``read`` (and ``note`` when the user
    must do something besides the fields)."""

    values = (False, True)
    saving = True
    option = ""
    help_on = help_off = help_one = ""

    def normalize(self, value: object) -> bool:
        return bool(value)

    def changes_math(self, value: bool) -> bool:
        return False

    def defaults(self, device: DeviceInfo) -> tuple[tuple[bool, ...], str | None]:
        return (False, True), None

    def check(self, device: DeviceInfo, value: bool, run: bool = True) -> None:
        return None  # every device runs it; whether the *model* supports it is the model's

    def flag(self, value: bool) -> str:
        return f"--{self.option}" if value else f"--no-{self.option}"

    def suggest(self, device: DeviceInfo) -> tuple[bool, ...]:
        return ()

    def note(self, value: bool) -> str | None:
        return None

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_mutually_exclusive_group()
        g.add_argument(f"--{self.option}", dest=self.name, action="store_const", const=True,
                       help=self.help_on)
        g.add_argument(f"--no-{self.option}", dest=self.name, action="store_const",
                       const=False, help=self.help_off)

    def from_options(self, args: argparse.Namespace) -> Any:
        return getattr(args, self.name)

    def add_option(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(f"--{self.option}", dest=self.name, action="store_true",
                            help=self.help_one)

    def option_value(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, self.name))


def asks_on(asked: object) -> bool:
    """Whether what a caller asked of an on/off knob includes on (``True``, or a list of values
    with ``True`` in it)."""
    return asked is True or (isinstance(asked, (list, tuple)) and True in asked)


def truthy(v: object) -> bool:
    """A config value that says yes (``True``, ``"true"``, ``"1"``, ``"yes"``: YAML and JSON
    files write them all)."""
    return str(v).strip().lower() in ("true", "1", "yes")


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (without importing it)."""
    return importlib.util.find_spec(package) is not None


@lru_cache(maxsize=1)
def training_arguments_fields() -> frozenset[str]:
    """The field names of the installed ``transformers.TrainingArguments``."""
    from dataclasses import fields

    from transformers import TrainingArguments

    return frozenset(f.name for f in fields(TrainingArguments))


def restrict(knob: Knob, device: DeviceInfo, allowed: object, reasons: list[str]
             ) -> tuple[Any, ...]:
    """The values of ``knob`` to search: ``allowed`` (one value or several) checked against
    the device, or the knob's defaults (their reason appended to ``reasons``)."""
    if allowed is None:
        values, why = knob.defaults(device)
        if why:
            reasons.append(why)
        return values
    many = allowed if isinstance(allowed, Sequence) and not isinstance(allowed, str) else [allowed]
    out = []
    for v in many:
        v = knob.normalize(v)
        knob.check(device, v)
        out.append(v)
    return tuple(dict.fromkeys(out))
