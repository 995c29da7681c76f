"""Terminal output: the memory breakdown box, with rich.

    >>> from autofit import estimate, TrainConfig
    >>> from autofit.report import render_estimate
    >>> text = render_estimate(estimate("tiny-llama", TrainConfig(), seq_len=128))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.knobs import KNOBS, choice_of, describe_choice, is_choice
from autofit.memory.breakdown import COMPONENTS, Component
from autofit.probe.device import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console, RenderableType

    from autofit.memory.breakdown import MemoryEstimate

__all__ = ["estimate_renderable", "render_estimate", "print_estimate", "candidates_renderable",
           "calibration_text", "print_fit", "TrialProgress"]

_COLORS = {
    Component.WEIGHTS: "blue",
    Component.GRADIENTS: "magenta",
    Component.OPTIMIZER_STATES: "yellow",
    Component.ACTIVATIONS: "green",
    Component.TEMPORARIES: "cyan",
    Component.OVERHEAD: "bright_black",
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
    if est.run_device_total_bytes is not None:  # the whole run, replayed in its order
        frag = est.run_fragmentation_bytes or 0
        table.add_row("fragmentation over the run", "", format_bytes(frag), "",
                      f"+{100 * frag / total:.1f}%")
        table.add_row(Text("run device total", style="bold"), "",
                      Text(format_bytes(est.run_device_total_bytes), style="bold"), "", "")
    table.add_row("capacity", "", format_bytes(est.capacity_bytes), "", "")
    if est.host_bytes and est.per_rank:  # several ranks offloading: a node's host memory
        table.add_row("host per node", "", format_bytes(est.host_bytes), "", "")
    elif est.host_bytes:  # activation offloading: outside the device
        table.add_row("host (pinned)", "", format_bytes(est.host_bytes), "", "")
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
        + describe_choice({k.name: cfg[k.name] for k in KNOBS if k.name in cfg
                           and is_choice(k, cfg.get("loss_impl") or "model")}, sep=" · ")
        + (" · TRL's loss" if cfg.get("loss_impl") == "trl" else "")
    )
    from rich.console import Group

    parts: list = [table, Text(""), verdict]
    if est.per_rank:
        parts[1:1] = [Text(""), _ranks_table(est)]
    subtitle = f"{est.method} estimate · peak in {est.peak_phase} · {est.num_params / 1e6:,.1f}M params ({est.trainable_params / 1e6:,.1f}M trainable)"
    for note in est.notes:
        parts.append(Text(f"note: {note}", style="dim"))
    return Panel(Group(*parts), title=title, subtitle=subtitle, expand=False)


def _ranks_table(est: MemoryEstimate) -> Any:
    """Per-rank figures (several processes): the top-level ones above are the peaking
    rank's; ranks with the same figures share a row."""
    from rich.table import Table
    from rich.text import Text

    alike = len({r["device_total_bytes"] for r in est.per_rank}) == 1
    title = ("per rank: every rank alike" if alike
             else f"per rank: rank {est.peak_rank} peaks (its figures above)")
    table = Table(box=None, pad_edge=False, show_header=True, header_style="bold",
                  title=title, title_justify="left")
    table.add_column("ranks")
    table.add_column("peak allocated", justify="right")
    table.add_column("peak reserved", justify="right")
    table.add_column("device total", justify="right")
    table.add_column("host", justify="right")
    rows: list[tuple[list[int], dict[str, Any]]] = []
    for r in est.per_rank:
        key = (r["peak_allocated_bytes"], r["peak_reserved_bytes"], r["device_total_bytes"],
               r["host_bytes"])
        if rows and (rows[-1][1]["peak_allocated_bytes"], rows[-1][1]["peak_reserved_bytes"],
                     rows[-1][1]["device_total_bytes"], rows[-1][1]["host_bytes"]) == key:
            rows[-1][0].append(r["rank"])
        else:
            rows.append(([r["rank"]], r))
    for ranks, r in rows:
        name = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        style = "bold" if est.peak_rank in ranks else ""
        table.add_row(Text(name, style=style), format_bytes(r["peak_allocated_bytes"]),
                      format_bytes(r["peak_reserved_bytes"]),
                      Text(format_bytes(r["device_total_bytes"]), style=style),
                      format_bytes(r["host_bytes"]))
    return table


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


class TrialProgress:
    """A rich progress bar over trials; call it with a line of text before each trial.

    Used as ``autofit(..., progress=TrialProgress(max_trials))`` inside a ``with``.
    """

    def __init__(self, total: int, console: Console | None = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self._console = console or Console(stderr=True)
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=self._console, transient=False)
        self._task = None
        self._total = total
        self._started = 0

    def __enter__(self) -> TrialProgress:
        return self  # the bar appears with the first trial: a plan without trials shows none

    def __exit__(self, *exc: object) -> None:
        if self._task is None:
            return
        if exc[0] is None:
            self._progress.update(self._task, total=self._started, completed=self._started,
                                  description="trials done")
        self._progress.__exit__(*exc)

    def __call__(self, line: str) -> None:
        counts = not line.startswith("simulating ")  # a status line, not a trial
        if self._task is None:
            self._progress.__enter__()
            self._task = self._progress.add_task(line, total=self._total)
        elif counts and self._started:
            self._progress.advance(self._task)
        if counts:
            self._started += 1
        self._progress.update(self._task, description=line)

    def status(self, line: str) -> None:
        """Show ``line`` under the current trial (what its ranks are doing): no new trial."""
        if self._task is None:
            self(line)
            return
        self._progress.update(self._task, description=line)


def candidates_renderable(result: Any) -> RenderableType:
    """Table of the candidates — one column per knob, then the micro batch, the peak as
    estimated (before any trial), the calibration the trials applied to it, the
    measured peak, predicted vs measured throughput and the verdict — with the reasons
    of the rejected and skipped ones as numbered notes under it, so that the table stays
    readable in 80 columns."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    chosen = tuple(getattr(result.config, k.name) for k in KNOBS)
    defaults = {k.name: f.default for k in KNOBS
                if (f := TrainConfig.__dataclass_fields__.get(k.name)) is not None}

    def value(r: dict[str, object], k: object) -> Any:
        # a row written before a knob existed (a cached answer) has the knob's default
        return r.get(k.name, defaults.get(k.name))

    # a knob at its default in every row and in the choice was not searched (restricted, or
    # not applicable: the reasons say why): its column is left out to keep 80 columns
    shown = [k for k in KNOBS if k.name not in defaults or getattr(result.config, k.name)
             != defaults[k.name] or any(value(r, k) != defaults[k.name]
                                        for r in result.candidates)]
    t = Table(title="candidates", title_justify="left", header_style="bold",
              box=box.SIMPLE_HEAD, pad_edge=False, padding=0)
    for k in shown:
        t.add_column(k.title, no_wrap=True)
    for col in ("micro", "peak\nest.", "cal.", "peak\nmeas.", "tok/s\npred.", "tok/s\nmeas."):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("verdict")
    rows = sorted(result.candidates, key=lambda r: -(r.get("measured_tokens_per_s") or 0.0)
                  - 1e-9 * (r.get("predicted_tokens_per_s") or 0.0))
    notes: list[str] = []

    def fmt(v: object, kind: str) -> str:
        if v is None:
            return "—"
        return format_bytes(v) if kind == "b" else f"{v:,.0f}"

    for r in rows:
        is_choice = tuple(value(r, k) for k in KNOBS) == chosen
        verdict = "CHOSEN" if is_choice else r["status"]
        if r.get("failed_micro_batch"):
            verdict += f", {r['failed_micro_batch']}✗"
        if r.get("reason"):
            notes.append(r["reason"])
            verdict += f" [{len(notes)}]"
        t.add_row(*(k.short(value(r, k)) for k in shown),
                  str(r["micro_batch"] or "—"), fmt(r["estimate_bytes"], "b"),
                  calibration_text(r.get("calibration")),
                  fmt(r["measured_bytes"], "b"), fmt(r["predicted_tokens_per_s"], "t"),
                  fmt(r["measured_tokens_per_s"], "t"), verdict,
                  style="bold green" if is_choice else None)
    if not notes:
        return t
    return Group(t, *(Text(f"[{i}] {n}", style="dim") for i, n in enumerate(notes, 1)), Text(""))


def calibration_text(ratio: float | None) -> str:
    """``×1.07``: how the trials scaled an estimate; ``—`` when they did not (within 0.5%)."""
    if ratio is None or abs(ratio - 1) < 0.005:
        return "—"
    return f"×{ratio:.2f}"


def print_fit(result: Any, path: Any = None, console: Console | None = None) -> None:
    """The candidates table, the chosen configuration's breakdown and the reasons."""
    from rich.console import Console
    from rich.text import Text

    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a log file: no reason to fold at 80 columns
            console = Console(width=max(console.width, 120))
    console.print(candidates_renderable(result))
    console.print(estimate_renderable(result.estimate))
    state = ("confirmed on the device" if result.confirmed
             else "UNCONFIRMED: planned by simulating the step" if result.estimate.method == "simulate"
             else "UNCONFIRMED: planned from the estimate")
    if result.from_cache:
        state = "answered from the cache (no trial)"
    c = result.config
    console.print(Text(f"chosen ({state}): micro batch {c.micro_batch_size} × accumulation "
                       f"{c.grad_accum_steps}, {describe_choice(choice_of(c))}; "
                       f"{len(result.trials)} trials, {result.ooms} OOM", style="bold"))
    for r in result.reasons:
        console.print(f"  • {r}")
    if path is not None:
        console.print(f"wrote {path}")
        # the launch configs written beside it (autofit.emit.launch): several ranks, or the
        # regional compile no TrainingArguments field carries
        if c.world_size > 1 or c.torch_compile_regional:
            from autofit.emit.launch import accelerate_path, deepspeed_path, launch_commands

            beside = [accelerate_path(path)] + (
                [deepspeed_path(path)] if deepspeed_path(path).is_file() else [])
            console.print(f"wrote {' and '.join(str(b) for b in beside)}; launch with:")
            for cmd in launch_commands(path, c):
                console.print(f"  {cmd}")
