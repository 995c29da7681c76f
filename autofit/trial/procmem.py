"""Process memory as the kernel sees it (Linux ``/proc``), and a capped address space.

This is how a trial on the CPU measures from outside the tensor layer:

    base = rss_bytes()          # after setup, before the steps
    reset_peak_rss()            # VmHWM := current RSS
    ...                         # the training steps
    peak = peak_rss_bytes() - base

and how ``cpu:4GiB`` becomes a real limit: ``cap_address_space(extra)`` sets
``RLIMIT_AS`` to the current address-space size + ``extra``, so an allocation
past it fails with torch's "DefaultCPUAllocator: can't allocate memory".
``restore_address_space(previous)`` lifts it again.

Known limitations:
    NB: RLIMIT_AS bounds *address space*, RSS counts *resident pages*. Pages mapped
    before the baseline but touched only later (library code, heap slack) raise
    RSS without raising VmSize, so a measured peak can exceed the cap by a few MiB.
    NB: ``/proc/self/clear_refs`` and ``VmHWM`` are Linux-only; elsewhere the
    functions return None and the trial reports no CPU peak.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource

__all__ = [
    "CHILD_MALLOC_ENV",
    "vm_size_bytes",
    "rss_bytes",
    "anon_rss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
    "malloc_trim",
    "cap_address_space",
    "restore_address_space",
]

# The environment of a measuring child (docs/design.md, "Truth and measurement"):
# glibc: every allocation >= 64 KiB is its own mmap, freed memory goes straight back
# to the kernel, and one arena, so RSS follows the live tensors closely.
# oneDNN: no primitive cache. It keeps a JIT kernel per input shape (up to 1024, a
# BERT GELU's is 256 KiB of code space), so on the run's variable lengths the address
# space grows step after step: address space a capped CPU's RLIMIT_AS counts and a
# GPU does not have. Measured (tests/test_procmem.py): 60 new lengths of a tiny BERT
# map +35 MiB with the cache, +0.8 MiB without; a whole soak (benchmarks/soak.py)
# died of it at every micro batch. The cost is time: a kernel is JIT-compiled per call.
# pyarrow (imported by transformers.trainer when `datasets` is installed, e.g. with TRL)
# starts its bundled jemalloc's background thread at import: a process with a second
# thread cannot be forked safely, so the trial server refused to start and every trial
# paid a fresh process; the thread only purges pyarrow's own memory, unused by a trial.
CHILD_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "0",
    "MALLOC_ARENA_MAX": "1",
    "OMP_NUM_THREADS": "1",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm() -> tuple[int, int] | None:
    try:
        with open("/proc/self/statm") as f:
            size, resident = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(size) * _PAGE, int(resident) * _PAGE


def vm_size_bytes() -> int | None:
    """Address space of this process (VmSize), bytes."""
    s = _statm()
    return s[0] if s else None


def rss_bytes() -> int | None:
    """Resident memory of this process now (VmRSS), bytes."""
    s = _statm()
    return s[1] if s else None


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``RssAnon``), in bytes; None when
    it cannot be read or is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError):
        return None
    return None


def anon_rss_bytes() -> int | None:
    """Anonymous resident memory now (RssAnon), bytes; VmRSS where the kernel lacks it.

    What a trial can leave behind (tensors, allocator caches) is anonymous; the
    file-backed part of VmRSS grows when a kernel's code pages are first touched
    (tens of MiB the first time a worker runs a new op) and is not a leak.
    """
    anon = _status_bytes("RssAnon")
    return anon if anon is not None else rss_bytes()


def peak_rss_bytes() -> int | None:
    """High-water mark of resident memory (VmHWM) since start or ``reset_peak_rss``."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (write "5" to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def malloc_trim() -> None:
    """Give glibc's free heap pages back to the kernel (no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def cap_address_space(extra_bytes: int) -> tuple[int, int]:
    """Limit this process's address space to VmSize now + ``extra_bytes``.

    Returns the previous (soft, hard) limits for ``restore_address_space``.
    The hard limit is left as it was, so the soft limit can be raised again.
    """
    previous = resource.getrlimit(resource.RLIMIT_AS)
    size = vm_size_bytes()
    if size is None:
        raise OSError("cannot read /proc/self/statm: a capped CPU needs Linux")
    limit = size + max(0, int(extra_bytes))
    hard = previous[1]
    if hard != resource.RLIM_INFINITY and limit > hard:
        limit = hard
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return previous


def restore_address_space(previous: tuple[int, int]) -> None:
    """Put back the limits ``cap_address_space`` returned."""
    resource.setrlimit(resource.RLIMIT_AS, previous)
