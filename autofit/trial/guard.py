"""``autofit.guard(trainer)``: an out-of-memory error inside a micro step is absorbed, the math kept.

autofit plans a run so that it fits; the run still meets what no plan sees (a batch
longer than any in the sample, a neighbour process on a shared card). Guarded, the
trainer's micro step that runs out of memory is split and run again::

    trainer = Trainer(model=model, args=args, train_dataset=train)
    autofit.guard(trainer)          # any Trainer subclass, TRL's SFTTrainer included
    trainer.train()

When ``training_step`` raises an out-of-memory error (``autofit.is_oom``: CUDA, the CPU
allocator, ...), the guard frees what the failed attempt held, splits the same micro
batch into k chunks (2, 4, ... up to one sample each) along the batch dimension, and
runs them one after the other inside the same ``training_step`` call. Nothing the
Trainer owns changes: the dataloader, the step counters, the learning-rate schedule,
the optimizer state and the effective batch are those of the unguarded run.

The math: each chunk's loss is weighted as the Trainer weights micro batches.

* With ``num_items_in_batch`` (the Trainer counts the label tokens of the whole
  accumulation window; transformers' causal-LM losses sum and divide by it), a chunk's
  loss is already ``sum_chunk / N``: the chunks' gradients add up to the micro batch's.
* Without it (a model whose forward takes no loss kwargs: the loss is a mean over the
  micro batch), chunk c's loss is multiplied by ``n_c / n`` — its share of the micro
  batch's label items (tokens after the causal shift, or samples) — so the weighted
  chunk means add up to the micro batch's mean.
* An OOM in *backward* may come after some parameters' gradients were already
  accumulated (autograd accumulates a leaf's gradient once per backward, when it is
  complete). The guard records which parameters were accumulated during the attempt
  (``register_post_accumulate_grad_hook``); in the split rerun their incoming gradients
  are replaced by zeros, so each parameter receives this micro batch's gradient exactly
  once. Those gradients are the same sum as the chunks' (NB: up to floating-point
  summation order; with dropout, their masks are the failed attempt's).

The split persists for micro batches at least as long (in tokens) as the one that
failed; on one process a shorter one runs in as many pieces as keep about the tokens
per piece that ran (``_Guard.k_for``; on several ranks it runs whole). The split is retried one level up (k / 2) after
``retry_after`` guarded steps without an OOM. Evaluation is guarded the same way: ``prediction_step`` of a batch that
does not fit is split, the losses weighted by items and the logits and labels
concatenated, so the metrics equal the unsplit ones.

Every rescue is one line on stderr and in the log (logger ``"autofit"``), and one JSON
line in ``record`` (default ``<output_dir>/autofit-guard.jsonl``): step, batch shape,
k, the measured peak. ``autofit check`` reads such a record beside a tuned file.

Known limitations (named in the message when they happen):
    NB: an OOM in the optimizer step, in a collective or while loading the model is not
    inside a micro step: it cannot be split, and is raised as before (with a note).
    NB: several processes: plain data parallelism (DDP) only. Its micro steps run under
    ``no_sync`` and the ranks agree on the split after each (one small all-reduce), the
    gradients averaged after the window's last backward (not overlapped with it); see
    ``_Ranks``. FSDP and DeepSpeed gather and scatter weights inside forward and backward,
    so a rank that splits would run more collectives than the others: ``guard`` refuses
    them rather than hang the ranks.
    NB: a micro batch of one sample that does not fit cannot be split: that OOM is
    raised, with the rescue history in its note.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError
from autofit.trial.oom import is_oom

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from transformers import Trainer
    from transformers.trainer_utils import TrainOutput

    from autofit.config import Batch

__all__ = ["guard", "Rescue", "RETRY_AFTER", "RECORD_NAME", "read_record", "record_beside",
           "evidence"]

logger = logging.getLogger("autofit")

RETRY_AFTER = 200  # guarded steps at a split before one level up (k / 2) is tried again
RECORD_NAME = "autofit-guard.jsonl"
_IGNORE_INDEX = -100  # transformers' "no loss here" label


@dataclass(frozen=True)
class Rescue:
    """One absorbed OOM: where, what was split, into how many chunks, the peak measured."""

    kind: str  # "train" (training_step) or "eval" (prediction_step)
    step: int  # trainer.state.global_step when it happened
    batch_shape: tuple[int, ...]  # the micro batch that did not fit: (samples, tokens)
    piece: int  # samples of the piece that ran out of memory (then halved)
    k: int  # pieces the micro batch then ran in
    peak_bytes: int | None  # the device's peak (CUDA: allocated; CPU: process high-water mark)
    device: str
    error: str  # the first line of the OOM
    time: float
    rank: int = 0  # the process that ran out of memory (several ranks: $RANK)

    def line(self) -> str:
        peak = f", peak {self.peak_bytes / 2**30:.2f} GiB" if self.peak_bytes else ""
        shape = " x ".join(str(d) for d in self.batch_shape)
        what = "training micro step" if self.kind == "train" else "evaluation batch"
        where = f"{self.device}, rank {self.rank}" if self.rank else self.device
        return (f"autofit.guard: out of memory at step {self.step} in a {what} of {shape} "
                f"on {where}; a piece of {self.piece} halved, the batch now runs in "
                f"{self.k} pieces (same math){peak}")


def record_beside(tuned: str | os.PathLike) -> Path:
    """Where a guarded run of the tuned file ``tuned`` writes its rescues (``autofit run
    --guard``), and where ``autofit check`` looks for them: ``<name>-guard.jsonl``."""
    p = Path(tuned)
    return p.with_name(f"{p.stem}-guard.jsonl")


def read_record(path: str | os.PathLike) -> list[Rescue]:
    """The rescues a guarded run wrote to ``path`` (JSON lines; a bad line is skipped)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            d = json.loads(line)
            d["batch_shape"] = tuple(d["batch_shape"])
            out.append(Rescue(**d))
        except (ValueError, TypeError, KeyError):
            continue
    return out


def evidence(tuned: str | os.PathLike, micro_batch: int) -> str | None:
    """What a guarded run of the tuned file ``tuned`` found (its record beside the file):
    the problem line when one of its training micro steps at ``micro_batch`` samples ran out
    of memory (the file does not fit that run without the guard), else None."""
    rescues = [r for r in read_record(record_beside(tuned))
               if r.kind == "train" and r.batch_shape[0] == micro_batch]
    if not rescues:
        return None
    first = max(rescues, key=lambda r: r.batch_shape[1] if len(r.batch_shape) > 1 else 0)
    shape = " x ".join(str(d) for d in first.batch_shape)
    return (f"a guarded run of this file ran out of memory {len(rescues)} time(s) inside a "
            f"micro step (the longest: step {first.step}, micro batch {shape} tokens, run in "
            f"{first.k} pieces; {record_beside(tuned).name}): it fits only with autofit.guard; "
            "plan for that batch (autofit tune --max-seq-len / --block-size as the script "
            "feeds it) or keep the guard on")


# ------------------------------------------------------------------------ splitting


def _batch_shape(inputs: Batch) -> tuple[int, ...]:
    for key in ("input_ids", "inputs_embeds", "pixel_values", "labels"):
        v = inputs.get(key)
        if hasattr(v, "shape") and len(v.shape) >= 1:
            return tuple(int(d) for d in v.shape[:2])
    for v in inputs.values():
        if hasattr(v, "shape") and len(v.shape) >= 1:
            return tuple(int(d) for d in v.shape[:2])
    return (0,)


def _split(inputs: Batch, k: int) -> list[dict[str, Any]]:
    """``inputs`` cut into ``k`` chunks along dim 0 (every tensor with the batch's size
    there; other values shared), sizes differing by at most one, in order."""
    import torch

    b = _batch_shape(inputs)[0]
    parts: list[dict[str, Any]] = [{} for _ in range(k)]
    for key, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == b:
            for part, piece in zip(parts, torch.tensor_split(v, k, dim=0), strict=True):
                part[key] = piece
        else:
            for part in parts:
                part[key] = v
    return parts


def _items(trainer: Trainer, inputs: Batch) -> int:
    """Label items of ``inputs`` as the Trainer counts them: label tokens != -100 (after the
    causal shift when the model's loss shifts), else samples."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs.get("labels")
        if labels is not None and getattr(trainer, "_loss_shifts_labels", False) \
                and getattr(labels, "dim", lambda: 0)() >= 2:
            labels = labels[..., 1:]
    if labels is not None and hasattr(labels, "ne"):
        try:
            return int(labels.ne(_IGNORE_INDEX).sum())
        except (RuntimeError, TypeError):
            pass
    return _batch_shape(inputs)[0]


# ------------------------------------------------------------------------ memory


def _device_of(trainer: Trainer) -> str:
    dev = getattr(getattr(trainer, "args", None), "device", None)
    return str(dev) if dev is not None else "cpu"


def _peak_bytes(device: str) -> int | None:
    try:
        if device.startswith("cuda"):
            import torch

            return int(torch.cuda.max_memory_allocated())
        from autofit.trial.procmem import peak_rss_bytes

        return peak_rss_bytes()
    except Exception:  # a peak is a courtesy of the log line, never a new failure
        return None


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ------------------------------------------------------------------------ the guard


class _Guard:
    """The state of one guarded trainer: the split in force, the rescues, the hooks."""

    def __init__(self, trainer: Trainer, retry_after: int, record: Path | None, echo: bool) -> None:
        self.trainer = trainer
        self.retry_after = retry_after
        self.record = record
        self.echo = echo
        self.rescues: list[Rescue] = []
        self.k = 1  # chunks for micro batches at least `length` tokens long
        self.length = 0
        self.clean_steps = 0  # guarded steps at k without an OOM
        self.touched: set[int] = set()  # parameters accumulated during the current attempt
        self.recording = False
        self.handles: list[Any] = []
        self.train_step = trainer.training_step
        self.predict_step = trainer.prediction_step
        self.ranks: _Ranks | None = None  # several processes: how they agree
        self.overlap: _Buckets | None = None  # DDP: the window's gradient average in flight

    # -- which parameters an attempt accumulated ------------------------------------------
    def watch(self, model: torch.nn.Module) -> None:
        if self.handles:
            return
        for p in model.parameters():
            if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                self.handles.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def _accumulated(self, p: torch.nn.Parameter) -> None:
        if self.recording:
            self.touched.add(id(p))
        if self.overlap is not None:
            self.overlap.ready(p)

    @contextlib.contextmanager
    def _zero_grads_of(self, model: torch.nn.Module, ids: set[int]) -> Any:
        """Incoming gradients of the parameters in ``ids`` replaced by zeros (they hold this
        micro batch's gradient already, from the attempt that ran out of memory)."""
        if not ids:  # the common case: nothing to undo (no parameter walk on the hot path)
            yield
            return
        import torch

        handles = [p.register_hook(torch.zeros_like) for p in model.parameters()
                   if id(p) in ids]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    # -- the split in force ----------------------------------------------------------------
    def k_for(self, shape: tuple[int, ...]) -> int:
        """Pieces for a micro batch of ``shape``: the split in force for batches at least
        ``length`` long; on one process a shorter one keeps about the tokens per piece that
        ran (``k`` x its length / ``length``, up to a power of two: a step's memory per token
        does not grow as its batches shorten), where it ran whole and ran out of memory again
        at each new, shorter length (TRL's sft.py at micro batch 32 under ``autofit run
        --guard``: six rescues at 117 tokens, six more at 108)."""
        length = shape[1] if len(shape) > 1 else 0
        if self.k <= 1:
            return 1
        k = self.k
        if length < self.length:
            if getattr(self, "ranks", None) is not None:
                # on several ranks a shorter batch runs whole, as the ranks' agreement on
                # the overlapped buckets is tested for (a rank's own proportional split,
                # differing from a peer's, crashed the gloo run at exit 1 time in 4)
                return 1
            need = self.k * length / self.length
            k = 1 if need <= 1 else 1 << math.ceil(math.log2(need))
        return min(k, max(1, shape[0]))

    def _settle(self, k: int, shape: tuple[int, ...], smallest: int, rescued: bool) -> None:
        """After a micro batch: a rescue sets the split for batches at least as long; a clean
        guarded step counts (``retry_after`` of them try one level up: ``_retry_upward``)."""
        if rescued:
            length = shape[1] if len(shape) > 1 else 0
            need = -(-shape[0] // max(1, smallest))  # chunks of the smallest piece that ran
            self.k = max(self.k, 1 << (need - 1).bit_length())
            self.length = length if self.length == 0 else min(self.length, length)
            self.clean_steps = 0
            return
        if k <= 1 or k != self.k:
            return
        self.clean_steps += 1

    def _retry_upward(self) -> None:
        """``retry_after`` clean guarded steps at the split: try one level up (k / 2)."""
        if self.k > 1 and self.clean_steps >= self.retry_after:
            self.k //= 2
            self.clean_steps = 0
            if self.k <= 1:
                self.k, self.length = 1, 0

    def _rescue(self, exc: BaseException, kind: str, shape: tuple[int, ...],
                piece: tuple[int, ...], pieces: int) -> None:
        """Log one absorbed OOM (``piece``, a part of the micro batch ``shape``, failed; the
        micro batch now runs in ``pieces`` parts), or re-raise when ``piece`` is one sample."""
        if piece[0] <= 1:
            tokens = f"{piece[1]} tokens" if len(piece) > 1 else "one sample"
            _add_note(exc, f"autofit.guard: a single sample of {tokens} does not fit: it cannot "
                      f"be split further ({len(self.rescues)} rescues before); shorten the "
                      "longest samples (max_seq_len) or lower what the step needs (autofit tune)")
            raise exc
        step = int(getattr(getattr(self.trainer, "state", None), "global_step", 0) or 0)
        device = _device_of(self.trainer)
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        rescue = Rescue(kind=kind, step=step, batch_shape=shape, piece=piece[0], k=pieces,
                        peak_bytes=_peak_bytes(device), device=device, error=first,
                        time=time.time(), rank=int(os.environ.get("RANK", "0") or 0))
        self.rescues.append(rescue)
        self._log(rescue)

    def _log(self, rescue: Rescue) -> None:
        line = rescue.line()
        logger.warning(line)
        if self.echo and not _logged_to_stderr(logger, logging.WARNING):
            print(line, file=sys.stderr, flush=True)
        if self.record is not None:
            try:
                self.record.parent.mkdir(parents=True, exist_ok=True)
                with self.record.open("a") as f:
                    f.write(json.dumps(asdict(rescue)) + "\n")
            except OSError as e:
                logger.warning("autofit.guard: could not write %s (%s)", self.record, e)

    # -- training_step ---------------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: Batch,
                      num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The guarded step: on one process, ``_local_step``; on several, the same under the
        model's ``no_sync`` and then the ranks' agreement (``_Ranks.step``)."""
        if self.ranks is None:
            loss = self._local_step(model, inputs, num_items_in_batch)
            self._retry_upward()
            return loss
        return self.ranks.step(self, model, inputs, num_items_in_batch)

    def _local_step(self, model: torch.nn.Module, inputs: Batch,
                    num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The Trainer's step over ``inputs``, in pieces when a piece runs out of memory.

        Pieces run in order; a piece that fails is halved in place. The parameters a failed
        piece's backward accumulated already hold that piece's gradient: its halves add
        zeros to them (``zero``), so every parameter gets each piece's gradient once."""
        from collections import deque

        self.watch(model)
        shape = _batch_shape(inputs)
        k = self.k_for(shape)
        # the loss is a mean over the micro batch (no num_items_in_batch): weight by items
        total = _items(self.trainer, inputs) if num_items_in_batch is None else None
        pending = deque((piece, frozenset()) for piece in
                        (_split(inputs, k) if k > 1 else [inputs]))
        done, smallest, rescued, loss = 0, shape[0], False, None
        while pending:
            piece, zero = pending.popleft()
            self.touched = set()
            self.recording = True
            try:
                with self._zero_grads_of(model, zero):
                    part = self._piece(model, piece, inputs, num_items_in_batch, total)
            except BaseException as e:  # noqa: BLE001 - only an OOM is handled
                self.recording = False
                if not is_oom(e):
                    raise
                if self.overlap is not None:  # the pieces' gradients are final only at the
                    self.overlap.armed = False  # end: their buckets go out after the step
                halves = _split(piece, 2)
                pending.extendleft(reversed([(h, zero | frozenset(self.touched))
                                             for h in halves]))
                self._rescue(e, "train", shape, _batch_shape(piece), done + len(pending))
                rescued = True
                del e, piece
                _free(_device_of(self.trainer))
                continue
            self.recording = False
            done += 1
            smallest = min(smallest, _batch_shape(piece)[0])
            loss = part if loss is None else loss + part
        self._settle(k, shape, smallest, rescued)
        return loss

    def _piece(self, model: torch.nn.Module, piece: Batch, whole: Batch,
               num_items_in_batch: torch.Tensor | int | None, total: int | None) -> Any:
        if piece is whole or total is None:
            return self.train_step(model, piece, num_items_in_batch)
        weight = _weight(self.trainer, piece, whole, total)
        with _scaled_loss(self.trainer, weight):
            return self.train_step(model, piece, num_items_in_batch)

    # -- prediction_step -------------------------------------------------------------------
    def prediction_step(self, model: torch.nn.Module, inputs: Batch, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        """The Trainer's evaluation step, in pieces when one runs out of memory: the losses
        weighted by items, logits and labels concatenated in order."""
        from collections import deque

        from transformers.trainer_pt_utils import nested_concat

        shape = _batch_shape(inputs)
        total = _items(self.trainer, inputs)
        pending = deque([inputs])
        done, loss, logits, labels = 0, None, None, None
        while pending:
            piece = pending.popleft()
            try:
                out = self.predict_step(model, piece, prediction_loss_only,
                                        ignore_keys=ignore_keys)
            except BaseException as e:  # noqa: BLE001 - only an OOM is handled
                if not is_oom(e):
                    raise
                pending.extendleft(reversed(_split(piece, 2)))
                self._rescue(e, "eval", shape, _batch_shape(piece), done + len(pending))
                del e
                _free(_device_of(self.trainer))
                continue
            if piece is inputs:
                return out
            done += 1
            lo, lo_logits, lo_labels = out
            if lo is not None:  # a mean over the piece's items: weighted back to the batch's
                part = lo * _weight(self.trainer, piece, inputs, total)
                loss = part if loss is None else loss + part
            if lo_logits is not None:
                logits = lo_logits if logits is None else nested_concat(
                    logits, lo_logits, padding_index=-100)
            if lo_labels is not None:
                labels = lo_labels if labels is None else nested_concat(
                    labels, lo_labels, padding_index=-100)
        return loss, logits, labels

    # -- outside the micro steps -----------------------------------------------------------
    def train(self, train: Callable[..., TrainOutput], *args: object, **kwargs: object) -> Any:
        try:
            return train(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised, with a note
            if is_oom(e):
                _add_note(e, "autofit.guard: this out-of-memory error came from outside a "
                          "micro step (the optimizer step, a collective, an evaluation "
                          "metric, a checkpoint save): it cannot be split; "
                          f"{len(self.rescues)} rescues before it")
            raise
        finally:
            for h in self.handles:
                h.remove()
            self.handles = []


class _Ranks:
    """How the guards of several processes (DDP) keep the ranks in step.

    A split on one rank runs more forward and backward passes there than on the others, so
    no collective may sit inside a micro step: every micro step runs under the model's
    ``no_sync`` (DDP's gradient all-reduce is off, its buffer broadcast runs on the first
    forward only). At the last micro step of the accumulation window (the one DDP would
    synchronise) each rank sends what it knows in one small all-reduce (MAX): whether it
    failed, the split in force, the length it applies from and its clean steps. Every
    rank then holds the same split (a spike on one rank splits the others' batches of
    that length too). A rank that cannot go on (a single sample that does not fit, any
    other error) sends that all-reduce where it fails, which the others meet at their
    window's end: all stop, none is left in a collective. The gradients are averaged over
    the ranks as DDP averages them, in buckets of ``BUCKET_BYTES`` (``_Buckets``), before
    that all-reduce: after the window's last backward (``OVERLAP``: during it, as DDP's
    are, off for now). An agreement after every micro step cost 17% of the step on two
    loaded CPU ranks (each a barrier); once per window it is one more small all-reduce
    beside the gradients'.
    """

    BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb
    IN_FLIGHT = 2  # buckets whose all-reduce may be outstanding (each a flat copy)
    # Sending buckets from the accumulation hooks while the last backward runs (DDP's
    # overlap): off. With it, a rank aborted ("terminate called without an active
    # exception") in 2 of ~30 two-rank runs where the other rank ran out of memory in
    # backward (tests/test_guard_ranks.py, under pytest only); not understood yet, and a
    # guard that can kill a run is worse than one that costs its all-reduce. Off, every
    # bucket goes out after the backward (two outstanding), from the buffers kept.
    OVERLAP = False
    _NONE = -(1 << 62)  # "nothing to say" in a MAX all-reduce

    def __init__(self, world: int) -> None:
        self.world = world
        self.kept: dict[str, Any] = {}  # the gradient buckets' layout and buffers (_Buckets)

    def step(self, guard: _Guard, model: torch.nn.Module, inputs: Batch,
             num_items_in_batch: torch.Tensor | int | None) -> Any:
        no_sync = getattr(model, "no_sync", None)
        if no_sync is None:
            raise BadInputError(
                f"autofit.guard on {self.world} processes needs a DistributedDataParallel "
                f"model in the training step, got {type(model).__name__}: run without guard")
        sync = bool(getattr(model, "require_backward_grad_sync", True))
        failure: BaseException | None = None
        loss = None
        device = _device_of(guard.trainer)
        # the window's last micro step: its gradients averaged as they become final
        buckets = (_Buckets(model, self.world, self.BUCKET_BYTES, self.IN_FLIGHT, self.kept)
                   if sync else None)
        if buckets is not None:
            buckets.armed = self.OVERLAP and guard.k_for(_batch_shape(inputs)) == 1
        guard.overlap = buckets
        with no_sync():
            try:
                loss = guard._local_step(model, inputs, num_items_in_batch)
            except BaseException as e:  # noqa: BLE001 - re-raised after the others know
                failure = e
            finally:
                guard.overlap = None
        if failure is None and not sync:
            return loss  # inside the window: no collective, however this rank split
        # every rank sends every bucket, in the same order, before the agreement: the others
        # send theirs at their window's last micro step, wherever this rank failed
        if failure is None and buckets is not None:
            buckets.finish()
        else:
            (buckets or _Buckets(model, self.world, self.BUCKET_BYTES, 1, self.kept)
             ).finish_void(device)
        # once per window (the others reach it at the window's last micro step) or at a
        # failure, wherever it happens: every rank calls it once per window
        failed_rank = self.agree(guard, failure is not None, device)
        if failure is not None:
            raise failure
        if failed_rank is not None:
            raise RuntimeError(
                f"autofit.guard: rank {failed_rank} stopped inside a micro step (its own error "
                "is in its log: a single sample that does not fit, or another error); this "
                "rank stops with it rather than wait in a collective")
        guard._retry_upward()
        return loss

    def agree(self, guard: _Guard, failed: bool, device: str) -> int | None:
        """One all-reduce (MAX): the ranks' split, length and clean steps made one; returns
        the lowest failed rank, or None."""
        import torch
        import torch.distributed as dist

        rank = dist.get_rank()
        split = guard.k > 1
        mine = torch.tensor(
            [-rank if failed else self._NONE, guard.k,
             -guard.length if split else self._NONE,
             -guard.clean_steps if split else self._NONE], dtype=torch.int64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        low, k, length, clean = (int(v) for v in mine.tolist())
        if k > 1:
            guard.k, guard.length, guard.clean_steps = k, -length, -clean
        return -low if low != self._NONE else None


class _Buckets:
    """The gradient average of an accumulation window (DDP's), overlapped with its last
    backward when ``armed``.

    The trainable parameters, in reverse order (the order a backward finishes them, as
    DDP buckets them), are cut into buckets of about ``size`` bytes. While the last micro
    step's backward runs (``armed``), a bucket whose every parameter has its final
    gradient (the accumulation hook fired) is flattened and all-reduced asynchronously, in
    bucket order, at most ``in_flight`` outstanding; ``finish`` sends the rest, in order,
    and waits. Every rank sends every bucket in the same order whatever happened on it, so
    the collectives pair up: a rank that ran out of memory keeps the buckets it sent (an
    attempt that ran out of memory leaves the gradients it reached final: their pieces add
    zeros, ``_Guard._local_step``) and sends the others after its pieces; a rank that
    fails sends them too before the agreement that stops every rank. A parameter no rank
    gave a gradient keeps None.
    """

    def __init__(self, model: torch.nn.Module, world: int, size: int, in_flight: int,
                 keep: dict[str, Any] | None = None) -> None:
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.world = world
        self.in_flight = max(1, in_flight)
        # what lasts from window to window (the caller's ``keep``): the bucket layout, and
        # ``in_flight`` flat buffers reused by every bucket (a buffer allocated per bucket
        # per window cost +2.3% of the step on two CPU ranks: glibc maps and zeroes
        # buffers that large afresh each time, -3.2% with its heap kept)
        self.keep = {} if keep is None else keep
        key = tuple(id(p) for p in params)
        if self.keep.get("key") != key:
            self.keep.update(key=key, layout=_bucket_layout(params, size), buffers={})
        self.buckets, self.bucket_of, self.kinds = self.keep["layout"]
        self.waiting = [len(b) for b in self.buckets]  # parameters not final yet
        self.sent = 0  # buckets sent, in order
        self.outstanding: list[tuple[Any, Any, list[torch.nn.Parameter], list[Any] | None]] = []
        self.armed = False

    def ready(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient is final for the window (its accumulation hook fired)."""
        if not self.armed:
            return
        b = self.bucket_of.get(id(p))
        if b is None:
            return
        self.waiting[b] -= 1
        while self.sent < len(self.buckets) and self.waiting[self.sent] <= 0:
            self._send()

    def finish(self) -> None:
        """The buckets not sent yet, in order, then every outstanding one waited for."""
        self.armed = False
        while self.sent < len(self.buckets):
            self._send()
        while self.outstanding:
            self._receive()

    def finish_void(self, device: str) -> None:
        """A failed rank's part: the buckets not sent yet, in order, sent from one buffer of
        zeros (the run stops after the agreement; what matters is that every collective
        the others started is met, with as little memory as a bucket)."""
        import torch
        import torch.distributed as dist

        self.armed = False
        while self.outstanding:
            self._receive()
        if self.sent >= len(self.kinds):
            return
        largest = max(n * d.itemsize for n, d in self.kinds[self.sent:])
        buffer = torch.zeros(largest, dtype=torch.uint8, device=device)
        for n, dtype in self.kinds[self.sent:]:
            dist.all_reduce(buffer[:n * dtype.itemsize].view(dtype))
            buffer.zero_()
        self.sent = len(self.kinds)

    def _send(self) -> None:
        import torch
        import torch.distributed as dist

        while len(self.outstanding) >= self.in_flight:
            self._receive()
        index = self.sent
        bucket = self.buckets[index]
        grad = bucket[0].grad
        if len(bucket) == 1 and grad is not None and grad.is_contiguous():
            flat, grads = grad, None  # one parameter (one larger than a bucket): in place
        else:
            numel, dtype = self.kinds[index]
            flat = self._buffer(index % self.in_flight, numel, dtype, bucket[0].device)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            offset = 0
            for g in grads:
                flat[offset:offset + g.numel()].copy_(g.reshape(-1))
                offset += g.numel()
        self.sent += 1
        self.outstanding.append((dist.all_reduce(flat, async_op=True), flat, bucket, grads))

    def _buffer(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> Any:
        """A flat (numel,) view of the kept buffer ``slot`` (grown, never shrunk)."""
        import torch

        nbytes = numel * dtype.itemsize
        buffers = self.keep["buffers"]
        buf = buffers.get((slot, device))
        if buf is None or buf.numel() < nbytes:
            buf = buffers[(slot, device)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype)

    def _receive(self) -> None:
        work, flat, bucket, grads = self.outstanding.pop(0)
        work.wait()
        flat.div_(self.world)
        if grads is None:
            return  # reduced in place
        offset = 0
        for q, g in zip(bucket, grads, strict=True):
            mean = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
            if q.grad is not None:
                g.copy_(mean)
            elif bool(mean.ne(0).any()):
                q.grad = mean.clone()


def _bucket_layout(params: list[torch.nn.Parameter], size: int,
                   ) -> tuple[list[list[torch.nn.Parameter]], dict[int, int],
                              list[tuple[int, torch.dtype]]]:
    """``params`` (in the order a backward finishes them) cut into buckets of about
    ``size`` bytes: the buckets, each parameter's bucket, each bucket's (numel, dtype). A
    parameter of ``size`` bytes or more is a bucket of its own (reduced in place: no
    buffer as large as it), so a bucket buffer stays under twice ``size``."""
    buckets: list[list[torch.nn.Parameter]] = []
    bucket_of: dict[int, int] = {}
    filled = size
    for p in params:
        nbytes = p.numel() * p.element_size()
        if filled >= size or (nbytes >= size and buckets and buckets[-1]):
            buckets.append([])
            filled = 0
        bucket_of[id(p)] = len(buckets) - 1
        buckets[-1].append(p)
        filled += nbytes if nbytes < size else size
    return buckets, bucket_of, [(sum(p.numel() for p in b), _common_dtype(b)) for b in buckets]


def _common_dtype(params: list[torch.nn.Parameter]) -> torch.dtype:
    """The dtype of ``_flatten_dense_tensors`` over these parameters' gradients."""
    import torch

    dtype = params[0].dtype
    for p in params[1:]:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def _logged_to_stderr(log: logging.Logger, level: int) -> bool:
    """Whether a record of ``level`` on ``log`` already reaches stderr: a stream handler on
    stderr on its way up (a script's ``logging.basicConfig``, the CLI's), or no handler at
    all (logging's last resort prints it there). The echo is then left out: the line came
    twice, in TRL's ``sft.py`` under ``autofit run --guard`` and in any script that
    configures no logging."""
    if not log.isEnabledFor(level):
        return False
    found = False
    current: logging.Logger | None = log
    while current is not None:
        for h in current.handlers:
            found = True
            to_stderr = getattr(h, "to_stderr", False) or (  # (the CLI's own handler)
                isinstance(h, logging.StreamHandler)
                and getattr(h, "stream", None) in (sys.stderr, sys.__stderr__))
            if to_stderr and level >= h.level:
                return True
        current = current.parent if current.propagate else None
    return not found and logging.lastResort is not None and level >= logging.lastResort.level


def _weight(trainer: Trainer, piece: Batch, whole: Batch, total: int) -> float:
    """``piece``'s share of ``whole``: its label items over the whole's (samples when the
    whole has no label item)."""
    if total > 0:
        return _items(trainer, piece) / total
    return _batch_shape(piece)[0] / max(1, _batch_shape(whole)[0])


@contextlib.contextmanager
def _scaled_loss(trainer: Trainer, weight: float) -> Any:
    """``trainer.compute_loss`` multiplied by ``weight`` for the duration (an instance
    attribute over the class's method, removed after)."""
    own = vars(trainer).get("compute_loss")
    original = trainer.compute_loss

    def compute_loss(*args: object, **kwargs: object) -> Any:
        out = original(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * weight, *out[1:])
        return out * weight

    trainer.compute_loss = compute_loss
    try:
        yield
    finally:
        if own is not None:
            trainer.compute_loss = own
        else:
            del trainer.compute_loss


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    logger.error(note)


def _world_size(trainer: Trainer) -> int:
    args = getattr(trainer, "args", None)
    try:
        return int(getattr(args, "world_size", 1) or 1)
    except (TypeError, ValueError):
        return 1


def guard(trainer: Trainer, *, retry_after: int = RETRY_AFTER,
          record: str | os.PathLike | None = None, echo: bool = True) -> Any:
    """Absorb out-of-memory errors inside the trainer's micro steps (see the module docstring).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass: ``trl.SFTTrainer``,
            ``autofit.ChunkedLossTrainer``), before ``trainer.train()``.
        retry_after: guarded steps at a split before one level up is tried again.
        record: where each rescue is appended as a JSON line; default
            ``<output_dir>/autofit-guard.jsonl`` (``$AUTOFIT_GUARD_RECORD`` when set).
        echo: print each rescue's line on stderr as well as logging it (unless the log
            already reaches stderr: each line once).

    Returns:
        the same trainer, guarded (``trainer.autofit_guard.rescues`` lists the rescues).

    Raises:
        BadInputError: not a Trainer, already guarded, a non-positive ``retry_after``, or
            a trainer under FSDP or DeepSpeed (see Known limitations).

    Example:
        >>> import autofit
        >>> trainer = autofit.guard(trainer)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """
    if not (hasattr(trainer, "training_step") and hasattr(trainer, "prediction_step")
            and hasattr(trainer, "train")):
        raise BadInputError(f"guard takes a transformers.Trainer, got {type(trainer).__name__}")
    if getattr(trainer, "autofit_guard", None) is not None:
        raise BadInputError("this trainer is guarded already: call autofit.guard(trainer) once")
    if isinstance(retry_after, bool) or not isinstance(retry_after, int) or retry_after < 1:
        raise BadInputError(f"retry_after must be a positive number of steps, got {retry_after!r}")
    world = _world_size(trainer)
    sharded = [name for name, on in (
        ("DeepSpeed", getattr(trainer, "is_deepspeed_enabled", False)),
        ("FSDP", getattr(trainer, "is_fsdp_enabled", False)
         or getattr(trainer, "is_fsdp_xla_enabled", False))) if on]
    if sharded:
        raise BadInputError(
            f"autofit.guard splits micro steps of plain data parallelism (DDP) only; this trainer "
            f"runs {sharded[0]}, whose forward and backward gather and scatter the weights "
            "across the ranks: a rank that splits its batch would run more of those "
            "collectives than the others and hang them. Run without guard (autofit tune "
            "--strategy ... plans a margin per rank)")
    if record is None:
        env = os.environ.get("AUTOFIT_GUARD_RECORD")
        out = getattr(getattr(trainer, "args", None), "output_dir", None)
        record = env or (Path(out) / RECORD_NAME if out else None)
    state = _Guard(trainer, retry_after, Path(record) if record is not None else None, echo)
    if world > 1:
        state.ranks = _Ranks(world)
    trainer.training_step = state.training_step
    trainer.prediction_step = state.prediction_step
    original_train = trainer.train
    trainer.train = lambda *a, **kw: state.train(original_train, *a, **kw)
    trainer.autofit_guard = state
    return trainer
