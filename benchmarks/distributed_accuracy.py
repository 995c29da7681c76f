"""How close autofit's per-rank estimates are to measured per-rank peaks (several processes).

For every configuration of ``benchmarks/results/distributed_measured.json`` (measured by
``benchmarks/distributed_measure.py``, which shares no code with autofit: N fresh
processes, gloo, peak RSS per rank), compare::

    autofit.estimate(model, TrainConfig(micro_batch_size=B, precision=P,
                     gradient_checkpointing=G, optimizer="adamw_torch",
                     nproc_per_node=N, nnodes=1, strategy=S, offload=O),
                     seq_len=T, device="cpu", method="analytic" | "simulate")

with the measurement: the estimate's ``peak_allocated_bytes`` (the rank that peaks)
against the measured peak of the rank that peaks, and ``per_rank[r]`` against rank r.
The measured peak is absolute: its baseline precedes the model (see
distributed_measure.py), so it includes the rank's weights.

    python benchmarks/distributed_accuracy.py                  # both methods, all rows
    python benchmarks/distributed_accuracy.py --methods analytic --names ddp2-fp32

Strategy names: ``fsdp`` with ``reshard_after_forward`` false is autofit's
``"fsdp-shard-grad-op"``; the others keep their names. DDP's ``bucket_cap_mb`` and
``gradient_as_bucket_view`` are not TrainConfig fields: those rows are estimated for
the Trainer's defaults (25 MiB, False) and say so.

Offload on a CPU "device": the host is the device, so the measured RSS holds both
what the estimator calls device memory and what it calls host memory; rows with
offload compare the measurement with ``peak_allocated_bytes + host_bytes`` of the rank.

While the several-process estimator is missing (TrainConfig without ``strategy``), the
script says so, writes the measured table and the published table without estimates,
and exits 0.

Writes ``benchmarks/results/distributed_accuracy.md``, ``.json`` and ``.png``.
Also reads ``benchmarks/published_sharded.json`` (per-GPU memory published for sharded
training of real models) and puts autofit's estimate for the published GPU beside each
row when the estimator is available.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
if not os.environ.get("PYTHONPATH"):  # else PYTHONPATH names the autofit checkout to compare
    sys.path.insert(0, str(HERE.parent))

MEASURED = RESULTS / "distributed_measured.json"
PUBLISHED = HERE / "published_sharded.json"
TARGETS = {"analytic": (0.05, 0.15), "simulate": (0.03, 0.08)}  # median, worst |error| (issue 14)
NEEDED_FIELDS = ("nproc_per_node", "nnodes", "strategy", "offload")
MIB, GIB = 2**20, 2**30
PARTS = ("local_param_bytes", "model_resident_bytes", "steady_rss_after_step_bytes",
         "first_step_peak_bytes", "peak_bytes")  # per rank, bytes above the baseline


def estimator_missing() -> str | None:
    """Why the several-process estimator cannot be called, or None when it can."""
    try:
        import autofit
        from autofit import TrainConfig
    except ImportError as e:
        return f"autofit is not importable ({e})"
    if not hasattr(autofit, "estimate"):
        return "autofit has no estimate()"
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    missing = [f for f in NEEDED_FIELDS if f not in names]
    if missing:
        return (f"autofit.TrainConfig has no {', '.join(missing)} yet: the several-process "
                "estimator (issue 14) is not in this checkout")
    return None


def autofit_strategy(spec: dict[str, Any]) -> str:
    """The TrainConfig strategy name of a measured spec."""
    if spec["strategy"] == "fsdp" and not spec["reshard_after_forward"]:
        return "fsdp-shard-grad-op"
    return spec["strategy"]


def sharding_of(spec: dict[str, Any], recipe: str) -> dict[str, Any] | None:
    """How the measured ranks ran, as ``estimate(..., sharding=)`` takes it: the plain torch
    FSDP2 recipe (``fully_shard`` per block + root, ``MixedPrecisionPolicy(bf16, reduce
    fp32)``, no autocast), DeepSpeed's own AdamW, DDP's bucket settings as measured; None
    (``recipe="trainer"``) estimates what the Trainer would run instead."""
    if recipe == "trainer":
        return None
    return {"fsdp_recipe": "torch", "zero_optimizer": "deepspeed",
            "zero_sizes": "deepspeed" if spec.get("ds_buckets") == "deepspeed-default" else "auto",
            "bucket_cap_mb": spec["bucket_cap_mb"],
            "gradient_as_bucket_view": spec["gradient_as_bucket_view"]}


def estimate_caveat(spec: dict[str, Any]) -> str | None:
    """What of the measured configuration the estimate cannot be told, or None."""
    if spec["strategy"] != "ddp":
        return None
    odd = []
    if spec["gradient_as_bucket_view"]:
        odd.append("gradient_as_bucket_view=True")
    if spec["bucket_cap_mb"] != 25:
        odd.append(f"bucket_cap_mb={spec['bucket_cap_mb']}")
    return ("estimated for DDP's defaults, measured with " + ", ".join(odd)) if odd else None


def compared_bytes(est: Any, rank: dict[str, Any] | None, offload: str) -> int:
    """What is compared with a measured RSS: device peak, plus host bytes when offloading
    (on a CPU the host is the device: both are in the process's RSS)."""
    if rank is None:
        peak = int(est.peak_allocated_bytes)
        host = int(getattr(est, "host_bytes", 0) or 0)
    else:
        peak = int(rank["peak_allocated_bytes"])
        host = int(rank.get("host_bytes", 0) or 0)
    return peak + (host if offload != "none" else 0)


def signed_error(predicted: int, measured: int) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


def _config_path(tmp: Path, name: str, model_type: str, config: dict[str, Any]) -> str:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"model_type": model_type, **config}))
    return str(path)


def _estimate(spec: dict[str, Any], method: str, tmp: Path,
              recipe: str = "measured") -> tuple[Any, float]:
    from autofit import TrainConfig, estimate

    config = TrainConfig(
        micro_batch_size=spec["batch"], precision=spec["precision"],
        gradient_checkpointing=spec["gradient_checkpointing"], optimizer=spec["optimizer"],
        nproc_per_node=spec["nproc"], nnodes=1, strategy=autofit_strategy(spec),
        offload=spec["offload"])
    t = time.perf_counter()
    est = estimate(_config_path(tmp, spec["name"], spec["model_type"], spec["config"]), config,
                   seq_len=spec["seq"], device="cpu", method=method, task=spec["task"],
                   attn_implementation=spec["attn_implementation"],
                   sharding=sharding_of(spec, recipe))
    return est, time.perf_counter() - t


def _describe(spec: dict[str, Any]) -> str:
    parts = [f"{spec['nproc']}x {spec['strategy']}", spec["precision"]]
    if spec["strategy"] == "fsdp" and not spec["reshard_after_forward"]:
        parts.append("no reshard")
    if spec["strategy"] == "ddp" and spec["gradient_as_bucket_view"]:
        parts.append("grad bucket view")
    if spec["offload"] != "none":
        parts.append(f"offload {spec['offload']}")
    if spec["gradient_checkpointing"]:
        parts.append("ckpt")
    if spec.get("ds_buckets") == "deepspeed-default":
        parts.append("DeepSpeed default buckets")
    return " ".join(parts)


def compare_row(measured: dict[str, Any], methods: list[str], tmp: Path,
                recipe: str = "measured") -> dict[str, Any]:
    """One table row: the measurement and each method's estimate with its signed error."""
    spec = measured["spec"]
    row: dict[str, Any] = {
        "name": measured["name"], "what": _describe(spec), "shape": f"{spec['batch']}x{spec['seq']}",
        "measured": measured["peak_bytes"], "measured_rank": measured["peak_rank"],
        "measured_per_rank": [r["peak_bytes"] for r in measured["ranks"]],
        "measured_phases": measured["ranks"][measured["peak_rank"]]["phase_peaks"],
        "optimizer_class": "/".join(c for c in (measured.get("optimizer_class"),
                                                 measured.get("basic_optimizer_class")) if c),
        "measured_parts": {k: measured["ranks"][measured["peak_rank"]][k] for k in PARTS},
        "caveat": estimate_caveat(spec) if recipe == "trainer" else None,
    }
    for method in methods:
        try:
            est, secs = _estimate(spec, method, tmp, recipe)
        except Exception as e:  # noqa: BLE001 - a row the estimator refuses is reported, not fatal
            row[f"{method}_failed"] = f"{type(e).__name__}: {e}"
            continue
        per_rank = getattr(est, "per_rank", None) or ()
        predicted = compared_bytes(est, None, spec["offload"])
        row[method] = predicted
        row[f"{method}_err"] = signed_error(predicted, row["measured"])
        row[f"{method}_phase"] = getattr(est, "peak_phase", None)
        row[f"{method}_s"] = secs
        if per_rank:
            by_rank = {int(r["rank"]): r for r in per_rank}
            row[f"{method}_per_rank"] = [
                compared_bytes(est, by_rank.get(i), spec["offload"]) if i in by_rank else None
                for i in range(spec["nproc"])]
            errs = [signed_error(p, m) for p, m in zip(row[f"{method}_per_rank"],
                                                        row["measured_per_rank"], strict=True)
                    if p is not None]
            row[f"{method}_worst_rank_err"] = max(errs, key=abs) if errs else None
    return row


def summarize(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Median and worst |error| per method over the rows that have an estimate."""
    out = {}
    for method in methods:
        errs = [abs(r[f"{method}_err"]) for r in rows if f"{method}_err" in r]
        if not errs:
            continue
        med_t, worst_t = TARGETS[method]
        out[method] = {
            "n": len(errs), "median_abs_error": statistics.median(errs),
            "max_abs_error": max(errs), "target_median": med_t, "target_max": worst_t,
            "meets_target": statistics.median(errs) <= med_t and max(errs) <= worst_t,
            "failed": [r["name"] for r in rows if f"{method}_failed" in r],
        }
    return out


# --------------------------------------------------------------------------- published


def load_published(path: Path = PUBLISHED) -> list[dict[str, Any]]:
    """The published per-GPU measurements (see the file's ``about``)."""
    return json.loads(path.read_text())["rows"]


def estimate_published(row: dict[str, Any], tmp: Path, method: str = "analytic") -> dict[str, Any]:
    """autofit's per-GPU estimate of a published row: device peak reserved (what torch's
    max_memory_reserved reports) and allocated; with checkpointing "selective", both ends
    (no checkpointing / full checkpointing) since autofit models full checkpointing only."""
    from autofit import TrainConfig, estimate

    ckpt = row["gradient_checkpointing"]
    cases = {"none": [False], "full": [True]}.get(ckpt, [False, True])
    out: dict[str, Any] = {}
    for g in cases:
        config = TrainConfig(micro_batch_size=row["micro_batch"],
                             grad_accum_steps=row.get("grad_accum_steps", 1),
                             precision=row["precision"], gradient_checkpointing=g, optimizer=row["optimizer"],
                             nproc_per_node=row["nproc_per_node"], nnodes=row["nnodes"],
                             strategy=row["strategy"], offload=row["offload"])
        est = estimate(_config_path(tmp, row["id"], row["model_type"], row["model_config"]),
                       config, seq_len=row["seq_len"], device=row["autofit_device"],
                       method=method, task="causal-lm")
        key = "ckpt" if g else "no_ckpt"
        out[key] = {"reserved": int(est.peak_reserved_bytes),
                    "allocated": int(est.peak_allocated_bytes)}
    return out


UNIT_BYTES = {"GiB": GIB, "GB": GIB}  # "GB": training scripts print torch's bytes / 1024**3


def published_verdict(row: dict[str, Any], est: dict[str, Any]) -> str:
    """The estimate against the reported number: the signed error of the estimate of the
    published setup, or, for selective checkpointing, where the report falls between the
    estimates without and with full checkpointing."""
    reported = row["reported_value"] * UNIT_BYTES[row["reported_unit"]]
    if "no_ckpt" in est and "ckpt" in est:
        hi, lo = est["no_ckpt"]["reserved"], est["ckpt"]["reserved"]
        if lo <= reported <= hi:
            return "within the bracket"
        side = "below" if reported < lo else "above"
        return f"{side} the bracket ({100 * signed_error(lo if side == 'below' else hi, int(reported)):+.1f}%)"
    (only,) = est.values()
    return f"{100 * signed_error(only['reserved'], int(reported)):+.1f}%"


# --------------------------------------------------------------------------- output


def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / MIB:.1f}"


def _cell(row: dict[str, Any], m: str) -> str:
    if f"{m}_failed" in row:
        return "failed"
    if m not in row:
        return "–"
    return f"{_mib(row[m])} ({100 * row[m + '_err']:+.1f}%)"


def write_markdown(path: Path, rows: list[dict[str, Any]], summary: dict[str, Any],
                   methods: list[str], missing: str | None, published: list[dict[str, Any]],
                   pub_estimates: dict[str, Any]) -> None:
    lines = [
        "# Several-process estimates vs per-rank measurements (CPU, gloo)",
        "",
        "Measured = per-rank peak RSS above a baseline taken before the model exists",
        "(`benchmarks/distributed_measure.py`, N fresh processes, shares no code with",
        "autofit), so it includes the rank's weights. Predicted = `autofit.estimate(...,",
        "device=\"cpu\")` with `nproc_per_node`, `strategy`, `offload`: `peak_allocated_bytes`",
        "(+ `host_bytes` with offload: on a CPU the host is the device). Error = (predicted −",
        "measured) / measured, for the rank that peaks. Produced by",
        "`python benchmarks/distributed_accuracy.py`.",
        "",
    ]
    if missing:
        lines += [f"**Estimates not available:** {missing}. Measured values only.", ""]
    if summary:
        lines += ["| method | configs | median abs error | max abs error | target (median / max) | met |",
                  "|---|---|---|---|---|---|"]
        for m, s in summary.items():
            lines.append(f"| {m} | {s['n']} | {100 * s['median_abs_error']:.1f}% | "
                         f"{100 * s['max_abs_error']:.1f}% | {100 * s['target_median']:.0f}% / "
                         f"{100 * s['target_max']:.0f}% | {'yes' if s['meets_target'] else 'NO'} |")
        lines.append("")
    lines += ["| config | what | B×T per rank | measured MiB per rank | fwd / bwd / opt MiB (peak rank) | "
              "optimizer that ran | " + " | ".join(f"{m} MiB (error)" for m in methods) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(methods)]
    for r in rows:
        ph = r["measured_phases"]
        per_rank = " / ".join(_mib(x) for x in r["measured_per_rank"])
        what = r["what"] + (f" ({r['caveat']})" if r.get("caveat") else "")
        lines.append(f"| {r['name']} | {what} | {r['shape']} | {per_rank} | "
                     f"{_mib(ph['forward'])} / {_mib(ph['backward'])} / {_mib(ph['optimizer'])} | "
                     f"{r.get('optimizer_class') or ''} | "
                     + " | ".join(_cell(r, m) for m in methods) + " |")
    lines += ["", "## What a rank holds (measured, the rank that peaks)", "",
              "Bytes above the pre-model baseline, MiB: the parameters the rank holds after",
              "wrapping (tensor storages), RSS after wrapping and making the optimizer, RSS after",
              "the last step's `zero_grad` / `engine.step()`, the first step's peak (optimizer",
              "states appear during it) and the peak of steps 2-3.", "",
              "| config | local params | after wrapping | after a step | first step peak | peak |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        parts = r.get("measured_parts")
        if parts:
            lines.append(f"| {r['name']} | " + " | ".join(_mib(parts[k]) for k in PARTS) + " |")
    lines += ["", "## Published per-GPU memory of sharded training", "",
              "Numbers reported by others for real models on GPUs (`benchmarks/published_sharded.json`,",
              "sources linked). autofit's estimate (analytic, the published GPU from its catalog, the",
              "model built on the meta device from its published dimensions) is put beside each when",
              "the estimator is available; with selective activation checkpointing (not modelled)",
              "the estimate is given without and with full checkpointing, which bracket it.",
              "A reported \"GB\" is read as 2^30 bytes (what `bytes / 1024**3` prints).", ""]
    lines += ["| id | model | strategy | GPUs | micro batch × seq | precision | checkpointing | "
              "reported | metric | autofit reserved GiB (no ckpt / full ckpt) | autofit vs reported | source |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in published:
        e = pub_estimates.get(p["id"])
        if isinstance(e, dict):
            cells = " / ".join(f"{e[k]['reserved'] / GIB:.1f}" if k in e else "–"
                               for k in ("no_ckpt", "ckpt"))
            verdict = published_verdict(p, e)
        else:
            cells, verdict = e or "–", "–"
        lines.append(
            f"| {p['id']} | {p['model']} | {p['strategy_as_published']} | "
            f"{p['nproc_per_node'] * p['nnodes']}× {p['gpu']} | {p['micro_batch']} × {p['seq_len']} | "
            f"{p['precision_as_published']} | {p['checkpointing_as_published']} | "
            f"{p['reported_value']} {p['reported_unit']} | {p['metric']} | {cells} | {verdict} | "
            f"[link]({p['source_url']}) |")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict[str, Any]], methods: list[str]) -> None:
    from plotting import pyplot

    pts = {m: [(r["measured"] / MIB, r[m] / MIB) for r in rows if m in r] for m in methods}
    if not any(pts.values()):
        return
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 6))
    for (m, xy), marker in zip(pts.items(), ["o", "x"], strict=False):
        if xy:
            ax.scatter(*zip(*xy, strict=True), label=m, marker=marker, alpha=0.8)
    meas = [r["measured"] / MIB for r in rows]
    lo, hi = min(meas) * 0.8, max(meas) * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="exact")
    ax.fill_between([lo, hi], [lo * 0.92, hi * 0.92], [lo * 1.08, hi * 1.08], color="grey",
                    alpha=0.15, label="±8%")
    ax.set_xlabel("measured per-rank peak (MiB, RSS of the rank that peaks)")
    ax.set_ylabel("predicted per-rank peak (MiB)")
    ax.set_title("autofit several-process estimate vs measured (CPU, gloo)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="analytic,simulate")
    ap.add_argument("--names", default=None, help="comma-separated subset of measured configs")
    ap.add_argument("--measured", default=str(MEASURED))
    ap.add_argument("--out", default=str(RESULTS / "distributed_accuracy"))
    ap.add_argument("--recipe", choices=["measured", "trainer"], default="measured",
                    help="estimate the recipe that was measured (default), or what the "
                         "Trainer would run with the same strategy")
    args = ap.parse_args(argv)

    methods = [m for m in args.methods.split(",") if m in TARGETS]
    measured = json.loads(Path(args.measured).read_text())
    if args.names:
        wanted = set(args.names.split(","))
        measured = [m for m in measured if m["name"] in wanted]
    missing = estimator_missing()
    if missing:
        print(f"skipping estimates: {missing}", file=sys.stderr)
    published = load_published()

    rows, pub_estimates = [], {}
    with tempfile.TemporaryDirectory() as d:
        for m in measured:
            row = compare_row(m, [] if missing else methods, Path(d), args.recipe)
            rows.append(row)
            print(f"{row['name']:<26} measured {_mib(row['measured']):>8} MiB  " + "  ".join(
                f"{x} {_cell(row, x)}" for x in methods), flush=True)
        if not missing:
            for p in published:
                try:
                    pub_estimates[p["id"]] = estimate_published(p, Path(d))
                except Exception as e:  # noqa: BLE001 - reported in the table
                    pub_estimates[p["id"]] = f"failed: {type(e).__name__}"
                    print(f"published {p['id']}: {type(e).__name__}: {e}", file=sys.stderr)

    summary = summarize(rows, methods)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"summary": summary, "estimator_missing": missing, "rows": rows,
         "published_estimates": pub_estimates}, indent=1) + "\n")
    write_markdown(out.with_suffix(".md"), rows, summary, methods, missing, published,
                   pub_estimates)
    plot(out.with_suffix(".png"), rows, methods)
    for m, s in summary.items():
        print(f"{m}: n={s['n']} median |err| {100 * s['median_abs_error']:.1f}% max "
              f"{100 * s['max_abs_error']:.1f}% (target {100 * s['target_median']:.0f}% / "
              f"{100 * s['target_max']:.0f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
