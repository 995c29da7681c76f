"""autofit against the batch-size finders of accelerate, Lightning and transformers.

On one capped CPU device per model (``cpu:<cap>``: every attempt is a fresh
process whose address space is capped, so exceeding the cap is a real
allocation failure), for small models with different memory profiles, compare:

1. **autofit** restricted to the one combination the peers search (32-true,
   AdamW, no checkpointing), four runs: keeping a target effective batch (micro
   batches are then divisors of it) and with no target (accumulation 1, the
   peers' setting), each with the default 10% margin and with ``margin=0.0``.
   Plus one unrestricted run, for information.
2. **accelerate** ``find_executable_batch_size`` (the real function, default
   ``starting_batch_size=128``; since huggingface/accelerate#3650 it multiplies
   the batch by 0.9 on every OOM, older releases halved it).
3. **Lightning** ``Tuner.scale_batch_size(mode="binsearch")`` (the real tuner,
   2.x defaults: start at 2, double until OOM, then bisect, then a 5% margin),
   driven through a proxy ``LightningModule`` whose ``training_step`` runs the
   real step in the capped child.
4. **transformers** ``auto_find_batch_size``: the exact call ``Trainer.train``
   makes, ``find_executable_batch_size(self._inner_training_loop,
   args.train_batch_size, args.auto_find_batch_size)``, with a stand-in for
   ``_inner_training_loop`` that runs the capped attempt at the batch it is given.

Every attempt of every tuner is one ``autofit.trial.measure`` call on the
model's worst-case batch (the ``B`` longest samples padded to the longest): a
fresh capped child process (forked from autofit's trial server), 1 warm-up + 2 measured optimizer steps (Lightning's
``steps_per_trial=3``; for accelerate / transformers, the first 3 steps of the
training the decorated function would run). An OOM comes back as the
exception a peer would have seen in-process (type and message), which the
peer's own predicate (accelerate's ``should_reduce_batch_size``, Lightning's
``is_oom_error``) judges; one it does not recognise would be re-raised as
``torch.OutOfMemoryError`` with the CPU allocator's message, and counted.

The truth: the largest micro batch that fits, by exhaustive search with the same
measurement (every size from 1 up to the first failure) for autofit's step
(gradient accumulation, so the gradients are held through the next micro
batch); for the peers' step (no accumulation) from there up to the first failure
(a one-micro-batch step does a subset of the work of a two-micro-batch one). It
runs after the tuners and reuses any identical measurement they made (same micro
batch, same step kind); it is not timed against them.

    OMP_NUM_THREADS=1 python benchmarks/tuners.py            # ~20 min, writes results/
    python benchmarks/tuners.py --models llama-vocab --skip-unrestricted

Writes ``benchmarks/results/tuners.md``, ``tuners.json`` and ``tuners.png`` (``--replot``
redraws the last two from the JSON). Run by hand, not in CI. The JSON it replaces is
read first: its date, total and per-row wall times and its trial cost are kept
under ``previous`` and shown beside this run's (*wall s before*, **Trial cost**).
The trial server is started before the first tuner (no row pays it), and after
the first model the same out-of-memory attempt runs three times each way,
alternately forked from the server and in a fresh process (``side_by_side``).

Known limitations:
    NB: each attempt pays a process start-up, the same for every tuner: a fork of
    the pre-imported trial server (``autofit.trial.server``), tenths of a second;
    runs before it started a fresh interpreter per attempt (~5 s here importing
    torch, and seconds more of transformers' lazy imports in the child). The
    attempts' own steps now dominate, as with in-process retries on a GPU.
    NB: the peers are tried on the worst-case batch, the most favourable setting
    for them (as if the data were sorted longest-first for the search); with
    their own shuffled loader they meet the longest samples only by chance.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
for _p in (str(HERE.parent), str(HERE)):  # autofit, and the benchmarks' own modules
    if _p not in sys.path:
        sys.path.insert(0, _p)

MiB = 1 << 20
DEFAULT_MARGIN = 0.10  # autofit's (autofit.search.DEFAULT_MARGIN)
ACCELERATE_START = 128  # accelerate's default starting_batch_size
PEER_COMBINATION = ("32-true", "adamw_torch", False)  # precision, optimizer, checkpointing
TARGETS = {"choice_vs_true_max": 0.95, "max_ooms": 1, "wall_vs_fastest_peer": 1 / 3}
# (label, margin (None: autofit's default), keep the target effective batch?)
AUTOFIT_ROWS = (
    ("autofit", None, True),
    ("autofit margin=0", 0.0, True),
    ("autofit, no target", None, False),
    ("autofit, no target, margin=0", 0.0, False),
)


# ---------------------------------------------------------------- models and data


@dataclass(frozen=True)
class Spec:
    """One model on one capped device."""

    name: str
    profile: str  # what dominates its memory
    config: dict[str, Any]  # a transformers config (model_type + fields)
    task: str
    cap: str  # the capped CPU device
    seq_max: int  # the longest sample, tokens
    target: int = 48  # effective batch autofit keeps; transformers' per-device batch
    samples: int = 160
    seed: int = 0


SPECS: tuple[Spec, ...] = (
    Spec(
        name="llama-vocab",
        profile="logits dominate: (B, T, 32000) fp32 logits, log-softmax and their grads",
        config={
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 32000, "max_position_embeddings": 1024, "tie_word_embeddings": False,
            "architectures": ["LlamaForCausalLM"],
        },
        task="causal-lm",
        cap="cpu:1GiB",
        seq_max=256,
    ),
    Spec(
        name="gpt2-dropout",
        profile="activations dominate: 6 layers of attention with dropout masks (p=0.1)",
        config={
            "model_type": "gpt2", "n_embd": 64, "n_layer": 6, "n_head": 4, "vocab_size": 2048,
            "n_positions": 512, "bos_token_id": 0, "eos_token_id": 0,
            "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
            "architectures": ["GPT2LMHeadModel"],
        },
        task="causal-lm",
        cap="cpu:384MiB",
        seq_max=256,
    ),
    Spec(
        name="bert-bigvocab",
        profile="weights + grads + AdamW states are over half the peak: a 250k-token "
        "embedding (32M of 34M params), sequence classification",
        config={
            "model_type": "bert", "hidden_size": 128, "num_hidden_layers": 8,
            "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 250002,
            "max_position_embeddings": 512, "architectures": ["BertForSequenceClassification"],
        },
        task="seq-cls",
        cap="cpu:900MiB",
        seq_max=256,
    ),
)


def sample_lengths(n: int, seq_max: int, seed: int) -> list[int]:
    """Skewed lengths: mostly 16-64 tokens, some up to seq_max/2, three at seq_max."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.85:
            out.append(rng.randint(16, 64))
        elif u < 0.97:
            out.append(rng.randint(65, seq_max // 2))
        else:
            out.append(rng.randint(seq_max // 2, seq_max - 1))
    for i in rng.sample(range(n), 3):  # a few at the maximum
        out[i] = seq_max
    return out


def loader_lengths(dataset: list[dict[str, Any]], batch: int, steps: int = 3,
                   seed: int = 0) -> list[int]:
    """Padded lengths of the first ``steps`` batches of a shuffled loader (pad to longest)."""
    order = list(range(len(dataset)))
    random.Random(seed).shuffle(order)
    return [max(len(dataset[i]["input_ids"]) for i in order[k * batch:(k + 1) * batch])
            for k in range(steps) if order[k * batch:(k + 1) * batch]]


def make_dataset(spec: Spec) -> list[dict[str, Any]]:
    """A seeded list of samples with ``input_ids`` (and ``label`` for seq-cls)."""
    rng = random.Random(spec.seed + 1)
    vocab = int(spec.config["vocab_size"])
    data = []
    for length in sample_lengths(spec.samples, spec.seq_max, spec.seed):
        sample: dict[str, Any] = {"input_ids": [rng.randrange(5, vocab) for _ in range(length)]}
        if spec.task == "seq-cls":
            sample["label"] = rng.randrange(2)
        data.append(sample)
    return data


# ---------------------------------------------------------------- attempts


@dataclass
class Attempt:
    """One capped trial: a micro batch, its accumulation, what happened."""

    size: int
    accum: int
    fits: bool
    oom: bool
    error: str | None
    wall_s: float | None  # None: run inside autofit, not timed on its own
    peak_bytes: int | None
    steps: int  # optimizer steps completed (warm-up + measured)
    tokens_per_s: float | None = None


@dataclass
class Log:
    """The attempts of one tuner, and how its peer recognised their OOMs."""

    attempts: list[Attempt] = field(default_factory=list)
    recognised: int = 0  # OOMs the peer's own predicate recognised as they came
    wrapped: int = 0  # OOMs re-raised as torch.OutOfMemoryError for the peer

    @property
    def sizes(self) -> list[int]:
        return [a.size for a in self.attempts]

    @property
    def ooms(self) -> int:
        return sum(a.oom for a in self.attempts)


class Device:
    """Capped attempts of one model on one device (each a fresh capped process).

    Every attempt is remembered by (micro batch, accumulated or not): a trial step
    runs ``min(accumulation, 2)`` micro batches, so any accumulation >= 2 is the
    same measurement. ``cached`` answers from there first (for the truth only;
    the tuners always run live).
    """

    def __init__(self, spec: Spec, model_dir: Path, dataset: list[dict[str, Any]]) -> None:
        self.spec = spec
        self.model = str(model_dir)
        self.dataset = dataset
        self.known: dict[tuple[int, bool], Attempt] = {}

    def record(self, a: Attempt) -> Attempt:
        self.known.setdefault((a.size, a.accum > 1), a)
        return a

    def cached(self, size: int, accum: int = 1) -> tuple[Attempt, bool]:
        """(attempt, reused): a known measurement of this step, else a new one."""
        hit = self.known.get((size, accum > 1))
        return (hit, True) if hit is not None else (self.attempt(size, accum), False)

    def config(self, size: int, accum: int = 1, **kw: Any) -> Any:
        from autofit.config import TrainConfig

        return TrainConfig(micro_batch_size=size, grad_accum_steps=accum, precision="32-true",
                           gradient_checkpointing=False, optimizer="adamw_torch", **kw)

    def attempt(self, size: int, accum: int = 1, *, measure_steps: int = 2) -> Attempt:
        from autofit.trial import measure

        t = time.perf_counter()
        r = measure(self.model, self.config(size, accum), self.dataset, device=self.spec.cap,
                    task=self.spec.task, warmup_steps=1, measure_steps=measure_steps,
                    timeout_s=600.0)
        return self.record(Attempt(
            size=size, accum=accum, fits=r.fits, oom=r.oom, error=r.error,
            wall_s=time.perf_counter() - t, peak_bytes=r.device_total_bytes,
            steps=r.warmup_steps + r.steps, tokens_per_s=r.tokens_per_s))


_ERROR = re.compile(r"^(?:[\w -]+ step: )?(?P<type>[A-Za-z_][\w.]*): (?P<msg>.*)$", re.S)
_EXCEPTIONS = {"RuntimeError": RuntimeError, "MemoryError": MemoryError}


def rebuild_exception(error: str) -> BaseException:
    """The exception a trial child met, as the peer would have seen it in-process.

    The child reports ``"<phase> step: <Type>: <first line>"``; torch's allocator
    prefix ``[enforce fail at ...]`` is already stripped, which no predicate needs.
    ``OutOfMemoryError`` becomes ``torch.OutOfMemoryError``; anything else that
    does not parse becomes a ``RuntimeError`` of the whole text.
    """
    m = _ERROR.match(error)
    if m is None:
        return RuntimeError(error)
    name, msg = m["type"].rsplit(".", 1)[-1], m["msg"]
    if name == "OutOfMemoryError":
        import torch

        return torch.OutOfMemoryError(msg)
    return _EXCEPTIONS.get(name, RuntimeError)(msg)


def oom_raiser(
    attempt: Callable[[int, int], Attempt],
    predicate: Callable[[BaseException], bool],
    log: Log,
) -> Callable[..., None]:
    """``try_size(b, accum=1)``: run the attempt; on OOM raise what the peer would see.

    An OOM the peer's ``predicate`` does not recognise is re-raised as
    ``torch.OutOfMemoryError("DefaultCPUAllocator: can't allocate memory ...")``
    (recognised by accelerate and Lightning alike) and counted in ``log.wrapped``.
    Any other failure is raised as a ``RuntimeError`` (the peer re-raises it).
    """

    def try_size(size: int, accum: int = 1) -> None:
        a = attempt(size, accum)
        log.attempts.append(a)
        if a.fits:
            return
        if not a.oom:
            raise RuntimeError(f"attempt at micro batch {size} failed: {a.error}")
        exc = rebuild_exception(a.error or "")
        if predicate(exc):
            log.recognised += 1
            raise exc
        import torch

        log.wrapped += 1
        raise torch.OutOfMemoryError(
            "DefaultCPUAllocator: can't allocate memory (re-raised by benchmarks/tuners.py; "
            f"the trial reported: {a.error})"
        )

    return try_size


# ---------------------------------------------------------------- the peers


def run_accelerate(
    try_size: Callable[[int], None],
    start: int = ACCELERATE_START,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> int:
    """accelerate's ``find_executable_batch_size`` around one training run."""
    from accelerate.utils import find_executable_batch_size

    @find_executable_batch_size(starting_batch_size=start,
                                reduce_batch_size_fn=reduce_batch_size_fn)
    def train(batch_size: int) -> int:
        try_size(batch_size)  # the first steps of training at this batch
        return batch_size

    return train()


def run_transformers(try_size: Callable[..., None], per_device_batch: int) -> tuple[int, int]:
    """``Trainer.train`` with ``auto_find_batch_size=True``: its exact call.

    ``find_executable_batch_size(self._inner_training_loop, self._train_batch_size,
    args.auto_find_batch_size)`` where ``_train_batch_size = args.train_batch_size``;
    the loop trains at ``batch_size`` with ``args.gradient_accumulation_steps``
    unchanged. Returns (micro batch, accumulation).
    """
    from transformers import TrainingArguments
    from transformers.trainer_utils import find_executable_batch_size

    before = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="tuners-args-") as tmp:
        try:
            args = TrainingArguments(output_dir=tmp, auto_find_batch_size=True,
                                     per_device_train_batch_size=per_device_batch,
                                     max_steps=3, use_cpu=True, report_to=[])
        finally:  # TrainingArguments may export ACCELERATE_* variables to the children
            os.environ.clear()
            os.environ.update(before)

    def inner_training_loop(batch_size: int, args: Any = None) -> int:
        try_size(batch_size, accum=args.gradient_accumulation_steps)
        return batch_size

    loop = find_executable_batch_size(inner_training_loop, args.train_batch_size,
                                      args.auto_find_batch_size)
    return loop(args=args), args.gradient_accumulation_steps


def run_lightning(try_size: Callable[[int], None], dataset_len: int, root: str) -> int:
    """Lightning's ``Tuner.scale_batch_size(mode="binsearch")`` with its defaults.

    The ``LightningModule`` is a proxy: its dataloader yields sample indices at
    ``self.batch_size`` (so Lightning's dataset-length stop applies), and the first
    ``training_step`` of each trial runs the real step in the capped child
    (``try_size``), raising its OOM there; the trial's other steps are the
    child's measured steps, so they do nothing here.
    """
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.tuner import Tuner

    class Proxy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 1
            self.w = torch.nn.Parameter(torch.zeros(1))
            self._tried: int | None = None

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(dataset_len), batch_size=self.batch_size)

        def on_train_start(self) -> None:
            self._tried = None  # a new trial

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self._tried != self.batch_size:
                self._tried = self.batch_size
                try_size(self.batch_size)
            return (self.w * 0.0).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root,
                         num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return int(Tuner(trainer).scale_batch_size(Proxy(), mode="binsearch"))


# ---------------------------------------------------------------- the truth


def first_failure(fits: Callable[[int], bool], start: int = 1, limit: int = 1024) -> int:
    """Try ``start, start+1, ...`` until one does not fit; return that size."""
    b = start
    while b <= limit and fits(b):
        b += 1
    return b


def true_max(
    attempt: Callable[[int, int], tuple[Attempt, bool]], target: int,
    budget: int | None = None,
) -> dict[str, Any]:
    """Largest fitting micro batch for autofit's step and for the peers' step.

    ``attempt(size, accum) -> (Attempt, reused)``. Autofit's step uses the
    accumulation it would with ``target`` (``target // size``); the peers' none.
    With ``budget`` (bytes), also the largest whose measured peak is within it, for
    both steps (the plain step measured downwards from its limit until one is).
    """
    reused: list[list[int]] = [[], []]

    def fits_accum(b: int) -> bool:
        a, again = attempt(b, max(1, target // b))
        log_accum.append(a)
        if again:
            reused[0].append(b)
        return a.fits

    def fits_plain(b: int) -> bool:
        a, again = attempt(b, 1)
        log_plain.append(a)
        if again:
            reused[1].append(b)
        return a.fits

    log_accum: list[Attempt] = []
    log_plain: list[Attempt] = []
    b_accum = first_failure(fits_accum) - 1
    start = max(1, b_accum)
    b_plain = first_failure(fits_plain, start=start) - 1
    consistent = True
    if b_plain < start:  # the one-micro-batch step failed where the two-batch one fit
        consistent = False
        b_plain = first_failure(fits_plain, start=1) - 1
    allowed = [d for d in range(1, target + 1) if target % d == 0 and d <= b_accum]
    within_accum = within_plain = None
    if budget is not None:
        within_accum = max((a.size for a in log_accum if a.fits and a.peak_bytes is not None
                            and a.peak_bytes <= budget), default=None)
        for b in range(b_plain, 0, -1):
            a, again = attempt(b, 1)
            if a not in log_plain:
                log_plain.append(a)
                if again:
                    reused[1].append(b)
            if a.fits and a.peak_bytes is not None and a.peak_bytes <= budget:
                within_plain = b
                break
    return {
        "accumulated": b_accum, "plain": b_plain,
        "within_margin_accumulated": within_accum, "within_margin_plain": within_plain,
        "budget_bytes": budget,
        "allowed_accumulated": max(allowed) if allowed else None,
        "consistent": consistent,
        "reused_accumulated": reused[0],
        "reused_plain": reused[1],
        "attempts_accumulated": [asdict(a) for a in log_accum],
        "attempts_plain": [asdict(a) for a in log_plain],
    }


# ---------------------------------------------------------------- autofit


def run_autofit(device: Device, *, restricted: bool, margin: float | None,
                progress: list[tuple[float, str]] | None = None,
                keep_target: bool = True) -> dict[str, Any]:
    """One ``autofit()`` call on the capped device, timed; its 32-true AdamW trials recorded.

    ``progress`` collects (seconds since the start, line) before each trial; it is
    the caller's, so that it survives an exception.
    """
    from autofit.api import autofit

    kw: dict[str, Any] = {"cache": False, "max_micro_batch": ACCELERATE_START,
                          "task": device.spec.task}
    if restricted:
        kw.update(precision=["32-true"], optimizer=["adamw_torch"], gradient_checkpointing=False)
    progress = [] if progress is None else progress
    t = time.perf_counter()
    kw["progress"] = lambda line: progress.append((time.perf_counter() - t, line))
    r = autofit(device.model, device.dataset, device=device.spec.cap,
                target_batch_size=device.spec.target if keep_target else None, margin=margin,
                **kw)
    wall = time.perf_counter() - t
    trials = [{"size": x.config["micro_batch_size"], "accum": x.config["grad_accum_steps"],
               "precision": x.config["precision"], "optimizer": x.config["optimizer"],
               "checkpointing": x.config["gradient_checkpointing"], "fits": x.fits,
               "oom": x.oom, "error": x.error, "peak_bytes": x.device_total_bytes,
               "steps": x.warmup_steps + x.steps, "tokens_per_s": x.tokens_per_s}
              for x in r.trials]
    for x in trials:  # the truth may reuse them: the same measurement
        if (x["precision"], x["optimizer"], x["checkpointing"]) == PEER_COMBINATION:
            device.record(Attempt(x["size"], x["accum"], x["fits"], x["oom"], x["error"], None,
                                  x["peak_bytes"], x["steps"], x["tokens_per_s"]))
    return {
        "micro": r.config.micro_batch_size, "accum": r.config.grad_accum_steps,
        "effective": r.config.effective_batch_size, "precision": r.config.precision,
        "optimizer": r.config.optimizer, "checkpointing": r.config.gradient_checkpointing,
        "confirmed": r.confirmed, "wall_s": wall, "margin": margin,
        "target": device.spec.target if keep_target else None,
        "before_first_trial_s": progress[0][0] if progress else None,
        "progress": [line for _, line in progress],
        "attempts": len(trials), "ooms": sum(x["oom"] for x in trials),
        "steps": sum(x["steps"] for x in trials), "trials": trials,
        "reasons": list(r.reasons),
    }


def run_unrestricted(device: Device) -> dict[str, Any]:
    """autofit over its whole default space; a failure is recorded with the trials it ran."""
    from autofit.errors import AutofitError

    progress: list[tuple[float, str]] = []
    seen: list[dict[str, Any]] = []
    t = time.perf_counter()
    try:
        with _recording_trials(seen):
            return run_autofit(device, restricted=False, margin=None, progress=progress)
    except AutofitError as e:
        return {"error": f"{type(e).__name__}: {e}", "wall_s": time.perf_counter() - t,
                "progress": [line for _, line in progress], "attempts": len(seen),
                "ooms": sum(x["oom"] for x in seen), "trials": seen}


@contextlib.contextmanager
def _recording_trials(seen: list[dict[str, Any]]) -> Any:
    """Record every trial ``autofit()`` runs (it imports ``autofit.trial.measure`` per call).

    Observation only: the wrapped function is called as is, and put back on exit.
    """
    import autofit.trial

    original = autofit.trial.measure

    def measure(model: Any, config: Any, *args: Any, **kw: Any) -> Any:
        r = original(model, config, *args, **kw)
        seen.append({"size": config.micro_batch_size, "precision": config.precision,
                     "optimizer": config.optimizer,
                     "checkpointing": config.gradient_checkpointing, "fits": r.fits,
                     "oom": r.oom, "peak_bytes": r.device_total_bytes, "error": r.error})
        return r

    autofit.trial.measure = measure
    try:
        yield
    finally:
        autofit.trial.measure = original


def full_run(device: Device, micro: int, accum: int, steps: int = 3) -> dict[str, Any]:
    """1 warm-up + ``steps`` optimizer steps of the choice on the worst-case batch."""
    a = device.attempt(micro, accum, measure_steps=steps)
    return asdict(a)


# ---------------------------------------------------------------- one model


def peer_row(name: str, log: Log, wall: float, micro: int | None, accum: int,
             target: int, error: str | None = None) -> dict[str, Any]:
    return {
        "tuner": name, "attempts": len(log.attempts), "ooms": log.ooms,
        "steps": sum(a.steps for a in log.attempts), "wall_s": wall, "micro": micro,
        "accum": accum, "effective": None if micro is None else micro * accum,
        "kept": micro is not None and micro * accum == target,
        "recognised": log.recognised, "wrapped": log.wrapped, "sizes": log.sizes,
        "attempt_log": [asdict(a) for a in log.attempts], "error": error,
    }


def run_peer(name: str, fn: Callable[[Log], tuple[int, int]], target: int) -> dict[str, Any]:
    """Run one peer, timed; a peer that raises (gives up) is recorded, not fatal."""
    log = Log()
    t = time.perf_counter()
    try:
        micro, accum = fn(log)
        error = None
    except Exception as e:  # noqa: BLE001 - a peer that gives up is a result
        micro, accum, error = None, 1, f"{type(e).__name__}: {e}"[:300]
    return peer_row(name, log, time.perf_counter() - t, micro, accum, target, error)


def bench_model(spec: Spec, workdir: Path, *, unrestricted: bool) -> dict[str, Any]:
    """Every tuner on one model, then the truth, then full runs of autofit's choices."""
    from accelerate.utils.memory import should_reduce_batch_size
    from lightning.pytorch.utilities.memory import is_oom_error

    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model

    model_dir = workdir / spec.name
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(spec.config))
    dataset = make_dataset(spec)
    device = Device(spec, model_dir, dataset)
    info = probe_model(str(model_dir), task=spec.task)
    out: dict[str, Any] = {"spec": asdict(spec), "params": info.trainable_params,
                           "cap_bytes": resolve_device(spec.cap).capacity_bytes,
                           "lengths": _length_stats(dataset)}
    t0 = time.perf_counter()

    rows = []
    for label, margin, keep in AUTOFIT_ROWS:
        _say(f"{spec.name} on {spec.cap}: {label} (restricted)")
        af = run_autofit(device, restricted=True, margin=margin, keep_target=keep)
        rows.append({"tuner": label, **af, "kept": af["effective"] == spec.target})

    def accelerate(log: Log) -> tuple[int, int]:
        return run_accelerate(oom_raiser(device.attempt, should_reduce_batch_size, log)), 1

    def transformers(log: Log) -> tuple[int, int]:
        return run_transformers(oom_raiser(device.attempt, should_reduce_batch_size, log),
                                spec.target)

    def lightning(log: Log) -> tuple[int, int]:
        with tempfile.TemporaryDirectory(prefix="tuners-pl-") as root:
            return run_lightning(oom_raiser(device.attempt, is_oom_error, log),
                                 spec.samples, root), 1

    for name, fn in (("accelerate find_executable_batch_size", accelerate),
                     ("transformers auto_find_batch_size", transformers),
                     ("Lightning scale_batch_size binsearch", lightning)):
        _say(f"  {name}")
        rows.append(run_peer(name, fn, spec.target))

    _say("  exhaustive truth (reusing identical measurements made above)")
    t = time.perf_counter()
    budget = int((1 - DEFAULT_MARGIN) * out["cap_bytes"])
    truth = true_max(device.cached, spec.target, budget=budget)
    truth["wall_s"] = time.perf_counter() - t
    out["truth"] = truth
    _say(f"  truth: {truth['accumulated']} with accumulation, {truth['plain']} without")
    for r in rows:
        accumulated = r["tuner"].startswith("autofit") and r.get("target") is not None
        r["true_max"] = truth["accumulated" if accumulated else "plain"]
        r["true_max_within_margin"] = truth["within_margin_accumulated" if accumulated
                                            else "within_margin_plain"]
        if r["micro"] is not None and not r["tuner"].startswith("autofit"):
            r["loader_lengths"] = loader_lengths(dataset, r["micro"])
    out["rows"] = rows

    _say("  full runs of autofit's choices on the worst-case batch")
    runs: dict[tuple[int, bool], dict[str, Any]] = {}
    for r in rows:
        if r["tuner"].startswith("autofit"):
            key = (r["micro"], r["accum"] > 1)
            if key not in runs:
                runs[key] = full_run(device, r["micro"], r["accum"])
            r["full_run"] = runs[key]
    if unrestricted:
        _say("  autofit (unrestricted)")
        out["unrestricted"] = run_unrestricted(device)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _length_stats(dataset: list[dict[str, Any]]) -> dict[str, Any]:
    lengths = sorted(len(s["input_ids"]) for s in dataset)
    return {"n": len(lengths), "median": statistics.median(lengths),
            "p90": lengths[int(0.9 * (len(lengths) - 1))], "max": lengths[-1],
            "at_max": sum(x == lengths[-1] for x in lengths)}


def _say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


# ---------------------------------------------------------------- recognition probe

_PROBE = r"""
import json, torch
from autofit.trial import procmem
from accelerate.utils.memory import should_reduce_batch_size
from lightning.pytorch.utilities.memory import is_oom_error
from autofit.trial import is_oom
prev = procmem.cap_address_space(64 << 20)
try:
    torch.empty(256 << 20, dtype=torch.uint8)
except BaseException as e:
    exc = e
procmem.restore_address_space(prev)
print(json.dumps({"type": type(exc).__name__, "args": len(exc.args),
                  "message": str(exc)[:200], "accelerate": should_reduce_batch_size(exc),
                  "lightning": is_oom_error(exc), "autofit": is_oom(exc)}))
"""


def recognition_probe() -> dict[str, Any]:
    """A real capped-CPU allocation failure, judged by each library's predicate."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       env=env, timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]}
    return json.loads(lines[-1])


# ---------------------------------------------------------------- report


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _fmt_wall(row: dict[str, Any], ref: float) -> tuple[str, str]:
    return f"{row['wall_s']:.0f}", f"{row['wall_s'] / ref:.2f}×"


def _divisor_at_most(target: int, size: int | None) -> int | None:
    return max((d for d in range(1, target + 1) if target % d == 0 and size is not None
                and d <= size), default=None)


def summarise(model: dict[str, Any]) -> dict[str, Any]:
    """The targets for one model, per autofit run.

    Each run's choice is compared with the true maximum of its own step, and with
    the largest size it may choose: within its margin (the default keeps 10% of the
    cap free, ``margin=0`` none) and, with a target effective batch, a divisor of it.
    """
    truth, target = model["truth"], model["spec"]["target"]
    peers = [r for r in model["rows"] if not r["tuner"].startswith("autofit")]
    finished = [r for r in peers if r["micro"] is not None]
    fastest = min(finished, key=lambda r: r["wall_s"]) if finished else None
    rows = []
    for r in model["rows"]:
        if not r["tuner"].startswith("autofit"):
            continue
        accumulated = r.get("target") is not None
        step = "accumulated" if accumulated else "plain"
        true = truth[step]
        margin0 = r["margin"] == 0.0
        ref = true if margin0 else truth[f"within_margin_{step}"]
        kind = "true max" if margin0 else "true max within the 10% margin"
        if accumulated:
            ref = _divisor_at_most(target, ref)
            kind = (f"largest divisor of {target} that fits" if margin0
                    else f"largest divisor of {target} within the 10% margin")
        rows.append({
            "tuner": r["tuner"], "micro": r["micro"], "accum": r["accum"],
            "true_max": true, "reference": ref, "reference_kind": kind,
            "choice_vs_true_max": r["micro"] / true,
            "choice_vs_reference": r["micro"] / ref if ref else None,
            "ooms": r["ooms"],
            "wall_vs_fastest_peer": r["wall_s"] / fastest["wall_s"] if fastest else None,
            "full_run_fits": r["full_run"]["fits"],
            "kept": r["kept"] if accumulated else None,
        })
    return {"fastest_peer": fastest["tuner"] if fastest else None, "rows": rows}


def trial_cost(results: dict[str, Any]) -> tuple[float | None, int]:
    """Median wall of the peers' attempts that ran out of memory in their first step
    (almost all process start-up), and how many there were."""
    walls = [a["wall_s"] for m in results.get("models", []) for r in m["rows"]
             for a in r.get("attempt_log", []) if a["oom"] and a["steps"] == 0 and a["wall_s"]]
    return (statistics.median(walls) if walls else None), len(walls)


def previous_run(path: Path) -> dict[str, Any] | None:
    """What the committed results at ``path`` (the run this one replaces) said, in brief."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not old.get("models"):
        return None
    cost, n = trial_cost(old)
    return {"date": old.get("date"), "machine": old.get("machine"), "wall_s": old.get("wall_s"),
            "oom_attempt_s": cost, "oom_attempts": n,
            "rows": {m["spec"]["name"]: {r["tuner"]: r["wall_s"] for r in m["rows"]}
                     for m in old["models"]}}


def _autofit_wall(results: dict[str, Any], rows: dict[str, dict[str, float]] | None = None
                  ) -> float:
    """Seconds of autofit's restricted runs (the four rows), every model."""
    if rows is None:
        rows = {m["spec"]["name"]: {r["tuner"]: r["wall_s"] for r in m["rows"]}
                for m in results["models"]}
    return sum(w for m in results["models"] for t, w in rows.get(m["spec"]["name"], {}).items()
               if t.startswith("autofit"))


def trial_start_side_by_side(spec: Spec, model_dir: Path, dataset: list[dict[str, Any]],
                             rounds: int = 3) -> dict[str, Any]:
    """The same attempt, alternately forked from the trial server and in a fresh process.

    Micro batch ``ACCELERATE_START`` (accelerate's first attempt): it runs out of
    memory in its first step, so its wall time is almost all start-up. A fresh
    process is what ``AUTOFIT_TRIAL_SERVER=0`` gives: ``python -m autofit.trial.child``.
    """
    device = Device(spec, model_dir, dataset)  # its own: nothing recorded for the truth
    walls: dict[str, list[float]] = {"server": [], "fresh": []}
    for _ in range(rounds):
        for mode in walls:
            if mode == "fresh":
                os.environ["AUTOFIT_TRIAL_SERVER"] = "0"
            try:
                a = device.attempt(ACCELERATE_START)
            finally:
                os.environ.pop("AUTOFIT_TRIAL_SERVER", None)
            walls[mode].append(a.wall_s)
    return {"model": spec.name, "size": ACCELERATE_START, "walls_s": walls,
            "median_s": {k: statistics.median(v) for k, v in walls.items()}}


def _cost_lines(results: dict[str, Any]) -> list[str]:
    cost, n = trial_cost(results)
    prev = results.get("previous")
    if cost is None:
        return []
    line = (f"**Trial cost.** A capped attempt that runs out of memory in its first step is "
            f"almost all start-up: median {cost:.2f} s here ({n} such attempts), the child "
            "forked from autofit's pre-imported trial server")
    start = results.get("server_start_s")
    line += "." if start is None else (f" (started once before the first tuner, in "
                                       f"{start:.0f} s, counted in no row).")
    ab = results.get("side_by_side")
    if ab:
        med = ab["median_s"]
        line += (f" Side by side in this run ({ab['model']}, micro batch {ab['size']}, "
                 f"{len(ab['walls_s']['server'])} attempts each way, alternating): "
                 f"{med['server']:.2f} s forked from the server, {med['fresh']:.2f} s in a fresh "
                 f"`python -m autofit.trial.child` ({med['fresh'] / med['server']:.1f}×).")
    if prev and prev.get("oom_attempt_s"):
        before = _autofit_wall(results, prev["rows"])
        line += (f" The previous committed run ({prev['date']}, {prev.get('machine') or '?'}; a "
                 f"fresh process per attempt) took {prev['oom_attempt_s']:.2f} s per such "
                 f"attempt ({prev['oom_attempts']} attempts); autofit's four restricted runs "
                 f"{before:.0f} s in all, {_autofit_wall(results):.0f} s here; the whole "
                 f"benchmark {prev['wall_s'] / 60:.1f} min, {results['wall_s'] / 60:.1f} min here "
                 "(*wall s before* in the tables). Runs on different days share the machine "
                 "with other work (the load average): the side-by-side figure is the like-for-"
                 "like one.")
    return [line, ""]


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Tuner benchmark: autofit vs accelerate, Lightning and transformers",
        "",
        f"Produced by `{results['command']}` on {results['date']} "
        f"({results['machine']}; {results['versions']}). Total wall time "
        f"{results['wall_s'] / 60:.1f} min.",
        "",
        "Every attempt of every tuner is one `autofit.trial.measure` call: a fresh process "
        "(forked from autofit's trial server, which imported torch and transformers once) "
        "capped with `RLIMIT_AS` at the device's cap, 1 warm-up + 2 measured optimizer steps "
        "on the worst-case batch (the B longest samples padded to the longest). Wall times "
        "are measured side by side in this run and given as a ratio to autofit's "
        "(restricted, default margin). The truth is an exhaustive search with the same "
        "measurement. See the docstring of `benchmarks/tuners.py` for the method.",
        "",
        "![attempts, OOMs and choices per tuner and model](tuners.png)",
        "",
    ]
    lines += _cost_lines(results)
    probe = results["recognition_probe"]
    peers = [r for m in results["models"] for r in m["rows"] if "wrapped" in r]
    wrapped = sum(r["wrapped"] for r in peers)
    recognised = sum(r["recognised"] for r in peers)
    lines += [
        "**OOM recognition.** A real capped-CPU allocation failure is a "
        f"`{probe.get('type')}` with {probe.get('args')} argument "
        f"(\"{probe.get('message', '')[:90]}...\"): accelerate's `should_reduce_batch_size` "
        f"→ {probe.get('accelerate')}, Lightning's `is_oom_error` → {probe.get('lightning')}, "
        f"autofit's `is_oom` → {probe.get('autofit')}. In the runs below, {recognised} OOMs "
        f"reached the peers as the `RuntimeError` the child met and were recognised by their "
        f"own predicate; {wrapped} had to be re-raised as `torch.OutOfMemoryError` "
        "(fields *recognised* / *wrapped* in the JSON).",
        "",
    ]
    for m in results["models"]:
        lines += _model_section(m, (results.get("previous") or {}).get("rows", {}))
    lines += _summary_section(results)
    return "\n".join(lines) + "\n"


def _model_section(m: dict[str, Any], previous: dict[str, dict[str, float]]) -> list[str]:
    s, truth, ls = m["spec"], m["truth"], m["lengths"]
    ref = next(r for r in m["rows"] if r["tuner"] == "autofit")["wall_s"]
    out = [
        f"## {s['name']} ({s['config']['architectures'][0]}, {m['params'] / 1e6:.1f}M params) "
        f"on `{s['cap']}`",
        "",
        f"{s['profile']}. Data: {ls['n']} samples, median {ls['median']:.0f} tokens, p90 "
        f"{ls['p90']}, max {ls['max']} ({ls['at_max']} at the max); worst-case batch B × "
        f"{ls['max']}. Target effective batch {s['target']}.",
        "",
        f"True largest micro batch: **{truth['plain']}** for a plain step (the peers'), "
        f"**{truth['accumulated']}** with gradient accumulation (autofit's step: the "
        f"gradients are held through the next micro batch); largest divisor of "
        f"{s['target']} that fits with accumulation: {truth['allowed_accumulated']}."
        + ("" if truth["consistent"] else " NB: the plain step failed where the accumulated "
           "one fit; searched from 1.")
        + f" ({len(truth['attempts_accumulated']) + len(truth['attempts_plain'])} sizes "
        f"checked, {len(truth['reused_accumulated']) + len(truth['reused_plain'])} of them "
        f"measured by a tuner first; {truth['wall_s']:.0f} s more.)",
        "",
        "| tuner | attempts | OOMs | steps | wall s | wall s before | wall / autofit | micro | "
        "accum | effective (kept?) | true max | choice / true max | sizes tried |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    before = previous.get(s["name"], {})
    for r in m["rows"]:
        wall, ratio = _fmt_wall(r, ref)
        micro = "failed" if r["micro"] is None else str(r["micro"])
        kept = "yes" if r["kept"] else "no"
        eff = "-" if r["effective"] is None else f"{r['effective']} ({kept})"
        share = "-" if r["micro"] is None else _ratio(r["micro"] / r["true_max"])
        sizes = r["sizes"] if "sizes" in r else [f"{t['size']}" + ("✗" if t["oom"] else "")
                                                 for t in r["trials"]]
        sizes_s = ", ".join(str(x) for x in sizes)
        if "sizes" in r:
            fails = {a["size"] for a in r["attempt_log"] if a["oom"]}
            sizes_s = ", ".join(f"{x}✗" if x in fails else str(x) for x in sizes)
        was = before.get(r["tuner"])
        was_s = "-" if was is None else f"{was:.0f}"
        out.append(f"| {r['tuner']} | {r['attempts']} | {r['ooms']} | {r['steps']} | {wall} | "
                   f"{was_s} | {ratio} | {micro} | {r['accum']} | {eff} | {r['true_max']} | {share} | "
                   f"{sizes_s} |")
    seen = {r["micro"]: r["loader_lengths"] for r in m["rows"] if r.get("loader_lengths")}
    if seen:
        out += ["", "A shuffled loader (seed 0) would give the peers' first 3 trial steps batches "
                "padded to " + "; ".join(f"{v} tokens at micro batch {k}" for k, v in
                                         sorted(seen.items()))
                + f" — the worst case is {ls['max']}."]
    seen_runs: set[tuple[int, int]] = set()
    for r in m["rows"]:
        fr = r.get("full_run")
        if fr is None or (fr["size"], fr["accum"]) in seen_runs:
            continue
        seen_runs.add((fr["size"], fr["accum"]))
        who = ", ".join(x["tuner"] for x in m["rows"]
                        if x.get("full_run") and (x["full_run"]["size"], x["full_run"]["accum"])
                        == (fr["size"], fr["accum"]))
        peak = "-" if fr["peak_bytes"] is None else f"{fr['peak_bytes'] / MiB:.0f} MiB"
        out.append("")
        out.append(f"Full run of micro {fr['size']} × accum {fr['accum']} ({who}; 1 warm-up + 3 "
                   f"optimizer steps, {min(fr['accum'], 2)} micro batch(es) each, on the "
                   f"worst-case batch): "
                   f"{'no OOM' if fr['fits'] else 'FAILED: ' + str(fr['error'])}, peak {peak} "
                   f"of {s['cap'].split(':')[1]}.")
    u = m.get("unrestricted")
    if u is not None and "error" in u:
        out += ["", f"Unrestricted autofit (for information) **failed** after {u['attempts']} "
                f"trials and {u['wall_s']:.0f} s: {u['error']}", "", "Its trials:", ""]
        budget = (1 - DEFAULT_MARGIN) * m["cap_bytes"]
        for line, x in zip(u["progress"], u["trials"], strict=False):
            peak = "-" if x["peak_bytes"] is None else f"{x['peak_bytes'] / MiB:.0f} MiB"
            over = x["peak_bytes"] is not None and x["peak_bytes"] > budget
            what = ("OOM" if x["oom"] else x["error"] if not x["fits"]
                    else f"fits, peak {peak}" + (" (over the 90% budget)" if over else ""))
            out.append(f"- {line} → measured: {what}")
    elif u is not None:
        out += ["", f"Unrestricted autofit (for information): {u['precision']}, "
                f"{u['optimizer']}, checkpointing {u['checkpointing']}, micro {u['micro']} × "
                f"accum {u['accum']}; {u['attempts']} trials, {u['ooms']} OOMs, "
                f"{u['wall_s']:.0f} s ({u['wall_s'] / ref:.2f}× the restricted run)."]
    return out + [""]


def _summary_section(results: dict[str, Any]) -> list[str]:
    out = ["## Summary", "",
           "| model | autofit run | choice | true max | may choose (what) | choice / true max | "
           "choice / may choose | OOMs | wall / fastest peer | full run | effective batch |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in results["models"]:
        t = m["summary"]
        for r in t["rows"]:
            wall = "-" if r["wall_vs_fastest_peer"] is None else f"{r['wall_vs_fastest_peer']:.2f}"
            kept = ("-" if r["kept"] is None else
                    f"{r['micro'] * r['accum']} ({'kept' if r['kept'] else 'NOT kept'})")
            out.append(
                f"| {m['spec']['name']} | {r['tuner']} | {r['micro']} | {r['true_max']} | "
                f"{r['reference']} ({r['reference_kind']}) | {_ratio(r['choice_vs_true_max'])} | "
                f"{_ratio(r['choice_vs_reference'])} | {r['ooms']} | {wall} | "
                f"{'no OOM' if r['full_run_fits'] else 'OOM'} | {kept} |")
    out += ["", "Fastest peer per model: " + "; ".join(
        f"{m['spec']['name']}: {m['summary']['fastest_peer']}" for m in results["models"]) + ".",
        "", "Targets (met / not met, per model and autofit run):", ""]
    for m in results["models"]:
        for r in m["summary"]["rows"]:
            checks = [
                ("choice ≥ 95% of the largest it may choose",
                 r["choice_vs_reference"] is not None
                 and r["choice_vs_reference"] >= TARGETS["choice_vs_true_max"]),
                ("choice ≥ 95% of the true max", r["choice_vs_true_max"]
                 >= TARGETS["choice_vs_true_max"]),
                ("at most one OOM", r["ooms"] <= TARGETS["max_ooms"]),
                ("wall < 1/3 of the fastest peer's", r["wall_vs_fastest_peer"] is not None
                 and r["wall_vs_fastest_peer"] < TARGETS["wall_vs_fastest_peer"]),
                ("full run without OOM", r["full_run_fits"]),
            ]
            out.append(f"- {m['spec']['name']}, {r['tuner']}: " + "; ".join(
                f"{label}: **{'met' if ok else 'not met'}**" for label, ok in checks))
    return out + [""] + _notes(results)


def _notes(results: dict[str, Any]) -> list[str]:
    target = results["models"][0]["spec"]["target"] if results["models"] else 48
    divisors = ", ".join(str(d) for d in range(1, target + 1) if target % d == 0)
    return [
        "## How to read this", "",
        "- *True max* is the largest micro batch that fits, for the run's own step: with a "
        "target, autofit's accumulated step (the gradients of one micro batch are held "
        "through the next, 4 bytes per parameter more); without one, the peers' plain step. "
        "*May choose* is the largest size the run's constraints allow: within its margin "
        "(the largest size whose measured peak is at most 90% of the cap, from the same "
        "exhaustive measurements; `margin=0`: the true max) and, with a target, a divisor "
        f"of it ({target}: {divisors}), so that micro × accumulation is exactly the target. "
        "The issue's target (choice ≥ 95% of the true maximum *for the combination it "
        "chose*) is read as *choice / may choose*; *choice / true max* is shown beside it, "
        "and is what the 10% margin and the divisors cost.",
        "- The margin is a fraction of the whole capacity, kept free for what a trial does not "
        "see (fragmentation, a longer run, other processes); the batch it costs is "
        "0.1 × cap / (bytes per sample): small when activations dominate, large when weights, "
        "gradients and optimizer states fill most of the cap. With `margin=0.0` autofit "
        "confirms the largest allowed size whose measured peak fits the cap.",
        "- accelerate 1.15's `find_executable_batch_size` multiplies the batch by 0.9 on each "
        "OOM (huggingface/accelerate#3650; earlier releases halved it); transformers' "
        "`auto_find_batch_size` is the same function started at `per_device_train_batch_size` "
        "with `gradient_accumulation_steps` unchanged, so the effective batch shrinks with the "
        "micro batch; Lightning's binsearch ends with a 5% margin (`int(0.95 × b)`). None of "
        "them keeps the effective batch, and none of them looks at the data: here they were "
        "given the worst-case batch, the most favourable setting for them; on a shuffled "
        "loader their trial steps meet the longest samples only by chance (for this data and "
        "seed, see the lengths per model above), and when they do not, the size they settle "
        "on can fail later, on the first long batch.",
        "- Each attempt (for every tuner) is a fresh capped process forked from autofit's trial "
        "server (see **Trial cost** above: runs before the server paid a new interpreter's "
        "imports, ~5-8 s here, per attempt); the wall-time ratios follow the attempt counts "
        "and the steps each attempt runs, as for in-process retries on a GPU.",
        "",
    ]


# ---------------------------------------------------------------- main


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for pkg in ("torch", "transformers", "accelerate", "lightning"):
        with contextlib.suppress(PackageNotFoundError):
            parts.append(f"{pkg} {version(pkg)}")
    return ", ".join(parts)


def _warm_up() -> None:
    """Import what every tuner needs, so that no tuner pays the first import."""
    import accelerate.utils  # noqa: F401
    import lightning.pytorch  # noqa: F401
    import transformers.trainer  # noqa: F401

    import autofit.api  # noqa: F401
    import autofit.trial  # noqa: F401


def _start_trial_server() -> float | None:
    """Start autofit's trial server (one trial of a tiny model), so that no tuner pays it;
    seconds, None if the server is off."""
    from autofit.config import TrainConfig
    from autofit.trial import measure, server

    if not server.enabled():
        return None
    t = time.perf_counter()
    measure("tiny-gpt2", TrainConfig(micro_batch_size=1), seq_len=8, device="cpu:1GiB",
            measure_steps=1)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=[s.name for s in SPECS],
                    choices=[s.name for s in SPECS])
    ap.add_argument("--skip-unrestricted", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "tuners")
    ap.add_argument("--replot", action="store_true",
                    help="redraw the .md and .png from the .json of a finished run; run nothing")
    args = ap.parse_args(argv)
    if args.replot:
        results = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(markdown(results))
        plot(results, args.out.with_suffix(".png"))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    _warm_up()
    results: dict[str, Any] = {
        "command": "python benchmarks/tuners.py" + (" " + " ".join(argv or sys.argv[1:])
                                                    if (argv or sys.argv[1:]) else ""),
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
                   f"{os.getloadavg()[0]:.1f} at the start",
        "versions": _versions(),
        "recognition_probe": recognition_probe(),
        "targets": TARGETS,
        "models": [],
    }
    previous = previous_run(args.out.with_suffix(".json"))  # the run this one replaces
    if previous is not None:
        results["previous"] = previous
    results["server_start_s"] = _start_trial_server()
    with tempfile.TemporaryDirectory(prefix="tuners-") as tmp:
        for spec in SPECS:
            if spec.name not in args.models:
                continue
            m = bench_model(spec, Path(tmp), unrestricted=not args.skip_unrestricted)
            m["summary"] = summarise(m)
            results["models"].append(m)
            if "side_by_side" not in results:
                _say(f"{spec.name}: trial start-up, forked from the server vs a fresh process")
                results["side_by_side"] = trial_start_side_by_side(
                    spec, Path(tmp) / spec.name, make_dataset(spec))
            _write(results, args.out, time.perf_counter() - t0)  # partial results survive
    _write(results, args.out, time.perf_counter() - t0)
    print(args.out.with_suffix(".md").read_text())
    return 0


def _write(results: dict[str, Any], out: Path, wall: float) -> None:
    results["wall_s"] = wall
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    plot(results, out.with_suffix(".png"))


def plot(results: dict[str, Any], path: Path) -> bool:
    """One panel per model: every tuner's attempts (OOMs in red) on a log wall-time axis,
    and its choice against the true maximum. False when matplotlib is missing."""
    from plotting import pyplot

    plt = pyplot()
    if plt is None:
        return False
    models = results["models"]
    if not models:
        return False
    fig, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 7.5), squeeze=False)
    for j, m in enumerate(models):
        rows = m["rows"]
        names = [r["tuner"].replace(" find_executable_batch_size", "").replace(
            " auto_find_batch_size", "").replace(" scale_batch_size binsearch", " binsearch")
            for r in rows]
        ys = range(len(rows))
        top, bottom = axes[0][j], axes[1][j]
        fits = [r["attempts"] - r["ooms"] for r in rows]
        top.barh(ys, fits, color="#4c9a5a", label="attempts that fit")
        top.barh(ys, [r["ooms"] for r in rows], left=fits, color="#c8442f", label="OOMs")
        for y, r in zip(ys, rows, strict=True):
            top.text(r["attempts"] + 0.3, y, f"{r['wall_s']:.0f} s", va="center", fontsize=8)
        top.set_yticks(list(ys), names, fontsize=8)
        top.invert_yaxis()
        top.set_xlabel("attempts, each a capped trial (wall time at the end of the bar)")
        top.set_title(f"{m['spec']['name']} on {m['spec']['cap']}", fontsize=10)
        if j == 0:
            top.legend(fontsize=8, loc="lower right")
        chosen = [r["micro"] or 0 for r in rows]
        bottom.barh(ys, chosen, color=["#3b6ea5" if r["tuner"].startswith("autofit")
                                       else "#999999" for r in rows])
        for y, r in zip(ys, rows, strict=True):
            bottom.plot([r["true_max"], r["true_max"]], [y - 0.4, y + 0.4], color="black", lw=1.5)
            if r["tuner"].startswith("autofit"):
                eff = f" × {r['accum']} = {r['effective']}" if r.get("target") else ""
                bottom.text((r["micro"] or 0) + 0.2, y, f"{r['micro']}{eff}", va="center",
                            fontsize=8)
        bottom.set_yticks(list(ys), names, fontsize=8)
        bottom.invert_yaxis()
        bottom.set_xlabel("micro batch chosen (black: true max of its step)")
    fig.suptitle("autofit vs accelerate, transformers and Lightning: attempts, OOMs, choice",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
