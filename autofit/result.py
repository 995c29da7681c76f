"""``FitResult``: what ``autofit()`` returns — the choice, its evidence, and how to use it.

    result = autofit(model, dataset, device="cpu:4GiB", target_batch_size=32)
    result.config               # the TrainConfig chosen
    result.training_arguments   # transformers.TrainingArguments, ready for Trainer
    result.save("tuned.yaml")   # loadable by HfArgumentParser(TrainingArguments)
    print(result.reasons)       # why
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.config import TrainConfig
from autofit.memory.breakdown import MemoryEstimate

__all__ = ["FitResult"]


@dataclass(frozen=True)
class FitResult:
    """The configuration chosen for a model, a dataset and a device.

    Attributes:
        config: the chosen ``TrainConfig``.
        estimate: the ``MemoryEstimate`` of the choice (calibrated by trials when
            ``confirmed``).
        trials: every ``TrialResult`` measured on the device, in order.
        reasons: why each automatic choice was made, one line each.
        confirmed: True when the choice was measured on the device; False when it
            was planned from the estimate alone (e.g. for a card not present).
        candidates: one row per combination considered (estimated / measured
            peak, throughput, status and reason).
        training_arguments_kwargs: the ``TrainingArguments`` fields.
        meta: what ``autofit check`` needs to verify the plan later.
        from_cache: answered from the study cache, with no trial.
        eval_micro_batch: ``per_device_eval_batch_size``, tuned apart from training
            (``autofit.memory.eval.tune_eval_batch``); None when not tuned.
        predicted_run_bytes: what the whole run is predicted to need on the device:
            the confirmed trial's measured step (else the calibrated estimate) + what
            the modelled run adds above it (``autofit.memory.run``), or an evaluation
            when it needs more; None when not known (an answer from an old cache).
    """

    config: TrainConfig
    estimate: MemoryEstimate
    trials: tuple[Any, ...]
    reasons: tuple[str, ...]
    confirmed: bool
    device: str
    candidates: tuple[dict[str, Any], ...] = ()
    training_arguments_kwargs: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    from_cache: bool = False
    eval_micro_batch: int | None = None
    predicted_run_bytes: int | None = None

    @property
    def training_arguments(self) -> Any:
        """A ``transformers.TrainingArguments`` with the tuned fields (a ``trl.SFTConfig``
        when the user's ``training_args`` was one).

        Raises:
            BadInputError: when they cannot be built on this machine (e.g. bf16 on
                a machine without a bf16 GPU, for a plan made for another card);
                the message says to ``save()`` and load the file on the target.
        """
        from autofit.emit import build_training_arguments

        return build_training_arguments(dict(self.training_arguments_kwargs),
                                        self.meta.get("arguments_class"))

    @property
    def ooms(self) -> int:
        """How many trials ran out of memory."""
        return sum(1 for t in self.trials if getattr(t, "oom", False))

    def save(self, path: str | Path, *, source: str | Path | None = None) -> Path:
        """Write the TrainingArguments fields as YAML or JSON (by suffix).

        ``source``: the user's arguments file the run was tuned from (``autofit tune
        --training-args``): the output is that file with only the tuned fields changed —
        every other key (a script's model and data keys too), its order and, YAML to
        YAML, its comments kept.

        With several ranks (``config.world_size > 1``) the launch configs go beside it
        (``autofit.emit.launch``): ``<stem>-accelerate.yaml`` and, for ZeRO,
        ``<stem>-deepspeed.json`` (the file's ``deepspeed`` field points at it).

        Raises:
            BadInputError: ``path`` is not a .yaml/.yml/.json name or cannot be written
                (a folder, a read-only file or folder); nothing is written then.
        """
        from autofit.emit import write_config

        meta = dict(self.meta)
        meta["reasons"] = list(self.reasons)
        meta["confirmed"] = self.confirmed
        meta["config"] = self.config.to_dict()
        meta["estimate"] = {k: v for k, v in self.estimate.to_dict().items()
                            if k != "headroom_bytes"}
        # what `autofit report` draws from the file alone
        from autofit.report.files import trial_summary

        meta["candidates"] = list(self.candidates)
        meta["trials"] = [trial_summary(t) for t in self.trials]
        meta["eval_micro_batch"] = self.eval_micro_batch
        # several ranks: the DeepSpeed JSON and the accelerate config beside the file
        from autofit.emit.launch import launch_files

        args, beside, launch = launch_files(path, self.config, self.training_arguments_kwargs)
        meta.update(launch)
        if source is not None:
            from autofit.emit.args_file import read_args_file

            source = read_args_file(source)
        return write_config(path, args, meta, beside, source=source)

    def report(self, path: str | Path | None = None) -> tuple[Path, Path]:
        """Draw the memory breakdown and the candidates as ``<stem>.png`` + ``<stem>.html``.

        ``path`` names the files by its stem (``"tuned.yaml"`` -> ``tuned.png``,
        ``tuned.html`` beside it; default ``autofit-report`` in the working
        directory). The HTML page is self-contained (the PNG inlined).

        Raises:
            BadInputError: the ``.png`` or ``.html`` cannot be written there (``path`` a
                folder, a read-only folder or file), found before anything is drawn.
        """
        from autofit.emit import check_output
        from autofit.report.files import report_data_from_result, write_report

        p = Path(path) if path is not None else Path("autofit-report")
        check_output(p, writes=[p.with_suffix(".png"), p.with_suffix(".html")], name="path")
        return write_report(report_data_from_result(self), p)

    def summary(self) -> str:
        """The choice and its reasons as plain text."""
        lines = [f"autofit: {'confirmed' if self.confirmed else 'UNCONFIRMED (estimate only)'} "
                 f"choice for {self.device}"]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
