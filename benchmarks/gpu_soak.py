"""The soak of ``gpu_check.py``: whole ``Trainer.train()`` runs against autofit's run replay.

A step's peak is not the run's: batches of varying padded length follow each other
and the caching allocator keeps the segments each one made. ``gpu_check.py`` runs
each configuration of ``SOAKS`` in a fresh child (``--soak-child``; this module's
``run_soak_child``) and predicts it in its own process (``predict_soak``):

* **the data**: ``batch x accumulation x steps`` samples (one epoch is exactly the
  run's ``max_steps`` optimizer steps, so ``estimate(..., epochs=1)`` is the same
  order) of log-normal length (median ``seq / 7.4``, sigma 0.8, cut at ``seq``:
  the longest batch is ``seq`` tokens), random ids; an eval split of
  ``eval_samples``; both seeded (``data_seed``), the same in both processes.
* **measured** (the child: torch / transformers only): the real
  ``transformers.Trainer.train()`` -- ``DataCollatorForLanguageModeling`` padding to
  the longest sample of each micro batch, the Trainer's own sampler (seed 42),
  ``max_steps``, evaluation every ``eval_steps``, a checkpoint every ``save_steps``
  (to a temporary folder, ``save_total_limit=1``), never ``empty_cache`` (calls from
  the Trainer itself during the run are counted). A ``TrainerCallback`` reads
  ``max_memory_reserved`` / ``max_memory_allocated`` / ``memory_reserved`` after
  every optimizer step, each evaluation and each save; after the run, ``mem_get_info``
  total - free. Then the worst step alone: everything freed, ``empty_cache`` (the run
  is over) and the peak counters reset, a fresh model trains two steps on the
  run's longest micro batch (its samples, the same for every micro batch), as
  ``simulate`` predicts a step. Over the run = run peak reserved - that step's.
* **predicted** (``--soak-predict-child``: a process of its own that sees no CUDA
  device, started with the run so it overlaps the matrix): ``autofit.estimate(model, config,
  device=<the matrix's target>, method="simulate", dataset=<the samples>, epochs=1,
  seed=42)``: ``run_peak_reserved_bytes``, ``run_device_total_bytes`` and the
  step's ``peak_reserved_bytes``; the order (``run_order``) is compared with the
  padded lengths the child's collator saw.

On the CPU (``--dry-run``) the same path runs on micro models and the counters are
the resident set (``VmHWM`` above the RSS when ``train()`` starts, weights excluded):
they exercise the code and validate nothing.

Known limitations:
    NB: autofit's run replay has no evaluation nor save in it (``autofit.memory.run``):
    the growth each brings is reported apart (``growth_by_kind``).
    NB: the measured step alone runs after the soak in the same process, from an
    emptied cache: what stays allocated then (cuBLAS workspaces) is in it, as it is
    in a fresh process after its first matmul.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import re
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
SOAK_SEED = 42  # TrainingArguments.seed: the Trainer's sampler
PAD_ID = 0  # the collator's padding id; samples use ids from 1
MAX_TOKEN_ID = 2000  # below every vocabulary here (the micro configs have 2048)
LENGTH_SIGMA = 0.8


@dataclass(frozen=True)
class SoakSpec:
    """One soak: a whole Trainer run of variable-length samples."""

    name: str
    model: str  # a bundled autofit model name, or a config JSON path (dry run)
    precision: str  # "32-true" | "bf16-mixed" | "bf16-true"
    optimizer: str  # TrainingArguments.optim
    batch: int  # per_device_train_batch_size (and eval)
    accumulation: int  # gradient_accumulation_steps
    seq: int  # the longest sample (lengths are cut here)
    steps: int  # max_steps (optimizer steps): exactly one epoch of the samples
    eval_steps: int
    save_steps: int
    eval_samples: int
    data_seed: int = 7  # the samples' lengths and ids

    @property
    def samples(self) -> int:
        return self.batch * self.accumulation * self.steps

    def describe(self) -> str:
        return (f"{self.precision} {self.optimizer} B{self.batch} ×{self.accumulation} "
                f"{self.steps} steps, eval /{self.eval_steps}, save /{self.save_steps}")


# Each worst step is 4.5-7 GiB on the H200 (the longest batch: B x seq tokens, its
# (B, T, V) fp32 logits); ~25 s of device time each (imports and CUDA context ~10 s,
# 200 steps of mostly short batches, 4 evaluations, 2 saves, the step alone).
SOAKS: list[SoakSpec] = [
    SoakSpec("soak-tinyllama-bf16m-b8-ga1", "tiny-llama", "bf16-mixed", "adamw_torch_fused",
             8, 1, 1024, 200, 50, 100, 64),
    SoakSpec("soak-tinyllama-bf16m-b8-ga4", "tiny-llama", "bf16-mixed", "adamw_torch_fused",
             8, 4, 1024, 200, 50, 100, 64),
    SoakSpec("soak-tinygpt2-bf16m-b8-ga1", "tiny-gpt2", "bf16-mixed", "adamw_torch_fused",
             8, 1, 1024, 200, 50, 100, 64),
]
DRY_SOAK = {"batch": 2, "seq": 64, "steps": 8, "eval_steps": 4, "save_steps": 8,
            "eval_samples": 8}


def dry_soak(spec: SoakSpec, models: Path) -> SoakSpec:
    """The micro version ``--dry-run`` runs on the CPU (``models``: gpu_check's micro configs)."""
    family = "micro-gpt2" if "gpt2" in spec.model else "micro-llama"
    stem = spec.name.rsplit("-b", 1)[0]
    return replace(spec, name=f"{stem}-dry-ga{spec.accumulation}",
                   model=str(models / f"{family}.json"), **DRY_SOAK)


def sample_lengths(n: int, seq: int, seed: int) -> list[int]:
    """``n`` log-normal lengths (median ``seq / 7.4``: 138 tokens for 1024), 2 to ``seq``."""
    rng = random.Random(seed)
    mu = math.log(seq) - 2.0
    return [max(2, min(seq, int(rng.lognormvariate(mu, LENGTH_SIGMA)))) for _ in range(n)]


def soak_samples(spec: SoakSpec, split: str = "train") -> list[dict[str, list[int]]]:
    """The seeded samples of ``split`` ("train" or "eval"), ``{"input_ids": [...]}`` each."""
    n, seed = ((spec.samples, spec.data_seed) if split == "train"
               else (spec.eval_samples, spec.data_seed + 1))
    rng = random.Random(seed * 7919)
    return [{"input_ids": [rng.randrange(1, MAX_TOKEN_ID) for _ in range(length)]}
            for length in sample_lengths(n, spec.seq, seed)]


# =========================================================================== child
# A fresh process per soak; torch / transformers only (no autofit import).


def _tokenizer() -> Any:
    """A tokenizer that only pads (id 0): the collator needs one; no file, no network."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<unk>": 1}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>", unk_token="<unk>")


class _Counters:
    """The allocator's counters (CUDA) or the resident set above ``base`` (CPU)."""

    def __init__(self, cuda: bool, base: int, hwm: Any, rss: Any) -> None:
        import torch

        self.torch, self.cuda, self.base, self.hwm, self.rss = torch, cuda, base, hwm, rss

    def read(self) -> dict[str, int]:
        if self.cuda:
            c = self.torch.cuda
            return {"max_reserved": int(c.max_memory_reserved()),
                    "max_allocated": int(c.max_memory_allocated()),
                    "reserved": int(c.memory_reserved()), "allocated": int(c.memory_allocated())}
        peak, now = self.hwm() - self.base, self.rss() - self.base
        return {"max_reserved": peak, "max_allocated": peak, "reserved": now, "allocated": now}


class _Spy:
    """The collator, recording each train micro batch's size and padded length."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: list[int] = []
        self.lengths: list[int] = []
        self.longest: list[list[int]] = []  # the input_ids of the (first) longest batch

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        train = features[0].get("split") == "train"
        rows = [{"input_ids": f["input_ids"]} for f in features]
        if train:
            width = max(len(r["input_ids"]) for r in rows)
            if not self.lengths or width > max(self.lengths):
                self.longest = [list(r["input_ids"]) for r in rows]
            self.sizes.append(len(rows))
            self.lengths.append(width)
        return self.inner(rows)


def _build(config: Any, spec: dict[str, Any], device: Any) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if spec["precision"].endswith("-true") and spec["precision"] != "32-true":
        model.to(torch.bfloat16)
    model.config.use_cache = False
    return model


def _args(spec: dict[str, Any], out: str, cuda: bool, **kw: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=spec["batch"],
        per_device_eval_batch_size=spec["batch"],
        gradient_accumulation_steps=spec["accumulation"], optim=spec["optimizer"],
        bf16=spec["precision"] == "bf16-mixed", seed=SOAK_SEED, use_cpu=not cuda,
        report_to=[], disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=0, **kw)


def _recorder(counters: _Counters) -> Any:
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """The counters after every optimizer step, evaluation and save."""

        def __init__(self) -> None:
            self.steps: list[dict[str, int]] = []
            self.events: list[dict[str, Any]] = []
            self.begin: dict[str, int] = {}
            self.running = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.begin, self.running = counters.read(), True

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.steps.append(counters.read())

        def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.events.append({"kind": "eval", "step": state.global_step, **counters.read()})

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.events.append({"kind": "save", "step": state.global_step, **counters.read()})

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.running = False

    return Recorder()


def growth(begin: int, steps: list[dict[str, int]], events: list[dict[str, Any]]
           ) -> dict[str, Any]:
    """Where the reserved peak grew: by kind (step / eval / save) and the last growth.

    ``steps[i]`` is read after optimizer step ``i + 1``; an event of step ``s`` comes
    after that step's reading (the Trainer evaluates and saves after the step).
    """
    timeline: list[tuple[str, int, int]] = []
    for i, s in enumerate(steps, 1):
        timeline.append(("step", i, s["max_reserved"]))
        timeline += [(e["kind"], i, e["max_reserved"]) for e in events if e["step"] == i]
    by_kind = {"step": 0, "eval": 0, "save": 0}
    last_step, last = 0, None
    prev = begin
    for kind, i, peak in timeline:
        if peak > prev:
            by_kind[kind] += peak - prev
            last = f"{kind} {i}"
            if kind == "step":
                last_step = i
        prev = max(prev, peak)
    return {"growth_by_kind": by_kind, "converged_step": last_step, "last_growth": last}


def run_soak_child(spec: dict[str, Any], device_name: str, config: Any) -> dict[str, Any]:
    """The soak run and the step alone (module docstring). A JSON-able dict, never raises."""
    t_start = time.perf_counter()
    import torch

    from benchmarks.measure_cpu import _hwm_bytes, _rss_bytes

    cuda = device_name.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    device = torch.device(device_name)
    if cuda:
        torch.cuda.set_device(device)
    res: dict[str, Any] = {"name": spec["name"], "device": device_name, "oom": False,
                           "error": None}
    soak = SoakSpec(**{k: v for k, v in spec.items() if k in SoakSpec.__dataclass_fields__})
    train = [{**s, "split": "train"} for s in soak_samples(soak, "train")]
    evals = [{**s, "split": "eval"} for s in soak_samples(soak, "eval")]
    base = _rss_bytes()
    counters = _Counters(cuda, base, _hwm_bytes, _rss_bytes)
    spy = _Spy(_data_collator())

    calls = {"run": 0}
    real_empty = torch.cuda.empty_cache

    def counted_empty_cache() -> None:  # the Trainer's own calls during the run, counted
        if recorder.running:
            calls["run"] += 1
        real_empty()

    recorder = _recorder(counters)
    torch.cuda.empty_cache = counted_empty_cache
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-soak-") as out, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _soak(res, soak, spec, config, device, cuda, out, train, evals, spy, recorder,
                  counters)
    except torch.OutOfMemoryError as exc:
        res["oom"] = True
        res["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0][:300]}"
    except Exception as exc:  # noqa: BLE001 - reported in the row, the parent goes on
        res["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        torch.cuda.empty_cache = real_empty
    res["empty_cache_calls_during_run"] = calls["run"]
    if not res["error"]:
        try:
            _step_alone(res, soak, spec, config, device, cuda, spy, counters)
        except torch.OutOfMemoryError as exc:
            res["oom"] = True
            res["error"] = f"step alone: OutOfMemoryError: {str(exc).splitlines()[0][:300]}"
        except Exception as exc:  # noqa: BLE001
            res["error"] = f"step alone: {type(exc).__name__}: {str(exc)[:300]}"
    if res.get("run_peak_reserved_bytes") is not None and res.get("step_peak_reserved_bytes") is not None:
        res["over_the_run_bytes"] = res["run_peak_reserved_bytes"] - res["step_peak_reserved_bytes"]
    res["child_wall_s"] = time.perf_counter() - t_start
    return res


def _data_collator() -> Any:
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tokenizer=_tokenizer(), mlm=False)


def _soak(res: dict[str, Any], soak: SoakSpec, spec: dict[str, Any], config: Any, device: Any,
          cuda: bool, out: str, train: list, evals: list, spy: _Spy, recorder: Any,
          counters: _Counters) -> None:
    import torch
    from transformers import Trainer

    model = _build(config, spec, device)
    args = _args(spec, out, cuda, max_steps=soak.steps, eval_strategy="steps",
                 eval_steps=soak.eval_steps, save_strategy="steps", save_steps=soak.save_steps,
                 save_total_limit=1, logging_strategy="steps", logging_steps=soak.eval_steps)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals,
                      data_collator=spy, callbacks=[recorder])
    if not cuda:  # the run's high-water mark above the RSS it starts from (imports aside)
        from benchmarks.measure_cpu import _reset_hwm, _rss_bytes

        counters.base = _rss_bytes()
        _reset_hwm()
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        if cuda:
            torch.cuda.synchronize()
        res["train_wall_s"] = time.perf_counter() - t0
        end = counters.read()
        res["begin"] = recorder.begin
        res["by_step"] = {k: [s[k] for s in recorder.steps]
                          for k in ("max_reserved", "max_allocated", "reserved")}
        res["events"] = recorder.events
        res["run_peak_reserved_bytes"] = end["max_reserved"]
        res["run_peak_allocated_bytes"] = end["max_allocated"]
        res["reserved_end_bytes"] = end["reserved"]
        res["steps_done"] = len(recorder.steps)
        res["order_sizes"], res["order_lengths"] = spy.sizes, spy.lengths
        res.update(growth(recorder.begin.get("max_reserved", 0), recorder.steps,
                          recorder.events))
        if cuda:
            free, total = torch.cuda.mem_get_info()
            res["device_used_end_bytes"] = int(total - free)
            res["device_capacity_bytes"] = int(total)
            stats = torch.cuda.memory_stats()
            res["num_alloc_retries"] = int(stats.get("num_alloc_retries", 0))
            res["num_ooms"] = int(stats.get("num_ooms", 0))
        hist = trainer.state.log_history
        res["losses"] = [h["loss"] for h in hist if "loss" in h]
        res["eval_losses"] = [h["eval_loss"] for h in hist if "eval_loss" in h]
        res["loss_finite"] = bool(res["losses"]) and all(
            math.isfinite(x) for x in res["losses"] + res["eval_losses"])
        res["checkpoints"] = sorted(p.name for p in Path(out).glob("checkpoint-*"))
        del trainer, model
        gc.collect()


def _step_alone(res: dict[str, Any], soak: SoakSpec, spec: dict[str, Any], config: Any,
                device: Any, cuda: bool, spy: _Spy, counters: _Counters) -> None:
    """Two steps of a fresh model on the run's longest micro batch, from an emptied cache."""
    import torch
    from transformers import Trainer

    from benchmarks.measure_cpu import _reset_hwm, _rss_bytes

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the run is measured: the step starts as a fresh process
        res["alone_allocated_before_bytes"] = int(torch.cuda.memory_allocated())
        res["alone_reserved_before_bytes"] = int(torch.cuda.memory_reserved())
        torch.cuda.reset_peak_memory_stats()
    rows = [{"input_ids": ids, "split": "train"} for ids in spy.longest]
    alone = _Spy(spy.inner)
    recorder = _recorder(counters)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-soak-alone-") as out, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _build(config, spec, device)
        args = _args(spec, out, cuda, max_steps=2, train_sampling_strategy="sequential",
                     eval_strategy="no", save_strategy="no", logging_strategy="no")
        trainer = Trainer(model=model, args=args, train_dataset=rows * (2 * soak.accumulation),
                          data_collator=alone, callbacks=[recorder])
        if not cuda:  # as the run's: above the RSS train() starts from
            counters.base = _rss_bytes()
            _reset_hwm()
        trainer.train()
        if cuda:
            torch.cuda.synchronize()
        end = counters.read()
        del trainer, model
    res["alone_wall_s"] = time.perf_counter() - t0
    res["alone_lengths"] = alone.lengths
    res["step_peak_reserved_bytes"] = end["max_reserved"]
    res["step_peak_allocated_bytes"] = end["max_allocated"]
    res["step1_peak_reserved_bytes"] = (recorder.steps[0]["max_reserved"] if recorder.steps
                                        else None)
    with contextlib.suppress(ValueError):
        res["longest_length"] = max(spy.lengths)


# =========================================================================== parent


def predict_soak(spec: SoakSpec, device: Any) -> dict[str, Any]:
    """``autofit.estimate(..., method="simulate", dataset=...)`` for the soak, and its order."""
    from autofit import TrainConfig, estimate
    from autofit.probe.run import run_order

    t = time.perf_counter()
    samples = soak_samples(spec, "train")
    cfg = TrainConfig(micro_batch_size=spec.batch, grad_accum_steps=spec.accumulation,
                      precision=spec.precision, optimizer=spec.optimizer)
    try:
        e = estimate(spec.model, cfg, device=device, method="simulate", dataset=samples,
                     epochs=1.0, seed=SOAK_SEED)
        order = run_order([len(s["input_ids"]) for s in samples],
                          micro_batch_size=spec.batch, grad_accum_steps=spec.accumulation,
                          epochs=1.0, seed=SOAK_SEED)
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "wall_s": time.perf_counter() - t}
    conv = None
    for note in e.notes:
        m = re.search(r"peak stopped growing at step (\d+)", note)
        if m:
            conv = int(m.group(1))
    return {
        "run_peak_reserved_bytes": e.run_peak_reserved_bytes,
        "run_device_total_bytes": e.run_device_total_bytes,
        "peak_reserved_bytes": e.peak_reserved_bytes,
        "peak_allocated_bytes": e.peak_allocated_bytes,
        "device_total_bytes": e.device_total_bytes,
        "over_the_run_bytes": e.run_peak_reserved_bytes - e.peak_reserved_bytes,
        "run_need_over_step_bytes": e.run_fragmentation_bytes,
        "converged_step": conv, "steps": len(order.steps), "longest_length": max(order.lengths),
        "order_lengths": list(order.lengths), "fits": e.fits, "notes": list(e.notes),
        "wall_s": time.perf_counter() - t,
    }


def compare(row: dict[str, Any]) -> None:
    """Fill ``row["compare"]`` from its measured and predicted parts (when both are there)."""
    m, p = row.get("measured") or {}, row.get("predicted") or {}
    if not m or not p or "error" in p:
        return

    def err(pk: str, mk: str) -> float | None:
        pred, meas = p.get(pk), m.get(mk)
        return None if pred is None or not meas else (pred - meas) / meas

    seen = m.get("order_lengths") or []
    row["compare"] = {
        "run_peak_reserved_err": err("run_peak_reserved_bytes", "run_peak_reserved_bytes"),
        "step_peak_reserved_err": err("peak_reserved_bytes", "step_peak_reserved_bytes"),
        "over_the_run_measured_bytes": m.get("over_the_run_bytes"),
        "over_the_run_predicted_bytes": p.get("over_the_run_bytes"),
        "order_matches": bool(seen) and seen == p.get("order_lengths"),
        "steps_match": m.get("steps_done") == p.get("steps"),
    }


def soak_row(spec: SoakSpec) -> dict[str, Any]:
    return {"name": spec.name, "model": Path(spec.model).stem if spec.model.endswith(".json")
            else spec.model, "batch": spec.batch, "accumulation": spec.accumulation,
            "seq": spec.seq, "steps": spec.steps, "samples": spec.samples,
            "what": spec.describe(), "spec": asdict(spec)}


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:,.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def markdown(rows: list[dict[str, Any]], cuda: bool) -> list[str]:
    """The soak table (lines of ``gpu_check.md``)."""
    if not rows:
        return []
    lines = ["", "## Whole-run soak (Trainer.train(), variable lengths, eval, save)", "",
             ("Measured: `max_memory_reserved` over the run (never `empty_cache`), the "
              "longest micro batch's two steps alone from an emptied cache; used = "
              "`mem_get_info` total - free at the end." if cuda else
              "Measured (dry run): resident set above the RSS when `train()` starts (weights "
              "excluded); it exercises the pipeline and validates nothing.")
             + " Predicted: `estimate(method=\"simulate\", dataset=<the samples>, epochs=1, "
             "seed=42)`. Over the run = run peak reserved - step peak reserved. MiB.", "",
             "| soak | B×accum, steps | run peak reserved: measured / predicted (error) | "
             "step reserved: measured / predicted (error) | over the run: measured / "
             "predicted | growth step / eval / save | stopped growing at: measured / "
             "predicted | used at end / predicted need | order | s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p, c = r.get("measured") or {}, r.get("predicted") or {}, r.get("compare") or {}
        if m.get("error") and not m.get("run_peak_reserved_bytes"):
            lines.append(f"| {r['name']} | {r['batch']}×{r['accumulation']}, {r['steps']} | "
                         f"error: {m['error'][:80]} | | | | | | | |")
            continue
        g = m.get("growth_by_kind") or {}
        order = "-" if not c else ("same" if c.get("order_matches") else "DIFFERS")
        lines.append(
            f"| {r['name']} | {r['batch']}×{r['accumulation']}, {m.get('steps_done', '-')} | "
            f"{_mib(m.get('run_peak_reserved_bytes'))} / {_mib(p.get('run_peak_reserved_bytes'))}"
            f" ({_pct(c.get('run_peak_reserved_err'))}) | "
            f"{_mib(m.get('step_peak_reserved_bytes'))} / {_mib(p.get('peak_reserved_bytes'))} "
            f"({_pct(c.get('step_peak_reserved_err'))}) | "
            f"{_mib(m.get('over_the_run_bytes'))} / {_mib(p.get('over_the_run_bytes'))} | "
            f"{_mib(g.get('step'))} / {_mib(g.get('eval'))} / {_mib(g.get('save'))} | "
            f"{m.get('converged_step', '-')} ({m.get('last_growth', '-')}) / "
            f"{p.get('converged_step', '-')} | {_mib(m.get('device_used_end_bytes'))} / "
            f"{_mib(p.get('run_device_total_bytes'))} | {order} | "
            f"{m.get('child_wall_s', 0):.0f} |"
            + (f" error: {m['error'][:80]}" if m.get("error") else "")
            + (f" predicted: {p['error'][:80]}" if p.get("error") else ""))
    return lines
