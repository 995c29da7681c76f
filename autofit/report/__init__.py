"""What people look at: the terminal (``terminal``: the breakdown box, the candidates
table, the progress bar) and files (``files``: a PNG chart and a self-contained HTML page)."""

from autofit.report.terminal import (
    TrialProgress,
    candidates_renderable,
    estimate_renderable,
    print_estimate,
    print_fit,
    render_estimate,
)

__all__ = ["TrialProgress", "candidates_renderable", "estimate_renderable", "print_estimate",
           "print_fit", "render_estimate"]
