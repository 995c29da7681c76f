"""The errors autofit raises on bad input or when nothing fits.

Every error is an `AutofitError`; its message is one line that says what to do.
The CLI prints that line and exits with `exit_code` (2 for bad input, 3 when the
configuration does not fit), never a traceback.

A message names the fix in the caller's own terms: ``fix("--max-seq-len 512",
"max_seq_len=512")`` gives the flag when autofit runs as the ``autofit`` command
(``on_command_line()``, entered by ``autofit.cli.main``) and the keyword in Python.

    >>> fix("--max-seq-len 512", "max_seq_len=512")
    'max_seq_len=512'
    >>> with on_command_line():
    ...     fix("--max-seq-len 512", "max_seq_len=512")
    '--max-seq-len 512'
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = [
    "fix",
    "inplace_autograd_error",
    "on_command_line",
    "AutofitError",
    "BadInputError",
    "ValueDependentShapeError",
    "UnmodelledStepError",
    "StepFailsError",
    "UnknownModelError",
    "UnknownTaskError",
    "UnknownDeviceError",
    "InvalidConfigError",
    "InvalidArgumentsError",
    "UnsupportedPrecisionError",
    "MissingDependencyError",
    "NoTrainableParametersError",
    "EmptyDatasetError",
    "DoesNotFitError",
    "OPTIONAL_PACKAGES",
    "require",
    "missing_dependency",
]


_SURFACE: contextvars.ContextVar[str] = contextvars.ContextVar("autofit_surface",
                                                               default="python")


@contextlib.contextmanager
def on_command_line() -> Iterator[None]:
    """While inside, messages name command-line flags (``fix`` returns its ``cli`` form)."""
    token = _SURFACE.set("cli")
    try:
        yield
    finally:
        _SURFACE.reset(token)


def fix(cli: str, python: str) -> str:
    """How the caller asks for something: ``cli`` on the command line, else ``python``."""
    return cli if _SURFACE.get() == "cli" else python


def inplace_autograd_error(e: BaseException, name: str, config: object) -> StepFailsError | None:
    """The one line for a step that autograd refuses because the model modifies a tensor it
    saved for backward in place (transformers' xLSTM without checkpointing), which a run
    hits the same way; None for any other error."""
    if "modified by an inplace operation" not in str(e):
        return None
    if getattr(config, "gradient_checkpointing", False):
        return StepFailsError(f"{name}: its checkpointed step fails in autograd (a tensor "
                             "saved for backward is modified in place), as a run's would")
    return StepFailsError(f"{name}: its step without checkpointing fails in autograd (a tensor "
                         "saved for backward is modified in place), as a run's would: train "
                         "it with " + fix("--gradient-checkpointing",
                                          "gradient_checkpointing=True"))


class AutofitError(Exception):
    """Base class of every error autofit raises on purpose."""

    exit_code: int = 2


class BadInputError(AutofitError, ValueError):
    """The caller asked for something that cannot be done as asked."""


class ValueDependentShapeError(BadInputError):
    """The model's step makes a tensor whose shape depends on values fake tensors do not
    have (``nonzero`` of a mixture of experts' routing, from its weights). Values the
    simulation knows -- its batch's token ids, what is computed from them alone, what a
    factory makes: Longformer's and LED's global attention, BART's end-of-sequence
    pooling -- are followed (``autofit.memory.simulate._values``)."""

    def __init__(self, message: str, op: str) -> None:
        super().__init__(message)
        self.op = op


class UnmodelledStepError(BadInputError):
    """The step holds memory that the estimate does not model within its targets: on a
    CPU, a checkpointed per-position recurrence of a family not measured within them
    (RWKV's CPU kernel, whose thousands of autograd objects a block and the heap's holes
    between them are host memory that was 5-12% over the simulated step; Mamba's scan is
    measured and estimated). Refused, never estimated low."""


class StepFailsError(UnmodelledStepError):
    """The configuration's step fails as a run's would, whatever its memory: a number beyond
    a 16-bit dtype's range (DeBERTa's attention mask under bf16-mixed), a tensor saved for
    backward modified in place (xLSTM without checkpointing). A search leaves the
    configuration out with this reason; asked alone, it is refused in one line."""


class UnknownModelError(BadInputError):
    """The model could not be found or recognised."""


class UnknownTaskError(BadInputError):
    """The task name is not one autofit knows."""


class UnknownDeviceError(BadInputError):
    """The device name is neither present nor in the catalog."""


class InvalidConfigError(BadInputError):
    """A TrainConfig field has a value that cannot be trained with."""


class InvalidArgumentsError(InvalidConfigError):
    """TrainingArguments fields (a file or a dict) that TrainingArguments would refuse.

    ``problems`` lists every one, one line each; the message joins them.
    """

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = tuple(problems)


class UnsupportedPrecisionError(BadInputError):
    """The device cannot run the requested precision (e.g. bf16 before Ampere)."""


class MissingDependencyError(BadInputError):
    """An optional package is needed for what was asked (e.g. bitsandbytes)."""


# import name -> how to install it (the extras of pyproject.toml, or the package itself)
OPTIONAL_PACKAGES: dict[str, str] = {
    "bitsandbytes": "pip install 'autofit[bnb]'",
    "deepspeed": "pip install 'autofit[deepspeed]'",
    "liger_kernel": "pip install 'autofit[liger]'",
    "trl": "pip install 'autofit[trl]'",
    "matplotlib": "pip install matplotlib",  # a core dependency: a broken install lacks it
    "peft": "pip install peft",
}


def missing_dependency(module: str, what: str) -> MissingDependencyError:
    """The error for ``what`` needing the package ``module`` (an import name), which names
    the pip command that installs it."""
    top = module.split(".")[0]
    how = OPTIONAL_PACKAGES.get(top, f"pip install {top}")
    return MissingDependencyError(f"{what} needs {top}, which is not installed: {how}")


def require(module: str, what: str) -> None:
    """Raise ``missing_dependency(module, what)`` unless ``module`` can be imported here.

    Checked before any work (it does not import the package: ``find_spec`` only), so a
    missing extra is one line and exit 2, not a ``ModuleNotFoundError`` after minutes.
    """
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken entry
        found = False
    if not found:
        raise missing_dependency(module, what)


class NoTrainableParametersError(BadInputError):
    """The model has no parameter with requires_grad=True."""


class EmptyDatasetError(BadInputError):
    """The dataset has no samples to train on."""


class DoesNotFitError(AutofitError):
    """The configuration does not fit the device's memory."""

    exit_code = 3
