"""Soak benchmark: does the tuned configuration survive a whole training run?

For three small models with different memory profiles (tuners.py's, scaled
down: see ``SOAKS``), each on a capped CPU device (``cpu:<cap>``):

1. **autofit** restricted to the combination the peers search (32-true, AdamW,
   no checkpointing), no target batch (accumulation 1): its micro batch, its
   eval batch (``FitResult.eval_micro_batch``), its reasons, and its prediction
   of the run (``estimate.run_device_total_bytes`` when autofit fills it, else
   ``estimate.device_total_bytes``) beside the chosen trial's measured bytes.
2. **The soak** of that choice: the real ``Trainer.train()`` for one epoch of at
   least ``MIN_STEPS`` optimizer steps on seeded, shuffled, variable-length
   samples, evaluating every ``EVAL_EVERY`` steps and saving a checkpoint every
   ``SAVE_EVERY`` (``save_total_limit=1``), in a fresh child process under the
   same cap as autofit's trials (``CHILD_MALLOC_ENV``; a warm-up ``train()`` of
   2 steps with one eval and one save first, so one-time imports and first-touch
   pages are not counted; baseline RSS; ``RLIMIT_AS`` := VmSize + (cap -
   weights and buffers); then train). The run's measured peak is defined as a
   trial's device total: VmHWM - baseline + weights and buffers. VmHWM is read
   and reset at every optimizer step, evaluation and save, so the result has the
   peak of every step and the phase (train / eval / save) of the run's peak.
3. **The largest micro batch that survives the soak**, searched with the same
   soak (from autofit's choice up by ~10% until one dies, then bisect; or down
   if autofit's choice dies). NB: a soak that survives at B is taken to mean
   every smaller B survives; every probe is a full soak, and a soak run once is
   reused (the peers' choices too).
4. **The peers, the way they really run**, each in a fresh capped child with the
   same warm-up and cap, on the same data:
   accelerate's ``find_executable_batch_size(starting_batch_size=128)`` around a
   function that builds a shuffled ``DataLoader`` (seed 42) at batch b and runs
   its first 3 training steps; transformers' ``auto_find_batch_size=True``: the
   real ``Trainer.train()`` from ``per_device_train_batch_size=128`` (it restarts
   at 0.9x on every OOM, from step 0; every restart is recorded); Lightning's
   ``Tuner.scale_batch_size(mode="binsearch")`` on a ``LightningModule`` that
   wraps the same HF model with the real shuffled loader. The probes see the
   batches their loaders give them first, not the worst case. accelerate's and
   Lightning's choices are then soaked (reusing any soak of the same size);
   transformers' run *is* its soak.

Every soak uses autofit's eval batch, so soaks differ only in the training
micro batch. Writes ``benchmarks/results/soak.md``, ``soak.json``, ``soak.png``.

    OMP_NUM_THREADS=1 python benchmarks/soak.py                  # all three models
    python benchmarks/soak.py --models gpt2-dropout --quick      # smoke run, fewer steps
    python benchmarks/soak.py --replot                           # redraw from soak.json

Run by hand, not in CI. One child: ``python benchmarks/soak.py --child JOB.json``.

Known limitations:
    NB: the models, caps and sequence lengths are tuners.py's scaled down (see
    ``SOAKS``) so that one soak of >= 300 steps takes about a minute on 2 shared
    cores; the profiles (what dominates the peak) are kept.
    NB: RSS counts resident pages; a page mapped before the baseline and touched
    later counts in the peak without counting against RLIMIT_AS (a few MiB).
    NB: the cap bounds *address space* (RLIMIT_AS), as for autofit's trials, so every
    mark also records the address space mapped since the cap was set; a death whose
    resident peak was well below the cap is marked an "address space" death. The
    children run with autofit's measuring environment (``CHILD_MALLOC_ENV``), which
    turns oneDNN's primitive cache off: it keeps a JIT kernel per input shape (GELU:
    256 KiB of code space each, mostly not resident, up to 1024 kernels), so on
    variable-length batches the address space grew step after step while RSS stayed
    flat (on 2026-11-30, before the change, every bert-bigvocab soak died of it).
    NB: a child killed by a signal (e.g. a Rust allocation failure in
    safetensors aborts the process) leaves no result; its events file gives the
    last step and phase, and it is reported as killed, with the signal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import tuners  # noqa: E402  (Spec, SPECS, recognition_probe, _versions)

MiB = 1 << 20
MIN_STEPS = 300  # optimizer steps of one soak, at least (one epoch, or more when it is shorter)
EVAL_EVERY = 100
SAVE_EVERY = 150
LOG_EVERY = 50
QUICK = {"min_steps": 40, "eval_every": 15, "save_every": 20, "log_every": 10}
EVAL_SAMPLES = 64
PEER_START = 128  # accelerate's default starting_batch_size; transformers' per-device batch
PROBE_STEPS = 3  # accelerate probe: the first training steps of each attempt
DEFAULT_EVAL_BATCH = 8  # TrainingArguments' per_device_eval_batch_size
CHILD_TIMEOUT_S = 3600
TARGETS = {"ooms": 0, "peak_error": 0.05, "choice_vs_largest": 0.97}
PHASES = ("train", "eval", "save")


# ---------------------------------------------------------------- models and data


def _scaled(name: str, **changes: Any) -> tuners.Spec:
    base = next(s for s in tuners.SPECS if s.name == name)
    config = {**base.config, **changes.pop("config", {})}
    return dataclasses.replace(base, config=config, **changes)


# tuners.py's three models, scaled down so that one soak (>= 300 steps) takes about a
# minute here; ``samples`` gives one epoch of >= MIN_STEPS steps up to micro batch
# samples // MIN_STEPS. What changed, and why, is in CHANGES.
SOAKS: tuple[tuners.Spec, ...] = (
    _scaled("llama-vocab", config={"vocab_size": 8000, "hidden_size": 32,
                                   "intermediate_size": 86},
            cap="cpu:128MiB", seq_max=128, samples=2700),
    _scaled("gpt2-dropout", cap="cpu:128MiB", seq_max=128, samples=2700),
    _scaled("bert-bigvocab", config={"vocab_size": 60000, "hidden_size": 64,
                                     "num_hidden_layers": 4, "intermediate_size": 256},
            cap="cpu:128MiB", seq_max=128, samples=3900),
)
CHANGES = {
    "llama-vocab": "vocab 32000 -> 8000, hidden 64 -> 32; cap 1GiB -> 128MiB; longest sample "
                   "256 -> 128 tokens (the logits still dominate)",
    "gpt2-dropout": "cap 384MiB -> 128MiB; longest sample 256 -> 128 tokens",
    "bert-bigvocab": "vocab 250002 -> 60000, hidden 128 -> 64, 8 -> 4 layers; cap 900MiB -> "
                     "128MiB; longest sample 256 -> 128 tokens (the embedding is still 94% of "
                     "the parameters)",
}


def soak_lengths(n: int, seq_max: int, seed: int) -> list[int]:
    """Skewed lengths (tuners.py's shape, shorter and with a lighter tail): 94% in
    4..seq_max/8, 5% up to seq_max/2, 1% up to seq_max - 1, and three at seq_max."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.94:
            out.append(rng.randint(4, seq_max // 8))
        elif u < 0.99:
            out.append(rng.randint(seq_max // 8 + 1, seq_max // 2))
        else:
            out.append(rng.randint(seq_max // 2 + 1, seq_max - 1))
    for i in rng.sample(range(n), 3):  # a few at the maximum
        out[i] = seq_max
    return out


def make_samples(spec: tuners.Spec, n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` seeded samples with ``input_ids`` (ids >= 5; 0 pads) and ``label`` for seq-cls."""
    rng = random.Random(seed + 1)
    vocab = int(spec.config["vocab_size"])
    data = []
    for length in soak_lengths(n, spec.seq_max, seed):
        sample: dict[str, Any] = {"input_ids": [rng.randrange(5, vocab) for _ in range(length)]}
        if spec.task == "seq-cls":
            sample["label"] = rng.randrange(2)
        data.append(sample)
    return data


def datasets_of(spec: tuners.Spec, samples: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval): the training samples and a small eval split of the same shape."""
    return make_samples(spec, samples, spec.seed), make_samples(spec, EVAL_SAMPLES, spec.seed + 7)


def length_stats(dataset: list[dict[str, Any]]) -> dict[str, Any]:
    lengths = sorted(len(s["input_ids"]) for s in dataset)
    return {"n": len(lengths), "median": statistics.median(lengths),
            "p90": lengths[int(0.9 * (len(lengths) - 1))],
            "p99": lengths[int(0.99 * (len(lengths) - 1))], "max": lengths[-1],
            "at_max": sum(x == lengths[-1] for x in lengths)}


# ---------------------------------------------------------------- the child


class _Meter:
    """Peak RSS per interval (an optimizer step, an eval, a save), as a trial's device total.

    ``mark(phase)`` closes the interval since the last mark: its VmHWM - baseline +
    resident is that interval's peak; VmHWM is then reset. Every mark is one JSON line
    in the events file (flushed: a killed child leaves them).
    """

    def __init__(self, events: Any, base: int, resident: int) -> None:
        from autofit.trial import procmem

        self.procmem = procmem
        self.events = events
        self.base = base
        self.resident = resident
        self.t0 = time.monotonic()
        self.phase = "set-up"
        self.step = 0
        self.peak = 0
        self.peak_at: dict[str, Any] | None = None
        self.seq: int | None = None  # padded length of the current step's batch
        self.rows: int | None = None  # samples in it
        self.attempt = 0
        self.vm_base = procmem.vm_size_bytes() or 0  # address space when the cap was set

    def write(self, **kw: Any) -> None:
        self.events.write(json.dumps(kw) + "\n")
        self.events.flush()

    def vm_used(self, vm: int | None = None) -> int:
        """Address space mapped since the cap was set (RLIMIT_AS allows cap - resident)."""
        vm = self.procmem.vm_size_bytes() if vm is None else vm
        return (vm or 0) - self.vm_base

    def enter(self, phase: str) -> None:
        self.phase = phase
        if phase != "train":
            self.write(kind="enter", phase=phase, step=self.step, attempt=self.attempt)

    def mark(self, phase: str, step: int) -> dict[str, Any]:
        hwm = self.procmem.peak_rss_bytes() or 0
        rss = self.procmem.rss_bytes() or 0
        vm = self.procmem.vm_size_bytes() or 0
        ev = {"kind": "mark", "phase": phase, "step": step, "attempt": self.attempt,
              "t": round(time.monotonic() - self.t0, 3),
              "peak": max(0, hwm - self.base) + self.resident,
              "rss": max(0, rss - self.base) + self.resident, "vm": self.vm_used(vm)}
        if phase == "train" and self.seq is not None:
            ev["seq"] = self.seq
            ev["rows"] = self.rows
        if ev["peak"] > self.peak:
            self.peak = ev["peak"]
            self.peak_at = {"phase": phase, "step": step, "seq": ev.get("seq")}
        self.write(**ev)
        self.procmem.reset_peak_rss()
        self.step = step
        return ev


def _first_line(exc: BaseException) -> str:
    from autofit.trial.loop import _first_line as first

    return first(exc)


def _tokenizer() -> Any:
    """A pad-only tokenizer (pad id 0): the collators only pad ids that are already there."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   model_input_names=["input_ids", "attention_mask"])


def _collator(task: str) -> Any:
    """The default padding collator of the task (pad to the longest sample of the batch)."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    tok = _tokenizer()
    if task == "seq-cls":
        return DataCollatorWithPadding(tok)
    return DataCollatorForLanguageModeling(tok, mlm=False)


def _build_model(job: dict[str, Any]) -> Any:
    import torch
    import transformers

    from autofit.probe.model import TASKS

    config = dict(job["config"])
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(int(job["seed"]))
    return getattr(transformers, TASKS[job["task"]]).from_config(config)


def _training_args(out_dir: str, **kw: Any) -> Any:
    from transformers import TrainingArguments

    base: dict[str, Any] = {
        "output_dir": out_dir, "eval_strategy": "steps", "save_strategy": "steps",
        "save_total_limit": 1, "report_to": [], "use_cpu": True, "seed": 42,
        "dataloader_num_workers": 0, "disable_tqdm": True, "optim": "adamw_torch",
    }
    base.update(kw)
    return TrainingArguments(**base)


def _trainer_class() -> Any:
    """``Trainer`` that tells the meter its phase: eval, save, each attempt of the loop."""
    from transformers import Trainer

    class SoakTrainer(Trainer):
        meter: _Meter | None = None
        attempts: list[dict[str, Any]]

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            if self.meter is not None:
                self.meter.seq = int(inputs["input_ids"].shape[1])
                self.meter.rows = int(inputs["input_ids"].shape[0])
            return super().training_step(model, inputs, num_items_in_batch)

        def evaluate(self, *a: Any, **k: Any) -> Any:
            if self.meter is None:
                return super().evaluate(*a, **k)
            self.meter.enter("eval")
            out = super().evaluate(*a, **k)
            self.meter.mark("eval", self.state.global_step)
            self.meter.enter("train")
            return out

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            if self.meter is None:
                return super()._save_checkpoint(model, trial)
            self.meter.enter("save")
            super()._save_checkpoint(model, trial)
            self.meter.mark("save", self.state.global_step)
            self.meter.enter("train")
            return None

        def _inner_training_loop(self, batch_size: Any = None, args: Any = None,
                                 resume_from_checkpoint: Any = None, trial: Any = None,
                                 ignore_keys_for_eval: Any = None) -> Any:
            m = self.meter
            if m is not None:
                m.attempt += 1
                m.step = 0
                m.peak, m.peak_at = 0, None
                m.write(kind="attempt", attempt=m.attempt, batch=batch_size)
                m.enter("train")
                m.procmem.reset_peak_rss()
            failed: dict[str, Any] | None = None
            try:
                return super()._inner_training_loop(
                    batch_size, args=args, resume_from_checkpoint=resume_from_checkpoint,
                    trial=trial, ignore_keys_for_eval=ignore_keys_for_eval)
            except Exception as exc:
                from autofit.trial.oom import is_oom

                failed = {"oom": is_oom(exc), "error": _first_line(exc)}
                raise
            finally:
                if m is not None:
                    self.attempts.append(_attempt_record(m, batch_size, failed))

    return SoakTrainer


def _attempt_record(m: _Meter, batch: Any, failed: dict[str, Any] | None) -> dict[str, Any]:
    """One run of the training loop: how far it got, its peak, how it ended."""
    hwm = m.procmem.peak_rss_bytes() or 0
    last = max(0, hwm - m.base) + m.resident  # the interval it ended in
    vm = m.vm_used()  # NB: while the exception unwinds, the failed step's tensors are alive
    rec = {"batch": batch, "peak": max(m.peak, last), "peak_at": m.peak_at,
           "steps": m.step, "survived": failed is None, "vm_end": vm}
    if failed is not None:
        step = m.step + 1 if m.phase == "train" else m.step
        rec.update(failed, died_step=step, died_phase=m.phase, died_peak=last, died_vm=vm)
        m.write(kind="died", attempt=m.attempt, step=step, phase=m.phase, peak=last, vm=vm,
                **failed)
    else:
        m.write(kind="done", attempt=m.attempt, steps=m.step)
    return rec


def _step_callback(meter: _Meter) -> Any:
    from transformers import TrainerCallback

    class StepMarks(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            meter.phase = "train"

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            meter.mark("train", state.global_step)

    return StepMarks()


def _warm_up(job: dict[str, Any], model: Any, train: list[Any], evals: list[Any],
             collator: Any) -> None:
    """``Trainer.train`` on a handful of samples: 2 steps, one eval, one save; then dropped."""
    cls = _trainer_class()
    with tempfile.TemporaryDirectory(prefix="soak-warm-") as tmp:
        args = _training_args(tmp, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                              max_steps=2, eval_steps=2, save_steps=2, logging_steps=1)
        trainer = cls(model=model, args=args, train_dataset=train[:8], eval_dataset=evals[:4],
                      data_collator=collator)
        trainer.attempts = []
        trainer.train()
        del trainer
    model.zero_grad(set_to_none=True)
    model.train()  # as built (the warm-up's evaluation left it in eval mode)
    gc.collect()


def _steps_plan(job: dict[str, Any], batch: int, samples: int) -> dict[str, Any]:
    """One epoch, or ``min_steps`` when one epoch at this batch is shorter."""
    per_epoch = math.ceil(samples / batch)
    if per_epoch >= job["min_steps"]:
        return {"num_train_epochs": 1}
    return {"max_steps": job["min_steps"]}


def child_main(job_path: str) -> int:
    """Run one job (a soak, or a peer's search) and write its result JSON."""
    job = json.loads(Path(job_path).read_text())
    warnings.filterwarnings("ignore")
    import logging

    for name in ("transformers", "accelerate", "lightning.pytorch", "lightning.fabric",
                 "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # noqa: F401
    import transformers.trainer  # noqa: F401

    from autofit.trial import procmem
    from autofit.trial.step import storage_bytes

    if job["mode"] == "lightning":
        import lightning.pytorch  # noqa: F401
        from lightning.pytorch.tuner import Tuner  # noqa: F401
    if job["mode"] == "accelerate":
        import accelerate.utils  # noqa: F401

    spec = tuners.Spec(**job["spec"])
    train, evals = datasets_of(spec, job["samples"])
    collator = _collator(spec.task)
    model = _build_model(job)
    t_setup = time.monotonic()
    _warm_up(job, model, train, evals, collator)
    result: dict[str, Any] = {"mode": job["mode"], "warm_up_s": round(time.monotonic() - t_setup, 1)}
    out_dir = tempfile.mkdtemp(prefix="soak-run-")
    events = open(job["events"], "w")  # noqa: SIM115 - open before the cap, closed at exit
    try:
        prepared = _prepare(job, model, train, evals, collator, out_dir)
        # what reports an OOM is imported before the baseline and the cap: importing it
        # after one (a few MiB of address space left) failed with its own MemoryError
        import autofit.trial.loop  # noqa: F401
        import autofit.trial.oom  # noqa: F401

        gc.collect()
        procmem.malloc_trim()
        base = procmem.rss_bytes() or 0
        resident = storage_bytes(model.parameters(), model.buffers())
        meter = _Meter(events, base, resident)
        result.update(baseline_bytes=base, resident_bytes=resident, cap_bytes=job["cap_bytes"])
        previous = procmem.cap_address_space(job["cap_bytes"] - resident)
        procmem.reset_peak_rss()
        t0 = time.monotonic()
        try:
            result.update(RUNNERS[job["mode"]](job, prepared, meter))
        finally:
            procmem.restore_address_space(previous)
        result["wall_s"] = round(time.monotonic() - t0, 1)
    finally:
        events.close()
        shutil.rmtree(out_dir, ignore_errors=True)
    Path(job["out"]).write_text(json.dumps(result))
    return 0


def _prepare(job: dict[str, Any], model: Any, train: list[Any], evals: list[Any],
             collator: Any, out_dir: str) -> dict[str, Any]:
    """What the run needs, built before the baseline (the Trainer, the loaders' pieces)."""
    prepared: dict[str, Any] = {"model": model, "train": train, "evals": evals,
                                "collator": collator, "out_dir": out_dir}
    if job["mode"] in ("soak", "transformers"):
        batch = PEER_START if job["mode"] == "transformers" else job["batch"]
        kw = dict(job.get("training_args", {}))
        kw.update(per_device_train_batch_size=batch,
                  per_device_eval_batch_size=job["eval_batch"],
                  eval_steps=job["eval_every"], save_steps=job["save_every"],
                  logging_steps=job["log_every"])
        if job["mode"] == "transformers":
            kw.update(auto_find_batch_size=True, num_train_epochs=1)
        else:
            kw.update(_steps_plan(job, batch, len(train)))
        kw.pop("output_dir", None)
        args = _training_args(out_dir, **kw)
        trainer = _trainer_class()(model=model, args=args, train_dataset=train,
                                   eval_dataset=evals, data_collator=collator)
        trainer.attempts = []
        prepared["trainer"] = trainer
    if job["mode"] == "lightning":
        prepared["lightning"] = _lightning_setup(model, train, collator, out_dir)
    return prepared


def _run_trainer(job: dict[str, Any], prepared: dict[str, Any], meter: _Meter) -> dict[str, Any]:
    """``Trainer.train()`` under the cap: a soak (one attempt), or transformers'
    ``auto_find_batch_size`` (restarts at 0.9x on every OOM, each an attempt)."""
    trainer = prepared["trainer"]
    trainer.meter = meter
    trainer.add_callback(_step_callback(meter))
    error: str | None = None
    oom = False
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - an OOM is the result
        from autofit.trial.oom import is_oom

        oom, error = is_oom(exc), _first_line(exc)
    attempts = trainer.attempts
    last = attempts[-1] if attempts else {}
    out = {"attempts": attempts, "survived": error is None, "oom": oom, "error": error,
           "batch": last.get("batch"), "steps": last.get("steps"),
           "vm_allowance": job["cap_bytes"] - meter.resident,
           "vm_end": last.get("vm_end"),
           "planned_steps": trainer.state.max_steps, "peak": last.get("peak"),
           "peak_at": last.get("peak_at")}
    if error is not None and attempts and not attempts[-1]["survived"]:
        out.update(died_step=last["died_step"], died_phase=last["died_phase"],
                   died_peak=last["died_peak"], died_vm=last["died_vm"])
    return out


def _run_accelerate(job: dict[str, Any], prepared: dict[str, Any],
                    meter: _Meter) -> dict[str, Any]:
    """accelerate's ``find_executable_batch_size`` around the first steps of training."""
    import torch
    from accelerate.utils import find_executable_batch_size

    model, train, collator = prepared["model"], prepared["train"], prepared["collator"]
    attempts: list[dict[str, Any]] = []

    @find_executable_batch_size(starting_batch_size=PEER_START)
    def probe(batch_size: int) -> int:
        rec: dict[str, Any] = {"batch": batch_size, "seq": [], "steps": 0}
        attempts.append(rec)
        model.zero_grad(set_to_none=True)
        meter.procmem.reset_peak_rss()
        try:
            loader = torch.utils.data.DataLoader(
                train, batch_size=batch_size, shuffle=True, collate_fn=collator,
                generator=torch.Generator().manual_seed(42))
            optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
            model.train()
            for i, batch in enumerate(loader):
                if i == PROBE_STEPS:
                    break
                rec["seq"].append(int(batch["input_ids"].shape[1]))
                model(**batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                rec["steps"] += 1
        except Exception as exc:
            from autofit.trial.oom import is_oom

            rec.update(oom=is_oom(exc), error=_first_line(exc))
            raise
        finally:
            hwm = meter.procmem.peak_rss_bytes() or 0
            rec["peak"] = max(0, hwm - meter.base) + meter.resident
        return batch_size

    choice: int | None = None
    error = None
    try:
        choice = probe()
    except Exception as exc:  # noqa: BLE001 - a peer that gives up is a result
        error = _first_line(exc)
    return {"choice": choice, "error": error, "attempts": attempts}


def _lightning_setup(model: Any, train: list[Any], collator: Any, root: str) -> dict[str, Any]:
    """The LightningModule around the HF model and a tiny fit (Lightning's own warm-up)."""
    import logging

    import lightning.pytorch as pl
    import torch

    from autofit.trial import procmem

    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class HFModule(pl.LightningModule):
        def __init__(self, hf: Any, batch_size: int) -> None:
            super().__init__()
            self.model = hf
            self.batch_size = batch_size
            self.trials: list[dict[str, Any]] = []
            self.data = train

        def train_dataloader(self) -> Any:  # the real shuffled loader, seed 42
            return torch.utils.data.DataLoader(
                self.data, batch_size=self.batch_size, shuffle=True, collate_fn=collator,
                generator=torch.Generator().manual_seed(42))

        def on_train_start(self) -> None:
            self.trials.append({"batch": self.batch_size, "seq": [], "steps": 0, "hwm": []})
            procmem.reset_peak_rss()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.trials:
                self.trials[-1]["seq"].append(int(batch["input_ids"].shape[1]))
                self.trials[-1]["rows"] = int(batch["input_ids"].shape[0])

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.trials:
                self.trials[-1]["steps"] += 1
                self.trials[-1]["hwm"].append(procmem.peak_rss_bytes() or 0)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=5e-5)

    def trainer() -> Any:
        return pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=root,
                          num_sanity_val_steps=0)

    with warnings.catch_warnings():  # the warm-up fit: 2 steps at batch 2
        warnings.simplefilter("ignore")
        warm = HFModule(model, 2)
        warm.data = train[:4]
        t = trainer()
        t.fit(warm)
        del t, warm
    model.zero_grad(set_to_none=True)
    model.train()  # NB: Lightning keeps submodules' modes; a model in eval mode trains so
    gc.collect()
    return {"module": HFModule(model, 2), "trainer": trainer}


def _run_lightning(job: dict[str, Any], prepared: dict[str, Any], meter: _Meter) -> dict[str, Any]:
    """Lightning's ``Tuner.scale_batch_size(mode="binsearch")`` with its defaults."""
    from lightning.pytorch.tuner import Tuner

    lit = prepared["lightning"]
    module = lit["module"]
    choice: int | None = None
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            choice = Tuner(lit["trainer"]()).scale_batch_size(module, mode="binsearch")
    except Exception as exc:  # noqa: BLE001 - a peer that gives up is a result
        error = _first_line(exc)
    hwm = meter.procmem.peak_rss_bytes() or 0
    trials = [dict(t, oom=t["steps"] < PROBE_STEPS,
                   step_peaks=[max(0, h - meter.base) + meter.resident for h in t.pop("hwm")])
              for t in module.trials]
    return {"choice": None if choice is None else int(choice), "error": error,
            "attempts": trials, "peak": max(0, hwm - meter.base) + meter.resident}


RUNNERS = {"soak": _run_trainer, "transformers": _run_trainer,
           "accelerate": _run_accelerate, "lightning": _run_lightning}


# ---------------------------------------------------------------- the parent


def _child_env() -> dict[str, str]:
    from autofit.trial.procmem import CHILD_MALLOC_ENV

    env = dict(os.environ, **CHILD_MALLOC_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in
                                                        env.get("PYTHONPATH", "").split(os.pathsep)
                                                        if p])
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def run_child(job: dict[str, Any], workdir: Path, label: str) -> dict[str, Any]:
    """Run one job in a fresh process; a child killed by a signal is reported from its events."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = dict(job, events=str(workdir / f"{label}.events.jsonl"),
               out=str(workdir / f"{label}.out.json"))
    job_path = workdir / f"{label}.job.json"
    job_path.write_text(json.dumps(job))
    Path(job["out"]).unlink(missing_ok=True)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(job_path)],
                       env=_child_env(), capture_output=True, text=True,
                       timeout=job.get("timeout_s", CHILD_TIMEOUT_S))
    wall = time.perf_counter() - t
    events = _read_events(Path(job["events"]))
    out = Path(job["out"])
    if out.exists():
        result = json.loads(out.read_text())
    else:  # killed (a signal) or crashed: what the events say
        result = _from_events(events, p.returncode, p.stderr)
    result["process_wall_s"] = round(wall, 1)
    result["curve"] = _curve(events)
    return result


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def _from_events(events: list[dict[str, Any]], returncode: int, stderr: str) -> dict[str, Any]:
    """A child with no result: how far its events got, and how it ended."""
    how = (f"killed by {signal.Signals(-returncode).name}" if returncode < 0
           else f"exit {returncode}")
    tail = [x for x in stderr.strip().splitlines() if x.strip()][-3:]
    marks = [e for e in events if e.get("kind") == "mark"]
    step = marks[-1]["step"] if marks else 0
    phase = "train"
    for e in events:
        if e.get("kind") == "enter":
            phase = e["phase"]
        elif e.get("kind") == "mark":
            phase = "train"
    died = step + 1 if phase == "train" else step
    peak = max((e["peak"] for e in marks), default=None)
    return {"survived": False, "oom": None, "error": f"{how}: {' | '.join(tail)}"[:500],
            "killed": how, "died_step": died, "died_phase": phase, "steps": step, "peak": peak,
            "attempts": []}


def _curve(events: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The marks as columns (the last attempt of the loop): step, phase, peak, rss, seq."""
    marks = [e for e in events if e.get("kind") == "mark"]
    if marks:
        last = max(e.get("attempt", 0) for e in marks)
        marks = [e for e in marks if e.get("attempt", 0) == last]
    return {"step": [e["step"] for e in marks], "phase": [e["phase"] for e in marks],
            "peak": [e["peak"] for e in marks], "rss": [e["rss"] for e in marks],
            "vm": [e.get("vm") for e in marks],
            "seq": [e.get("seq") for e in marks], "t": [e["t"] for e in marks]}


# ---------------------------------------------------------------- one model


def _plan(quick: bool) -> dict[str, int]:
    if quick:
        return dict(QUICK)
    return {"min_steps": MIN_STEPS, "eval_every": EVAL_EVERY, "save_every": SAVE_EVERY,
            "log_every": LOG_EVERY}


def _samples(spec: tuners.Spec, quick: bool) -> int:
    """Training samples: the spec's, or for --quick as many as QUICK's steps need."""
    if not quick:
        return spec.samples
    return max(8, spec.samples * QUICK["min_steps"] // MIN_STEPS)


def run_autofit(spec: tuners.Spec, model_dir: Path, train: list[Any]) -> dict[str, Any]:
    """autofit on the peers' combination, no target batch; its choice and its predictions."""
    from autofit import autofit

    t = time.perf_counter()
    r = autofit(str(model_dir), train, device=spec.cap, precision=["32-true"],
                optimizer=["adamw_torch"], gradient_checkpointing=False, progress=False,
                cache=False, task=spec.task)
    wall = time.perf_counter() - t
    micro, accum = r.config.micro_batch_size, r.config.grad_accum_steps
    chosen = [x for x in r.trials if x.fits and x.config.get("micro_batch_size") == micro
              and x.config.get("grad_accum_steps") == accum]
    est = r.estimate
    run = getattr(r, "predicted_run_bytes", None) or est.run_device_total_bytes
    return {
        "micro": micro, "accum": accum, "eval_batch": r.eval_micro_batch,
        "confirmed": r.confirmed, "wall_s": round(wall, 1), "reasons": list(r.reasons),
        "predicted_step_bytes": est.device_total_bytes, "predicted_run_bytes": run,
        "predicted_bytes": run if run is not None else est.device_total_bytes,
        "predicted_kind": "predicted_run_bytes" if run is not None
        else "device_total_bytes (no run prediction)",
        "breakdown": dict(est.breakdown), "estimate_notes": list(est.notes),
        "trial_bytes": chosen[-1].device_total_bytes if chosen else None,
        "trials": [{"micro": x.config.get("micro_batch_size"), "fits": x.fits, "oom": x.oom,
                    "bytes": x.device_total_bytes, "error": x.error} for x in r.trials],
        "training_arguments": {k: v for k, v in r.training_arguments_kwargs.items()
                               if k != "output_dir"},
    }


class Soaks:
    """Soaks of one model at any micro batch (autofit's eval batch), each run once."""

    def __init__(self, base_job: dict[str, Any], workdir: Path) -> None:
        self.base_job = base_job
        self.workdir = workdir
        self.done: dict[int, dict[str, Any]] = {}
        self.order: list[int] = []

    def __call__(self, batch: int) -> dict[str, Any]:
        if batch not in self.done:
            _say(f"    soak at micro batch {batch}")
            r = run_child(dict(self.base_job, mode="soak", batch=batch), self.workdir,
                          f"soak-{batch}")
            self.done[batch] = r
            self.order.append(batch)
            _say("      " + _soak_line(r))
        return self.done[batch]

    def survives(self, batch: int) -> bool:
        return bool(self(batch)["survived"])


def _soak_line(r: dict[str, Any]) -> str:
    peak = "-" if r.get("peak") is None else f"{r['peak'] / MiB:.1f} MiB"
    if r["survived"]:
        at = r.get("peak_at") or {}
        return (f"survived {r['steps']} steps, run peak {peak} ({at.get('phase')} at step "
                f"{at.get('step')}), {r.get('wall_s')} s")
    return (f"DIED at step {r.get('died_step')} ({r.get('died_phase')}): {r.get('error')}; "
            f"{r.get('process_wall_s')} s")


def largest_surviving(survives: Any, start: int, limit: int) -> dict[str, Any]:
    """The largest micro batch whose soak survives: from ``start`` up by ~10% (at least 1)
    until one dies (or down, if ``start`` dies, until one survives), then bisect.

    NB: assumes a soak that survives at B survives at every smaller B (and one that dies
    at B dies at every larger one).
    """
    probes: list[int] = []

    def ok(b: int) -> bool:
        probes.append(b)
        return survives(b)

    lo: int | None = None  # largest known to survive
    hi: int | None = None  # smallest known to die
    b = start
    if ok(b):
        lo = b
        while hi is None and b < limit:
            b = min(limit, max(b + 1, math.ceil(b * 1.1)))
            if ok(b):
                lo = b
            else:
                hi = b
    else:
        hi = b
        while lo is None and b > 1:
            b = max(1, min(b - 1, math.floor(b / 1.1)))
            if ok(b):
                lo = b
            else:
                hi = b
    while lo is not None and hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"largest": lo, "first_death": hi, "probes": probes,
            "capped_at_limit": hi is None}


def bench_model(spec: tuners.Spec, workdir: Path, *, quick: bool) -> dict[str, Any]:
    """autofit, the soak of its choice, the largest surviving micro batch, the peers."""
    from autofit.probe.device import resolve_device

    mdir = workdir / spec.name
    mdir.mkdir(parents=True, exist_ok=True)
    (mdir / "config.json").write_text(json.dumps(spec.config))
    samples = _samples(spec, quick)
    train, evals = datasets_of(spec, samples)
    cap = resolve_device(spec.cap).capacity_bytes
    out: dict[str, Any] = {"spec": dataclasses.asdict(spec), "changes": CHANGES[spec.name],
                           "cap_bytes": cap, "train_lengths": length_stats(train),
                           "eval_lengths": length_stats(evals), "plan": _plan(quick)}
    t0 = time.perf_counter()
    _say(f"{spec.name} on {spec.cap}: autofit (32-true, adamw_torch, no checkpointing, "
         "no target)")
    af = run_autofit(spec, mdir, train)
    out["autofit"] = af
    _say(f"  autofit: micro batch {af['micro']}, eval batch {af['eval_batch']}, predicted "
         f"{af['predicted_bytes'] / MiB:.1f} MiB ({af['predicted_kind']}), trial "
         f"{(af['trial_bytes'] or 0) / MiB:.1f} MiB, {af['wall_s']} s")
    eval_batch = af["eval_batch"] or DEFAULT_EVAL_BATCH
    base_job = {"spec": dataclasses.asdict(spec), "config": spec.config, "task": spec.task,
                "seed": spec.seed, "samples": samples, "cap_bytes": cap,
                "eval_batch": eval_batch, "training_arguments": af["training_arguments"],
                **_plan(quick)}
    soaks = Soaks(base_job, mdir / "runs")
    _say("  soak of autofit's choice, then the largest micro batch that survives")
    out["search"] = largest_surviving(soaks.survives, af["micro"], limit=4 * af["micro"])
    out["autofit_soak"] = soaks(af["micro"])
    _say(f"  largest surviving: {out['search']['largest']} "
         f"(first to die: {out['search']['first_death']})")

    peers: dict[str, Any] = {}
    for mode, label in (("accelerate", "accelerate find_executable_batch_size"),
                        ("transformers", "transformers auto_find_batch_size"),
                        ("lightning", "Lightning scale_batch_size binsearch")):
        _say(f"  {label}")
        r = run_child(dict(base_job, mode=mode), mdir / "runs", mode)
        row: dict[str, Any] = {"peer": label, "mode": mode, "probe": r}
        if mode == "transformers":
            row["choice"] = r.get("batch")
            row["soak"] = {k: r.get(k) for k in ("survived", "oom", "error", "batch", "steps",
                                                 "planned_steps", "peak", "peak_at",
                                                 "died_step", "died_phase", "wall_s",
                                                 "killed", "died_peak", "died_vm",
                                                 "vm_allowance")}
            row["restarts"] = [a for a in r.get("attempts", []) if not a["survived"]]
            _say(f"    {len(row['restarts'])} restarts; final batch {row['choice']}: "
                 + _soak_line(r))
        else:
            row["choice"] = r.get("choice")
            _say(f"    choice {row['choice']} after {len(r.get('attempts', []))} attempts"
                 + (f" ({r['error']})" if r.get("error") else ""))
            if row["choice"]:
                row["soak_reused"] = row["choice"] in soaks.done
                s = soaks(int(row["choice"]))
                row["soak"] = {k: s.get(k) for k in ("survived", "oom", "error", "batch",
                                                     "steps", "planned_steps", "peak",
                                                     "peak_at", "died_step", "died_phase",
                                                     "wall_s", "killed", "died_peak",
                                                     "died_vm", "vm_allowance")}
        peers[mode] = row
    out["peers"] = peers
    out["soaks"] = {str(b): soaks.done[b] for b in soaks.order}
    out["summary"] = summarise(out)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def summarise(m: dict[str, Any]) -> dict[str, Any]:
    """The issue's three targets for one model."""
    af, soak, search = m["autofit"], m["autofit_soak"], m["search"]
    measured = soak.get("peak") if soak["survived"] else None
    err = None if measured is None else (af["predicted_bytes"] - measured) / measured
    step_err = None if measured is None else (af["predicted_step_bytes"] - measured) / measured
    trial_err = (None if measured is None or af["trial_bytes"] is None
                 else (af["trial_bytes"] - measured) / measured)
    largest = search["largest"]
    ratio = None if not largest else af["micro"] / largest
    ooms = 0 if soak["survived"] else 1
    return {
        "autofit_micro": af["micro"], "largest_surviving": largest,
        "first_death": search["first_death"], "choice_vs_largest": ratio,
        "ooms": ooms, "died_step": soak.get("died_step"), "died_phase": soak.get("died_phase"),
        "predicted_bytes": af["predicted_bytes"], "measured_run_peak_bytes": measured,
        "peak_error": err, "step_estimate_error": step_err, "trial_vs_run": trial_err,
        "peak_at": soak.get("peak_at"),
        "met": {
            "0 OOM": ooms == TARGETS["ooms"],
            "run peak predicted within 5%": err is not None
            and abs(err) <= TARGETS["peak_error"],
            "choice >= 97% of the largest surviving": ratio is not None
            and ratio >= TARGETS["choice_vs_largest"],
        },
    }


def _say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


# ---------------------------------------------------------------- report


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.0f}%"


def requested_bytes(error: str | None) -> int | None:
    """The failed request of torch's CPU allocator ("you tried to allocate N bytes")."""
    import re

    m = re.search(r"tried to allocate (\d+) bytes", error or "")
    return int(m.group(1)) if m else None


def death_cause(s: dict[str, Any], cap: int) -> str | None:
    """What ran out: *address space* when the resident peak of the dying interval plus the
    failed request is more than 8 MiB below the cap (RLIMIT_AS refused what resident
    memory had room for), else memory. None when it did not die or is not known."""
    if s.get("survived") or s.get("died_peak") is None:
        return None
    request = requested_bytes(s.get("error"))
    if request is None:
        return None
    if s["died_peak"] + request < cap - 8 * MiB:
        return "address space"
    return "memory"


def _fate(s: dict[str, Any] | None, cap: int | None = None) -> str:
    if not s:
        return "-"
    if s.get("survived"):
        return f"survived ({s.get('steps')} steps)"
    how = "OOM" if s.get("oom") else (s.get("killed") or "failed")
    cause = death_cause(s, cap) if cap else None
    if cause == "address space":
        how += (f": address space; resident peak {s['died_peak'] / MiB:.1f} + request "
                f"{requested_bytes(s.get('error')) / MiB:.1f} MiB < cap")
    return f"**died** at step {s.get('died_step')} ({s.get('died_phase')}, {how})"


def _phase_peaks(r: dict[str, Any]) -> dict[str, int | None]:
    c = r.get("curve") or {}
    out: dict[str, int | None] = {}
    for ph in PHASES:
        v = [p for p, x in zip(c.get("peak", []), c.get("phase", []), strict=False) if x == ph]
        out[ph] = max(v) if v else None
    return out


def markdown(results: dict[str, Any]) -> str:
    probe = results.get("recognition_probe") or {}
    lines = [
        "# Soak benchmark: does the tuned configuration survive the whole run?",
        "",
        f"Produced by `{results['command']}` on {results['date']} ({results['machine']}; "
        f"{results['versions']}). Total wall time {results['wall_s'] / 60:.1f} min.",
        "",
        "Per model, on a capped CPU: autofit restricted to the peers' combination (32-true, "
        "AdamW, no checkpointing, no target batch), then the real `Trainer.train()` of its "
        "choice for a whole epoch of shuffled variable-length samples (at least "
        f"{results['plan']['min_steps']} optimizer steps), evaluating every "
        f"{results['plan']['eval_every']} steps and saving a checkpoint every "
        f"{results['plan']['save_every']}, in a fresh process capped like autofit's trials. "
        "The largest micro batch that survives is searched with the same soak; the peers run "
        "as they really do, on the batches their loaders give them, and their choices are "
        "soaked. Method: the docstring of `benchmarks/soak.py`.",
        "",
        "![autofit's soak against the cap, and the micro batches of every tuner](soak.png)",
        "",
        "**OOM recognition** (tuners.py's probe: a real capped-CPU allocation failure): "
        f"`{probe.get('type')}` — accelerate's `should_reduce_batch_size` → "
        f"{probe.get('accelerate')}, Lightning's `is_oom_error` → {probe.get('lightning')}, "
        f"autofit's `is_oom` → {probe.get('autofit')}. In the peers' children below the real "
        "exceptions reached the libraries' own handlers.",
        "",
        "## Summary",
        "",
        "| model | cap | autofit micro (eval) | largest surviving (first to die) | choice / "
        "largest | autofit's soak | predicted run peak MiB (kind) | trial MiB | measured run "
        "peak MiB | error | run peak at |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results["models"]:
        s, af, t = m["spec"], m["autofit"], m["summary"]
        at = t.get("peak_at") or {}
        where = (f"{at.get('phase')}, step {at.get('step')}"
                 + (f", T={at['seq']}" if at.get("seq") else "")) if at else "-"
        if not m["autofit_soak"]["survived"]:
            where = "- (died)"
        kind = "run" if af["predicted_run_bytes"] is not None else "step"
        lines.append(
            f"| {s['name']} | {s['cap'].split(':')[1]} | {af['micro']} ({af['eval_batch']}) | "
            f"{t['largest_surviving']} ({t['first_death']}) | {_pct(t['choice_vs_largest'])} | "
            f"{_fate(m['autofit_soak'], m['cap_bytes'])} | {_mib(af['predicted_bytes'])} ({kind}) | "
            f"{_mib(af['trial_bytes'])} | {_mib(t['measured_run_peak_bytes'])} | "
            f"{_pct(t['peak_error'], signed=True)} | {where} |")
    lines += ["", "Targets (issue 12): 0 OOM for autofit's choice; predicted run peak within 5% "
              "of the measured run peak; autofit's choice ≥ 97% of the largest surviving "
              "micro batch.", ""]
    for m in results["models"]:
        met = m["summary"]["met"]
        lines.append(f"- {m['spec']['name']}: " + "; ".join(
            f"{k}: **{'met' if v else 'not met'}**" for k, v in met.items()))
    lines += ["", "## Peers", "",
              "| model | peer | probe: sizes tried (✗ = OOM) | padded lengths its probe saw at "
              "its choice | choice | soak of its choice | restarts (batch: step, phase) |",
              "|---|---|---|---|---|---|---|"]
    for m in results["models"]:
        for mode, row in m["peers"].items():
            lines.append(_peer_row(m, mode, row))
    for m in results["models"]:
        lines += _model_section(m)
    lines += _notes(results)
    return "\n".join(lines) + "\n"


def _peer_row(m: dict[str, Any], mode: str, row: dict[str, Any]) -> str:
    probe = row["probe"]
    atts = probe.get("attempts", [])
    if mode == "transformers":
        tried = ", ".join(f"{a['batch']}" + ("" if a["survived"] else "✗") for a in atts)
        seen = "-"
        restarts = "; ".join(f"{a['batch']}: {a.get('died_step')}, {a.get('died_phase')}"
                             for a in atts if not a["survived"] and a.get("died_step", 0) > 1)
        early = sum(1 for a in atts if not a["survived"] and a.get("died_step", 0) <= 1)
        restarts = (f"{early} died at step 1" + ("; then " + restarts if restarts else "")) \
            if early else (restarts or "none")
    else:
        tried = ", ".join(f"{a['batch']}" + ("✗" if a.get("oom") else "") for a in atts)
        passed = [a for a in atts if not a.get("oom") and a["batch"] >= (row.get("choice") or 0)]
        seen = (f"{min(passed, key=lambda a: a['batch'])['seq']}"
                + ("" if min(a["batch"] for a in passed) == row.get("choice")
                   else f" (at {min(a['batch'] for a in passed)})")) if passed else "-"
        restarts = "-"
    soak = row.get("soak")
    fate = _fate(soak, m["cap_bytes"]) + (" (reused)" if row.get("soak_reused") else "")
    if probe.get("error") and (not row.get("choice") or mode == "transformers"):
        fate = f"gave up: {probe['error'][:80]}"
    return (f"| {m['spec']['name']} | {row['peer']} | {tried} | {seen} | {row.get('choice')} | "
            f"{fate} | {restarts} |")


def _model_section(m: dict[str, Any]) -> list[str]:
    s, af, ls = m["spec"], m["autofit"], m["train_lengths"]
    out = [
        "", f"## {s['name']} ({s['config']['architectures'][0]}) on `{s['cap']}`", "",
        f"{s['profile']}. Scaled from tuners.py: {m['changes']}. Training data: {ls['n']} "
        f"samples, median {ls['median']:.0f} tokens, p90 {ls['p90']}, p99 {ls['p99']}, max "
        f"{ls['max']} ({ls['at_max']} at the max); eval: {m['eval_lengths']['n']} samples "
        f"(max {m['eval_lengths']['max']}). autofit took {af['wall_s']} s, "
        f"{len(af['trials'])} trial(s) ({', '.join(str(x['micro']) + ('' if x['fits'] else '✗') for x in af['trials'])}).",
        "",
        "autofit's reasons:", "",
    ]
    out += [f"- {r}" for r in af["reasons"]]
    out += ["", "Soaks (every one a fresh capped process; peak = VmHWM − baseline + weights; "
            "per phase, the largest peak of its intervals; *mapped*: address space mapped "
            "since the cap was set, at the end or at the death, of the `RLIMIT_AS` allowance "
            "cap − weights):", "",
            "| micro batch | steps (planned) | result | run peak MiB | at | train max | eval max "
            "| save max | mapped MiB | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for b, r in sorted(m["soaks"].items(), key=lambda kv: int(kv[0])):
        at = r.get("peak_at") or {}
        pp = _phase_peaks(r)
        where = f"{at.get('phase')} {at.get('step')}" if at else "-"
        if not r.get("survived"):  # its peak is where it died
            where = f"{r.get('died_phase')} {r.get('died_step')} (died)"
        tag = " (autofit)" if int(b) == af["micro"] else ""
        vm = r.get("died_vm") if not r.get("survived") else r.get("vm_end")
        mapped = "-" if vm is None else f"{_mib(vm)} / {_mib(r.get('vm_allowance'))}"
        out.append(f"| {b}{tag} | {r.get('steps')} ({r.get('planned_steps')}) | "
                   f"{_fate(r, m['cap_bytes'])} | {_mib(r.get('peak'))} | {where} | "
                   f"{_mib(pp['train'])} | {_mib(pp['eval'])} | {_mib(pp['save'])} | {mapped} | "
                   f"{r.get('wall_s') or '-'} |")
    return out


def _notes(results: dict[str, Any]) -> list[str]:
    return [
        "", "## What was measured, and its limits", "",
        "- *Measured run peak*: the soak's VmHWM above its baseline (after the warm-up `train()`, "
        "`gc` and `malloc_trim`) plus the weights and buffers — the definition of a capped-CPU "
        "trial's device total. VmHWM is read and reset after every optimizer step, evaluation "
        "and save, so each has its own peak; *at* is the interval of the run's peak (T: the "
        "padded length of that step's batch).",
        "- *Predicted run peak*: `estimate.run_device_total_bytes` of autofit's result when it is "
        "filled, else `estimate.device_total_bytes` (its step, calibrated by the trial); *kind* "
        "says which. *trial*: the measured device total of autofit's chosen trial (worst-case "
        "batch, 1 warm-up + measured steps).",
        "- *Largest surviving*: searched with the same soak from autofit's choice (up ~10% until "
        "one dies, then bisect; down if autofit's dies). A soak that survives at B is taken to "
        "mean every smaller B survives. Every soak uses autofit's eval batch, so soaks differ "
        "only in the training micro batch; the peers do not tune an eval batch.",
        "- Peers: accelerate's probe runs the first 3 steps of a shuffled `DataLoader` (seed 42) "
        "at each size, as a training function wrapped in `find_executable_batch_size` would; "
        "Lightning's binsearch runs 3 steps per trial on the module's shuffled loader "
        "(seed 42); their choices are then soaked with the HF Trainer (its own sampler, seed "
        "42). transformers' `auto_find_batch_size` is the soak itself, restarting from step 0 "
        "at 0.9× the batch after each OOM; its epoch is one epoch at its final batch.",
        "- A soak that dies ends at its first OOM (the step and phase are the Trainer's: the "
        "step being trained, or the step after which it evaluated or saved); its run peak is "
        "where it died. Each size is soaked once.",
        "- The cap is on address space (`RLIMIT_AS` := VmSize + cap − weights, as in autofit's "
        "trials), the peak is resident memory. *mapped* is the address space mapped since the "
        "cap was set (at a death: when the error reached the Trainer's loop, the failed "
        "step's buffers partly freed, so a lower bound); a death marked *address space* was "
        "refused a request that resident memory had room for (resident peak of the dying "
        "interval + the failed request more than 8 MiB below the cap). The soaks, like "
        "autofit's trials, run with oneDNN's primitive cache off "
        "(`ONEDNN_PRIMITIVE_CACHE_CAPACITY=0` in `CHILD_MALLOC_ENV`): it keeps a JIT kernel "
        "per input shape (BERT's GELU: 256 KiB of code space each, hardly resident, up to "
        "1024 of them), so on variable-length batches the mapped address space grew step "
        "after step (`tests/test_procmem.py`: +35 MiB over 60 new lengths with the cache, "
        "under 1 MiB without); before it was turned off every bert-bigvocab soak died of it, "
        "resident peaks 99-110 MiB of 128.",
        "- The models are tuners.py's scaled down (per model above) so that one soak takes "
        "about a minute on this machine; the profile of each (what dominates the peak) is "
        "kept.",
        "",
    ]


def plot(results: dict[str, Any], path: Path) -> bool:
    """Per model: autofit's soak (peak of every step, eval, save) against the cap and the
    prediction; below, the micro batch of every tuner, survived or died."""
    from plotting import pyplot

    plt = pyplot()
    if plt is None:
        return False
    models = results["models"]
    if not models:
        return False
    fig, axes = plt.subplots(2, len(models), figsize=(5.6 * len(models), 8), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})
    for j, m in enumerate(models):
        top, bottom = axes[0][j], axes[1][j]
        af, soak = m["autofit"], m["autofit_soak"]
        c = soak.get("curve") or {}
        steps, phases, peaks = c.get("step", []), c.get("phase", []), c.get("peak", [])
        tr = [(s, p / MiB) for s, p, ph in zip(steps, peaks, phases, strict=False)
              if ph == "train"]
        if tr:
            top.plot([x for x, _ in tr], [y for _, y in tr], color="#3b6ea5", lw=0.7,
                     label="peak of each step")
        res = soak.get("resident_bytes") or 0
        vm = [(s, (v + res) / MiB) for s, v, ph in zip(steps, c.get("vm", []), phases,
                                                      strict=False)
              if ph == "train" and v is not None]
        if vm:
            top.plot([x for x, _ in vm], [y for _, y in vm], color="#8e5ea2", lw=1.2,
                     label="address space between steps (mapped + weights)")
        for ph, mk, col in (("eval", "^", "#2a9d8f"), ("save", "s", "#e9a23b")):
            pts = [(s, p / MiB) for s, p, x in zip(steps, peaks, phases, strict=False) if x == ph]
            if pts:
                top.scatter([x for x, _ in pts], [y for _, y in pts], marker=mk, color=col,
                            zorder=3, label=f"peak of each {ph}")
        cap = m["cap_bytes"] / MiB
        top.axhline(cap, color="#c8442f", lw=1.5, label=f"cap {cap:.0f} MiB")
        top.axhline(af["predicted_bytes"] / MiB, color="black", ls="--", lw=1,
                    label=f"predicted ({'run' if af['predicted_run_bytes'] else 'step'}) "
                          f"{af['predicted_bytes'] / MiB:.1f} MiB")
        if af.get("trial_bytes"):
            top.axhline(af["trial_bytes"] / MiB, color="grey", ls=":", lw=1,
                        label=f"trial {af['trial_bytes'] / MiB:.1f} MiB")
        if not soak.get("survived") and soak.get("died_step") is not None:
            top.axvline(soak["died_step"], color="#c8442f", ls="-.", lw=1)
            if soak.get("died_peak") is not None:
                top.scatter([soak["died_step"]], [soak["died_peak"] / MiB], marker="x",
                            color="#c8442f", zorder=4, label="resident peak at the death")
            top.text(soak["died_step"], cap * 0.5, f" died: step {soak['died_step']} "
                     f"({soak.get('died_phase')})", color="#c8442f", fontsize=8)
        top.set_ylim(0, cap * 1.5)
        top.set_xlabel("optimizer step")
        top.set_ylabel("MiB (VmHWM − baseline + weights)")
        top.set_title(f"{m['spec']['name']} on {m['spec']['cap']}: autofit's micro batch "
                      f"{af['micro']}", fontsize=10)
        top.legend(fontsize=7, loc="upper center", ncol=2)
        rows = [("autofit", af["micro"], soak)]
        rows.append(("largest surviving", m["search"]["largest"],
                     m["soaks"].get(str(m["search"]["largest"]))
                     or {"survived": False, "none": True}))
        for mode, row in m["peers"].items():
            label = mode + (f" ({len(row.get('restarts', []))} restarts)"
                            if mode == "transformers" else "")
            soak_row = row.get("soak")
            if mode == "transformers" and row["probe"].get("error"):
                soak_row = {"survived": False, "gave_up": True}
            rows.append((label, row.get("choice"), soak_row))
        ys = list(range(len(rows)))
        colors = ["#4c9a5a" if (s or {}).get("survived") else "#c8442f" for _, _, s in rows]
        bottom.barh(ys, [b or 0 for _, b, _ in rows], color=colors)
        for y, (_, b, s) in zip(ys, rows, strict=True):
            s = s or {}
            txt = (f" {b}: survived" if s.get("survived") else
                   " none survives" if s.get("none") else
                   f" gave up after {b}" if s.get("gave_up") else
                   f" {b}: died at step {s.get('died_step')} ({s.get('died_phase')})"
                   + (", address space" if death_cause(s, m["cap_bytes"]) == "address space"
                      else ""))
            bottom.text((b or 0) + 0.1, y, txt, va="center", fontsize=8)
        bottom.set_yticks(ys, [r[0] for r in rows], fontsize=8)
        bottom.invert_yaxis()
        top_b = max([b or 0 for _, b, _ in rows] + [1])
        bottom.set_xlim(0, top_b * 1.6)
        bottom.set_xlabel("micro batch (green: its soak survived; red: died)")
    fig.suptitle("Soak: the real Trainer.train() for a whole epoch under the cap", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="*", default=[s.name for s in SOAKS],
                    choices=[s.name for s in SOAKS])
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK['min_steps']} steps per soak instead of {MIN_STEPS}")
    ap.add_argument("--out", type=Path, default=RESULTS / "soak")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the children's job, events and result files in this folder")
    ap.add_argument("--replot", action="store_true",
                    help="redraw the .md and .png from the .json of a finished run; run nothing")
    args = ap.parse_args(argv)
    if args.child is not None:
        return child_main(str(args.child))
    if args.replot:
        results = json.loads(args.out.with_suffix(".json").read_text())
        args.out.with_suffix(".md").write_text(markdown(results))
        plot(results, args.out.with_suffix(".png"))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    given = argv if argv is not None else sys.argv[1:]
    results: dict[str, Any] = {
        "command": "python benchmarks/soak.py" + (" " + " ".join(given) if given else ""),
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
                   f"{os.getloadavg()[0]:.1f} at the start",
        "versions": tuners._versions(),
        "recognition_probe": tuners.recognition_probe(),
        "targets": TARGETS, "plan": _plan(args.quick), "quick": args.quick,
        "models": [],
    }
    keep = args.keep
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        work = keep if keep is not None else Path(tmp)
        for spec in SOAKS:
            if spec.name not in args.models:
                continue
            results["models"].append(bench_model(spec, work, quick=args.quick))
            _write(results, args.out, time.perf_counter() - t0)  # partial results survive
    _write(results, args.out, time.perf_counter() - t0)
    print(args.out.with_suffix(".md").read_text())
    return 0


def _write(results: dict[str, Any], out: Path, wall: float) -> None:
    results["wall_s"] = wall
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    try:  # the JSON is what matters; a report that fails is redrawn with --replot
        out.with_suffix(".md").write_text(markdown(results))
        plot(results, out.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001
        print(f"report failed ({type(e).__name__}: {e}); fix it and run --replot",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
