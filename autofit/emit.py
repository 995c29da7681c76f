"""Turn a chosen TrainConfig into what trainers read: TrainingArguments, YAML, JSON.

The file ``FitResult.save("tuned.yaml")`` writes holds ``TrainingArguments``
fields only, so ``HfArgumentParser(TrainingArguments).parse_yaml_file`` (or
``parse_json_file``) loads it as is. What autofit needs to check the plan again
later (model, sequence length, device, the estimate) travels in a comment line
``# autofit: {...}`` (YAML) or in a sibling ``<name>.autofit.json`` (JSON).

    >>> from autofit import TrainConfig
    >>> training_arguments_dict(TrainConfig(micro_batch_size=4, grad_accum_steps=8,
    ...                         precision="bf16-mixed"), output_dir="out")["bf16"]
    True
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError

__all__ = [
    "training_arguments_dict",
    "build_training_arguments",
    "write_config",
    "read_config",
    "TUNED_FIELDS",
]

# The TrainingArguments fields autofit may change; everything else is the user's.
TUNED_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "bf16",
    "fp16",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "optim",
    "optim_args",
    "use_cpu",
    "per_device_eval_batch_size",
)
_META_PREFIX = "# autofit: "


def training_arguments_dict(
    config: TrainConfig,
    *,
    base: dict[str, Any] | None = None,
    output_dir: str = "autofit-output",
    use_cpu: bool = False,
) -> dict[str, Any]:
    """TrainingArguments keyword arguments for ``config``.

    ``base`` (a user's ``TrainingArguments.to_dict()`` or a plain dict) is kept;
    only the fields in ``TUNED_FIELDS`` change. ``*-true`` precisions set neither
    ``bf16`` nor ``fp16``: the model itself is loaded in that dtype (say so to the
    user: ``torch_dtype=torch.bfloat16``).
    """
    out: dict[str, Any] = dict(base or {})
    out.setdefault("output_dir", output_dir)
    out["per_device_train_batch_size"] = config.micro_batch_size
    out["gradient_accumulation_steps"] = config.grad_accum_steps
    out["bf16"] = config.precision == "bf16-mixed"
    out["fp16"] = config.precision == "16-mixed"
    out["gradient_checkpointing"] = config.gradient_checkpointing
    if config.gradient_checkpointing:
        out["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    else:
        out.pop("gradient_checkpointing_kwargs", None)
    out["optim"] = config.optimizer
    if config.optim_args:
        out["optim_args"] = config.optim_args
    else:
        out.pop("optim_args", None)
    if use_cpu:
        out["use_cpu"] = True
    # TrainingArguments.to_dict() carries enum values and internal fields: keep plain data
    return {k: (v.value if hasattr(v, "value") else v) for k, v in out.items()}


def build_training_arguments(kwargs: dict[str, Any]) -> Any:
    """``transformers.TrainingArguments(**kwargs)``, with autofit's error on failure."""
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


def write_config(path: str | Path, args: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write TrainingArguments fields (+ autofit's metadata) as YAML or JSON by suffix."""
    p = Path(path)
    suffix = p.suffix.lower()
    p.parent.mkdir(parents=True, exist_ok=True)
    if suffix in (".yaml", ".yml"):
        import yaml

        reasons = meta.get("reasons", [])
        header = ["# Tuned by autofit. Load with:",
                  "#   HfArgumentParser(TrainingArguments).parse_yaml_file(path)"]
        header += [f"#   - {r}" for r in reasons]
        header.append(_META_PREFIX + json.dumps(meta, separators=(",", ":"), default=str))
        p.write_text("\n".join(header) + "\n" + yaml.safe_dump(args, sort_keys=False))
    elif suffix == ".json":
        p.write_text(json.dumps(args, indent=2) + "\n")
        p.with_name(p.stem + ".autofit.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    else:
        raise BadInputError(f"unknown config format {p.suffix!r}; use a .yaml or .json file name")
    return p


def read_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read back (TrainingArguments fields, autofit metadata) from ``write_config``'s file."""
    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"{p}: no such file")
    text = p.read_text()
    meta: dict[str, Any] = {}
    if p.suffix.lower() in (".yaml", ".yml"):
        import yaml

        for line in text.splitlines():
            if line.startswith(_META_PREFIX):
                meta = json.loads(line[len(_META_PREFIX):])
        try:
            args = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise BadInputError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    elif p.suffix.lower() == ".json":
        try:
            args = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadInputError(f"{p}: not valid JSON ({e})") from None
        side = p.with_name(p.stem + ".autofit.json")
        if side.is_file():
            meta = json.loads(side.read_text())
    else:
        raise BadInputError(f"unknown config format {p.suffix!r}; use a .yaml or .json file")
    if not isinstance(args, dict):
        raise BadInputError(f"{p}: expected a mapping of TrainingArguments fields")
    return args, meta


def config_from_arguments(args: dict[str, Any], seq_len: int | None = None) -> TrainConfig:
    """The TrainConfig a TrainingArguments dict (or file) describes."""
    precision = "bf16-mixed" if args.get("bf16") else "16-mixed" if args.get("fp16") else "32-true"
    optim = args.get("optim", "adamw_torch")
    optim = getattr(optim, "value", optim)
    return TrainConfig(
        micro_batch_size=int(args.get("per_device_train_batch_size", 8)),
        grad_accum_steps=int(args.get("gradient_accumulation_steps", 1)),
        precision=precision,
        gradient_checkpointing=bool(args.get("gradient_checkpointing")
                                    or args.get("activation_checkpointing")),
        optimizer=str(optim),
        optim_args=args.get("optim_args") or None,
        seq_len=seq_len,
    )
