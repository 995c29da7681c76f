"""``autofit report``: a tuned file's memory breakdown and candidates as PNG + HTML.

    autofit report tuned.yaml                     # tuned.png + tuned.html beside it
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autofit.cli.options import EXIT_OK

__all__ = ["add_report_parser", "run_report_command"]


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``report`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "report",
        help="draw a tuned file's memory breakdown and candidates (PNG + HTML)",
        description="Write <name>.png and a self-contained <name>.html beside a tuned file: "
        "the chosen configuration's memory by component against the capacity, and the "
        "candidates tried (micro batch vs peak and vs throughput, OOMs marked).",
    )
    p.add_argument("config", help="a file written by autofit tune -o / FitResult.save")
    p.add_argument("-o", "--output", default=None,
                   help="where to write (its stem names both files; default: beside the file)")
    p.set_defaults(func=run_report_command)
    return p


def run_report_command(args: argparse.Namespace) -> int:
    """Run ``autofit report``; returns the exit code."""
    from rich.console import Console

    from autofit.report import estimate_renderable
    from autofit.report.files import report_data_from_file, write_report

    data = report_data_from_file(args.config)
    png, page = write_report(data, Path(args.output) if args.output else Path(args.config))
    console = Console()
    console.print(estimate_renderable(data.estimate))
    for r in data.reasons:
        console.print(f"  • {r}")
    console.print(f"wrote {png} and {page}")
    return EXIT_OK
