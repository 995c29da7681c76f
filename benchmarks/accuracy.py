"""How close autofit's memory estimates are to measured peaks on this machine.

For every spec of ``benchmarks/configs.py`` (the project-wide spec format), compare
``autofit.estimate(..., device="cpu")`` with the ground truth of
``benchmarks/measure_cpu.py``: peak resident memory of an isolated process around
real training steps with real tensors, which shares no code with the estimator.
The measured absolute peak is ``peak_bytes + weights_bytes`` (the child's baseline
is taken after its weights exist).

    python benchmarks/accuracy.py                    # reuse results/measured.json
    python benchmarks/accuracy.py --measure          # measure again (several minutes)
    python benchmarks/accuracy.py --methods analytic --names llama-b4s256-adamw
    python benchmarks/accuracy.py --names A,B --merge   # A, B again; other rows kept

Writes ``benchmarks/results/accuracy.md``, ``accuracy.json`` and ``accuracy.png``
(predicted vs measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

TARGETS = {"analytic": (0.05, 0.15), "simulate": (0.02, 0.05)}  # median, worst |error| (issue 13)


def lora_spec(lo: dict | None):
    """autofit's LoraSpec of a spec's ``"lora"`` dict (r, alpha, target_modules, dropout)."""
    from autofit.probe.model import LoraSpec

    if not lo:
        return None
    tm = lo.get("target_modules", "all-linear")
    return LoraSpec(r=lo["r"], alpha=lo.get("alpha", 2 * lo["r"]),
                    target_modules=tm if isinstance(tm, str) else tuple(tm),
                    dropout=lo.get("dropout", 0.0))


@contextmanager
def cpu_rules_of(cpu: str | None, vendor: str | None):
    """Estimates inside use the CPU math libraries' cache rule of the instruction set ``cpu``
    and the maker ``vendor`` a row was measured on (None: this machine's instruction set;
    rows from before the maker was recorded: the Xeon's), not this machine's: the caches
    differ by both (``benchmarks/cpu_cache.py``)."""
    import autofit.probe.device as device

    here, maker = device.cpu_capability, device.cpu_vendor
    device.cpu_capability = lambda: cpu or here()  # type: ignore[assignment]
    device.cpu_vendor = lambda: vendor or "Intel"  # type: ignore[assignment]
    try:
        yield
    finally:
        device.cpu_capability, device.cpu_vendor = here, maker  # type: ignore[assignment]


def _estimate_on(cpu: str, spec: dict, method: str, tmp: Path, vendor: str | None = None):
    """``_estimate`` with the rules of the CPU the row was measured on (``cpu_rules_of``;
    rows from before the instruction set was recorded: the AVX2 machine's), as ``zoo.py``
    does."""
    with cpu_rules_of(cpu, vendor):
        return _estimate(spec, method, tmp)


def _estimate(spec: dict, method: str, tmp: Path):
    from autofit import TrainConfig, estimate

    cfg_path = tmp / f"{spec['name']}.json"
    cfg_path.write_text(json.dumps({"model_type": spec["model_type"], **spec["config"]}))
    lora = lora_spec(spec.get("lora"))
    config = TrainConfig(
        micro_batch_size=spec["batch"],
        grad_accum_steps=int(spec.get("grad_accum_steps", 1)),
        precision=spec["precision"],
        gradient_checkpointing=spec.get("gradient_checkpointing", False),
        optimizer=spec["optimizer"],
        optim_args=spec.get("optim_args"),
        chunked_loss=bool(spec.get("chunked_loss", False)),
        torch_compile=bool(spec.get("torch_compile", False)),
        torch_compile_mode=spec.get("torch_compile_mode"),
        torch_compile_regional=bool(spec.get("torch_compile_regional", False)),
        loss_impl="trl" if spec.get("trl_loss") else "model",
    )
    t = time.perf_counter()
    est = estimate(str(cfg_path), config, seq_len=spec["seq"], device="cpu", method=method,
                   task=spec["task"], attn_implementation=spec.get("attn_implementation"),
                   lora=lora, peft_config=spec.get("peft"),
                   quantization_config=spec.get("quantization"))
    return est, time.perf_counter() - t


def _peft_name(d: dict) -> str:
    """``ia3``, ``lora r16 dora``, ``prefix_tuning 20 tok``: the method and what sizes it."""
    name = str(d["peft_type"]).lower()
    if "r" in d:
        name += f" r{d['r']}"
    for flag in ("use_dora", "use_rslora"):
        if d.get(flag):
            name += " " + flag[4:]
    if d.get("lora_dropout"):
        name += f" dropout {d['lora_dropout']}"
    if d.get("trainable_token_indices"):
        name += " +tokens"
    if "num_virtual_tokens" in d:
        name += f" {d['num_virtual_tokens']} tok"
    return name


def _describe(spec: dict) -> str:
    parts = [spec["precision"], spec["optimizer"] + (f"({spec['optim_args']})" if spec.get("optim_args") else "")]
    if spec.get("gradient_checkpointing"):
        parts.append("ckpt")
    if spec.get("lora"):
        parts.append(f"lora r{spec['lora']['r']}")
    if spec.get("peft"):
        parts.append(_peft_name(spec["peft"]))
    q = spec.get("quantization")
    if q:
        if q.get("load_in_8bit"):
            base = "int8"
        else:
            base = str(q.get("bnb_4bit_quant_type", "fp4"))
            base += "+dq" if q.get("bnb_4bit_use_double_quant") else ""
        dtype = str(q.get("bnb_4bit_compute_dtype", "float32")).replace("bfloat16", "bf16")
        parts.append(f"{base} base ({dtype.replace('float32', 'fp32')})")
    if spec.get("chunked_loss"):
        parts.append("chunked loss")
    if spec.get("torch_compile"):
        parts.append(("regional torch.compile" if spec.get("torch_compile_regional")
                      else "torch.compile")
                     + (f" ({spec['torch_compile_mode']})" if spec.get("torch_compile_mode")
                        else ""))
    if spec.get("trl_loss"):
        parts.append("TRL SFT loss")
    if spec.get("attn_implementation") == "eager":
        parts.append("eager")
    return " ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="analytic,simulate")
    ap.add_argument("--measure", action="store_true", help="measure again instead of reusing")
    ap.add_argument("--names", default=None, help="comma-separated subset of spec names")
    ap.add_argument("--out", default=str(RESULTS / "accuracy"))
    ap.add_argument("--merge", action="store_true",
                    help="with --names: keep the other configs' rows of OUT.json and "
                         "rewrite the summary, table and plot from all of them")
    args = ap.parse_args(argv)

    from configs import CONFIGS

    from autofit.api import METHODS

    methods = [m for m in args.methods.split(",") if m in METHODS]
    specs = CONFIGS
    if args.names:
        wanted = set(args.names.split(","))
        specs = [s for s in CONFIGS if s["name"] in wanted]
    measured_path = RESULTS / "measured.json"
    if args.measure or not measured_path.exists():
        from measure_cpu import measure

        from autofit.probe.device import cpu_capability, cpu_vendor

        measured = {}
        for i, spec in enumerate(specs, 1):
            print(f"[{i}/{len(specs)}] measuring {spec['name']}", flush=True)
            # the instruction set it ran on: the math libraries' caches differ by it
            measured[spec["name"]] = {**measure(spec), "cpu": cpu_capability(),
                                      "vendor": cpu_vendor()}
        if args.names and measured_path.exists():  # the others' measurements kept
            kept = {r["name"]: r for r in json.loads(measured_path.read_text())}
            measured = {**kept, **measured}
        measured_path.write_text(json.dumps(list(measured.values()), indent=1))
    else:
        measured = {r["name"]: r for r in json.loads(measured_path.read_text())}

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for spec in specs:
            m = measured.get(spec["name"])
            if m is None:
                print(f"no measurement for {spec['name']}; run with --measure", file=sys.stderr)
                continue
            truth = m["peak_bytes"] + m["weights_bytes"]
            row = {"name": spec["name"], "model": spec["model_type"], "task": spec["task"],
                   "shape": f"{spec['batch']}x{spec['seq']}", "what": _describe(spec),
                   "measured": truth, "measured_phases": m.get("phase_peaks")}
            for method in methods:
                est, secs = _estimate_on(m.get("cpu", "AVX2"), spec, method, Path(d),
                                          m.get("vendor"))
                row[method] = est.peak_allocated_bytes
                row[f"{method}_err"] = (est.peak_allocated_bytes - truth) / truth
                row[f"{method}_phase"] = est.peak_phase
                row[f"{method}_s"] = secs
            rows.append(row)
            print(f"{row['name']:<30} measured {truth / 2**20:8.1f} MiB  " + "  ".join(
                f"{m_} {row[m_] / 2**20:8.1f} ({100 * row[m_ + '_err']:+.1f}%)" for m_ in methods),
                flush=True)

    out = Path(args.out)
    if args.merge and out.with_suffix(".json").exists():
        fresh = {r["name"]: r for r in rows}
        kept = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
        rows = [fresh.get(s["name"], kept.get(s["name"])) for s in CONFIGS]
        rows = [r for r in rows if r is not None and all(m in r for m in methods)]
    summary = {}
    for method in methods:
        errs = [abs(r[f"{method}_err"]) for r in rows]
        times = [r[f"{method}_s"] for r in rows]
        med_t, worst_t = TARGETS[method]
        summary[method] = {
            "n": len(errs),
            "median_abs_error": statistics.median(errs),
            "max_abs_error": max(errs),
            "median_seconds": statistics.median(times),
            "target_median": med_t,
            "target_max": worst_t,
            "meets_target": statistics.median(errs) <= med_t and max(errs) <= worst_t,
        }
    out.with_suffix(".json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    _write_markdown(out.with_suffix(".md"), rows, summary, methods)
    _plot(out.with_suffix(".png"), rows, methods)
    for method, s in summary.items():
        print(f"{method}: n={s['n']} median |err| {100 * s['median_abs_error']:.1f}% "
              f"max {100 * s['max_abs_error']:.1f}% (target {100 * s['target_median']:.0f}% / "
              f"{100 * s['target_max']:.0f}%) median time {1000 * s['median_seconds']:.0f} ms")
    return 0


def _write_markdown(path: Path, rows, summary, methods) -> None:
    lines = [
        "# Estimate accuracy on this machine (CPU)",
        "",
        "Measured = peak resident memory of an isolated process around real training steps",
        "(`benchmarks/measure_cpu.py`, shares no code with autofit) + the weights it held before",
        "its baseline. Predicted = `autofit.estimate(..., device=\"cpu\").peak_allocated_bytes`.",
        "Error = (predicted − measured) / measured. Produced by `python benchmarks/accuracy.py`.",
        "",
        "NB: the estimates include the CPU math libraries' buffer caches (MKL, oneDNN; up to",
        "~14 MiB, created by the first full-size step and kept). A `torch.compile` row's",
        "measurement does not: its warm-up runs at the measured shape, before the baseline, so",
        "those rows read high by the cache (llamas-b4s256-gc-compile: ~14 MiB of its +8-10%).",
        "",
        "| method | configs | median abs error | max abs error | target (median / max) | met | median time per estimate |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, s in summary.items():
        lines.append(f"| {m} | {s['n']} | {100 * s['median_abs_error']:.1f}% | "
                     f"{100 * s['max_abs_error']:.1f}% | {100 * s['target_median']:.0f}% / "
                     f"{100 * s['target_max']:.0f}% | {'yes' if s['meets_target'] else 'NO'} | "
                     f"{1000 * s['median_seconds']:.0f} ms |")
    lines += ["", "| config | model | task | B×T | precision, optimizer, options | measured MiB | "
              + " | ".join(f"{m} MiB (error)" for m in methods) + " |",
              "|---|---|---|---|---|---|" + "---|" * len(methods)]
    for r in rows:
        cells = [f"{r[m] / 2**20:.1f} ({100 * r[m + '_err']:+.1f}%)" for m in methods]
        lines.append(f"| {r['name']} | {r['model']} | {r['task']} | {r['shape']} | {r['what']} | "
                     f"{r['measured'] / 2**20:.1f} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def _plot(path: Path, rows, methods) -> None:
    from plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 6))
    meas = [r["measured"] / 2**20 for r in rows]
    for m, marker in zip(methods, ["o", "x"], strict=False):
        ax.scatter(meas, [r[m] / 2**20 for r in rows], label=m, marker=marker, alpha=0.8)
    lo, hi = min(meas) * 0.8, max(meas) * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="exact")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey",
                    alpha=0.15, label="±10%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured peak (MiB, isolated process RSS)")
    ax.set_ylabel("predicted peak allocated (MiB)")
    ax.set_title("autofit estimate vs measured training-step peak (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
