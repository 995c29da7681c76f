"""Reports people can look at: a PNG chart and a self-contained HTML page.

    from autofit.report.files import report_data_from_file, write_report
    png, html = write_report(report_data_from_file("tuned.yaml"))   # tuned.png, tuned.html

The chart (matplotlib's Agg canvas, no display needed) has three panels: the memory of the chosen configuration (the
estimate's components stacked, the measured peak beside it, the capacity and the
budget the margin leaves), and the candidates tried — micro batch against peak
memory and against throughput (estimates hollow, measurements filled, out of
memory marked with a red x). The HTML page inlines the PNG (base64) with the
tables behind it and the reasons: no external asset, one file to attach or mail.

The data come from a ``FitResult`` (``FitResult.report()``) or from the metadata
line of a file it saved (``autofit report tuned.yaml``); a file saved before the
candidates and trials were recorded there still gives the breakdown panel.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.knobs import KNOBS
from autofit.memory.breakdown import COMPONENTS, Component, MemoryEstimate
from autofit.probe.device import format_bytes
from autofit.report.terminal import calibration_text

__all__ = ["ReportData", "report_data_from_result", "report_data_from_file", "write_report",
           "trial_summary"]

_COLORS = {  # the terminal box's colours, as matplotlib names
    Component.WEIGHTS: "tab:blue",
    Component.GRADIENTS: "tab:pink",
    Component.OPTIMIZER_STATES: "gold",
    Component.ACTIVATIONS: "tab:green",
    Component.TEMPORARIES: "tab:cyan",
    Component.OVERHEAD: "tab:gray",
}
_GiB = float(1 << 30)


@dataclass(frozen=True)
class ReportData:
    """What a report shows; built from a FitResult or a saved file's metadata."""

    model: str
    device: str
    estimate: MemoryEstimate
    config: dict[str, Any]
    training_arguments: dict[str, Any]
    margin: float | None = None
    confirmed: bool = False
    from_cache: bool = False
    seq_len: int | None = None
    reasons: tuple[str, ...] = ()
    candidates: tuple[dict[str, Any], ...] = ()
    trials: tuple[dict[str, Any], ...] = ()
    eval_micro_batch: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def trial_summary(t: object) -> dict[str, Any]:
    """The few fields of a TrialResult (object or dict) a report draws."""
    d = t.to_dict() if hasattr(t, "to_dict") else dict(t)
    c = d.get("config") or {}
    return {
        **{k.name: c.get(k.name) for k in KNOBS},
        "micro_batch": c.get("micro_batch_size"),
        "grad_accum": c.get("grad_accum_steps"),
        "oom": bool(d.get("oom")),
        "device_total_bytes": d.get("device_total_bytes"),
        "tokens_per_s": d.get("tokens_per_s"),
        "step_time_s": d.get("step_time_s"),
        "error": d.get("error"),
        **({"per_rank": [{"rank": r.get("rank"), "oom": bool(r.get("oom")),
                          "device_total_bytes": r.get("device_total_bytes")}
                         for r in d["per_rank"]]} if d.get("per_rank") else {}),
    }


def estimate_from_dict(d: dict[str, object], **defaults: Any) -> MemoryEstimate:
    """A MemoryEstimate from ``to_dict()`` output; fields missing from older files are filled."""
    from dataclasses import fields

    names = {f.name for f in fields(MemoryEstimate)}
    kw = {k: v for k, v in d.items() if k in names}
    for k, v in defaults.items():
        kw.setdefault(k, v)
    kw.setdefault("breakdown", {})
    kw.setdefault("peak_reserved_bytes", kw.get("peak_allocated_bytes", 0))
    kw.setdefault("peak_allocated_bytes", kw.get("peak_reserved_bytes", 0))
    kw.setdefault("device_total_bytes", sum(kw["breakdown"].values()))
    kw.setdefault("capacity_bytes", 0)
    kw.setdefault("fits", kw["device_total_bytes"] <= kw["capacity_bytes"])
    kw.setdefault("method", "analytic")
    kw.setdefault("device", "")
    kw.setdefault("peak_phase", "unknown")
    kw["notes"] = tuple(kw.get("notes", ()))
    return MemoryEstimate(**kw)


def report_data_from_result(result: Any) -> ReportData:
    """ReportData of a ``FitResult``."""
    meta = result.meta or {}
    return ReportData(
        model=str(meta.get("model") or result.estimate.model),
        device=result.device,
        estimate=result.estimate,
        config=result.config.to_dict(),
        training_arguments=dict(result.training_arguments_kwargs),
        margin=meta.get("margin"),
        confirmed=result.confirmed,
        from_cache=result.from_cache,
        seq_len=meta.get("seq_len"),
        reasons=tuple(result.reasons),
        candidates=tuple(result.candidates),
        trials=tuple(trial_summary(t) for t in result.trials),
        eval_micro_batch=getattr(result, "eval_micro_batch", None),
    )


def report_data_from_file(path: str | Path) -> ReportData:
    """ReportData from a file ``FitResult.save`` wrote (its ``# autofit:`` metadata).

    Raises:
        BadInputError: unreadable file, or one without autofit's metadata.
    """
    from autofit.emit import read_config
    from autofit.errors import BadInputError

    args, meta = read_config(path)
    if not meta.get("estimate") or not meta.get("config"):
        raise BadInputError(f"{path} has no autofit metadata (estimate, config): write it with "
                            "`autofit tune ... -o` or FitResult.save")
    est = estimate_from_dict(meta["estimate"], device=meta.get("device", ""),
                             model=str(meta.get("model", "")), seq_len=meta.get("seq_len") or 0,
                             config=meta["config"])
    return ReportData(
        model=str(meta.get("model", "")),
        device=str(meta.get("device", est.device)),
        estimate=est,
        config=meta["config"],
        training_arguments=args,
        margin=meta.get("margin"),
        confirmed=bool(meta.get("confirmed")),
        seq_len=meta.get("seq_len"),
        reasons=tuple(meta.get("reasons", ())),
        candidates=tuple(meta.get("candidates", ())),
        trials=tuple(meta.get("trials", ())),
        eval_micro_batch=meta.get("eval_micro_batch") or args.get("per_device_eval_batch_size"),
    )


# ---------------------------------------------------------------- the chart

# One (colour, marker) per combination, the same in every panel: ten colours and twelve
# markers, so that twelve combinations never share both.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "p", "<", ">")


def _combo(r: dict[str, object]) -> tuple[Any, ...]:
    """A row's (or trial's) combination: each knob's value (checkpointing as a bool)."""
    return tuple(bool(r.get(k.name)) if isinstance(k.values[0], bool) else r.get(k.name)
                 for k in KNOBS)


def _combo_label(key: tuple[object, ...]) -> str:
    # a yes/no knob reads by its title ("ckpt" / "no ckpt"); one with its own words by them
    return ", ".join(k.short(v) if not isinstance(v, bool) or k.short(True) != "yes"
                     else (k.title if v else f"no {k.title}")
                     for k, v in zip(KNOBS, key, strict=True) if v is not None)


def combo_styles(keys: list[tuple[object, ...]]) -> dict[tuple[Any, ...], tuple[Any, str]]:
    """``{combination: (colour, marker)}``: distinct pairs for up to 120 combinations."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {k: (cmap(i % 10), _MARKERS[i % len(_MARKERS)]) for i, k in enumerate(keys)}


def _figure(data: ReportData) -> Any:
    """The three panels as a matplotlib ``Figure`` (Agg canvas; no pyplot, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    est = data.estimate
    cap = est.capacity_bytes / _GiB
    keys = list(dict.fromkeys([_combo(r) for r in data.candidates]
                              + [_combo(t) for t in data.trials]))
    style = combo_styles(keys)
    fig = Figure(figsize=(16, 6.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.0, 1.3, 1.3]})
    _draw_breakdown(axes[0], data, cap)
    for ax, what in ((axes[1], "peak"), (axes[2], "throughput")):
        _draw_candidates(ax, data, what, keys, style, cap)
    # one legend for the combinations of both candidate panels, outside them (below)
    handles = [_combo_handle(style[k], _combo_label(k)) for k in keys]
    handles.append(_combo_handle(("black", "o"), "estimate (hollow, before trials)", hollow=True))
    if any(t.get("oom") for t in data.trials):
        handles.append(_combo_handle(("tab:red", "x"), "out of memory (needs > capacity)"))
    if keys:
        fig.legend(handles=handles, loc="outside lower right", ncol=min(4, len(handles)),
                   fontsize=8, frameon=False)
    fig.suptitle(f"autofit: {data.model} on {data.device}"
                 + (f" · seq {data.seq_len}" if data.seq_len else ""), fontsize=12)
    return fig


def _combo_handle(style: tuple[object, str], label: str, hollow: bool = False) -> Any:
    from matplotlib.lines import Line2D

    colour, marker = style
    return Line2D([], [], color=colour, marker=marker, linestyle="none", markersize=8,
                  markerfacecolor="none" if hollow else colour, label=label)


def _draw_breakdown(ax: Any, data: ReportData, cap: float) -> None:
    """Panel 1: the chosen configuration's memory, stacked by component, the measured peak
    beside it, the capacity and the budget; the legend below the axes, off the bars."""
    est = data.estimate
    bottom = 0.0
    for name in COMPONENTS:
        v = est.breakdown.get(name, 0) / _GiB
        if v > 0:
            ax.bar(["estimate"], [v], bottom=[bottom], color=_COLORS[name], label=name,
                   edgecolor="white", linewidth=0.5)
        bottom += v
    chosen = _combo(data.config)
    measured = [t for t in data.trials if _combo(t) == chosen
                and t.get("micro_batch") == data.config.get("micro_batch_size")
                and not t.get("oom") and t.get("device_total_bytes")]
    ax.text(0, bottom, format_bytes(est.device_total_bytes), ha="center", va="bottom",
            fontsize=9)
    if measured:
        m = measured[-1]["device_total_bytes"]
        ax.bar(["measured"], [m / _GiB], color="dimgray", label="measured peak")
        ax.text(1, m / _GiB, format_bytes(m), ha="center", va="bottom", fontsize=9)
    if cap > 0:
        ax.axhline(cap, color="tab:red", linestyle="--", linewidth=1.5,
                   label=f"capacity {format_bytes(est.capacity_bytes)}")
        if data.margin:
            ax.axhline(cap * (1 - data.margin), color="tab:orange", linestyle=":", linewidth=1.5,
                       label=f"budget (margin {data.margin:.0%})")
    c = data.config
    ax.set_title(f"chosen: micro batch {c.get('micro_batch_size')} x accum "
                 f"{c.get('grad_accum_steps')}\n{_combo_label(chosen)}", fontsize=10)
    ax.set_ylabel("GiB")
    ax.set_ylim(0, max(cap, bottom, *(m["device_total_bytes"] / _GiB for m in measured)) * 1.15
                or 1)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2,
              frameon=False)


def _draw_candidates(ax: Any, data: ReportData, what: str, keys: list[tuple[object, ...]],
                     style: dict[tuple[object, ...], tuple[object, str]], cap: float) -> None:
    """Panels 2 and 3: micro batch against peak memory or throughput, per combination:
    estimates hollow, trials filled and joined, out of memory a red x."""
    for k in keys:
        colour, marker = style[k]
        xs, ys = [], []
        for r in data.candidates:
            v = r.get("estimate_bytes") if what == "peak" else r.get("predicted_tokens_per_s")
            if _combo(r) == k and r.get("micro_batch") and v:
                xs.append(r["micro_batch"])
                ys.append(v / _GiB if what == "peak" else v)
        if xs:
            ax.scatter(xs, ys, facecolors="none", edgecolors=[colour], s=70, marker=marker)
        ok = [t for t in data.trials if _combo(t) == k and not t.get("oom") and t.get("micro_batch")]
        pts = sorted((t["micro_batch"], (t.get("device_total_bytes") or 0) / _GiB
                      if what == "peak" else (t.get("tokens_per_s") or 0)) for t in ok)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle="-",
                    color=colour, ms=6)
        ooms = [t["micro_batch"] for t in data.trials if _combo(t) == k and t.get("oom")
                and t.get("micro_batch")]
        if ooms:
            y = cap if what == "peak" else 0.0
            ax.scatter(ooms, [y] * len(ooms), marker="x", color="tab:red", s=90,
                       linewidths=2.5, zorder=5)
    if what == "peak" and cap > 0:
        ax.axhline(cap, color="tab:red", linestyle="--", linewidth=1.2)
        if data.margin:
            ax.axhline(cap * (1 - data.margin), color="tab:orange", linestyle=":", linewidth=1.2)
    ticks = sorted({int(r["micro_batch"]) for r in (*data.candidates, *data.trials)
                    if r.get("micro_batch")})
    if ticks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlim(ticks[0] / 1.5, ticks[-1] * 1.5)
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("micro batch")
    ax.set_ylabel("GiB (device total)" if what == "peak" else "tokens / s")
    ax.set_title("candidates: micro batch vs " + ("peak memory" if what == "peak"
                                                 else "throughput"), fontsize=10)
    ax.grid(True, alpha=0.3)
    if not keys:
        ax.text(0.5, 0.5, "no candidates recorded", ha="center", va="center",
                transform=ax.transAxes, color="gray")


def _draw(data: ReportData) -> bytes:
    buf = io.BytesIO()
    _figure(data).savefig(buf, format="png")
    return buf.getvalue()


# ---------------------------------------------------------------- the page


def _table(headers: list[str], rows: list[list[object]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(v: object, kind: str) -> str:
    if v is None or v == "":
        return "—"
    if kind == "b":
        return format_bytes(v)
    if kind == "t":
        return f"{v:,.0f}"
    return str(v)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em;color:#222;
max-width:1200px}h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:left}th{background:#f3f3f3}tr.chosen td{font-weight:bold;background:#eef8ee}
img{max-width:100%;border:1px solid #ddd}.fits{color:#1a7f37}.nofit{color:#b42318}
code{background:#f3f3f3;padding:0 .2em}
"""


def _knob_cells(r: dict[str, object]) -> list[str]:
    return [k.short(v) if (v := r.get(k.name)) is not None else "—" for k in KNOBS]


def _page(data: ReportData, png: bytes) -> str:
    e = html.escape
    est = data.estimate
    total = max(est.device_total_bytes, 1)
    state = ("answered from the cache" if data.from_cache else
             "confirmed on the device" if data.confirmed else
             "UNCONFIRMED: planned by simulating the step" if est.method == "simulate" else
             "UNCONFIRMED: planned from the estimate")
    verdict = (f"<span class='fits'>fits: {e(format_bytes(est.headroom_bytes))} headroom</span>"
               if est.fits else
               f"<span class='nofit'>does not fit: {e(format_bytes(-est.headroom_bytes))} over</span>")
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>autofit report: {e(data.model)} on {e(data.device)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>autofit report: {e(data.model)} on {e(data.device)}</h1>",
        f"<p>{e(state)} · estimate {e(format_bytes(est.device_total_bytes))} of "
        f"{e(format_bytes(est.capacity_bytes))} · {verdict}</p>",
        "<img alt='memory breakdown and candidates' src='data:image/png;base64,"
        + base64.b64encode(png).decode("ascii") + "'>",
        "<h2>Chosen configuration (TrainingArguments)</h2>",
        _table(["field", "value"], [[k, v] for k, v in data.training_arguments.items()]),
        "<h2>Memory breakdown (estimate)</h2>",
        _table(["component", "bytes", "share"],
               [[n, format_bytes(est.breakdown.get(n, 0)),
                 f"{100 * est.breakdown.get(n, 0) / total:.1f}%"] for n in COMPONENTS]
               + [["peak allocated", format_bytes(est.peak_allocated_bytes), ""],
                  ["peak reserved", format_bytes(est.peak_reserved_bytes), ""],
                  ["device total", format_bytes(est.device_total_bytes), "100%"],
                  ["capacity", format_bytes(est.capacity_bytes), ""]]),
    ]
    if data.eval_micro_batch:
        parts.append(f"<p>evaluation batch: <code>per_device_eval_batch_size = "
                     f"{int(data.eval_micro_batch)}</code> (tuned apart from training)</p>")
    if data.candidates:
        chosen = _combo(data.config)
        rows = []
        for r in data.candidates:
            rows.append([*_knob_cells(r), _fmt(r.get("micro_batch"), ""),
                         _fmt(r.get("estimate_bytes"), "b"), calibration_text(r.get("calibration")),
                         _fmt(r.get("measured_bytes"), "b"),
                         _fmt(r.get("predicted_tokens_per_s"), "t"),
                         _fmt(r.get("measured_tokens_per_s"), "t"),
                         ("CHOSEN" if _combo(r) == chosen else r.get("status", ""))
                         + (f": {r['reason']}" if r.get("reason") else "")])
        parts += ["<h2>Candidates</h2>",
                  _table([*(k.title for k in KNOBS), "micro", "est. peak (before trials)",
                          "calibration", "measured", "pred. tok/s", "meas. tok/s", "verdict"],
                         rows)]
    if data.trials:
        rows = [[i, *_knob_cells(t), _fmt(t.get("micro_batch"), ""), _fmt(t.get("grad_accum"), ""),
                 "OUT OF MEMORY" if t.get("oom") else _fmt(t.get("device_total_bytes"), "b"),
                 _fmt(t.get("tokens_per_s"), "t"), t.get("error") or ""]
                for i, t in enumerate(data.trials, 1)]
        parts += ["<h2>Trials on the device</h2>",
                  _table(["#", *(k.title for k in KNOBS), "micro", "accum", "peak",
                          "tok/s", "error"], rows)]
    if data.reasons:
        parts.append("<h2>Reasons</h2><ul>"
                     + "".join(f"<li>{e(r)}</li>" for r in data.reasons) + "</ul>")
    if est.notes:
        parts.append("<h2>Notes</h2><ul>"
                     + "".join(f"<li>{e(n)}</li>" for n in est.notes) + "</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(data: ReportData, path: str | Path) -> tuple[Path, Path]:
    """Write ``<path stem>.png`` and ``<path stem>.html`` beside ``path``; return both paths."""
    p = Path(path)
    png_path = p.with_suffix(".png")
    html_path = p.with_suffix(".html")
    png_path.parent.mkdir(parents=True, exist_ok=True)
    png = _draw(data)
    png_path.write_bytes(png)
    html_path.write_text(_page(data, png), encoding="utf-8")
    return png_path, html_path
