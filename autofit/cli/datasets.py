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


def load_dataset_ref(ref: Any) -> Any:
    """A dataset from a bundled name, a .json/.jsonl file or a ``save_to_disk`` directory (a
    dataset already loaded, not a name: itself)."""
    if not isinstance(ref, (str, Path)):
        return ref
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
    """Samples from a .json or .jsonl file, read as ``datasets``' json loader reads them: one
    JSON object per line (either suffix), a list of objects (or of strings: ``text``),
    ``{"data": [...]}``, or an object of columns (``{"text": [...]}``)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise BadInputError(f"--dataset {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"--dataset {path}: not a UTF-8 JSON text file ({e})") from None
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark, as datasets tolerates
    data = _json_lines(text, path) if p.suffix.lower() == ".jsonl" else _json(text, path)
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    elif isinstance(data, dict) and _columns(data):
        n = len(next(iter(data.values())))
        data = [{k: v[i] for k, v in data.items()} for i in range(n)]
    elif isinstance(data, dict):
        data = [data]  # one JSON object: one sample (a JSON-lines file of one line)
    if isinstance(data, list) and data and all(isinstance(x, str) for x in data):
        data = [{"text": x} for x in data]  # a list of strings: a text column, as datasets
    if not isinstance(data, list):
        raise BadInputError(
            f"--dataset {path}: expected a list of samples (dicts with input_ids or text)"
        )
    return data


def _json(text: str, path: str) -> Any:
    """One JSON document, else JSON lines (``datasets`` reads a .json of lines too)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":
            raise BadInputError(f"--dataset {path}: not readable JSON ({e})") from None
    except RecursionError:
        raise BadInputError(f"--dataset {path}: JSON nested too deeply to be a dataset") from None
    return _json_lines(text, path)


def _json_lines(text: str, path: str) -> list[Any]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise BadInputError(f"--dataset {path}: line {n} is not readable JSON ({e}); "
                                "give one JSON object per line") from None
        except RecursionError:
            raise BadInputError(f"--dataset {path}: line {n} is JSON nested too deeply to be "
                                "a sample") from None
    return out


def _columns(data: dict[str, object]) -> bool:
    """Whether an object holds columns of equal length (not one sample's lists of ids)."""
    values = list(data.values())
    if not values or not all(isinstance(v, list) for v in values):
        return False
    if len({len(v) for v in values}) != 1:
        return False
    ids = data.get("input_ids")
    return ids is None or not ids or isinstance(ids[0], (list, tuple))

