"""Pre-flight in training pipelines: will this run fit on this machine, start to end?

``preflight`` (``trainer``) reads a Trainer / TrainingArguments and runs the check
(``check``: estimate, one confirming trial or the cache, the verdict, the fix);
``cache`` keeps one measured trial per exact configuration; ``AutofitCallback``
(``callback``) runs the check at ``on_train_begin``; ``PreflightReport`` and
``PreflightError`` (``verdict``) are its answer. ``run_command`` (``run``) runs the
user's own training command and measures its real peak against the tuned figure.

    >>> from autofit.preflight import PreflightReport
    >>> sorted(PreflightReport.__dataclass_fields__)[:4]
    ['capacity_bytes', 'changes', 'config', 'device']
"""

from typing import Any

from autofit.preflight.run import RunRecord, run_command
from autofit.preflight.trainer import config_of, preflight
from autofit.preflight.verdict import PreflightError, PreflightReport

__all__ = ["AutofitCallback", "PreflightError", "PreflightReport", "RunRecord",  # noqa: F822
           "config_of", "preflight", "run_command"]


def __getattr__(name: str) -> Any:
    # AutofitCallback subclasses transformers.TrainerCallback: built on first use
    if name == "AutofitCallback":
        from autofit.preflight.callback import callback_class

        return callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
