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
text field (``text`` by default) and a tokenizer. A text field that holds a list of words
(CoNLL's ``tokens`` beside ``ner_tags``, as transformers' ``run_ner.py`` reads it) is
tokenized as pre-split words (``is_split_into_words=True``, as that script does);
``labelled_words`` says whether the samples carry a label per word (token
classification).

Every sample is read once and checked: integer token ids, not empty, no negative id;
with the model's limits (``vocab_size=``, ``max_positions=``: the learned position
table) no id at or above the vocabulary and no sample longer than the positions after
truncation. All problems are reported at once, as one line that names the first
offending sample (0-based) and what to do.

Known limitations:
    NB: labels are not checked against the vocabulary (only input_ids).
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
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError, EmptyDatasetError, UnknownTaskError, fix

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from autofit.config import Batch, Collator

__all__ = ["DataInfo", "probe_data", "worst_case_batch", "random_batch", "check_batch",
           "sample_ids", "labelled_words"]

_TASKS = ("causal-lm", "masked-lm", "seq2seq", "seq-cls", "token-cls")
_TEXT_COLUMNS = ("text", "content", "sentence", "prompt", "tokens")
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
    # every sample's tokens after truncation, in dataset order (the run's order uses them)
    lengths: tuple[int, ...] = field(default=(), repr=False)

    def batch_shape(self, micro_batch_size: int) -> tuple[int, int]:
        """(B, T) of the worst-case batch for another micro batch size."""
        return (micro_batch_size, self.length_max)


def _check_task(task: str | None) -> str:
    t = (task or "causal-lm").strip().lower().replace("_", "-")
    if t not in _TASKS:
        raise UnknownTaskError(f"unknown task {task!r}; choose one of {', '.join(_TASKS)}")
    return t


def _to_list(x: object) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]


def _ids_array(x: object) -> array:
    """Token ids as an int64 array (C speed); TypeError / OverflowError for anything else
    (text, floats, nested lists, None)."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, int):
        return array("q", [x])
    if isinstance(x, (str, bytes)) or x is None:
        raise TypeError(type(x).__name__)
    return array("q", x)


def _not_ids(x: object) -> str:
    """What a value that is not a list of token ids holds, for the message."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (str, bytes, int, float)) or x is None or not hasattr(x, "__iter__"):
        bad = x
    else:
        bad = next((v for v in x if isinstance(v, bool) or not isinstance(v, int)), x)
    text = repr(bad)
    return f"{type(bad).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


@dataclass
class _Problems:
    """What is wrong with the samples: per kind, how many, the first sample and a detail."""

    found: dict[str, list[Any]] = field(default_factory=dict)  # kind -> [count, index, detail]

    def add(self, kind: str, index: int, detail: str = "") -> None:
        if kind in self.found:
            self.found[kind][0] += 1
        else:
            self.found[kind] = [1, index, detail]

    def raise_if_any(self, texts: dict[str, tuple[str, str]]) -> None:
        """One line: per kind, ``sample i <what> (<detail>): <fix>`` (or ``N samples ...``)."""
        parts = []
        for kind, (count, index, detail) in self.found.items():
            what, fix = texts[kind]
            if count == 1:
                head = f"sample {index} {what}" + (f" ({detail})" if detail else "")
            else:  # the phrases are singular: "has ..." / "is ..."
                verb, _, rest = what.partition(" ")
                what = {"has": "have", "is": "are"}.get(verb, verb) + " " + rest
                head = (f"{count} samples {what} (first: sample {index}"
                        + (f", {detail}" if detail else "") + ")")
            parts.append(f"{head}: {fix}")
        if parts:
            raise BadInputError("bad dataset: " + "; ".join(parts))


@dataclass
class _Scan:
    """Per sample (dataset order): untruncated length, smallest and largest token id."""

    lengths: list[int]
    mins: list[int | None]
    maxs: list[int | None]
    problems: _Problems
    unreadable: set[int]  # samples whose ids could not be read (length 0, not "empty")


def _scan(ids_of_samples: Iterable[tuple[int, object]]) -> _Scan:
    """Read every sample's ids once; unreadable ones are problems (length 0)."""
    scan = _Scan([], [], [], _Problems(), set())
    lengths, mins, maxs = scan.lengths, scan.mins, scan.maxs
    for i, ids in ids_of_samples:
        try:
            if ids is _MISSING:
                scan.problems.add("missing", i)
                raise ValueError
            a = _ids_array(ids)
        except (TypeError, ValueError, OverflowError):
            if ids is not _MISSING:
                scan.problems.add("type", i, f"got {_not_ids(ids)}")
            scan.unreadable.add(i)
            lengths.append(0)
            mins.append(None)
            maxs.append(None)
            continue
        lengths.append(len(a))
        mins.append(min(a) if a else None)
        maxs.append(max(a) if a else None)
    return scan


_MISSING = object()  # a sample without input_ids


class _View:
    """Random access to a dataset's samples as dicts, plus their lengths."""

    def __init__(
        self,
        dataset: object,
        tokenizer: PreTrainedTokenizerBase | None,
        max_seq_len: int | None,
        text_column: str | None,
        text_suffix: str | None = None,
    ) -> None:
        self.text_suffix = text_suffix  # appended to every text not ending with it (an EOS)
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
            # a column named like text that holds text or words (not ids called tokens)
            col = text_column or next((c for c in _TEXT_COLUMNS if c in self.columns and (
                not isinstance(first, dict) or _is_text(first.get(c)))), None)
            if col is None or col not in self.columns:
                raise BadInputError(
                    f"samples have neither input_ids nor a text column (columns: "
                    f"{', '.join(self.columns) or 'none'}); tokenize them or "
                    + fix("call the text column 'text'", "name it with text_column=")
                )
            if tokenizer is None:
                raise BadInputError(
                    f"the dataset has text in {col!r} but no input_ids; pass "
                    + fix("--tokenizer NAME", "tokenizer=") + " to tokenize it"
                )
            self.text_column = col
        # a list of words per sample (CoNLL's tokens): tokenized as pre-split words
        self.words = self.text_column is not None and _is_words(
            first.get(self.text_column) if isinstance(first, dict) else None)
        self.scan: _Scan | None = None  # per-sample ids; None after the arrow fast path
        self.id_range: tuple[int, int] | None = None  # (min, max) token id over all samples
        self.raw_lengths = self._lengths()

    def _lengths(self) -> list[int]:
        if self.hf and self.text_column is None:
            fast = self._arrow_lengths()
            if fast is not None:
                return fast
        self.scan = _scan(self._all_ids())
        ranges = [(lo, hi) for lo, hi in zip(self.scan.mins, self.scan.maxs, strict=True)
                  if lo is not None and hi is not None]
        if ranges:
            self.id_range = (min(r[0] for r in ranges), max(r[1] for r in ranges))
        return self.scan.lengths

    def _all_ids(self) -> Iterable[tuple[int, Any]]:
        """(index, input_ids) of every sample, tokenizing a text column in chunks of 1000."""
        if self.text_column is not None:
            texts = self._column(self.text_column)
            end = self.text_suffix
            if end:
                texts = [t if not isinstance(t, str) or t.endswith(end) else t + end
                         for t in texts]
            for start in range(0, len(texts), 1000):
                enc = self._encode(list(texts[start : start + 1000]), truncation=False)
                yield from enumerate(enc["input_ids"], start)
        elif self.hf:
            yield from enumerate(self._column("input_ids"))
        else:
            for i in range(self.n):
                sample = self.dataset[i]
                yield i, (sample.get("input_ids", _MISSING) if isinstance(sample, dict)
                          else sample)

    def _arrow_lengths(self) -> list[int] | None:
        """Lengths and the id range of a tokenized ``datasets.Dataset`` from its arrow column;
        None when the column is not a list of integers (then every sample is read)."""
        try:
            import pyarrow as pa
            import pyarrow.compute as pc

            col = self.dataset.with_format("arrow")[:]["input_ids"]
            if col.null_count or not pa.types.is_integer(col.type.value_type):
                return None
            lengths = [int(v) for v in pc.list_value_length(col).to_pylist()]
            mm = pc.min_max(pc.list_flatten(col)).as_py()
        except Exception:  # noqa: BLE001 - any layout arrow cannot measure: read them
            return None
        if mm["min"] is not None:
            self.id_range = (int(mm["min"]), int(mm["max"]))
        return lengths

    def validate(self, vocab_size: int | None = None, max_positions: int | None = None) -> None:
        """Raise one BadInputError listing every problem of the samples (module docstring)."""
        ids_bad = self.id_range is not None and (
            self.id_range[0] < 0 or (vocab_size is not None and self.id_range[1] >= vocab_size))
        if self.scan is None and ids_bad:  # the arrow fast path saw a bad id: find it
            self.scan = _scan(self._all_ids())
        problems = self.scan.problems if self.scan is not None else _Problems()
        if self.scan is not None and ids_bad:
            for i, (lo, hi) in enumerate(zip(self.scan.mins, self.scan.maxs, strict=True)):
                if lo is not None and lo < 0:
                    problems.add("negative", i, f"id {lo}")
                if hi is not None and vocab_size is not None and hi >= vocab_size:
                    problems.add("vocab", i, f"id {hi}")
        unreadable = self.scan.unreadable if self.scan is not None else set()
        for i, (raw, n) in enumerate(zip(self.raw_lengths, self.lengths(), strict=True)):
            if raw == 0 and i not in unreadable:
                problems.add("empty", i)
            if max_positions is not None and n > max_positions:
                problems.add("positions", i, f"{n} tokens" + (
                    f" after truncation at {self.max_seq_len}" if self.max_seq_len else ""))
        cut = max_positions or 0
        problems.raise_if_any({
            "type": ("has input_ids that are not integer token ids",
                     "tokenize the text first (or pass "
                     + fix("--tokenizer NAME", "tokenizer=") + ")"),
            "missing": ("has no input_ids", "give every sample input_ids (or a text column "
                        "and a tokenizer)"),
            "empty": ("has no tokens", "drop empty samples before tuning"),
            "negative": ("has a negative token id",
                         "token ids index the vocabulary from 0: tokenize with the model's "
                         "own tokenizer"),
            "vocab": (f"has token ids at or above the model's vocabulary size {vocab_size}",
                      "tokenize with the model's own tokenizer (or resize its embeddings)"),
            "positions": (f"is longer than the model's {max_positions} learned positions",
                          "truncate with " + fix(f"--max-seq-len {cut}", f"max_seq_len={cut}")),
        })

    def _encode(self, texts: list[Any], **kw: Any) -> Any:
        """The tokenizer on a batch of texts, or of word lists as pre-split words (as
        ``run_ner.py`` calls it). A byte-level BPE (GPT-2, RoBERTa) refuses words unless it
        was loaded with ``add_prefix_space=True``, as that script loads it: then each word
        follows a space, which is what that tokenizer makes of them."""
        if not self.words:
            return self.tokenizer(texts, **kw)
        try:
            return self.tokenizer(texts, is_split_into_words=True, **kw)
        except (ValueError, TypeError, AssertionError) as e:
            if "add_prefix_space" not in str(e):
                raise
            return self.tokenizer([" " + " ".join(map(str, w)) for w in texts], **kw)

    def _column(self, name: str) -> list[Any]:
        if self.hf:
            return list(self.dataset[name])
        return [self.dataset[i][name] for i in range(self.n)]

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
            enc = self._encode([sample[self.text_column]], **kw)
            out.update({k: _to_list(v[0]) for k, v in enc.items() if k in _KEEP})
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


def _is_text(v: object) -> bool:
    """A sample's text: a string, or a list of words."""
    return isinstance(v, str) or _is_words(v)


def _is_words(v: object) -> bool:
    """A sample's text given as a non-empty list of words."""
    return isinstance(v, (list, tuple)) and bool(v) and all(isinstance(w, str) for w in v)


def labelled_words(dataset: object, *, text_column: str | None = None) -> str | None:
    """The column of per-word labels when ``dataset``'s samples are words with a label per
    word, i.e. token classification data (CoNLL: ``tokens`` + ``ner_tags``; the label column
    as ``run_ner.py`` picks it: ``*_tags``, else the first other column of lists as long as
    the words, checked on the first 16 samples); None otherwise.

        >>> labelled_words([{"tokens": ["Alice", "ran"], "ner_tags": ["B-PER", "O"]}])
        'ner_tags'
        >>> labelled_words([{"text": "Alice ran"}]) is None
        True
    """
    try:
        n = min(16, len(dataset))  # type: ignore[arg-type]
        samples = [dataset[i] for i in range(n)]  # type: ignore[index]
    except (TypeError, KeyError, IndexError):
        return None
    if not samples or not all(isinstance(s, dict) for s in samples):
        return None
    words = text_column or ("tokens" if "tokens" in samples[0] else next(
        (c for c, v in samples[0].items() if _is_words(v)), None))
    if words is None or not all(_is_words(s.get(words)) for s in samples):
        return None
    others = [c for c in samples[0] if c != words]
    for col in sorted(others, key=lambda c: not c.endswith("_tags")):
        if all(isinstance(s.get(col), (list, tuple)) and len(s[col]) == len(s[words])
               for s in samples):
            return col
    return None


def _is_scalar(v: object) -> bool:
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
    dataset: object,
    micro_batch_size: int = 1,
    *,
    max_seq_len: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    text_column: str | None = None,
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> DataInfo:
    """Length statistics of ``dataset`` (tokens per sample after truncation), every sample
    checked (module docstring).

    Args:
        vocab_size: the model's vocabulary: every token id must be below it.
        max_positions: the model's learned positions: no sample may be longer after
            truncation (None for rotary / relative positions, which have no table).

    Raises:
        EmptyDatasetError: the dataset has no samples.
        BadInputError: the samples cannot be read as token ids, or break the limits:
            one line listing every problem.
    """
    _check_batch_size(micro_batch_size)
    _check_max_len(max_seq_len)
    view = _View(dataset, tokenizer, max_seq_len, text_column)
    view.validate(vocab_size, max_positions)
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
        lengths=tuple(lengths),
    )


def sample_ids(dataset: object, *, tokenizer: PreTrainedTokenizerBase | None = None,
               text_column: str | None = None, text_suffix: str | None = None) -> list[list[int]]:
    """Every sample's token ids, in dataset order (a text column tokenized, each text ending
    in ``text_suffix`` first); every sample checked as ``probe_data`` checks it."""
    view = _View(dataset, tokenizer, None, text_column, text_suffix)
    view.validate()
    if view.scan is None:  # the arrow fast path read lengths only
        return [list(map(int, ids)) for ids in view._column("input_ids")]
    return [[int(v) for v in _ids_array(ids)] for _, ids in view._all_ids()]


def worst_case_batch(
    dataset: object,
    micro_batch_size: int,
    *,
    max_seq_len: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    collator: Collator | None = None,
    task: str | None = "causal-lm",
    text_column: str | None = None,
) -> dict[str, Any]:
    """The largest batch of ``micro_batch_size`` samples the run can meet, collated.

    The ``micro_batch_size`` longest samples (after truncation at ``max_seq_len``),
    padded on the right to the longest of them, with ``attention_mask`` and
    ``labels`` (causal-lm / masked-lm / seq2seq: the sample's labels or its
    input_ids, padding = -100; seq-cls: the sample's label or 0; token-cls: the sample's
    per-token labels or 0 per token, padding = -100). A ``collator``
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
    view.validate()
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


def _labels_from_ids(batch: Batch, task: str) -> Any:
    import torch

    ids = batch["input_ids"]
    if task == "seq-cls":
        return torch.zeros(ids.shape[0], dtype=torch.long)
    # token-cls: class 0 for every token (a label per token, as the model's classifier
    # expects; the values do not change memory), the LMs: the input ids
    labels = torch.zeros_like(ids) if task == "token-cls" else ids.clone()
    if "attention_mask" in batch:
        labels[batch["attention_mask"] == 0] = IGNORE_INDEX
    return labels


def _pad(rows: list[list[int]], value: int, width: int) -> Any:
    import torch

    out = torch.full((len(rows), width), value, dtype=torch.long)
    for r, row in enumerate(rows):
        out[r, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def _collate(features: list[dict[str, object]], task: str, pad_id: int) -> dict[str, Any]:
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


def check_batch(batch: Batch, *, vocab_size: int | None = None,
                max_positions: int | None = None) -> None:
    """A collated batch's ``input_ids`` are integer token ids the model can embed: none
    negative or at/above ``vocab_size``, no row longer than ``max_positions`` (learned
    positions). One BadInputError listing every problem.
    """
    import torch

    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(ids, torch.Tensor):
        raise BadInputError("a batch is a dict with an input_ids tensor of token ids")
    if ids.numel() == 0:
        raise BadInputError(f"the batch's input_ids are empty (shape {tuple(ids.shape)}): "
                            "give at least one token per sample")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise BadInputError(f"the batch's input_ids must be integer token ids, got {ids.dtype}: "
                            "tokenize the text first")
    rows = ids.reshape(ids.shape[0], -1) if ids.dim() > 1 else ids.reshape(1, -1)
    problems = []
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0:
        r = int((rows < 0).any(dim=1).nonzero()[0])
        problems.append(f"row {r} has a negative token id ({lo}): token ids index the "
                        "vocabulary from 0")
    if vocab_size is not None and hi >= vocab_size:
        r = int((rows >= vocab_size).any(dim=1).nonzero()[0])
        problems.append(f"row {r} has token id {hi}, at or above the model's vocabulary size "
                        f"{vocab_size}: tokenize with the model's own tokenizer")
    length = int(rows.shape[-1])
    if max_positions is not None and length > max_positions:
        problems.append(f"{length} tokens per sample, more than the model's {max_positions} "
                        f"learned positions: use seq_len={max_positions} (--seq-len "
                        f"{max_positions}) or less")
    if problems:
        raise BadInputError("bad batch: " + "; ".join(problems))


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
    elif t == "token-cls":
        batch["labels"] = torch.randint(0, max(1, num_labels), (batch_size, seq_len),
                                        generator=g)
    elif t == "seq2seq":
        batch["labels"] = torch.randint(0, int(vocab_size), (batch_size, seq_len), generator=g)
    else:
        batch["labels"] = ids.clone()
    return batch
