"""The whole run against its longest step: what replaying the run adds (no GPU needed).

For a model on a target card, a run of log-normal sample lengths (seeded) is put in
the Trainer's order (``autofit.probe.run.run_order``) and replayed through the
allocator model (``autofit.memory.run.simulate_run``), with and without gradient
accumulation. Reported per row: the longest step's reserved peak (what ``simulate``
gives for the worst-case batch), the run's need (the least capacity it runs through),
their difference (fragmentation over the run), the reserved peak with no capacity
limit (what ``max_memory_reserved`` would show on a huge card) and where the peak
stopped growing. A model of the allocator, not a measurement: ``gpu_check.py`` is
where a GPU checks it.

    python benchmarks/run_replay.py          # ~1 min; writes results/run_replay.md
"""

from __future__ import annotations

import datetime as dt
import random
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

ROWS = [("tiny-llama", "A100-80GB"), ("tiny-gpt2", "A100-80GB"), ("tiny-llama", "T4"),
        ("tiny-llama", "cpu")]
MICRO, SAMPLES, STEPS = 8, 2000, 250


def lengths(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(1024, int(rng.lognormvariate(5, 0.8))) + 1 for _ in range(SAMPLES)]


def main() -> int:
    warnings.filterwarnings("ignore")
    from autofit.config import TrainConfig
    from autofit.memory.run import simulate_run
    from autofit.memory.simulate import Simulator
    from autofit.probe.device import resolve_device
    from autofit.probe.model import build_model
    from autofit.probe.run import run_order

    mib = 1 << 20
    lines = ["# The whole run against its longest step (allocator model)", "",
             f"Produced by `python benchmarks/run_replay.py` on {dt.date.today()}: {SAMPLES} "
             f"samples of log-normal length (seed 0, 2 to 1025 tokens), micro batch {MICRO}, "
             f"the first {STEPS} optimizer steps of the Trainer's order (seed 42), lengths in "
             "at most 8 buckets. MiB.", "",
             "| model | card | precision | accumulation | longest step | run needs | "
             "over the run | unbounded reserved | stopped growing at step | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    data = lengths()
    for name, card in ROWS:
        module, task = build_model(name)
        dev = resolve_device(card)
        sim = Simulator(module, task=task, device=dev)
        precision = "bf16-mixed" if dev.bf16 else ("16-mixed" if dev.fp16 else "32-true")
        for ga in (1, 4):
            cfg = TrainConfig(micro_batch_size=MICRO, grad_accum_steps=ga, precision=precision)
            order = run_order(data, micro_batch_size=MICRO, grad_accum_steps=ga)
            t0 = time.perf_counter()
            r = simulate_run(sim, cfg, order, max_steps=STEPS)
            wall = time.perf_counter() - t0
            need = r.device_total_bytes - r.overhead_bytes
            lines.append(f"| {name} | {card} | {precision} | {ga} | "
                         f"{r.step_peak_reserved_bytes / mib:,.0f} | {need / mib:,.0f} | "
                         f"+{r.fragmentation_bytes / mib:,.0f} "
                         f"({100 * r.fragmentation_bytes / r.step_peak_reserved_bytes:.1f}%) | "
                         f"{r.unlimited_peak_reserved_bytes / mib:,.0f} | {r.converged_step} | "
                         f"{wall:.0f} |")
            print(lines[-1], flush=True)
    lines += ["", "On the CPU nothing is cached (each block is its own mapping), so the run "
              "needs its worst step. On a CUDA card the caching allocator keeps the segments "
              "each length made; it frees them and retries before it fails, so the run's need "
              "is far below what it reserves when nothing forces it to give memory back."]
    out = HERE / "results" / "run_replay.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
