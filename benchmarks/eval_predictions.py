"""What a Trainer evaluation keeps for ``compute_metrics``, measured (autofit issue 25).

``Trainer.evaluate()`` of a 4-layer llama (32,000-token vocabulary) on 32 evaluation samples
of 128 tokens, eval batch 4, on the CPU, in a fresh process per mode: without
``compute_metrics``, with it, and with it and ``eval_accumulation_steps=1``. Each process
evaluates once to warm up, resets its peak resident memory (``/proc/self/clear_refs``), and
reports the second evaluation's peak above its start. Beside each: what
``autofit.preflight.predictions.kept_prediction_bytes`` counts for the predictions::

    python benchmarks/eval_predictions.py        # writes results/eval_predictions.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "eval_predictions.md"
MODES = ("plain", "metrics", "accumulate")
SAMPLES, TOKENS, VOCAB, BATCH = 32, 128, 32000, 4


def _model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=688,
                               num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=VOCAB)
    return AutoModelForCausalLM.from_config(cfg)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(mode: str) -> dict[str, float]:
    import tempfile
    import warnings

    import numpy as np
    import torch
    from transformers import Trainer, TrainingArguments

    warnings.simplefilter("ignore")
    rows = [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, VOCAB, (SAMPLES, TOKENS))]

    def metrics(p):
        return {"n": float(np.asarray(p.predictions).size)}

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_eval_batch_size=BATCH, use_cpu=True,
                                 report_to=[],
                                 eval_accumulation_steps=1 if mode == "accumulate" else None)
        trainer = Trainer(model=_model(), args=args, eval_dataset=rows,
                          compute_metrics=None if mode == "plain" else metrics)
        trainer.evaluate()  # warm-up
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident memory
        start = _status("VmRSS:")
        trainer.evaluate()
        return {"peak_above_start_mib": (_status("VmHWM:") - start) / 2**20}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2])))
        return 0
    from autofit.preflight.predictions import kept_prediction_bytes

    counted = kept_prediction_bytes(_model(), SAMPLES, TOKENS, autocast=False,
                                    half=False) / 2**20
    rows = {}
    for mode in MODES:
        p = subprocess.run([sys.executable, __file__, "--child", mode], capture_output=True,
                           text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows[mode] = json.loads(p.stdout.strip().splitlines()[-1])["peak_above_start_mib"]
        print(mode, f"{rows[mode]:.1f} MiB", flush=True)
    logits = SAMPLES * TOKENS * VOCAB * 4 / 2**20
    lines = ["# What a Trainer evaluation keeps for compute_metrics", "",
             f"`python benchmarks/eval_predictions.py`: `Trainer.evaluate()` of a 4-layer llama "
             f"(vocabulary {VOCAB:,}) on {SAMPLES} samples of {TOKENS} tokens, eval batch "
             f"{BATCH}, CPU, fp32; peak resident memory of the second evaluation above its "
             f"start, a fresh process per row. The set's fp32 logits are {logits:.0f} MiB.", "",
             "| evaluation | peak above start (MiB) | more than without compute_metrics |",
             "|---|---|---|"]
    names = {"plain": "no compute_metrics", "metrics": "compute_metrics",
             "accumulate": "compute_metrics, eval_accumulation_steps=1"}
    for mode in MODES:
        lines.append(f"| {names[mode]} | {rows[mode]:.1f} | {rows[mode] - rows['plain']:+.1f} |")
    lines += ["", f"Counted by `autofit.preflight(trainer)` beside the evaluation step "
              f"(`kept_prediction_bytes`): {counted:.0f} MiB. On the CPU "
              "`eval_accumulation_steps` moves the predictions to the host, which is the same "
              "memory.", ""]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
