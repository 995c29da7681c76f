"""The installed versions of the libraries a training step's memory depends on.

    >>> sorted(library_versions())[:2]
    ['accelerate', 'autofit']
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["library_versions", "VERSIONED", "cache_dir"]

# What a cached answer depends on besides the model, data and device.
VERSIONED = ("autofit", "torch", "transformers", "peft", "bitsandbytes", "accelerate")


def library_versions() -> dict[str, str]:
    """``{package: version}`` of ``VERSIONED``, ``"-"`` for one not installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in VERSIONED:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "-"
    return out


def cache_dir() -> Path:
    """Where autofit keeps what it learnt between runs: ``$AUTOFIT_CACHE_DIR``, else
    ``~/.cache/autofit`` (not created here)."""
    import os

    return Path(os.environ.get("AUTOFIT_CACHE_DIR", Path.home() / ".cache" / "autofit")).expanduser()
