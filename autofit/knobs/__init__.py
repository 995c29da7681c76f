"""The levers the search may turn, one module each (see ``base`` for what a knob declares).

``precision``, ``checkpointing``, ``optimizer``, ``chunked_loss`` (``loss``: the chunked
causal-LM loss and its Trainer), ``offloading`` and ``compile`` (torch.compile) today;
``registry`` lists them in order. ``SearchSpace``, ``Candidate``, the optuna study, the
cache key, the
candidates table, the emitted fields and the "nothing fits" suggestions are
generic over ``KNOBS``.

``trl_loss`` is not a knob: TRL's fused LM-head loss is what ``trl.SFTTrainer`` runs, so it
is read from the user's ``SFTConfig`` (``TrainConfig.loss_impl="trl"``, fixed for every
candidate) and only takes the chunked loss out of the search.
"""

from autofit.knobs.base import Knob, installed, restrict, training_arguments_fields
from autofit.knobs.checkpointing import CHECKPOINTING
from autofit.knobs.chunked_loss import CHUNKED_LOSS
from autofit.knobs.compile import TORCH_COMPILE
from autofit.knobs.offloading import OFFLOADING
from autofit.knobs.optimizer import OPTIMIZER
from autofit.knobs.precision import PRECISION
from autofit.knobs.registry import (
    KNOBS,
    choice_of,
    conflict,
    describe_choice,
    emit_fields,
    is_choice,
    knob,
    knob_names,
    notes,
    owned_fields,
    reason_lines,
)

__all__ = ["CHECKPOINTING", "CHUNKED_LOSS", "KNOBS", "OFFLOADING", "OPTIMIZER", "PRECISION",
           "TORCH_COMPILE", "Knob", "choice_of", "conflict", "describe_choice", "emit_fields",
           "installed", "is_choice", "knob", "knob_names", "notes", "owned_fields", "reason_lines",
           "restrict", "training_arguments_fields"]
