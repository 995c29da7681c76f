"""What a ``Trainer`` evaluation keeps for ``compute_metrics``, beside its step.

``Trainer.evaluation_loop`` adds every batch's logits (and labels) to a container and hands
them all to ``compute_metrics`` when the evaluation ends: on a card they stay on the device
unless ``eval_accumulation_steps`` moves them to the host every n steps; on the CPU the host
is the device, so they stay in any case. At the end the container concatenates them and
turns them into numpy arrays, so the whole evaluation set's logits are held about twice.
Measured on the CPU (a 4-layer llama, 32,000-token vocabulary, 32 evaluation samples of 128
tokens, eval batch 4; ``benchmarks/eval_predictions.py``, ``results/eval_predictions.md``):
``Trainer.evaluate()`` peaked 125 MiB above its start without ``compute_metrics``, 1000 MiB
with it (the fp32 logits of the set are 500 MiB), 997 MiB with ``eval_accumulation_steps=1``;
counted 1000 MiB beside the step.

Counted where the ``Trainer`` object is known (``autofit.preflight(trainer)``): a file does
not say whether its script passes ``compute_metrics``, nor do the arguments
``AutofitCallback`` sees. A
``preprocess_logits_for_metrics`` decides their size (the transformers examples' ``argmax``
keeps one integer a token): said, not counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autofit.preflight.verdict import PreflightReport

__all__ = ["kept_prediction_bytes", "with_kept_predictions"]

# how many copies of the kept predictions are alive at the evaluation's end (the container
# concatenates each batch's onto the earlier ones: the old and the new whole are alive at
# once): measured 875 MiB above the same evaluation without compute_metrics (1000 - 125) for
# 500 MiB of logits, 1.75 copies; 2 taken (the safe side)
_COPIES = 2


def kept_prediction_bytes(model: Any, samples: int, seq_len: int, *, autocast: bool,
                          half: bool) -> int | None:
    """Bytes of the logits and labels an evaluation of ``samples`` samples of at most
    ``seq_len`` tokens keeps for ``compute_metrics`` (``_COPIES`` copies), by the model's
    task (``autofit.probe.loading.module_task``): (T, V) for a language-model head, (T,
    labels) for token classification, (labels) for sequence classification; None for
    another. The logits are fp32 under autocast (accelerate converts the outputs) or in fp32
    weights, else 2 bytes."""
    from autofit.probe.loading import module_task

    task = module_task(model)  # the class's task (a PEFT model's base's)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    labels = int(getattr(config, "num_labels", 2) or 2)
    if task in ("causal-lm", "masked-lm", "seq2seq"):
        vocab = getattr(config, "vocab_size", None) or getattr(
            getattr(config, "get_text_config", lambda: None)(), "vocab_size", None)
        if not vocab:
            return None
        per_sample, label_elems = seq_len * int(vocab), seq_len
    elif task == "token-cls":
        per_sample, label_elems = seq_len * labels, seq_len
    elif task == "seq-cls":
        per_sample, label_elems = labels, 1
    else:
        return None
    elem = 4 if autocast or not half else 2
    return _COPIES * samples * (per_sample * elem + label_elems * 8)


def with_kept_predictions(report: PreflightReport, trainer: Any, fields: dict[str, object],
                          eval_dataset: Any, eval_seq: int | None, *, fix: bool,
                          margin: float) -> tuple[PreflightReport, dict[str, Any]]:
    """``report`` with what the trainer's evaluation keeps for ``compute_metrics`` beside
    its step: a reason line with its size, a problem when the evaluation then does not
    fit (on a card ``fix`` sets ``eval_accumulation_steps=1``: the predictions go to the
    host each step), or a reason that it is not counted. Returns the report and the
    fields to change."""
    e = report.eval_estimate
    if (trainer is None or e is None or eval_dataset is None or not eval_seq
            or getattr(trainer, "compute_metrics", None) is None
            or fields.get("prediction_loss_only") or fields.get("batch_eval_metrics")):
        return report, {}
    cpu = str(report.device).startswith("cpu")
    if not cpu and fields.get("eval_accumulation_steps"):
        return report, {}
    try:
        samples = len(eval_dataset)
    except TypeError:
        return report, {}
    from autofit.probe.device import format_bytes

    spec = report.config.precision_spec
    kept = (None if getattr(trainer, "preprocess_logits_for_metrics", None) is not None
            else kept_prediction_bytes(trainer.model, samples, eval_seq, autocast=spec.autocast,
                                       half=spec.param_dtype != "float32"))
    if kept is None:
        return dataclasses.replace(report, reasons=(
            *report.reasons, f"compute_metrics: the predictions of all {samples} evaluation "
            "samples stay until the evaluation ends; not counted (preprocess_logits_for_metrics "
            "or the model's head decides their size)")), {}
    need = (e.run_device_total_bytes or e.device_total_bytes) + kept
    budget = int(report.capacity_bytes * (1 - margin))
    line = (f"compute_metrics: the evaluation keeps the logits and labels of its {samples} "
            f"samples until it ends, ~{format_bytes(kept)} beside its step "
            f"(~{format_bytes(need)} in all)")
    if need <= budget:
        return dataclasses.replace(report, reasons=(*report.reasons, line)), {}
    if fix and not cpu:
        return dataclasses.replace(report, reasons=(
            *report.reasons, line, "fixed: eval_accumulation_steps 1 (the predictions go to "
            "the host after every evaluation step)")), {"eval_accumulation_steps": (None, 1)}
    how = ("a preprocess_logits_for_metrics that reduces them (argmax), or fewer evaluation "
           "samples" if cpu else "eval_accumulation_steps (they go to the host every n steps)")
    problem = (f"evaluation does not fit with compute_metrics' predictions: "
               f"~{format_bytes(need)} > {format_bytes(budget)} "
               f"({samples} samples' logits, ~{format_bytes(kept)}, kept until it ends); "
               f"set {how}")
    return dataclasses.replace(report, fits=False, problems=(*report.problems, problem),
                               reasons=(*report.reasons, line)), {}
