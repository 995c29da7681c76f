"""Samples as the training script sees them: packed into fixed-size blocks.

transformers' language-modeling examples (``run_clm.py``) tokenize the text, then
``group_texts``: concatenate the samples and cut the stream into ``block_size``-token
blocks, dropping the remainder. They map it batched: each 1000 samples are packed apart
(each batch drops its own remainder), as here. TRL's ``SFTTrainer`` with ``packing=True`` packs into
``max_length``-token rows by ``packing_strategy``:

- ``"bfd"``: best-fit decreasing; whole samples (truncated at the row size) share a row;
  rows are at most ``max_length`` tokens (``trl.data_utils._pack_bfd``).
- ``"bfd_split"``: the same, a longer sample split into row-sized fragments first.
- ``"wrapped"``: the stream cut every ``max_length`` tokens; the remainder is kept as a
  shorter row.

TRL packs through ``datasets.map`` too: each batch of 1000 samples apart.

The packed samples are plain ``{"input_ids": [...]}`` dicts: the rest of autofit reads
their lengths (every one the block size for ``group_texts``) and builds the worst-case
batch from them, as from any dataset.

    >>> pack_ids([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4)
    [[1, 2, 3, 4], [5, 6, 7, 8]]
    >>> [len(r) for r in pack_ids([[1] * 3, [2] * 2, [3] * 4], 4, "bfd")]
    [4, 3, 2]

Known limitations:
    NB: SFTTrainer runs "bfd" rows padding-free (a batch is one row of all its tokens,
    attention per sample through flash-attention's varlen kernel); autofit plans the batch
    as micro batch x row size, the same tokens, and counts the run's shapes by its batches'
    token counts (``ScriptData.padding_free``, ``RunOrder.other_shapes``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError, fix

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["STRATEGIES", "Packed", "ScriptData", "pack_ids", "pack_dataset", "check_block_size",
           "as_script_sees"]

# how a script packs: transformers' group_texts, or TRL's packing_strategy values
STRATEGIES = ("group_texts", "bfd", "bfd_split", "wrapped")
_MAP_BATCH = 1000  # datasets.map's default batch: group_texts and TRL pack each apart


@dataclass(frozen=True)
class Packed:
    """Packed samples and what packing did, for the reasons."""

    samples: list[dict[str, Any]]  # {"input_ids": [...]} per packed row
    block_size: int
    strategy: str
    source_samples: int
    source_tokens: int

    def reason(self, by: str = "") -> str:
        """One line: how many rows of which length, from how much data."""
        n = len(self.samples)
        rows = sum(len(s["input_ids"]) for s in self.samples)
        what = {"group_texts": "as group_texts does: concatenated, cut, each 1000 samples' "
                               "remainder dropped",
                "bfd": "best-fit decreasing, longer samples truncated",
                "bfd_split": "best-fit decreasing, longer samples split",
                "wrapped": "concatenated and cut, remainder kept"}[self.strategy]
        size = (f"{n:,} samples of {self.block_size}" if self.strategy == "group_texts"
                else f"{n:,} rows of up to {self.block_size}")
        return (f"samples packed into {self.block_size}-token blocks ({size} from "
                f"{self.source_tokens:,} tokens in {self.source_samples:,} samples, "
                f"{rows:,} tokens kept; {what})" + (f"{by}" if by else ""))


def check_block_size(block_size: Any, *, max_positions: int | None = None,
                     name: str | None = None) -> int:
    """``block_size`` as a positive int no longer than the model's learned positions.

    Raises:
        BadInputError: not a positive integer, or more tokens than ``max_positions``.
    """
    opt = name or fix("--block-size", "block_size=")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise BadInputError(f"{opt} must be a positive integer (tokens per block), got "
                            f"{block_size!r}: e.g. " + fix("--block-size 128", "block_size=128"))
    if max_positions is not None and block_size > max_positions:
        raise BadInputError(f"{opt} {block_size} is more than the model's {max_positions} "
                            f"learned positions: use {max_positions} or less")
    return block_size


def pack_ids(ids: list[list[int]], block_size: int,
             strategy: str = "group_texts") -> list[list[int]]:
    """Token-id rows packed by ``strategy`` (module docstring)."""
    if strategy == "group_texts":
        return _group_texts(ids, block_size)
    if strategy == "wrapped":
        out: list[list[int]] = []
        for start in range(0, len(ids), _MAP_BATCH):
            flat = [t for row in ids[start:start + _MAP_BATCH] for t in row]
            out += [flat[i:i + block_size] for i in range(0, len(flat), block_size)]
        return out
    if strategy in ("bfd", "bfd_split"):
        return [row for start in range(0, len(ids), _MAP_BATCH)
                for row in _best_fit_decreasing(ids[start:start + _MAP_BATCH], block_size,
                                                split=strategy == "bfd_split")]
    raise BadInputError(f"unknown packing strategy {strategy!r}; choose one of "
                        f"{', '.join(STRATEGIES)}")


def _group_texts(ids: list[list[int]], block_size: int) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(ids), _MAP_BATCH):  # run_clm.py maps group_texts batched
        flat = [t for row in ids[start:start + _MAP_BATCH] for t in row]
        total = (len(flat) // block_size) * block_size  # each batch's remainder is dropped
        out += [flat[i:i + block_size] for i in range(0, total, block_size)]
    return out


def _best_fit_decreasing(ids: list[list[int]], size: int, *, split: bool) -> list[list[int]]:
    """TRL's BFD: the longest sample first, into the row with the least room that holds it
    (a new row when none does); rows in the order they were opened."""
    pieces: list[list[int]] = []
    for row in ids:
        if not row:
            continue  # TRL drops empty samples
        if split:
            cuts = list(range(0, len(row), size))
            pieces += [row[i:i + size] for i in cuts]
        else:
            pieces.append(row[:size])
    order = sorted(range(len(pieces)), key=lambda i: -len(pieces[i]))  # stable: ties in order
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, bin index), sorted; free > 0
    for i in order:
        n = len(pieces[i])
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, b = room.pop(at)
        else:
            free, b = size, len(bins)
            bins.append([])
        bins[b] += pieces[i]
        if free - n > 0:
            bisect.insort(room, (free - n, b))
    return bins


def pack_dataset(dataset: object, block_size: int, *, strategy: str = "group_texts",
                 tokenizer: PreTrainedTokenizerBase | None = None, text_column: str | None = None,
                 text_suffix: str | None = None) -> Packed:
    """``dataset`` tokenized as ``probe_data`` reads it, then packed (module docstring).

    Raises:
        BadInputError: a bad block size, or one larger than the whole dataset (no block).
        EmptyDatasetError: the dataset has no samples.
    """
    from autofit.probe.data import sample_ids

    check_block_size(block_size)
    ids = sample_ids(dataset, tokenizer=tokenizer, text_column=text_column,
                     text_suffix=text_suffix)
    total = sum(len(r) for r in ids)
    rows = pack_ids(ids, block_size, strategy)
    if not rows:
        most = max(sum(len(r) for r in ids[i:i + _MAP_BATCH])
                   for i in range(0, len(ids), _MAP_BATCH))
        where = (f"the whole dataset's {total:,} tokens" if len(ids) <= _MAP_BATCH else
                 f"the {most:,} tokens of any {_MAP_BATCH} samples (packed apart)")
        raise BadInputError(
            f"{fix('--block-size', 'block_size=')} {block_size} is more than {where}: no "
            "block would be made; use " + fix(f"--block-size {most}", f"block_size={most}")
            + " or less, or more data")
    return Packed([{"input_ids": r} for r in rows], block_size, strategy, len(ids), total)


@dataclass(frozen=True)
class ScriptData:
    """The dataset as the training script will feed it, and how it got so."""

    dataset: Any  # the packed samples, or the dataset as given
    max_seq_len: int | None  # truncation of the samples (None when packed)
    block_size: int | None  # packed into blocks of this many tokens
    strategy: str | None  # how (STRATEGIES), when packed
    reasons: tuple[str, ...]
    source: str  # what asked for the block size, for messages: "--block-size", "SFTConfig..."
    # SFTTrainer's "bfd" rows run padding-free: each micro batch is one row of all its tokens
    padding_free: bool = False

    @property
    def meta(self) -> dict[str, Any]:
        """What a tuned file records so ``check`` re-derives the same data."""
        if self.block_size is None:
            return {}
        return {"block_size": self.block_size, **(
            {"packing": self.strategy} if self.strategy != "group_texts" else {})}


def as_script_sees(dataset: object, *, block_size: int | None = None,
                   max_seq_len: int | None = None, packing: str | None = None, sft: Any = None,
                   tokenizer: PreTrainedTokenizerBase | None = None, text_column: str | None = None
                   ) -> ScriptData:
    """``dataset`` packed into ``block_size`` blocks (``packing``: a strategy, default
    group_texts), or as ``trl.SFTTrainer`` prepares it for ``sft`` (an ``SFTConfig``):
    truncated at ``max_length``, or packed by its ``packing_strategy``. An explicit
    ``block_size`` / ``max_seq_len`` wins over the SFTConfig's.

    Raises:
        BadInputError: a bad block size, a block size with ``max_seq_len``, a block larger
            than the dataset.
    """
    opt = fix("--block-size", "block_size=")
    if block_size is not None:
        check_block_size(block_size)
        if max_seq_len is not None:
            raise BadInputError(f"give {opt} or {fix('--max-seq-len', 'max_seq_len=')}, not "
                                "both: packed blocks are never truncated")
        packed = pack_dataset(dataset, block_size, strategy=packing or "group_texts",
                              tokenizer=tokenizer, text_column=text_column)
        return ScriptData(packed.samples, None, block_size, packed.strategy,
                          (packed.reason(),), opt)
    if sft is None or max_seq_len is not None:
        return ScriptData(dataset, max_seq_len, None, None, (), opt)
    return _sft_sees(dataset, sft, tokenizer, text_column)


def _sft_sees(dataset: object, sft: Any, tokenizer: PreTrainedTokenizerBase | None,
              text_column: str | None) -> ScriptData:
    """What SFTTrainer makes of the dataset (``trl.SFTTrainer._prepare_dataset``): every text
    ends in the EOS token; then truncation at ``max_length``, or packing into it."""
    max_length = _sft_value(sft, "max_length")
    eos = _sft_value(sft, "eos_token") or getattr(tokenizer, "eos_token", None)
    if _sft_value(sft, "packing"):
        strategy = _sft_value(sft, "packing_strategy") or "bfd"
        name = f"SFTConfig.max_length (packing={strategy!r})"
        if max_length is None:
            raise BadInputError("SFTConfig packing=True needs max_length (SFTTrainer refuses "
                                "None): set max_length, e.g. 1024")
        check_block_size(max_length, name="SFTConfig.max_length")
        packed = pack_dataset(dataset, max_length, strategy=strategy, tokenizer=tokenizer,
                              text_column=text_column, text_suffix=eos)
        free = " (padding-free: planned as micro batch x the row size)" if strategy != "wrapped" \
            else ""
        return ScriptData(packed.samples, None, max_length, strategy,
                          (packed.reason(f"; SFTConfig packing=True, packing_strategy="
                                         f"{strategy!r}, as SFTTrainer packs{free}"),), name,
                          padding_free=strategy != "wrapped")
    if max_length is None:
        return ScriptData(dataset, None, None, None, (), "SFTConfig.max_length")
    why = f"samples truncated at {max_length} tokens: SFTConfig.max_length, as SFTTrainer does"
    if eos and tokenizer is not None and _has_text(dataset):
        from autofit.probe.data import sample_ids

        dataset = [{"input_ids": r} for r in sample_ids(
            dataset, tokenizer=tokenizer, text_column=text_column, text_suffix=eos)]
        why += f" (each text ending in {eos!r})"
    return ScriptData(dataset, max_length, None, None, (why,), "SFTConfig.max_length")


def _sft_value(sft: Any, name: str) -> Any:
    """``sft.<name>``: an ``SFTConfig``'s attribute, or a file's field (a ``trl sft --config``
    file: a mapping) with SFTConfig's own default where the file leaves it out."""
    if not isinstance(sft, dict):
        return getattr(sft, name, None)
    if name in sft:
        return sft[name]
    try:
        from dataclasses import MISSING, fields

        from trl import SFTConfig
    except ImportError:  # no trl: the file's fields only
        return None
    f = {f.name: f for f in fields(SFTConfig)}.get(name)
    return None if f is None or f.default is MISSING else f.default


def _has_text(dataset: object) -> bool:
    """Whether the samples are text to tokenize (no ``input_ids``)."""
    try:
        cols = (dataset.column_names if hasattr(dataset, "column_names")
                else list(dataset[0]) if isinstance(dataset[0], dict) else ["input_ids"])
    except (IndexError, KeyError, TypeError):
        return False
    return "input_ids" not in cols
