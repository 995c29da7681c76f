"""Terminal output: the memory breakdown box, with rich.

    >>> from autofit import estimate, TrainConfig
    >>> from autofit.report import render_estimate
    >>> text = render_estimate(estimate("tiny-llama", TrainConfig(), seq_len=128))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.memory.breakdown import COMPONENTS
from autofit.probe.device import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console, RenderableType

    from autofit.memory.breakdown import MemoryEstimate

__all__ = ["estimate_renderable", "render_estimate", "print_estimate"]

_COLORS = {
    "weights": "blue",
    "gradients": "magenta",
    "optimizer_states": "yellow",
    "activations": "green",
    "temporaries": "cyan",
    "overhead": "bright_black",
}
_BAR = 32


def estimate_renderable(est: MemoryEstimate) -> RenderableType:
    """A rich Panel: one bar per component, bytes, bytes/param, and the verdict."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    total = max(est.device_total_bytes, 1)
    params = max(est.num_params, 1)
    table = Table(box=None, pad_edge=False, show_header=True, header_style="bold")
    table.add_column("component")
    table.add_column("", no_wrap=True)
    table.add_column("bytes", justify="right")
    table.add_column("B/param", justify="right")
    table.add_column("share", justify="right")
    for name in COMPONENTS:
        b = est.breakdown.get(name, 0)
        n = round(_BAR * b / total)
        bar = Text("█" * n + "·" * (_BAR - n), style=_COLORS[name])
        table.add_row(name, bar, format_bytes(b), f"{b / params:.2f}", f"{100 * b / total:.1f}%")
    table.add_row("", "", "", "", "")
    table.add_row("peak allocated", "", format_bytes(est.peak_allocated_bytes), "", "")
    table.add_row("peak reserved", "", format_bytes(est.peak_reserved_bytes), "", "")
    table.add_row(Text("device total", style="bold"), "", Text(format_bytes(est.device_total_bytes), style="bold"), "", "")
    table.add_row("capacity", "", format_bytes(est.capacity_bytes), "", "")
    head = est.headroom_bytes
    pct = 100 * head / max(est.capacity_bytes, 1)
    if est.fits:
        verdict = Text(f"fits on {est.device}: {format_bytes(head)} headroom ({pct:.1f}%)", style="bold green")
    else:
        verdict = Text(
            f"does NOT fit on {est.device}: {format_bytes(-head)} over ({-pct:.1f}%)", style="bold red"
        )
    cfg = est.config
    title = (
        f"{est.model} · batch {cfg.get('micro_batch_size')} × seq {est.seq_len} · "
        f"{cfg.get('precision')} · {cfg.get('optimizer')}"
        + (" · checkpointing" if cfg.get("gradient_checkpointing") else "")
    )
    from rich.console import Group

    parts: list = [table, Text(""), verdict]
    subtitle = f"{est.method} estimate · peak in {est.peak_phase} · {est.num_params / 1e6:,.1f}M params ({est.trainable_params / 1e6:,.1f}M trainable)"
    for note in est.notes:
        parts.append(Text(f"note: {note}", style="dim"))
    return Panel(Group(*parts), title=title, subtitle=subtitle, expand=False)


def render_estimate(est: MemoryEstimate, width: int = 100) -> str:
    """The breakdown box as plain text."""
    from rich.console import Console

    console = Console(width=width, record=True, file=_Null(), color_system=None)
    console.print(estimate_renderable(est))
    return console.export_text()


def print_estimate(est: MemoryEstimate, console: Console | None = None) -> None:
    from rich.console import Console

    (console or Console()).print(estimate_renderable(est))


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass
