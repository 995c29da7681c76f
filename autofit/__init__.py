"""autofit: the fastest training configuration that fits in device memory.

    >>> from autofit import estimate, TrainConfig
    >>> est = estimate("tiny-llama", TrainConfig(micro_batch_size=4), seq_len=512, device="cpu")
    >>> est.peak_allocated_bytes > 0
    True
"""

from autofit.api import autofit, estimate
from autofit.compare import PeftComparison, compare_peft
from autofit.config import TrainConfig
from autofit.errors import AutofitError, DoesNotFitError
from autofit.knobs.loss import causal_lm_chunked_loss
from autofit.memory.breakdown import MemoryEstimate
from autofit.preflight import PreflightError, PreflightReport, RunRecord, preflight, run_command
from autofit.result import FitResult
from autofit.trial import TrialResult, is_oom, measure
from autofit.trial.guard import guard

__all__ = [
    "AutofitCallback",
    "AutofitError",
    "ChunkedLossTrainer",
    "DoesNotFitError",
    "FitResult",
    "MemoryEstimate",
    "PeftComparison",
    "PreflightError",
    "PreflightReport",
    "RunRecord",
    "TrainConfig",
    "TrialResult",
    "autofit",
    "causal_lm_chunked_loss",
    "compare_peft",
    "estimate",
    "guard",
    "is_oom",
    "measure",
    "preflight",
    "run_command",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # AutofitCallback subclasses transformers.TrainerCallback: imported on first use
    if name == "AutofitCallback":
        import sys

        return getattr(sys.modules["autofit.preflight"], name)
    # ChunkedLossTrainer subclasses transformers.Trainer: built on first use
    if name == "ChunkedLossTrainer":
        from autofit.knobs.loss import trainer_class

        return trainer_class()
    raise AttributeError(f"module 'autofit' has no attribute {name!r}")
