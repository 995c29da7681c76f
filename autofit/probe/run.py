"""The order of a training run: each micro batch's padded length, as the Trainer feeds them.

A ``transformers.Trainer`` run is thousands of micro batches whose padded length
varies, and the caching allocator's fragmentation depends on that sequence, not on
the longest batch alone. The sequence is known before the run:

* ``random`` sampling (the default): accelerate replaces the ``RandomSampler`` by its
  ``SeedableRandomSampler``, whose permutation of epoch ``e`` is
  ``torch.randperm(n, generator=Generator().manual_seed(seed + e))`` with ``seed`` the
  run's ``data_seed`` or else ``seed`` (``Trainer`` seeds torch with it before it
  builds the sampler, and ``set_epoch(e)`` is called at each epoch). Reproduced
  exactly (tests compare with a real ``Trainer.train()``).
* ``sequential``: the dataset's order, every epoch.
* ``group_by_length``: ``get_length_grouped_indices`` (megabatches of
  ``micro x accumulation`` samples sorted by length, the longest first) over a
  permutation drawn from torch's *global* generator, whose state at that point
  depends on everything the run drew before (dropout, initialisation): the order is
  drawn here with ``seed + e`` — the same distribution, not the same sequence
  (``RunOrder.exact`` is False and the note says so).
* ``batch_rebalance``: not modelled yet; the random order stands in for it
  (``exact`` False).

Each micro batch's length is its longest sample after truncation at
``max_seq_len``, rounded up to ``pad_to_multiple_of`` (``DataCollatorWithPadding``'s
rule); a last, smaller micro batch is kept unless ``drop_last``.

    >>> order = run_order([5, 9, 3, 7, 2, 8], micro_batch_size=2, sampling="sequential")
    >>> order.lengths, order.sizes
    ((9, 7, 8), (2, 2, 2))

Known limitations:
    NB: one process (``world_size`` 1); several ranks shard each batch (issue of the
    distributed knobs).
    NB: an ``IterableDataset`` has no order to know; ``max_steps`` then bounds the run
    and the lengths are those of the probe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autofit.errors import BadInputError

if TYPE_CHECKING:
    from autofit.config import TrainConfig

__all__ = ["RunOrder", "RunPlan", "run_order", "eval_order", "SAMPLINGS"]

SAMPLINGS = ("random", "sequential", "group_by_length", "batch_rebalance")


@dataclass(frozen=True)
class RunOrder:
    """The micro batches of a run, in order.

    Attributes:
        lengths: padded tokens per sample of each micro batch.
        sizes: samples in each micro batch (the last of an epoch may be smaller).
        epochs: how many epochs (or parts of one) the sequence covers.
        exact: the Trainer's own sequence (True) or one of the same distribution.
        note: how the order was obtained, for the reasons shown to the user.
        steps: micro batches of each optimizer step, in order (the accumulation; the
            last step of an epoch may have fewer: the Trainer steps at every epoch's end).
        tokens: tokens of each micro batch, its samples' own (truncated) lengths summed:
            a padding-free batch's one row.
    """

    lengths: tuple[int, ...]
    sizes: tuple[int, ...]
    epochs: float
    exact: bool
    note: str
    steps: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.lengths)

    def distinct(self) -> list[tuple[int, int]]:
        """The distinct ``(size, length)`` micro batches, longest first."""
        return sorted(set(zip(self.sizes, self.lengths, strict=True)),
                      key=lambda sl: (sl[1], sl[0]), reverse=True)

    def other_shapes(self, padding_free: bool = False, ran: int = 0) -> tuple[int, int]:
        """(shapes, of them replayed): the run's micro-batch shapes besides the longest
        (samples x padded length), the one a trial steps, and how many of them its first
        ``ran`` micro batches replayed. Padding-free, every batch is one row of its tokens
        (``tokens``), a shape no trial's (micro batch x row) batch has: all of them count,
        none replayed."""
        if padding_free:
            return len(set(self.tokens)), 0
        keys = set(zip(self.sizes, self.lengths, strict=True))
        longest = self.distinct()[0]
        done = set(zip(self.sizes[:ran], self.lengths[:ran], strict=True)) - {longest}
        return len(keys) - 1, len(done)


def _padded(n: int, max_seq_len: int | None, multiple: int | None) -> int:
    if max_seq_len is not None:
        n = min(n, max_seq_len)
    if multiple:
        n = multiple * math.ceil(n / multiple)
    return n


def _check(name: str, value: int | None, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInputError(f"{name} must be a positive integer, got {value!r}")


def _permutation(n: int, seed: int) -> list[int]:
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).tolist()


def _epoch_indices(lengths: Sequence[int], sampling: str, seed: int, epoch: int,
                   group: int) -> list[int]:
    n = len(lengths)
    if sampling == "sequential":
        return list(range(n))
    if sampling == "group_by_length":
        import torch
        from transformers.trainer_pt_utils import get_length_grouped_indices

        g = torch.Generator()
        g.manual_seed(seed + epoch)
        return get_length_grouped_indices(list(lengths), group, generator=g)
    return _permutation(n, seed + epoch)  # random, and batch_rebalance's stand-in


def run_order(
    sample_lengths: Sequence[int],
    *,
    micro_batch_size: int,
    grad_accum_steps: int = 1,
    epochs: float = 1.0,
    max_steps: int | None = None,
    seed: int = 42,
    data_seed: int | None = None,
    sampling: str = "random",
    drop_last: bool = False,
    pad_to_multiple_of: int | None = None,
    max_seq_len: int | None = None,
) -> RunOrder:
    """The run's micro batches in the order the Trainer feeds them (see the module docstring).

    Args:
        sample_lengths: tokens of every training sample, in dataset order.
        micro_batch_size: ``per_device_train_batch_size``.
        grad_accum_steps: ``gradient_accumulation_steps`` (groups for ``group_by_length``).
        epochs: ``num_train_epochs`` (a fraction stops inside the last epoch).
        max_steps: ``max_steps`` (optimizer steps); overrides ``epochs`` when set.
        seed: ``TrainingArguments.seed``; ``data_seed``: its ``data_seed``.
        sampling: ``train_sampling_strategy``.
        drop_last: ``dataloader_drop_last``.
        pad_to_multiple_of: the collator's ``pad_to_multiple_of``.
        max_seq_len: truncation length.
    """
    lengths = list(sample_lengths)
    if not lengths:
        raise BadInputError("no training samples: the run has no batches")
    _check("micro_batch_size", micro_batch_size, optional=False)
    _check("grad_accum_steps", grad_accum_steps, optional=False)
    _check("max_steps", max_steps)
    _check("pad_to_multiple_of", pad_to_multiple_of)
    _check("max_seq_len", max_seq_len)
    if sampling not in SAMPLINGS:
        raise BadInputError(f"unknown sampling {sampling!r}; choose one of {', '.join(SAMPLINGS)}")
    for name, v in (("seed", seed), ("data_seed", data_seed)):  # torch.Generator takes ints
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise BadInputError(f"{name} must be a whole number, got {v!r}")
    if not (isinstance(epochs, int | float) and not isinstance(epochs, bool) and epochs > 0
            and math.isfinite(epochs)):
        raise BadInputError(f"epochs must be a positive number, got {epochs!r}")
    n = len(lengths)
    per_epoch = n // micro_batch_size if drop_last else math.ceil(n / micro_batch_size)
    if per_epoch == 0:
        raise BadInputError(f"{n} samples make no full micro batch of {micro_batch_size} with "
                            "drop_last: lower the micro batch or keep the last batch")
    if max_steps is not None:
        # an epoch is ceil(batches / accumulation) optimizer steps: its last one may
        # accumulate fewer micro batches (the Trainer steps at the end of every epoch)
        updates = math.ceil(per_epoch / grad_accum_steps)
        full, rest = divmod(max_steps, updates)
        total = full * per_epoch + min(rest * grad_accum_steps, per_epoch)
    else:
        total = math.ceil(epochs * per_epoch)
    base = data_seed if data_seed is not None else seed
    out_lengths: list[int] = []
    out_sizes: list[int] = []
    out_tokens: list[int] = []
    steps: list[int] = []
    epoch = 0
    while len(out_lengths) < total:
        order = _epoch_indices(lengths, sampling, base, epoch,
                               micro_batch_size * grad_accum_steps)
        for k in range(per_epoch):
            rows = order[k * micro_batch_size:(k + 1) * micro_batch_size]
            out_lengths.append(_padded(max(lengths[i] for i in rows), max_seq_len,
                                       pad_to_multiple_of))
            out_sizes.append(len(rows))
            out_tokens.append(sum(_padded(lengths[i], max_seq_len, None) for i in rows))
            if k % grad_accum_steps == 0:
                steps.append(0)
            steps[-1] += 1
            if len(out_lengths) == total:
                break
        epoch += 1
    exact = sampling in ("random", "sequential")
    note = {
        "random": f"the Trainer's order (seed {base}, one permutation per epoch)",
        "sequential": "the dataset's order",
        "group_by_length": (f"a group_by_length order drawn with seed {base}: the Trainer "
                            "draws its own from torch's global generator (same distribution)"),
        "batch_rebalance": "batch_rebalance is not modelled: a random order stands in for it",
    }[sampling]
    return RunOrder(tuple(out_lengths), tuple(out_sizes), len(out_lengths) / per_epoch, exact,
                    note, tuple(steps), tuple(out_tokens))


def eval_order(sample_lengths: Sequence[int], *, eval_batch_size: int,
               pad_to_multiple_of: int | None = None,
               max_seq_len: int | None = None) -> RunOrder:
    """An evaluation pass: the eval dataset in order (the Trainer's eval sampler is sequential)."""
    return run_order(sample_lengths, micro_batch_size=eval_batch_size, sampling="sequential",
                     pad_to_multiple_of=pad_to_multiple_of, max_seq_len=max_seq_len)


@dataclass(frozen=True)
class RunPlan:
    """What the Trainer's arguments say of the run beyond one step: its order and its
    evaluations and saves (the defaults when no ``training_args`` are given)."""

    epochs: float = 1.0
    max_steps: int | None = None
    seed: int = 42
    data_seed: int | None = None
    sampling: str = "random"
    drop_last: bool = False
    eval_steps: int | None = None  # None: the run does not evaluate
    save_steps: int | None = None  # None: the run does not save
    assumed: bool = True  # no training_args: one evaluation and one save assumed

    @classmethod
    def of(cls, base_args: dict[str, object] | None) -> RunPlan:
        if base_args is None:  # autofit writes an eval batch: assume the run evaluates
            return cls(eval_steps=10**9, save_steps=10**9)
        a = base_args

        def every(strategy_key: str, steps_key: str) -> int | None:
            strategy = str(a.get(strategy_key) or "no").split(".")[-1].lower()
            if strategy in ("no", "none"):
                return None
            if strategy == "steps":
                n = a.get(steps_key) or a.get("logging_steps") or 500
                return max(1, int(n)) if float(n) >= 1 else None  # a fraction: at the end
            return 10**9  # epoch / best: at the end of the (first) epoch, modelled once
        max_steps = a.get("max_steps")
        evals = every("eval_strategy", "eval_steps")
        if evals is None and a.get("do_eval"):  # a script's trainer.evaluate() after training
            evals = 10**9
        return cls(epochs=float(a.get("num_train_epochs") or 1.0),
                   max_steps=int(max_steps) if max_steps and int(max_steps) > 0 else None,
                   seed=int(a.get("seed") or 42), data_seed=a.get("data_seed"),
                   sampling=str(a.get("train_sampling_strategy") or "random"),
                   drop_last=bool(a.get("dataloader_drop_last")),
                   eval_steps=evals, save_steps=every("save_strategy", "save_steps"),
                   assumed=False)

    def order(self, lengths: Sequence[int], config: TrainConfig, max_seq_len: int | None
              ) -> RunOrder:
        return run_order(lengths, micro_batch_size=config.micro_batch_size,
                         grad_accum_steps=config.grad_accum_steps, epochs=self.epochs,
                         max_steps=self.max_steps, seed=self.seed, data_seed=self.data_seed,
                         sampling=self.sampling if self.sampling in ("random", "sequential",
                                                                     "group_by_length")
                         else "random",
                         drop_last=self.drop_last, max_seq_len=max_seq_len)
