"""Published single-GPU training memory next to autofit's estimates (autofit issue 25, item 3).

Each row of ``benchmarks/published_gpu.json`` is a number somebody else measured while
training a transformers architecture on one GPU, with the setup the source states. For
every row this writes the model's config (``{"model_type": ..., **model_config}``) to a
temp dir, as ``benchmarks/accuracy.py`` does, and runs::

    autofit.estimate(config_path, TrainConfig(micro_batch_size=B, grad_accum_steps=A,
                     precision=P, gradient_checkpointing=G, optimizer=O, torch_compile=C),
                     seq_len=T, device=row["autofit_device"], method=m, task=...,
                     attn_implementation=..., lora=LoraSpec(...) | None,
                     quantization_config=... | None)

for m in ("analytic", "simulate"), then compares the estimate's field that matches the
source's metric (``row["compare_to"]``): ``device_total_bytes`` for nvidia-smi / NVML,
``peak_reserved_bytes`` for ``memory_reserved``, ``peak_allocated_bytes`` for
``max_memory_allocated`` (or torchtune's peak active bytes).
``error = (estimate - reported) / reported``: negative is an underestimate. A row autofit
refuses shows the refusal's first line; simulate is cut off after 120 s a row.

    python benchmarks/published_gpu.py                          # all rows, both methods
    python benchmarks/published_gpu.py --methods analytic       # seconds
    python benchmarks/published_gpu.py --ids hf-bert-large-b4-fp32 --out /tmp/x.md

Writes ``benchmarks/results/published_gpu.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
DATA = HERE / "published_gpu.json"
OUT = HERE / "results" / "published_gpu.md"
METHODS = ("analytic", "simulate")
UNITS = {"MiB": 2**20, "GiB": 2**30, "MB": 1e6, "GB": 1e9}
FIELDS = {"device_total": "device_total_bytes", "peak_reserved": "peak_reserved_bytes",
          "peak_allocated": "peak_allocated_bytes"}
SIMULATE_LIMIT_S = 120
TOP = 5


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def estimate_row(row: dict[str, Any], method: str, tmp: Path) -> tuple[float | None, str, float]:
    """(estimate in the row's unit or None, a note, seconds) for one row and method."""
    from accuracy import lora_spec

    from autofit import TrainConfig, estimate

    path = tmp / f"{row['id']}.json"
    path.write_text(json.dumps({"model_type": row["model_type"], **row["model_config"]}))
    lora = lora_spec(row.get("lora"))
    config = TrainConfig(micro_batch_size=row["micro_batch"],
                         grad_accum_steps=row.get("grad_accum_steps", 1),
                         precision=row["precision"],
                         gradient_checkpointing=row.get("gradient_checkpointing") == "full",
                         optimizer=row.get("estimated_optimizer", row["optimizer"]),
                         torch_compile=bool(row.get("torch_compile", False)),
                         torch_compile_regional=bool(row.get("torch_compile_regional", False)))
    limit = SIMULATE_LIMIT_S if method == "simulate" else 0
    t = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit)
    try:
        with _stack(row.get("stack", {})):
            est = estimate(str(path), config, seq_len=row["seq_len"], device=device_of(row),
                           method=method, task=row["task"],
                           attn_implementation=row.get("attn_implementation"), lora=lora,
                           quantization_config=row.get("quantization_config"))
    except _Timeout:
        return None, f"skipped: over {SIMULATE_LIMIT_S} s", time.perf_counter() - t
    except Exception as e:  # a refusal (AutofitError) or a crash: shown, not raised
        first = (str(e).strip().splitlines() or [""])[0]
        return None, f"{type(e).__name__}: {first[:160]}", time.perf_counter() - t
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    value = getattr(est, FIELDS[row["compare_to"]]) / UNITS[row["reported_unit"]]
    return value, est.peak_phase, time.perf_counter() - t


def device_of(row: dict[str, Any]) -> Any:
    """The row's card from autofit's catalog, with the CUDA context the source measured on
    its own stack where it states one (``context_mib``: CUDA 11 without lazy module
    loading held 1.3 GB where today's holds the catalog's few hundred MiB)."""
    import dataclasses

    from autofit.probe.device import resolve_device

    device = resolve_device(row["autofit_device"])
    if row.get("context_mib") is not None:
        device = dataclasses.replace(device, context_bytes=int(row["context_mib"] * 2**20))
    return device


@contextlib.contextmanager
def _stack(versions: dict[str, str]) -> Iterator[None]:
    """While inside, autofit sees the row's stated library versions as installed (a
    library's memory rule that depends on its version: bitsandbytes' 4-bit layers kept
    their inputs up to 0.43.1)."""
    from unittest import mock

    from autofit.probe import versions as installed

    real = installed.installed_version
    with mock.patch.object(installed, "installed_version",
                           lambda pkg: versions.get(pkg) or real(pkg)):
        yield


def setup_of(row: dict[str, Any]) -> str:
    """``b4x512 fp32 adamw_torch ga4 gc LoRA r8 [q_proj,v_proj] nf4``: what sizes the step."""
    optim = row["optimizer"]
    if row.get("estimated_optimizer"):
        optim += f" (as {row['estimated_optimizer']})"
    parts = [f"b{row['micro_batch']}x{row['seq_len']}", row["precision"], optim]
    if row.get("grad_accum_steps", 1) > 1:
        parts.append(f"ga{row['grad_accum_steps']}")
    if row.get("gradient_checkpointing") == "full":
        parts.append("gc")
    if row.get("attn_implementation"):
        parts.append(row["attn_implementation"])
    if row.get("torch_compile"):
        parts.append("regional compile" if row.get("torch_compile_regional") else "compile")
    if row.get("context_mib") is not None:
        parts.append(f"context {row['context_mib']} MiB")
    if row.get("lora"):
        tm = row["lora"]["target_modules"]
        parts.append(f"LoRA r{row['lora']['r']} [{tm if isinstance(tm, str) else ','.join(tm)}]")
    qc = row.get("quantization_config")
    if qc:
        parts.append(qc.get("bnb_4bit_quant_type", row["quantization"])
                     + ("-dq" if qc.get("bnb_4bit_use_double_quant") else ""))
    return " ".join(parts)


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def summary(rows: list[dict[str, Any]], methods: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for m in methods:
        errs = [(r[f"{m}_err"], r["id"]) for r in rows if r.get(f"{m}_err") is not None]
        if not errs:
            out[m] = {"n": 0}
            continue
        worst = max(errs, key=lambda e: abs(e[0]))
        out[m] = {"n": len(errs), "median_abs": statistics.median(abs(e) for e, _ in errs),
                  "worst": worst, "under_5": sum(e < -0.05 for e, _ in errs),
                  "refused": sum(r.get(f"{m}_err") is None for r in rows)}
    return out


def write_markdown(path: Path, data: dict[str, Any], rows: list[dict[str, Any]],
                   methods: list[str]) -> None:
    srcs = sorted({r["source_url"] for r in rows})
    lines = ["# Published single-GPU training memory vs autofit", "",
             f"{len(rows)} rows from {len(srcs)} sources (`benchmarks/published_gpu.json`; "
             "setups, quotes and notes there). Each estimate is the field matching the source's "
             "metric: nvidia-smi -> `device_total_bytes` (context included), "
             "`memory_reserved` -> `peak_reserved_bytes`, `max_memory_allocated` / peak active "
             "-> `peak_allocated_bytes`. Error = (estimate - reported) / reported; negative = "
             "underestimate. Values in the source's unit (MiB/GiB binary, GB = 1e9 B).",
             "", "Produced by `python benchmarks/published_gpu.py`.", "", "## Summary", "",
             "| method | rows | median abs error | worst | under -5% | refused/skipped |",
             "|---|---|---|---|---|---|"]
    matched = [r for r in rows if not r.get("likely_gap")]
    for label, subset in (("", rows), (" (no known gap)", matched)):
        for m, s in summary(subset, methods).items():
            if not s["n"]:
                lines.append(f"| {m}{label} | 0 | | | | {len(subset)} |")
                continue
            lines.append(f"| {m}{label} | {s['n']} | {100 * s['median_abs']:.1f}% | "
                         f"{_pct(s['worst'][0])} ({s['worst'][1]}) | {s['under_5']} | "
                         f"{s['refused']} |")
    lines += ["", "'no known gap': the rows whose `likely_gap` is empty, i.e. no framework or "
              "library-version difference from the estimated transformers step is known."]
    lines += ["", "## Rows", "",
              "| id | model | GPU (autofit) | setup | metric | reported | "
              + " | ".join(f"{m} | err" for m in methods) + " |",
              "|" + "---|" * (6 + 2 * len(methods))]
    for r in rows:
        cells = [r["id"], r["model"].split(" (")[0], f"{r['gpu']} ({r['autofit_device']})",
                 setup_of(r), r["compare_to"], f"{r['reported_value']:g} {r['reported_unit']}"]
        for m in methods:
            v = r.get(m)
            cells += [f"{v:.2f}" if v is not None else r.get(f"{m}_note", ""),
                      _pct(r.get(f"{m}_err"))]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    lines += ["", "Sources:", ""] + [f"- {u}" for u in srcs]
    lines += ["", "## Skipped", ""]
    lines += [f"- {s['source']} ({s['source_url']}): {s['reason']}" for s in data.get("skipped", [])]
    lines += ["", "## Notes", "",
              f"The {TOP} rows with the largest error (either method), and what the measured run "
              "holds or counts that the estimate does not (`likely_gap` in the JSON; the row's "
              "`notes` give the source's full setup).", ""]
    def worst_err(r: dict[str, Any]) -> float:
        return max((abs(r[f"{m}_err"]) for m in methods if r.get(f"{m}_err") is not None),
                   default=-1.0)
    for r in sorted(rows, key=worst_err, reverse=True)[:TOP]:
        errs = ", ".join(f"{m} {_pct(r.get(f'{m}_err'))}" for m in methods)
        lines.append(f"- **{r['id']}** ({errs}): {r.get('likely_gap') or r['notes']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--ids", nargs="+", help="only these rows")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # a shared machine: fake tensors need no parallelism
    data = json.loads(DATA.read_text())
    rows = [dict(r) for r in data["rows"] if not args.ids or r["id"] in args.ids]
    with tempfile.TemporaryDirectory() as d:
        for r in rows:
            for m in args.methods:
                v, note, secs = estimate_row(r, m, Path(d))
                r[m], r[f"{m}_note"], r[f"{m}_s"] = v, note, secs
                r[f"{m}_err"] = None if v is None else (v - r["reported_value"]) / r["reported_value"]
            print(f"{r['id']:<40} reported {r['reported_value']:>8g} {r['reported_unit']:<3} " + "  ".join(
                f"{m} " + (f"{r[m]:8.2f} ({_pct(r[f'{m}_err'])}, {r[f'{m}_s']:.0f}s)"
                           if r[m] is not None else r[f"{m}_note"]) for m in args.methods),
                flush=True)
    write_markdown(Path(args.out), data, rows, args.methods)
    for m, s in summary(rows, args.methods).items():
        if s["n"]:
            print(f"{m}: n={s['n']} median |err| {100 * s['median_abs']:.1f}% worst "
                  f"{_pct(s['worst'][0])} ({s['worst'][1]}) under -5%: {s['under_5']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
