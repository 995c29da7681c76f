"""The registered knobs, in the order the search, the table and the files show them.

Adding a lever is one new module in ``autofit/knobs/`` (a ``Knob``: its fields, notes,
reason line and step-time term ``step_seconds``), its entry here, its ``TrainConfig``
field, its memory rule (in its module where it needs only the probes' description, or
as ``stand_ins`` where it swaps the model's code; else a term of ``autofit.memory``'s
closed form) and its tests. ``liger_kernels`` was added so: no file outside
``autofit/knobs/`` names it.

    >>> [k.name for k in KNOBS]
    ['precision', 'gradient_checkpointing', 'optimizer', 'chunked_loss', 'liger_kernels', 'activation_offloading', 'torch_compile', 'strategy', 'offload']

A knob may also define ``conflict(choice) -> str | None``: why a combination of values
cannot be trained (activation offloading without checkpointing); ``conflict`` asks every
knob, and the search space leaves such combinations out.

What a knob writes, says and costs goes through here, as torch's flop_counter goes
through its table of per-op formulas: ``emit_fields`` (its TrainingArguments fields),
``notes`` (what the user must do besides them), ``reason_lines`` (what the chosen value
saves or costs), ``step_seconds`` (the time its value adds to a micro batch), ``narrow``
(its values for one tune's model and trainer) and ``check_model`` (a value the model
cannot run) ask every registered knob in order; no caller names a knob.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError
from autofit.knobs.base import Knob
from autofit.knobs.checkpointing import CHECKPOINTING
from autofit.knobs.chunked_loss import CHUNKED_LOSS
from autofit.knobs.compile import TORCH_COMPILE
from autofit.knobs.liger import LIGER
from autofit.knobs.offloading import OFFLOADING
from autofit.knobs.optimizer import OPTIMIZER
from autofit.knobs.precision import PRECISION
from autofit.knobs.strategy import OFFLOAD, STRATEGY

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch

    from autofit.config import TrainConfig
    from autofit.knobs.base import Costs, KnobValue, Scope, StepContext

__all__ = ["KNOBS", "knob", "knob_names", "choice_of", "describe_choice", "owned_fields",
           "conflict", "emit_fields", "notes", "reason_lines", "step_seconds", "timed_knobs",
           "narrow", "check_model", "is_choice", "step_loss", "trial_loss", "patched", "swaps",
           "recorded", "prepare", "isolates", "patch_key", "patching"]

# the order the files are written in too: offloading adds its key to the kwargs that
# checkpointing writes afresh
KNOBS: tuple[Knob, ...] = (PRECISION, CHECKPOINTING, OPTIMIZER, CHUNKED_LOSS, LIGER, OFFLOADING,
                           TORCH_COMPILE, STRATEGY, OFFLOAD)


def knob(name: str) -> Knob:
    """The registered knob called ``name``."""
    for k in KNOBS:
        if k.name == name:
            return k
    raise BadInputError(f"unknown knob {name!r}; knobs: {', '.join(knob_names())}")


def knob_names() -> tuple[str, ...]:
    return tuple(k.name for k in KNOBS)


def is_choice(k: Knob, loss_impl: str = "model", trainer: str | None = None) -> bool:
    """Whether knob ``k`` is a choice when ``loss_impl`` runs in ``trainer`` (its
    ``is_choice``; knobs without one always are)."""
    check = getattr(k, "is_choice", None)
    return True if check is None else bool(check(loss_impl, trainer))


def choice_of(config: TrainConfig) -> dict[str, Any]:
    """``{knob name: value}`` of a ``TrainConfig`` (or anything with those attributes), the
    knobs that are no choice with its loss left out (``is_choice``: with TRL's loss,
    ``loss_impl="trl"``, the chunked loss)."""
    loss_impl = getattr(config, "loss_impl", "model")
    return {k.name: getattr(config, k.name) for k in KNOBS if is_choice(k, loss_impl)}


def describe_choice(choice: dict[str, KnobValue], sep: str = ", ") -> str:
    """``"bf16-mixed, checkpointing, adamw_torch"``: each knob's value as the reasons read."""
    return sep.join(k.describe(choice[k.name]) for k in KNOBS if k.name in choice)


def owned_fields() -> tuple[str, ...]:
    """Every TrainingArguments field a knob writes (the rest is the user's)."""
    return tuple(f for k in KNOBS for f in k.fields)


def conflict(choice: dict[str, KnobValue]) -> str | None:
    """Why the combination ``choice`` ({knob name: value}) cannot be trained, or None."""
    for k in KNOBS:
        check = getattr(k, "conflict", None)
        if check is not None and (why := check(choice)) is not None:
            return why
    return None


def emit_fields(config: TrainConfig, args: dict[str, object]) -> None:
    """Every knob writes its TrainingArguments fields of ``config`` into ``args`` (in
    registry order: a later knob may add to what an earlier one wrote)."""
    for k in KNOBS:
        k.emit(config, args)


def notes(config: TrainConfig, trainer: str) -> list[str]:
    """What the user must do besides the fields, per knob, for ``config`` trained by
    ``trainer`` (a knob's ``trainer_note`` when it has one, else its ``note``)."""
    out = []
    for k in KNOBS:
        value = getattr(config, k.name)
        for_trainer = getattr(k, "trainer_note", None)
        line = for_trainer(value, trainer) if for_trainer is not None else k.note(value)
        if line:
            out.append(line)
    return out


def reason_lines(config: TrainConfig, costs: Costs) -> list[str]:
    """Each knob's reason line for the chosen ``config`` (what its value saves or costs, by
    ``costs``: the estimators), in registry order; knobs without one say nothing."""
    out = []
    for k in KNOBS:
        reason = getattr(k, "reason", None)
        if reason is not None and (line := reason(config, costs)) is not None:
            out.append(line)
    return out


def step_seconds(ctx: StepContext) -> float:
    """The seconds every knob's value adds to one micro batch beyond its FLOPs (each knob's
    ``step_seconds``; knobs without one add nothing)."""
    total = 0.0
    for k in KNOBS:
        term = getattr(k, "step_seconds", None)
        if term is not None:
            total += term(ctx)
    return total


def step_loss(config: TrainConfig) -> Callable[..., torch.Tensor] | None:
    """The loss ``config``'s knob values make the trainer compute, ``(model, batch) ->
    loss`` (the first knob's ``step_loss`` that gives one); None: the model's own."""
    for k in KNOBS:
        hook = getattr(k, "step_loss", None)
        fn = hook(config) if hook is not None else None
        if fn is not None:
            return fn
    return None


@contextlib.contextmanager
def patched(config: TrainConfig, module: torch.nn.Module) -> Iterator[None]:
    """While inside, ``module`` (autofit's simulated copy) runs the stand-ins each knob's
    value in ``config`` puts in the model's code (its ``stand_ins``: the memory rule of a
    lever that swaps kernels, liger's), taken out on the way out."""
    with contextlib.ExitStack() as stack:
        for k in KNOBS:
            hook = getattr(k, "stand_ins", None)
            ctx = hook(config, module) if hook is not None else None
            if ctx is not None:
                stack.enter_context(ctx)
        yield


def recorded(config: TrainConfig, recorder: object, target: object) -> None:
    """Tell the simulation's recorder what ``config``'s knob values run differently from
    what a dispatch mode sees (each knob's ``recorded``: the chunked loss's op recorded as
    its Python implementation); ``target``: the simulated step's (``kind``, ``sm``), or
    only its kind (``"cpu"`` / ``"cuda"``: the derivation of analytic coefficients)."""
    for k in KNOBS:
        hook = getattr(k, "recorded", None)
        if hook is not None:
            hook(config, recorder, target)


def swaps(config: TrainConfig, module: torch.nn.Module) -> bool:
    """Whether a knob's value in ``config`` puts stand-ins in ``module``'s code (its
    ``stand_ins`` gives a context for this model; liger's for a model type it patches)."""
    return any(getattr(k, "stand_ins", None) is not None
               and k.stand_ins(config, module) is not None for k in KNOBS)


def prepare(config: TrainConfig, module: torch.nn.Module) -> None:
    """What the trainer does to ``module`` (a trial's own copy) for ``config``'s knob values
    besides the steps: each knob's ``prepare`` (liger's kernels applied)."""
    for k in KNOBS:
        hook = getattr(k, "prepare", None)
        if hook is not None:
            hook(config, module)


def isolates(config: TrainConfig) -> tuple[str, ...]:
    """The knobs whose value in ``config`` needs a trial of its own process (a knob's
    ``isolates``: a ``prepare`` that cannot be undone), each as ``describe`` says it;
    empty: none."""
    return tuple(k.describe(getattr(config, k.name)) for k in KNOBS
                 if getattr(k, "isolates", None) is not None and k.isolates(config))


def patch_key(config: TrainConfig) -> tuple[object, ...]:
    """The values of the knobs that patch the model (part of what derived coefficients are
    cached under: they change the activations)."""
    return tuple(getattr(config, k.name) for k in KNOBS
                 if getattr(k, "stand_ins", None) is not None)


def patching(config: TrainConfig) -> tuple[str, ...]:
    """The knobs whose value in ``config`` swaps the model's code (``describe`` of each)."""
    return tuple(k.describe(getattr(config, k.name)) for k in KNOBS
                 if getattr(k, "stand_ins", None) is not None and getattr(config, k.name))


def trial_loss(config: TrainConfig, device_kind: str) -> Callable[..., torch.Tensor] | None:
    """The loss a trial on a ``device_kind`` device ("cuda" / "cpu") runs for ``config``: a
    knob's ``trial_loss`` where it has one (the chunked loss that liger's field carries on
    a card: the model's own forward, which ``prepare`` made liger's), else ``step_loss``."""
    for k in KNOBS:
        trial, step = getattr(k, "trial_loss", None), getattr(k, "step_loss", None)
        fn = trial(config, device_kind) if trial else step(config) if step else None
        if fn is not None:
            return fn
    return None


def timed_knobs() -> tuple[str, ...]:
    """The knobs with a step-time term."""
    return tuple(k.name for k in KNOBS if getattr(k, "step_seconds", None) is not None)


def narrow(allowed: dict[str, object], scope: Scope) -> dict[str, object]:
    """``allowed`` ({knob name: what was asked}) with each knob's ``narrow`` applied: the
    values this tune's model and trainer allow (knobs without one: as asked)."""
    out = dict(allowed)
    for k in KNOBS:
        settle = getattr(k, "narrow", None)
        if settle is not None:
            out[k.name] = settle(out.get(k.name), scope)
    return out


def check_model(config: TrainConfig, module: torch.nn.Module, task: str) -> None:
    """Raise ``BadInputError`` where a knob's value in ``config`` is one the model cannot
    run (each knob's ``check_model``)."""
    for k in KNOBS:
        check = getattr(k, "check_model", None)
        if check is not None:
            check(getattr(config, k.name), module, task)
