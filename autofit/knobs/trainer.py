"""Which trainer runs the file: part of the question, since a lever outside ``TrainingArguments``
runs only where the trainer's code runs it.

    >>> normalize_trainer("Plain"), implied_trainer(chunked_loss=True)
    ('plain', 'autofit')
    >>> header_line("autofit")
    '# train with autofit.ChunkedLossTrainer (the chunked loss is in its code, not in a field)'

``Trainer`` names the three: ``plain`` (a ``transformers.Trainer`` built from the file's
fields: the default), ``autofit`` (``autofit.ChunkedLossTrainer``: the chunked causal-LM
loss, ``autofit.knobs.loss``) and ``trl`` (``trl.SFTTrainer``: TRL's fused LM-head loss,
``autofit.knobs.trl_loss``; implied by an ``SFTConfig``). Not a ``TrainConfig`` field: what a
trainer runs is already there (``chunked_loss``, ``loss_impl``); the trainer says which of
those values a run may take (``for_trainer``), and the tuned file records it
(``FitResult.meta["trainer"]``).

The chunked loss is searched only for ``autofit``, except where a ``TrainingArguments``
field carries it (``use_liger_kernel``, ``autofit.knobs.chunked_loss.liger_offered``).
"""

from __future__ import annotations

import difflib
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autofit.config import TrainConfig

__all__ = ["Trainer", "TRAINERS", "normalize_trainer", "trainer_of", "implied_trainer",
           "for_trainer", "runs_chunked_loss", "chunked_loss_refused", "header_line", "CLASS_NAME", "recorded_trainer",
           "not_searched_reason"]


class Trainer(StrEnum):
    """The trainer that runs a tuned file: ``plain`` (``transformers.Trainer``), ``autofit``
    (``autofit.ChunkedLossTrainer``) or ``trl`` (``trl.SFTTrainer``)."""

    PLAIN = "plain"
    AUTOFIT = "autofit"
    TRL = "trl"


TRAINERS: tuple[str, ...] = tuple(t.value for t in Trainer)
CLASS_NAME = {Trainer.PLAIN: "transformers.Trainer", Trainer.AUTOFIT: "autofit.ChunkedLossTrainer",
              Trainer.TRL: "trl.SFTTrainer"}
_HEADER = {Trainer.PLAIN: "# for a plain transformers.Trainer (built from these fields)",
           Trainer.AUTOFIT: "# train with autofit.ChunkedLossTrainer (the chunked loss is in its "
                            "code, not in a field)",
           Trainer.TRL: "# for trl.SFTTrainer (TRL's loss, from these SFTConfig fields)"}


def normalize_trainer(name: object) -> str:
    """``name`` as one of ``TRAINERS``, or a ``BadInputError`` naming them."""
    from autofit.errors import BadInputError

    t = str(name).strip().lower()
    if t not in TRAINERS:
        near = difflib.get_close_matches(t, TRAINERS, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]!r}?" if near else "choose one of " + ", ".join(TRAINERS)
        raise BadInputError(f"unknown trainer {name!r}; {hint}")
    return t


def trainer_of(trainer: object) -> str:
    """The trainer a ``Trainer`` object is, by its class: ``ChunkedLossTrainer`` -> autofit,
    ``SFTTrainer`` -> trl, else plain (a subclass of either counts as it)."""
    names = [(c.__name__, c.__module__) for c in type(trainer).__mro__]
    if ("ChunkedLossTrainer", "autofit.knobs.loss") in names:
        return Trainer.AUTOFIT.value
    if any(n == "SFTTrainer" for n, _ in names):
        return Trainer.TRL.value
    return Trainer.PLAIN.value


def implied_trainer(*, chunked_loss: bool = False, sft: bool = False) -> str:
    """The trainer nobody named: ``trl`` for an SFTConfig (or TRL's loss), ``autofit`` when the
    chunked loss is asked for, else ``plain``."""
    if sft:
        return Trainer.TRL.value
    return Trainer.AUTOFIT.value if chunked_loss else Trainer.PLAIN.value


def runs_chunked_loss(trainer: str) -> bool:
    """Whether ``trainer``'s own code computes autofit's chunked loss."""
    return trainer == Trainer.AUTOFIT


def chunked_loss_refused(trainer: str) -> str:
    """Why the chunked loss cannot be asked of ``trainer``, and what to do (one line)."""
    from autofit.errors import fix

    return (f"the chunked loss runs only in autofit.ChunkedLossTrainer, not in "
            f"{CLASS_NAME[Trainer(trainer)]} (TrainingArguments has no field for it): drop "
            + fix("--chunked-loss", "chunked_loss=True") + " or use "
            + fix("--trainer autofit", "trainer='autofit'"))


def not_searched_reason(trainer: str) -> str:
    """The reason line of a search that leaves the chunked loss out for ``trainer``."""
    from autofit.errors import fix

    return (f"no chunked loss: {CLASS_NAME[Trainer(trainer)]} computes the loss from the full "
            "logits (TrainingArguments has no field for autofit's chunked loss); to search it, "
            "train with autofit.ChunkedLossTrainer: "
            + fix("--trainer autofit", "trainer='autofit'"))


def for_trainer(config: TrainConfig, trainer: str | None) -> tuple[Any, str]:
    """``(config, trainer)``: the ``TrainConfig`` as ``trainer`` runs it and the trainer (None:
    the one ``config`` implies). ``trl`` computes TRL's loss (``loss_impl="trl"``); a chunked
    loss asked of ``plain`` / ``trl``, or TRL's loss asked of another trainer, is a
    ``BadInputError``."""
    from autofit.errors import BadInputError

    if trainer is None:
        return config, implied_trainer(chunked_loss=config.chunked_loss,
                                       sft=config.loss_impl == "trl")
    t = normalize_trainer(trainer)
    if config.chunked_loss and not runs_chunked_loss(t):
        raise BadInputError(chunked_loss_refused(t))
    if t == Trainer.TRL:
        return config.replace(loss_impl="trl"), t
    if config.loss_impl == "trl":
        raise BadInputError(f"loss_impl='trl' is trl.SFTTrainer's loss, not "
                            f"{CLASS_NAME[Trainer(t)]}'s: use trainer='trl' or "
                            "loss_impl='model'")
    return config, t


def recorded_trainer(meta: dict[str, object]) -> str:
    """The trainer a tuned file's metadata records (a file written before it was recorded:
    ``trl`` for an SFTConfig file, else ``plain``)."""
    from autofit.knobs.trl_loss import SFT_CONFIG

    t = meta.get("trainer")
    if t in TRAINERS:
        return str(t)
    return Trainer.TRL.value if meta.get("arguments_class") == SFT_CONFIG else Trainer.PLAIN.value


def header_line(trainer: str) -> str:
    """The tuned YAML's comment line saying which trainer the file is for."""
    return _HEADER[Trainer(trainer)]
