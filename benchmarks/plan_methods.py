"""Plans for cards that are not present: the closed form against the simulated step.

``autofit(model, data, device=<card>)`` plans from the analytic estimate alone;
``method="simulate"`` brackets the best candidates by simulating their training
step on fake tensors with the card's allocator model. Both are unconfirmed on
hardware; this shows where they choose differently and why (the analytic
reserved-memory allowance against the replayed allocator).

    python benchmarks/plan_methods.py      # ~2 min, writes results/plan_methods.md
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

CASES = (
    ("meta-llama/Llama-3.2-1B", "H100-80GB", {}),
    ("meta-llama/Llama-3.2-1B", "A10G", {}),
    ("meta-llama/Llama-3.1-8B", "A100-40GB", {"lora": {"r": 16}, "precision": ["bf16-true"]}),
    ("tiny-llama", "T4", {}),
)
# 32 samples: one of 2048 tokens (the worst case), the rest 256
DATA = [{"input_ids": list(range(1, 2049))}] + [{"input_ids": list(range(1, 257))}] * 31


def plan(model: str, card: str, method: str, extra: dict) -> dict:
    from autofit.api import autofit
    from autofit.errors import DoesNotFitError

    t = time.perf_counter()
    try:
        r = autofit(model, DATA, device=card, method=method, cache=False, max_micro_batch=64,
                    **extra)
    except DoesNotFitError as e:
        return {"error": str(e), "s": time.perf_counter() - t}
    c = r.config
    return {"choice": f"{c.precision}, {'ckpt' if c.gradient_checkpointing else 'no ckpt'}, "
                      f"{c.optimizer}, micro {c.micro_batch_size}",
            "total": r.estimate.device_total_bytes, "alloc": r.estimate.peak_allocated_bytes,
            "reserved": r.estimate.peak_reserved_bytes,
            "budget": int(0.9 * r.estimate.capacity_bytes), "s": time.perf_counter() - t}


def main() -> int:
    warnings.filterwarnings("ignore")
    gib = 2**30
    lines = ["# Plans for absent cards: analytic vs simulated step", "",
             f"Produced by `python benchmarks/plan_methods.py` on {time.strftime('%Y-%m-%d')}. "
             "32 samples, the longest 2048 tokens; default search space unless noted; "
             "estimates of the chosen configuration (GiB). Neither is confirmed on hardware.", "",
             "| model | card | extra | method | choice | allocated | reserved | device total | "
             "budget | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for model, card, extra in CASES:
        for method in ("analytic", "simulate"):
            r = plan(model, card, method, extra)
            if "error" in r:
                row = f"nothing fits: {r['error'][:120]}… | - | - | - | - "
            else:
                row = (f"{r['choice']} | {r['alloc'] / gib:.2f} | {r['reserved'] / gib:.2f} | "
                       f"{r['total'] / gib:.2f} | {r['budget'] / gib:.2f} ")
            line = f"| {model} | {card} | {extra or '-'} | {method} | {row}| {r['s']:.0f} |"
            print(line, flush=True)
            lines.append(line)
    out = HERE / "results" / "plan_methods.md"
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
