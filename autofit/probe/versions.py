"""The installed versions of the libraries a training step's memory depends on.

    >>> sorted(library_versions())[:2]
    ['accelerate', 'autofit']
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["library_versions", "VERSIONED", "cache_dir", "installed_version",
           "bnb_4bit_keeps_input"]

# What a cached answer depends on besides the model, data and device.
VERSIONED = ("autofit", "torch", "transformers", "peft", "bitsandbytes", "accelerate")


def library_versions() -> dict[str, str]:
    """``{package: version}`` of ``VERSIONED``, ``"-"`` for one not installed."""
    return {pkg: installed_version(pkg) or "-" for pkg in VERSIONED}


def installed_version(package: str) -> str | None:
    """The installed version of ``package``, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# bitsandbytes 0.43.2 (PR #1270, "delete useless buffered activation", July 2024) stopped
# MatMul4Bit keeping its input for a weight that is never trained
_BNB_4BIT_FREES_INPUT = (0, 43, 2)


def bnb_4bit_keeps_input() -> bool:
    """Whether the installed bitsandbytes' 4-bit layers keep their input for backward: up
    to 0.43.1 ``MatMul4Bit`` set ``ctx.tensors = (A, B)`` whenever ``A`` needed a gradient,
    although a frozen 4-bit weight never uses ``A`` (QLoRA's "memory bug"); 0.43.2 keeps
    ``(None, B)``. False when bitsandbytes is not installed.

        >>> isinstance(bnb_4bit_keeps_input(), bool)
        True
    """
    from packaging.version import Version

    v = installed_version("bitsandbytes")
    return v is not None and Version(v).release < _BNB_4BIT_FREES_INPUT


def cache_dir() -> Path:
    """Where autofit keeps what it learnt between runs: ``$AUTOFIT_CACHE_DIR``, else
    ``~/.cache/autofit`` (not created here)."""
    import os

    return Path(os.environ.get("AUTOFIT_CACHE_DIR", Path.home() / ".cache" / "autofit")).expanduser()
