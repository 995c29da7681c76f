"""Datasets by reference, for the command line: bundled names, JSON/JSONL files, saved datasets.

    >>> data = load_dataset_ref("tiny-samples")
    >>> len(data), max(len(s["input_ids"]) for s in data)
    (256, 256)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autofit.errors import BadInputError

__all__ = ["bundled_datasets", "load_dataset_ref", "load_dataset_file"]

_DIR = Path(__file__).resolve().parent.parent / "data" / "datasets"


def bundled_datasets() -> list[str]:
    """Names of the datasets that ship with autofit (tokenized, offline)."""
    return sorted(p.stem for p in _DIR.glob("*.jsonl"))


def load_dataset_ref(ref: str) -> Any:
    """A dataset from a bundled name, a .json/.jsonl file or a ``save_to_disk`` directory."""
    p = Path(ref).expanduser()
    if p.is_file():
        return load_dataset_file(str(p))
    if p.is_dir():
        try:
            import datasets
        except ImportError:
            raise BadInputError(f"{ref} is a directory: reading it needs `pip install datasets`") from None
        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:  # noqa: BLE001 - datasets raises many types
            raise BadInputError(f"{ref}: not a dataset saved with save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else next(iter(ds))
            ds = ds[split]
        return ds
    if (_DIR / f"{ref}.jsonl").is_file():
        return load_dataset_file(str(_DIR / f"{ref}.jsonl"))
    raise BadInputError(
        f"dataset {ref!r} not found: give a .json/.jsonl file, a directory saved with "
        f"datasets' save_to_disk, or a bundled name ({', '.join(bundled_datasets())})"
    )


def load_dataset_file(path: str) -> list[Any]:
    """Samples from a .json (a list, or {"data": [...]}, or columns) or .jsonl file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise BadInputError(f"--dataset {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix.lower() == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInputError(f"--dataset {path}: not readable JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    elif isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        n = len(next(iter(data.values())))
        data = [{k: v[i] for k, v in data.items()} for i in range(n)]
    if not isinstance(data, list):
        raise BadInputError(
            f"--dataset {path}: expected a list of samples (dicts with input_ids or text)"
        )
    return data
