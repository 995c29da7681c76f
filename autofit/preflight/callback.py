"""``AutofitCallback``: the pre-flight check at ``on_train_begin`` (verify and stop, never fix).

At train begin it prints one line to stderr (``PreflightReport.headline``): fits or not,
measured / estimated / from the cache, and the numbers.

    trainer = Trainer(model=model, args=args, train_dataset=train,
                      callbacks=[autofit.AutofitCallback()])
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError
from autofit.preflight.trainer import preflight
from autofit.preflight.verdict import PreflightError, PreflightReport

if TYPE_CHECKING:
    from autofit.probe.device import DeviceInfo

__all__ = ["callback_class"]


def _loader_batch_size(loader: Any) -> int | None:
    """Samples per micro batch of a (possibly accelerate-prepared) dataloader."""
    if loader is None:
        return None
    b = getattr(loader, "batch_size", None)
    if isinstance(b, int):
        return b
    sampler = getattr(loader, "batch_sampler", None)
    b = getattr(sampler, "batch_size", None)
    return b if isinstance(b, int) else None


def _callback_class() -> type:
    from transformers import TrainerCallback

    class AutofitCallback(TrainerCallback):
        """Runs the pre-flight check at ``on_train_begin``; raises ``PreflightError``.

        Args:
            dataset: the training samples; default: the train dataloader's dataset.
            device: as for ``preflight`` (default ``auto``).
            **options: any keyword of ``preflight`` except ``fix`` (``margin``,
                ``trial``, ``cache``, ``max_seq_len``, ``eval_dataset``,
                ``generate_max_new_tokens``, ``collator``, ``timeout_s``, ``trainer``:
                the callback sees the arguments, not the trainer, so a
                ``ChunkedLossTrainer`` is checked as one with ``trainer="autofit"``).

        At train begin it prints one line to stderr: fits or not, measured /
        estimated / from the cache, and the numbers (``PreflightReport.headline``).

        After ``on_train_begin``, ``report`` holds the ``PreflightReport``.

        Example:
            >>> cb = AutofitCallback(device="cpu", margin=0.05)  # doctest: +SKIP
            >>> Trainer(model, args, train_dataset=data, callbacks=[cb]).train()  # doctest: +SKIP
        """

        def __init__(self, dataset: object = None, *, device: str | DeviceInfo = 'auto',
                     **options: Any) -> None:
            if "fix" in options:
                raise BadInputError(
                    "AutofitCallback cannot fix: on_train_begin comes after the Trainer built "
                    "its dataloader; call autofit.preflight(trainer, fix=True) before "
                    "trainer.train() instead")
            self.dataset = dataset
            self.device = device
            self.options = options
            self.report: PreflightReport | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            loader = kwargs.get("train_dataloader")
            dataset = self.dataset if self.dataset is not None else getattr(loader, "dataset",
                                                                              None)
            live = _loader_batch_size(loader)
            report = preflight(args, model=kwargs.get("model"), dataset=dataset, fix=False,
                               device=self.device, raise_on_failure=False, **self.options)
            problems = list(report.problems)
            if live is not None and live != args.train_batch_size:
                problems.append(
                    f"the train dataloader yields batches of {live}, but the arguments say "
                    f"{args.train_batch_size}: they were changed after the Trainer was built; "
                    "use autofit.preflight(trainer, fix=True), which updates both")
            if problems != list(report.problems):
                from dataclasses import replace

                report = replace(report, fits=False, problems=tuple(problems))
            self.report = report
            # one visible line (logging may be off): stderr, beside the Trainer's progress bar
            print(report.headline(), file=sys.stderr, flush=True)
            if not report.fits:
                raise PreflightError(report, hint=(
                    "stopped before training; to shrink the micro batch while keeping the "
                    "effective batch, call autofit.preflight(trainer, fix=True) before "
                    "trainer.train()"))
            return control

    AutofitCallback.__module__ = "autofit.preflight"
    AutofitCallback.__qualname__ = "AutofitCallback"
    return AutofitCallback


@lru_cache(maxsize=1)
def callback_class() -> type:
    """``AutofitCallback``, built on first use (once) so that ``import autofit`` does not
    import transformers (it subclasses ``transformers.TrainerCallback``)."""
    return _callback_class()
