"""The ``autofit`` command line (see ``autofit.cli.main``)."""

from autofit.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
