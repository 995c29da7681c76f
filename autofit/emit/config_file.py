"""The tuned file: TrainingArguments fields as YAML or JSON, with autofit's metadata beside them.

The file holds ``TrainingArguments`` fields only, so
``HfArgumentParser(TrainingArguments).parse_yaml_file`` (or ``parse_json_file``)
loads it as is. What autofit needs to check the plan again later (model,
sequence length, device, the estimate) travels in a comment line
``# autofit: {...}`` (YAML) or in a sibling ``<name>.autofit.json`` (JSON).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tuned.yaml"
    >>> _ = write_config(path, {"per_device_train_batch_size": 4}, {"model": "tiny-llama"})
    >>> read_config(path)
    ({'per_device_train_batch_size': 4}, {'model': 'tiny-llama'})
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autofit.errors import BadInputError

__all__ = ["write_config", "read_config"]

_META_PREFIX = "# autofit: "


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
