"""matplotlib for the benchmarks' pictures: headless, and optional."""

from __future__ import annotations

import sys
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display), or None with one line on
    stderr when matplotlib is not installed (the benchmark still writes its tables)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return None
    return plt
