"""The PEFT comparison as a terminal table (rich) and a picture (matplotlib, Agg).

``c`` is an ``autofit.compare.PeftComparison`` (not imported: the comparison sits
above the report in the flow).

    >>> from autofit.compare import compare_peft
    >>> c = compare_peft("tiny-llama", seq_len=64, device="cpu:2GiB", methods=["lora"],
    ...                  confirm_top=0)
    >>> "lora" in render_comparison(c)
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autofit.errors import BadInputError
from autofit.probe.device import format_bytes

__all__ = ["render_comparison", "print_comparison", "plot_comparison"]

_GiB = 2**30


def _params(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def comparison_renderable(c: object) -> Any:
    from rich.table import Table

    best = c.best
    t = Table(title=f"PEFT methods on {c.model} · {c.device} · seq {c.seq_len} · "
                    f"{c.config.precision}{', checkpointing' if c.config.gradient_checkpointing else ''}"
                    f" · fits = under {format_bytes(c.budget_bytes)}",
              title_justify="left")
    t.add_column("method")
    t.add_column("trainable", justify="right")
    t.add_column(f"peak @ micro {c.micro_batch_size}", justify="right")
    t.add_column("largest micro", justify="right")
    t.add_column("tokens/s (pred.)", justify="right")
    t.add_column("trial", justify="right")
    for r in c.rows:
        if r.error is not None:
            t.add_row(r.method, "-", "-", "-", "-", "[red]n/a[/] (below)")
            continue
        trial = "-"
        if r.measured_oom:
            trial = "[red]OOM[/]"
        elif r.measured_bytes is not None:
            tps = f", {r.measured_tokens_per_s:,.0f} tok/s" if r.measured_tokens_per_s else ""
            trial = f"[green]{format_bytes(r.measured_bytes)}[/]{tps}"
        name = f"[bold]{r.method}[/] ★" if best is not None and r is best else r.method
        peak = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-"
        if r.peak_bytes is not None and r.peak_bytes > c.budget_bytes:
            peak = f"[red]{peak}[/]"
        t.add_row(name, _params(r.trainable_params), peak,
                  str(r.max_micro_batch) if r.max_micro_batch else "[red]0[/]",
                  f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-", trial)
    return t


def render_comparison(c: object, width: int = 110) -> str:
    """The table as text (no colour codes)."""
    from rich.console import Console

    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(comparison_renderable(c))
    for line in _errors(c):
        console.print(line)
    return console.export_text()


def _errors(c: object) -> list[str]:
    return [f"n/a {r.method}: {r.error}" for r in c.rows if r.error is not None]


def print_comparison(c: object, png: Path | None = None) -> None:
    """Print the table (and where the picture is) to the terminal."""
    from rich.console import Console

    console = Console()
    console.print(comparison_renderable(c))
    for line in _errors(c):
        console.print(line, style="red", highlight=False)
    best = c.best
    if best is not None:
        console.print(f"fastest that fits: [bold]{best.method}[/] at micro batch "
                      f"{best.max_micro_batch}; autofit never switches the method itself — "
                      "train it with --peft-config (its config is in --json)")
    else:
        console.print("[red]no method fits[/]: try --gradient-checkpointing, a shorter "
                      "--seq-len or a 4-bit base (--load-in-4bit)")
    if png is not None:
        console.print(f"picture: {png}")


def plot_comparison(c: object, path: str | Path) -> Path:
    """Two panels: each method's estimated peak at the compared micro batch (with the
    device's budget and the trials' measurements), and its largest micro batch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out = Path(path)
    if out.suffix.lower() != ".png":
        raise BadInputError(f"the picture must be a .png file, got {out}")
    if out.is_dir() or not out.parent.exists():
        raise BadInputError(f"cannot write the picture to {out}: give a .png path in an "
                            "existing folder")
    rows = [r for r in c.rows if r.error is None]
    if not rows:
        raise BadInputError("no method could be estimated on this model: nothing to draw")
    names = [r.method for r in rows]
    y = list(range(len(rows)))
    fig = Figure(figsize=(12, 0.45 * len(rows) + 1.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2, sharey=True)
    peaks = [(r.peak_bytes or 0) / _GiB for r in rows]
    colours = ["tab:red" if (r.peak_bytes or 0) > c.budget_bytes else "tab:blue" for r in rows]
    ax1.barh(y, peaks, color=colours, alpha=0.8, label="estimate")
    measured = [(i, r.measured_bytes / _GiB) for i, r in enumerate(rows)
                if r.measured_bytes is not None]
    if measured:
        ax1.scatter([m for _, m in measured], [i for i, _ in measured], marker="D",
                    color="black", zorder=3, label="trial (at its largest micro batch)")
    ax1.axvline(c.budget_bytes / _GiB, color="tab:red", ls="--", lw=1,
                label=f"budget {format_bytes(c.budget_bytes)}")
    ax1.set_yticks(y, names)
    ax1.invert_yaxis()
    ax1.set_xlabel(f"device memory at micro batch {c.micro_batch_size} (GiB)")
    ax1.legend(fontsize=8, loc="lower right")
    mb = [r.max_micro_batch or 0 for r in rows]
    ax2.barh(y, mb, color="tab:green", alpha=0.8)
    for i, r in enumerate(rows):
        if r.tokens_per_s:
            ax2.text(mb[i], i, f" {r.tokens_per_s:,.0f} tok/s", va="center", fontsize=8)
    ax2.set_xlabel("largest micro batch that fits (predicted throughput)")
    fig.suptitle(f"PEFT methods on {c.model} · {c.device} · seq {c.seq_len} · "
                 f"{c.config.precision} · {c.method}", fontsize=11)
    try:
        fig.savefig(out)
    except OSError as e:
        raise BadInputError(f"cannot write the picture to {out}: {e.strerror or e}") from None
    return out
