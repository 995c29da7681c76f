"""A planted spike on a capped CPU: a guarded run absorbs it; the peers lose steps or the run.

    python benchmarks/guard_spike.py            # writes benchmarks/results/guard_spike.{md,json}

The run: a small llama-style model (fp32, AdamW), a real ``Trainer`` with evaluation and
a checkpoint save, 8 optimizer steps of micro batch 8, on samples of L tokens, except the
micro batch at step ``SPIKE_STEP`` whose samples are 2L long (sequential sampling, so the
spike is where it is planted). Each run is a fresh child process under the measuring
environment (``CHILD_MALLOC_ENV``) with a real cap: ``RLIMIT_AS`` := VmSize + CAP after
the model and the trainer are built (autofit's ``cpu:CAP``). CAP is set between the
measured peak of a normal step and that of the spike step (a calibration child measures
both: VmHWM above the pre-training RSS).

Runs, side by side:

* **unguarded**: the plain Trainer under the cap (expected: dies at the spike);
* **guarded**: ``autofit.guard(trainer)`` under the cap;
* **reference**: the plain Trainer at the split size (micro 4, accumulation 2), no cap —
  the run the guarded one must equal (loss curve and final weights, fp32);
* **transformers**: ``auto_find_batch_size=True`` under the cap (restarts its loop at a
  smaller batch: the steps done before are lost, and the effective batch changes);
* **accelerate**: ``find_executable_batch_size`` around the whole training function (the
  run starts over at half the batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SPIKE_STEP = 4
STEPS = 8
MICRO = 8
LENGTH = 128
TOLERANCE = 1e-5  # issue 24: losses and weights of the run at the split size, fp32
LEARNING_RATE = 5e-5  # the Trainer's default: a fine-tune's step size

CHILD = r'''
import json, os, sys, time
import torch
from torch.utils.data import SequentialSampler
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from autofit.trial.procmem import cap_address_space, peak_rss_bytes, reset_peak_rss, rss_bytes

mode, cap, out_dir, micro, accum, steps, spike, length = (sys.argv[1], int(sys.argv[2]),
    sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]),
    int(sys.argv[8]))
LR = float(sys.argv[10])
torch.set_num_threads(1)
SPIKE_MICRO = int(sys.argv[9])
cfg = AutoConfig.for_model("llama", vocab_size=8000, hidden_size=256, intermediate_size=688,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                           max_position_embeddings=1024)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)
g = torch.Generator().manual_seed(1)
rows = []
for i in range(steps * micro * 2):
    n = 2 * length if (i // SPIKE_MICRO) in (spike, spike + steps) else length
    ids = torch.randint(1, 8000, (n,), generator=g)
    rows.append({"input_ids": ids, "labels": ids.clone()})
# the samples of optimizer step `spike` are the long ones (SPIKE_MICRO samples a step, taken
# in order: micro 8 x accumulation 1 and micro 4 x accumulation 2 see the same samples)

def collate(batch):
    width = max(len(r["input_ids"]) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    for i, r in enumerate(batch):
        ids[i, :len(r["input_ids"])] = r["input_ids"]
        labels[i, :len(r["labels"])] = r["labels"]
    return {"input_ids": ids, "labels": labels}

class Sequential(Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)

def args_for(b, a, **kw):
    return TrainingArguments(out_dir, per_device_train_batch_size=b, gradient_accumulation_steps=a,
                             max_steps=steps, learning_rate=LR, use_cpu=True, report_to=[],
                             logging_steps=1, save_strategy="steps", save_steps=steps - 1,
                             save_total_limit=1, eval_strategy="steps", eval_steps=steps - 1,
                             per_device_eval_batch_size=micro, seed=3, disable_tqdm=True,
                             dataloader_num_workers=0, **kw)

record = {"mode": mode, "micro": micro, "accum": accum}
losses = []
from transformers import TrainerCallback
class Log(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            losses.append((state.global_step, float(logs["loss"])))
    def on_step_end(self, args, state, control, **kw):
        record.setdefault("batch_sizes", []).append(args.per_device_train_batch_size * args.gradient_accumulation_steps)

def trainer_for(b, a, **kw):
    t = Sequential(model=model, args=args_for(b, a, **kw), train_dataset=rows,
                   eval_dataset=rows[:micro], data_collator=collate, callbacks=[Log()])
    return t

if mode == "calibrate":
    import gc
    t = trainer_for(micro, 1)
    base = rss_bytes(); reset_peak_rss()
    t.args.max_steps = spike
    t.args.eval_strategy = "no"; t.args.save_strategy = "no"
    t.train()
    normal = peak_rss_bytes() - base
    batch = collate(rows[spike * micro:(spike + 1) * micro])
    gc.collect(); reset_peak_rss()
    loss = model(**batch).loss; loss.backward()
    model.zero_grad(set_to_none=False)
    record.update(normal_bytes=normal, spike_bytes=peak_rss_bytes() - base)
    print(json.dumps(record)); sys.exit(0)

t0 = time.time()
if mode == "accelerate":
    from accelerate.utils import find_executable_batch_size
    attempts = []
    @find_executable_batch_size(starting_batch_size=micro)
    def run(batch_size):
        attempts.append(batch_size)
        global model
        torch.manual_seed(0)
        t = trainer_for(batch_size, 1)
        t.train()
        return batch_size
    if cap:
        cap_address_space(cap)
    try:
        b = run()
        record.update(survived=True, attempts=attempts, final_batch=b)
    except Exception as e:
        record.update(survived=False, attempts=attempts, error=str(e).splitlines()[0][:120])
else:
    kw = {"auto_find_batch_size": True} if mode == "transformers" else {}
    t = trainer_for(micro, accum, **kw)
    if mode == "guarded":
        import autofit
        autofit.guard(t)
    if cap:
        cap_address_space(cap)
    try:
        t.train()
        record.update(survived=True)
    except Exception as e:
        record.update(survived=False, error=str(e).splitlines()[0][:120],
                      died_at_step=t.state.global_step)
    if mode == "guarded":
        record["rescues"] = [r.line() for r in t.autofit_guard.rescues]
    if mode == "transformers":
        record["final_batch"] = t._train_batch_size
record["losses"] = losses
record["wall_s"] = round(time.time() - t0, 1)
if record.get("survived"):
    torch.save({n: p.detach() for n, p in model.named_parameters()},
               os.path.join(out_dir, "weights.pt"))
print(json.dumps(record))
'''


def _child(mode: str, cap: int, out: Path, micro: int = MICRO, accum: int = 1) -> dict:
    from autofit.trial.procmem import CHILD_MALLOC_ENV

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **CHILD_MALLOC_ENV, "PYTHONPATH": str(HERE.parent)}
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(cap), str(out), str(micro),
                           str(accum), str(STEPS), str(SPIKE_STEP), str(LENGTH), str(MICRO),
                           str(LEARNING_RATE)],
                          capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{\"mode\"")]
    if not lines:
        return {"mode": mode, "survived": False, "error": (proc.stderr.strip().splitlines()
                                                           or ["no output"])[-1][:200],
                "returncode": proc.returncode}
    return json.loads(lines[-1])


def _e(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def main() -> None:
    import tempfile

    import torch

    work = Path(tempfile.mkdtemp(prefix="autofit-guard-spike-"))
    cal = _child("calibrate", 0, work / "cal")
    normal, spike = cal["normal_bytes"], cal["spike_bytes"]
    cap = int((normal + spike) / 2)
    runs = {"calibrate": cal}
    for mode, micro, accum, c in [("unguarded", MICRO, 1, cap), ("guarded", MICRO, 1, cap),
                                  ("reference", MICRO // 2, 2, 0), ("uncapped", MICRO, 1, 0),
                                  ("transformers", MICRO, 1, cap), ("accelerate", MICRO, 1, cap)]:
        t0 = time.time()
        runs[mode] = _child(mode, c, work / mode, micro, accum)
        print(f"{mode}: survived={runs[mode].get('survived')} ({time.time() - t0:.0f} s)",
              flush=True)
    g = runs["guarded"]

    def diff(x: str, y: str) -> tuple[float | None, float | None, float | None]:
        """(largest relative loss difference, largest per-tensor and whole-model relative
        weight difference) between runs x and y."""
        a, b = runs[x], runs[y]
        loss = max((abs(u[1] - v[1]) / abs(v[1]) for u, v in
                    zip(a.get("losses", []), b.get("losses", []), strict=False)), default=None)
        if not (a.get("survived") and b.get("survived")):
            return loss, None, None
        wa, wb = (torch.load(work / n / "weights.pt") for n in (x, y))
        per = max(float((wa[n] - wb[n]).norm() / wb[n].norm()) for n in wa)
        whole = (sum(float((wa[n] - wb[n]).norm() ** 2) for n in wa)
                 / sum(float(wb[n].norm() ** 2) for n in wa)) ** 0.5
        return loss, per, whole

    pairs = {"guarded vs reference (split size)": diff("guarded", "reference"),
             "guarded vs uncapped (micro 8, no cap)": diff("guarded", "uncapped"),
             "uncapped vs reference (no guard: the float-order floor)":
                 diff("uncapped", "reference")}
    loss_rel, weight_rel, _ = pairs["guarded vs reference (split size)"]
    met = bool(g.get("survived") and not runs["unguarded"].get("survived")
               and loss_rel is not None and weight_rel is not None
               and loss_rel <= TOLERANCE and weight_rel <= TOLERANCE)
    summary = {"target_met": met, "tolerance": TOLERANCE, "learning_rate": LEARNING_RATE,
               "cap_bytes": cap, "normal_step_bytes": normal, "spike_step_bytes": spike,
               "differences": {k: dict(zip(("loss", "tensor", "model"), v, strict=True))
                               for k, v in pairs.items()}, "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "guard_spike.json").write_text(json.dumps(summary, indent=2) + "\n")
    mib = 2**20
    rows = [
        "| run | survived | what happened |",
        "|---|---|---|",
        f"| plain Trainer | {runs['unguarded'].get('survived')} | "
        f"{runs['unguarded'].get('error', '')} (step {runs['unguarded'].get('died_at_step')}) |",
        f"| autofit.guard | {g.get('survived')} | {len(g.get('rescues', []))} rescue(s); "
        f"losses within {loss_rel:.1e} and weights within {weight_rel:.1e} (relative) of the "
        f"run at the split size |" if loss_rel is not None and weight_rel is not None else
        f"| autofit.guard | {g.get('survived')} | {g.get('error', '')} |",
        f"| transformers auto_find_batch_size | {runs['transformers'].get('survived')} | "
        f"final micro batch {runs['transformers'].get('final_batch')} (from {MICRO}: the "
        f"effective batch changed); {len(runs['transformers'].get('losses', []))} logged steps "
        f"for {STEPS} optimizer steps (a restart repeats steps) |",
        f"| accelerate find_executable_batch_size | {runs['accelerate'].get('survived')} | "
        f"attempts at batch {runs['accelerate'].get('attempts')}: every OOM starts the whole "
        "run over |",
    ]
    text = "\n".join([
        "# A planted spike on a capped CPU (benchmarks/guard_spike.py)", "",
        f"llama-style, 4 layers, hidden 256, vocab 8000, fp32 AdamW; micro batch {MICRO} of "
        f"{LENGTH} tokens, {STEPS} steps at learning rate {LEARNING_RATE:g}, the micro batch "
        f"at step {SPIKE_STEP} of "
        f"{2 * LENGTH} tokens. Measured: normal step {normal / mib:.0f} MiB, spike step "
        f"{spike / mib:.0f} MiB; cap {cap / mib:.0f} MiB (RLIMIT_AS above the built trainer).",
        "", *rows, "",
        "Differences (relative; fp32; AdamW): the largest over logged losses, over single "
        "parameter tensors, and over the whole model's weights:", "",
        "| runs compared | loss | worst tensor | whole model |", "|---|---|---|---|",
        *[f"| {k} | {_e(v[0])} | {_e(v[1])} | {_e(v[2])} |" for k, v in pairs.items()], "",
        f"Target: the guarded run's losses and weights within {TOLERANCE:g} (relative) of "
        f"the run at the split size: **{'met' if met else 'NOT met'}**.", "",
        "A plain run at micro batch 8 and one at 4 x 2 differ by float summation order alone "
        "(the last row); AdamW's normalised update magnifies that in rarely-seen embedding "
        "rows, in proportion to the learning rate (at 1e-3 the floor was 4.1e-05 on one "
        "tensor, 1.6e-05 on the whole model, 2026-12-02). The guarded run differs from the "
        "run at micro batch 8 only at the spike step.",
        "",
        "Rescue lines of the guarded run:", "",
        *[f"    {line}" for line in g.get("rescues", [])], ""])
    (RESULTS / "guard_spike.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
