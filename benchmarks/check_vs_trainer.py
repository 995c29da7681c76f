"""Check that measure_cpu.py's step is the step ``transformers.Trainer`` really runs.

For each named spec, a fresh child (same malloc environment as measure_cpu) trains the
spec's model with ``Trainer.train()`` for 3 steps on the spec's batch; a callback reads
RSS at the end of step 1 and resets the high-water mark there, and reads VmHWM at the
end of step 3. Its "transient peak" (VmHWM over steps 2-3 minus RSS after step 1) is
compared with the harness's ``peak_bytes - steady_rss_after_step_bytes``, the same
quantity measured with the harness's hand-written step. Both exclude the weights and
the optimizer states; they differ only if the steps differ.

    python benchmarks/check_vs_trainer.py --names llama-b4s256,llama-b4s256-bf16m

``16-mixed`` cannot be checked: accelerate refuses fp16 mixed precision on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import measure_cpu as mc

RESULT_MARK = "@@TRAINER_RESULT@@ "
STEPS = 3


def _trainer_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, config = mc._build_model({**spec, "gradient_checkpointing": False})
    batch = mc._make_batch(spec, config, spec["batch"], spec["seq"])
    rows = [{k: v[i] for k, v in batch.items()} for i in range(spec["batch"])] * STEPS

    class Probe(TrainerCallback):
        rss_after_first = hwm = None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.rss_after_first = mc._rss_bytes()
                mc._reset_hwm()
            elif state.global_step == STEPS:
                self.hwm = mc._hwm_bytes()

    probe = Probe()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=spec["batch"],
            max_steps=STEPS,
            optim=spec["optimizer"],
            optim_args=spec["optim_args"],
            bf16=spec["precision"] == "bf16-mixed",
            gradient_checkpointing=spec["gradient_checkpointing"],
            gradient_checkpointing_kwargs={"use_reentrant": False},
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[probe])
        trainer.train()
    return {"name": spec["name"], "trainer_transient_bytes": probe.hwm - probe.rss_after_first}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--names", required=False, help="comma-separated spec names")
    args = parser.parse_args(argv)
    if args.child:
        print(RESULT_MARK + json.dumps(_trainer_child(json.loads(args.child))), flush=True)
        return 0
    if not args.names:
        parser.error("give --names")

    by_name = {c["name"]: c for c in mc.load_configs()}
    env = {**os.environ, **mc.CHILD_ENV}
    worst = 0.0
    for name in args.names.split(","):
        spec = by_name[name]
        if spec["precision"] == "16-mixed":
            print(f"{name}: skipped (the Trainer has no fp16 mixed precision on the CPU)")
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
        if not lines:
            print(f"{name}: Trainer run failed:\n{proc.stderr[-3000:]}")
            return 1
        trainer = json.loads(lines[0][len(RESULT_MARK) :])["trainer_transient_bytes"]
        r = mc.measure(spec)
        harness = r["peak_bytes"] - r["steady_rss_after_step_bytes"]
        diff = (harness - trainer) / trainer
        worst = max(worst, abs(diff))
        print(
            f"{name:<30} transient peak: harness {harness / 2**20:8.1f} MiB, "
            f"Trainer {trainer / 2**20:8.1f} MiB, diff {diff:+.2%}",
            flush=True,
        )
    print(f"largest difference {worst:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
