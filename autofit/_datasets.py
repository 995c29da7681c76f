"""Datasets by reference, for the command line: bundled names, JSON/JSONL files, saved datasets.

    >>> data = load_dataset_ref("tiny-samples")
    >>> len(data), max(len(s["input_ids"]) for s in data)
    (256, 256)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autofit.errors import BadInputError

__all__ = ["bundled_datasets", "load_dataset_ref"]

_DIR = Path(__file__).resolve().parent / "data" / "datasets"


def bundled_datasets() -> list[str]:
    """Names of the datasets that ship with autofit (tokenized, offline)."""
    return sorted(p.stem for p in _DIR.glob("*.jsonl"))


def load_dataset_ref(ref: str) -> Any:
    """A dataset from a bundled name, a .json/.jsonl file or a ``save_to_disk`` directory."""
    from autofit._cli_measure import load_dataset_file

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
