"""autofit's per-rank estimates against measured per-rank peaks, recipe for recipe.

The measurements (``benchmarks/distributed_measure.py``: N fresh processes, gloo, peak RSS
per rank above a pre-model baseline; shares no code with autofit) run the plain torch /
DeepSpeed recipes: FSDP2 ``fully_shard`` per block + root with
``MixedPrecisionPolicy(bf16, reduce_dtype=fp32)`` and no autocast, DeepSpeed's own AdamW
(``{"optimizer": {"type": "AdamW"}}``), DDP with ``bucket_cap_mb`` and
``gradient_as_bucket_view`` as given. The Trainer runs other recipes (accelerate's FSDP2
units under autocast, the Trainer's torch AdamW inside ZeRO), which is what
``autofit.estimate`` assumes by default; here every row is estimated for the recipe that
was measured, through ``estimate(..., sharding={...})``::

    python benchmarks/distributed_compare.py                      # both methods, every row
    python benchmarks/distributed_compare.py --methods simulate --names fsdp2-fp32
    python benchmarks/distributed_compare.py --recipe trainer     # the Trainer's recipes

The estimate's ``peak_allocated_bytes`` (device "cpu": the glibc allocator model) of the
rank that peaks is compared with the measured peak of the rank that peaks, and rank by
rank; with offload, ``+ host_bytes`` (on a CPU the host is the device). Writes
``benchmarks/results/distributed_compare.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

RESULTS = HERE / "results"
MEASURED = RESULTS / "distributed_measured.json"
MIB = 2**20


def config_of(spec: dict[str, Any]) -> Any:
    """The TrainConfig of a measured spec (FSDP2 without reshard: ``fsdp-shard-grad-op``)."""
    from autofit import TrainConfig

    strategy = spec["strategy"]
    if strategy == "fsdp" and not spec["reshard_after_forward"]:
        strategy = "fsdp-shard-grad-op"
    return TrainConfig(micro_batch_size=spec["batch"], precision=spec["precision"],
                       gradient_checkpointing=spec["gradient_checkpointing"],
                       optimizer=spec["optimizer"], nproc_per_node=spec["nproc"],
                       strategy=strategy, offload=spec["offload"])


def sharding_of(spec: dict[str, Any], recipe: str) -> dict[str, Any] | None:
    """How the measured ranks ran (``Layout`` fields), or None for the Trainer's recipes."""
    if recipe == "trainer":
        return None
    return {"fsdp_recipe": "torch", "zero_optimizer": "deepspeed",
            "zero_sizes": "deepspeed" if spec.get("ds_buckets") == "deepspeed-default" else "auto",
            "bucket_cap_mb": spec["bucket_cap_mb"],
            "gradient_as_bucket_view": spec["gradient_as_bucket_view"]}


def compared(rank: dict[str, Any], offload: str) -> int:
    """Device peak, + host bytes with offload (the same RAM on a CPU)."""
    return int(rank["peak_allocated_bytes"]) + (int(rank["host_bytes"]) if offload != "none" else 0)


def run(measured: list[dict[str, Any]], methods: list[str], recipe: str) -> list[dict[str, Any]]:
    from autofit import estimate

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in measured:
            spec = r["spec"]
            path = Path(tmp) / f"{r['name']}.json"
            path.write_text(json.dumps({"model_type": spec["model_type"], **spec["config"]}))
            row = {"name": r["name"], "measured": r["peak_bytes"], "measured_rank": r["peak_rank"],
                   "measured_ranks": [x["peak_bytes"] for x in r["ranks"]]}
            for m in methods:
                t0 = time.perf_counter()
                est = estimate(str(path), config_of(spec), seq_len=spec["seq"], device="cpu",
                               method=m, attn_implementation=spec["attn_implementation"],
                               sharding=sharding_of(spec, recipe))
                ranks = est.per_rank or ({"peak_allocated_bytes": est.peak_allocated_bytes,
                                          "host_bytes": est.host_bytes},)
                per = [compared(x, spec["offload"]) for x in ranks]
                top = compared({"peak_allocated_bytes": est.peak_allocated_bytes,
                                "host_bytes": est.per_rank[est.peak_rank]["host_bytes"]
                                if est.per_rank else est.host_bytes}, spec["offload"])
                row[m] = {"predicted": top, "error": (top - r["peak_bytes"]) / r["peak_bytes"],
                          "peak_rank": est.peak_rank, "per_rank": per,
                          "per_rank_error": [(p - q) / q for p, q in zip(per, row["measured_ranks"],
                                                                          strict=True)],
                          "phase": est.peak_phase, "wall_s": time.perf_counter() - t0}
            rows.append(row)
            print(line(row, methods), flush=True)
    return rows


def line(row: dict[str, Any], methods: list[str]) -> str:
    out = f"{row['name']:<24} measured {row['measured'] / MIB:7.1f} MiB"
    for m in methods:
        x = row[m]
        out += f" | {m} {x['predicted'] / MIB:7.1f} {x['error']:+6.1%}"
    return out


def summary(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for m in methods:
        errs = [abs(r[m]["error"]) for r in rows]
        ranks = [abs(e) for r in rows for e in r[m]["per_rank_error"]]
        out[m] = {"median": statistics.median(errs), "worst": max(errs),
                  "rank_median": statistics.median(ranks), "rank_worst": max(ranks),
                  "rows": len(errs)}
    return out


def markdown(rows: list[dict[str, Any]], methods: list[str], recipe: str) -> str:
    s = summary(rows, methods)
    lines = ["# Per-rank estimates vs measured per-rank peaks (CPU, gloo)", "",
             f"Recipe estimated: {recipe} (`python benchmarks/distributed_compare.py"
             + (" --recipe trainer" if recipe == "trainer" else "") + "`) against "
             "`benchmarks/results/distributed_measured.json` (`benchmarks/distributed_measure.py`: "
             "N processes, gloo, peak RSS per rank). Error = (estimate - measured) / measured, "
             "of the rank that peaks; per rank: every rank against its own measurement. "
             "Device \"cpu\" (glibc allocator model); with offload, + host_bytes.", ""]
    for m in methods:
        x = s[m]
        lines.append(f"- {m}: median |error| {x['median']:.1%}, worst {x['worst']:.1%} "
                     f"({x['rows']} rows); per rank median {x['rank_median']:.1%}, worst "
                     f"{x['rank_worst']:.1%}")
    lines += ["", "| config | measured MiB | " + " | ".join(f"{m} MiB | error" for m in methods)
              + " |", "|---|---:|" + "---:|---:|" * len(methods)]
    for r in rows:
        cells = " | ".join(f"{r[m]['predicted'] / MIB:.1f} | {r[m]['error']:+.1%}" for m in methods)
        lines.append(f"| {r['name']} | {r['measured'] / MIB:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", default=str(MEASURED), help="distributed_measured.json")
    p.add_argument("--methods", default="analytic,simulate")
    p.add_argument("--names", default=None, help="comma-separated row names")
    p.add_argument("--recipe", choices=["measured", "trainer"], default="measured",
                   help="estimate the recipe that was measured, or the Trainer's")
    p.add_argument("--out", default=str(RESULTS / "distributed_compare"),
                   help="writes OUT.md and OUT.json")
    args = p.parse_args(argv)
    measured = json.loads(Path(args.measured).read_text())
    if args.names:
        wanted = set(args.names.split(","))
        measured = [r for r in measured if r["name"] in wanted]
    methods = args.methods.split(",")
    rows = run(measured, methods, args.recipe)
    for m, x in summary(rows, methods).items():
        print(f"{m}: median {x['median']:.1%} worst {x['worst']:.1%}; per rank median "
              f"{x['rank_median']:.1%} worst {x['rank_worst']:.1%}")
    if args.out and not args.names:
        Path(args.out + ".json").write_text(json.dumps(
            {"recipe": args.recipe, "summary": summary(rows, methods), "rows": rows}, indent=1)
            + "\n")
        Path(args.out + ".md").write_text(markdown(rows, methods, args.recipe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
