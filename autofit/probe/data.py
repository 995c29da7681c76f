"""Data probing: how long the samples are, and the largest batch a run will see.

A trial must never pass on a batch smaller than one the run meets later. With
the usual collator (pad to the longest sample of the batch, truncate at
``max_seq_len``) the largest batch is the ``micro_batch_size`` longest samples
after truncation, padded to the longest of them: ``worst_case_batch`` builds
exactly that, with labels.

    >>> from autofit.probe.data import worst_case_batch, probe_data
    >>> data = [{"input_ids": [1, 2, 3]}, {"input_ids": list(range(40))}, {"input_ids": [4]}]
    >>> batch = worst_case_batch(data, 2, max_seq_len=16)
    >>> tuple(batch["input_ids"].shape), int(batch["attention_mask"].sum())
    ((2, 16), 19)
    >>> probe_data(data).length_max
    40

Accepted datasets: a Hugging Face ``datasets.Dataset`` (tokenized, with an
``input_ids`` column, or with a text column plus ``tokenizer=``), a map-style
``torch.utils.data.Dataset`` and a list of dicts (or of token-id lists). A sample
is a dict with ``input_ids`` (list / tensor / array) and optionally
``attention_mask``, ``token_type_ids``, ``labels`` / ``label``; or a dict with a
text field (``text`` by default) and a tokenizer.

Known limitations:
    NB: fewer samples than ``micro_batch_size``: the longest samples are repeated
    to fill the batch (the run would see smaller batches; the trial stays on the
    safe side).
    NB: lengths are read from every sample (tokenizing a text column once); for
    a very large text dataset tokenize it first.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autofit.errors import BadInputError, EmptyDatasetError, UnknownTaskError

__all__ = ["DataInfo", "probe_data", "worst_case_batch", "random_batch"]

_TASKS = ("causal-lm", "masked-lm", "seq2seq", "seq-cls")
_TEXT_COLUMNS = ("text", "content", "sentence", "prompt")
_KEEP = ("input_ids", "attention_mask", "token_type_ids", "labels")
IGNORE_INDEX = -100  # labels the loss skips (padding)


@dataclass(frozen=True)
class DataInfo:
    """Lengths (in tokens, after truncation) and the worst-case batch of a dataset."""

    num_samples: int
    columns: tuple[str, ...]
    length_min: int
    length_mean: float
    length_p50: int
    length_p90: int
    length_p99: int
    length_max: int  # after truncation at max_seq_len
    untruncated_max: int
    num_truncated: int
    max_seq_len: int | None
    micro_batch_size: int
    worst_case_batch_shape: tuple[int, int]  # (B, T) of worst_case_batch
    text_column: str | None = None  # set when lengths came from a tokenizer

    def batch_shape(self, micro_batch_size: int) -> tuple[int, int]:
        """(B, T) of the worst-case batch for another micro batch size."""
        return (micro_batch_size, self.length_max)


def _check_task(task: str | None) -> str:
    t = (task or "causal-lm").strip().lower().replace("_", "-")
    if t not in _TASKS:
        raise UnknownTaskError(f"unknown task {task!r}; choose one of {', '.join(_TASKS)}")
    return t


def _to_list(x: Any) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]


class _View:
    """Random access to a dataset's samples as dicts, plus their lengths."""

    def __init__(
        self,
        dataset: Any,
        tokenizer: Any,
        max_seq_len: int | None,
        text_column: str | None,
    ) -> None:
        if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__getitem__"):
            raise BadInputError(
                f"a dataset must be a datasets.Dataset, a map-style torch Dataset or a list of "
                f"dicts, got {type(dataset).__name__}"
            )
        try:
            n = len(dataset)
        except TypeError:
            raise BadInputError(
                f"{type(dataset).__name__} has no length (an iterable dataset?); pass a map-style "
                "dataset or a list of samples"
            ) from None
        if n == 0:
            raise EmptyDatasetError("the dataset has no samples; give at least one")
        self.dataset = dataset
        self.n = n
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.hf = hasattr(dataset, "column_names") and hasattr(dataset, "features")
        first = dataset[0]
        self.columns = (
            tuple(dataset.column_names)
            if self.hf
            else (tuple(first) if isinstance(first, dict) else ("input_ids",))
        )
        self.text_column = None
        if "input_ids" not in self.columns:
            col = text_column or next((c for c in _TEXT_COLUMNS if c in self.columns), None)
            if col is None or col not in self.columns:
                raise BadInputError(
                    f"samples have neither input_ids nor a text column (columns: "
                    f"{', '.join(self.columns) or 'none'}); tokenize them or name text_column="
                )
            if tokenizer is None:
                raise BadInputError(
                    f"the dataset has text in {col!r} but no input_ids; pass tokenizer= "
                    "(or --tokenizer) to tokenize it"
                )
            self.text_column = col
        self.raw_lengths = self._lengths()

    def _lengths(self) -> list[int]:
        if self.text_column is not None:
            texts = self._column(self.text_column)
            out: list[int] = []
            for i in range(0, len(texts), 1000):
                enc = self.tokenizer(list(texts[i : i + 1000]), truncation=False)
                out.extend(len(ids) for ids in enc["input_ids"])
            return out
        if self.hf:
            try:  # fast path: arrow list lengths
                import pyarrow.compute as pc

                col = self.dataset.with_format("arrow")[:]["input_ids"]
                return [int(v) for v in pc.list_value_length(col).to_pylist()]
            except Exception:  # noqa: BLE001 - any layout arrow cannot measure: read them
                pass
            return [len(ids) for ids in self._column("input_ids")]
        return [len(_to_list(self._ids_of(self.dataset[i]))) for i in range(self.n)]

    def _column(self, name: str) -> list[Any]:
        if self.hf:
            return list(self.dataset[name])
        return [self.dataset[i][name] for i in range(self.n)]

    @staticmethod
    def _ids_of(sample: Any) -> Any:
        return sample["input_ids"] if isinstance(sample, dict) else sample

    def lengths(self) -> list[int]:
        m = self.max_seq_len
        return [min(x, m) for x in self.raw_lengths] if m else list(self.raw_lengths)

    def feature(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as a dict of lists, tokenized and truncated."""
        sample = self.dataset[i]
        if not isinstance(sample, dict):
            sample = {"input_ids": sample}
        out: dict[str, Any] = {}
        if self.text_column is not None:
            kw: dict[str, Any] = {"truncation": bool(self.max_seq_len)}
            if self.max_seq_len:
                kw["max_length"] = self.max_seq_len
            enc = self.tokenizer(sample[self.text_column], **kw)
            out.update({k: _to_list(v) for k, v in enc.items() if k in _KEEP})
        for k in _KEEP:
            if k in sample and k not in out:
                v = sample[k]
                out[k] = v if (k == "labels" and _is_scalar(v)) else _to_list(v)
        if "labels" not in out and "label" in sample:
            out["labels"] = sample["label"]
        if self.max_seq_len:
            for k, v in out.items():
                if isinstance(v, list):
                    out[k] = v[: self.max_seq_len]
        return out


def _is_scalar(v: Any) -> bool:
    if isinstance(v, (int, float)):
        return True
    return getattr(v, "ndim", None) == 0 or (hasattr(v, "dim") and v.dim() == 0)


def _percentile(sorted_lengths: Sequence[int], q: float) -> int:
    k = max(0, min(len(sorted_lengths) - 1, math.ceil(q * len(sorted_lengths)) - 1))
    return int(sorted_lengths[k])


def _check_batch_size(micro_batch_size: int) -> None:
    if (
        isinstance(micro_batch_size, bool)
        or not isinstance(micro_batch_size, int)
        or micro_batch_size <= 0
    ):
        raise BadInputError(
            f"micro_batch_size must be a positive integer, got {micro_batch_size!r}"
        )


def _check_max_len(max_seq_len: int | None) -> None:
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len <= 0):
        raise BadInputError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")


def probe_data(
    dataset: Any,
    micro_batch_size: int = 1,
    *,
    max_seq_len: int | None = None,
    tokenizer: Any = None,
    text_column: str | None = None,
) -> DataInfo:
    """Length statistics of ``dataset`` (tokens per sample after truncation).

    Raises:
        EmptyDatasetError: the dataset has no samples.
        BadInputError: the samples cannot be read as token ids.
    """
    _check_batch_size(micro_batch_size)
    _check_max_len(max_seq_len)
    view = _View(dataset, tokenizer, max_seq_len, text_column)
    lengths = view.lengths()
    s = sorted(lengths)
    return DataInfo(
        num_samples=view.n,
        columns=view.columns,
        length_min=s[0],
        length_mean=float(statistics.fmean(s)),
        length_p50=_percentile(s, 0.50),
        length_p90=_percentile(s, 0.90),
        length_p99=_percentile(s, 0.99),
        length_max=s[-1],
        untruncated_max=max(view.raw_lengths),
        num_truncated=sum(1 for x in view.raw_lengths if max_seq_len and x > max_seq_len),
        max_seq_len=max_seq_len,
        micro_batch_size=micro_batch_size,
        worst_case_batch_shape=(micro_batch_size, s[-1]),
        text_column=view.text_column,
    )


def worst_case_batch(
    dataset: Any,
    micro_batch_size: int,
    *,
    max_seq_len: int | None = None,
    tokenizer: Any = None,
    collator: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None,
    task: str | None = "causal-lm",
    text_column: str | None = None,
) -> dict[str, Any]:
    """The largest batch of ``micro_batch_size`` samples the run can meet, collated.

    The ``micro_batch_size`` longest samples (after truncation at ``max_seq_len``),
    padded on the right to the longest of them, with ``attention_mask`` and
    ``labels`` (causal-lm / masked-lm / seq2seq: the sample's labels or its
    input_ids, padding = -100; seq-cls: the sample's label or 0). A ``collator``
    (e.g. ``DataCollatorForLanguageModeling``) replaces the default padding; labels
    are added if it makes none.

    Raises:
        EmptyDatasetError: the dataset has no samples.
        BadInputError: bad batch size / length, or samples that are not token ids.
    """
    import torch

    _check_batch_size(micro_batch_size)
    _check_max_len(max_seq_len)
    t = _check_task(task)
    view = _View(dataset, tokenizer, max_seq_len, text_column)
    lengths = view.lengths()
    # the longest first; ties keep dataset order
    top = heapq.nlargest(
        min(micro_batch_size, view.n), range(view.n), key=lambda i: (lengths[i], -i)
    )
    chosen = [top[k % len(top)] for k in range(micro_batch_size)]
    features = [view.feature(i) for i in chosen]
    if collator is not None:
        batch = dict(collator(features))
        batch = {
            k: (v if isinstance(v, torch.Tensor) else torch.as_tensor(v)) for k, v in batch.items()
        }
        if "labels" not in batch:
            batch["labels"] = _labels_from_ids(batch, t)
        return batch
    pad_id = getattr(tokenizer, "pad_token_id", None)
    return _collate(features, t, 0 if pad_id is None else int(pad_id))


def _labels_from_ids(batch: dict[str, Any], task: str) -> Any:
    import torch

    ids = batch["input_ids"]
    if task == "seq-cls":
        return torch.zeros(ids.shape[0], dtype=torch.long)
    labels = ids.clone()
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = IGNORE_INDEX
    return labels


def _pad(rows: list[list[int]], value: int, width: int) -> Any:
    import torch

    out = torch.full((len(rows), width), value, dtype=torch.long)
    for r, row in enumerate(rows):
        out[r, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def _collate(features: list[dict[str, Any]], task: str, pad_id: int) -> dict[str, Any]:
    """Pad to the longest sample (right padding), add attention mask and labels."""
    import torch

    ids = [f["input_ids"] for f in features]
    width = max(len(r) for r in ids)
    batch: dict[str, Any] = {"input_ids": _pad(ids, pad_id, width)}
    if all("attention_mask" in f for f in features):
        batch["attention_mask"] = _pad([f["attention_mask"] for f in features], 0, width)
    else:
        batch["attention_mask"] = _pad([[1] * len(r) for r in ids], 0, width)
    if all("token_type_ids" in f for f in features):
        batch["token_type_ids"] = _pad([f["token_type_ids"] for f in features], 0, width)
    if task == "seq-cls":
        labels = [f.get("labels", 0) for f in features]
        batch["labels"] = torch.as_tensor([int(_to_list(x)[0]) for x in labels], dtype=torch.long)
        return batch
    if all(isinstance(f.get("labels"), list) for f in features):
        rows = [f["labels"] for f in features]
        batch["labels"] = _pad(rows, IGNORE_INDEX, max(len(r) for r in rows))
    else:
        batch["labels"] = _labels_from_ids(batch, task)
    return batch


def random_batch(
    batch_size: int,
    seq_len: int,
    *,
    vocab_size: int,
    task: str | None = "causal-lm",
    num_labels: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Random token ids of shape (B, T) with labels; the global RNG is not touched."""
    import torch

    _check_batch_size(batch_size)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise BadInputError(f"seq_len must be a positive integer, got {seq_len!r}")
    t = _check_task(task)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(vocab_size), (batch_size, seq_len), generator=g)
    batch: dict[str, Any] = {
        "input_ids": ids,
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
    }
    if t == "seq-cls":
        batch["labels"] = torch.randint(0, max(1, num_labels), (batch_size,), generator=g)
    elif t == "seq2seq":
        batch["labels"] = torch.randint(0, int(vocab_size), (batch_size, seq_len), generator=g)
    else:
        batch["labels"] = ids.clone()
    return batch
