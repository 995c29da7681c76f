"""Trials: real micro-steps of the exact training step on the real device.

``measure`` (``runner``) runs the Trainer's step (``step``) a few times on the
worst-case batch, in this process (``runner``) or a fresh child (``child``),
through the measuring loop (``loop``) and the process-memory counters
(``procmem``); the user's model and RNGs are restored (``state``); ``is_oom``
(``oom``) is the one out-of-memory predicate. With ``world_size > 1`` the step runs on
every rank under torchrun (``ranks``: the launch and the verdict; ``rank``: one rank's
process; ``distributed``: DDP / FSDP2 / ZeRO as the Trainer wraps the model).
"""

from autofit.trial.oom import OOM_MESSAGES, is_oom
from autofit.trial.result import TrialResult, trial_from_dict
from autofit.trial.runner import DEFAULT_TIMEOUT_S, ISOLATIONS, MEASURE_STEPS, measure

__all__ = ["DEFAULT_TIMEOUT_S", "ISOLATIONS", "MEASURE_STEPS", "OOM_MESSAGES", "TrialResult",
           "is_oom", "measure", "trial_from_dict"]
