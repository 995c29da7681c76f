"""A chosen TrainConfig as ``TrainingArguments`` fields, and back.

    >>> from autofit import TrainConfig
    >>> training_arguments_dict(TrainConfig(micro_batch_size=4, grad_accum_steps=8,
    ...                         precision="bf16-mixed"), output_dir="out")["bf16"]
    True
"""

from __future__ import annotations

from typing import Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError
from autofit.knobs import KNOBS, emit_fields, owned_fields
from autofit.knobs.trl_loss import SFT_CONFIG

__all__ = [
    "training_arguments_dict",
    "build_training_arguments",
    "config_from_arguments",
    "TUNED_FIELDS",
]

# The TrainingArguments fields autofit may change (every knob's fields included); everything
# else is the user's.
TUNED_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", *owned_fields(),
                "use_cpu", "per_device_eval_batch_size")


def training_arguments_dict(
    config: TrainConfig,
    *,
    base: dict[str, object] | None = None,
    output_dir: str = "autofit-output",
    use_cpu: bool = False,
) -> dict[str, Any]:
    """TrainingArguments keyword arguments for ``config``.

    ``base`` (a user's ``TrainingArguments.to_dict()`` or a plain dict) is kept;
    only the fields in ``TUNED_FIELDS`` change: the batch, the accumulation, and
    each knob's fields as the knob writes them (with the field names of the
    installed transformers). ``*-true`` precisions set neither ``bf16`` nor
    ``fp16``: the model itself is loaded in that dtype (``Knob.note`` says so).
    """
    out: dict[str, Any] = dict(base or {})
    out.setdefault("output_dir", output_dir)
    out["per_device_train_batch_size"] = config.micro_batch_size
    out["gradient_accumulation_steps"] = config.grad_accum_steps
    if use_cpu:
        out["use_cpu"] = True  # before the knobs: what a knob writes may depend on it
    emit_fields(config, out)
    # TrainingArguments.to_dict() carries enum values and internal fields: keep plain data
    return {k: (v.value if hasattr(v, "value") else v) for k, v in out.items()}


def build_training_arguments(kwargs: dict[str, object], cls: str | None = None) -> Any:
    """``transformers.TrainingArguments(**kwargs)`` (``trl.SFTConfig`` when ``cls`` is
    ``"trl.SFTConfig"``: the user's arguments were one), with autofit's error on failure."""
    if cls == SFT_CONFIG:
        from autofit.errors import require

        require("trl", "the plan's trl.SFTConfig")
        from trl import SFTConfig as TrainingArguments
    else:
        from transformers import TrainingArguments

    try:
        return TrainingArguments(**kwargs)
    except (ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0]
        raise BadInputError(
            f"TrainingArguments cannot be built on this machine ({first}); save the plan with "
            "result.save('tuned.yaml') and load it on the target machine with "
            "HfArgumentParser(TrainingArguments).parse_yaml_file('tuned.yaml')"
        ) from None


def config_from_arguments(args: dict[str, object], seq_len: int | None = None, *,
                          source: str = "the TrainingArguments fields",
                          extra: tuple[str, ...] = ()) -> TrainConfig:
    """The TrainConfig a TrainingArguments dict (or file) describes (each knob reads its own).

    The fields are checked first as TrainingArguments would (``check_training_arguments``;
    ``extra`` names keys the caller reads itself), so a wrong one is a one-line
    ``InvalidArgumentsError`` listing every problem, never a raw ``ValueError``.
    """
    from autofit.emit.validate import check_training_arguments

    check_training_arguments(args, source=source, extra=extra)
    knobs = {k.name: k.read(args) for k in KNOBS}
    from autofit.knobs.checkpointing import every_n_layers

    n = every_n_layers(args)
    if knobs.get("gradient_checkpointing") and n > 1:
        from autofit.errors import UnmodelledStepError

        raise UnmodelledStepError(
            f"{source}: activation_checkpointing_kwargs every_n_layers {n} (the layers between "
            "checkpoints keep their activations) is not modelled: an estimate of every layer "
            "checkpointed would be low; drop it (every layer), or measure the step on the "
            "device (autofit measure)")
    mode = args.get("torch_compile_mode") if knobs.get("torch_compile") else None
    # no TrainingArguments field says it: accelerate launch's environment, which the
    # Trainer's TorchDynamoPlugin reads (autofit.knobs.compile.regional_from_env)
    from autofit.knobs.compile import regional_from_env

    regional = bool(knobs.get("torch_compile")) and regional_from_env()
    return TrainConfig(
        micro_batch_size=int(args.get("per_device_train_batch_size", 8)),
        grad_accum_steps=int(args.get("gradient_accumulation_steps", 1)),
        optim_args=args.get("optim_args") or None,
        seq_len=seq_len,
        torch_compile_mode=str(mode) if mode else None,
        torch_compile_regional=regional,
        **knobs,
    )
