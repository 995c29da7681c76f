"""The one place that decides whether an exception means "out of memory".

    >>> from autofit.trial.oom import is_oom
    >>> is_oom(MemoryError())
    True
    >>> is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED."))
    False

``is_oom`` is re-exported by ``autofit.trial``. Messages are matched on
``RuntimeError`` (what torch raises) only, so a ``ValueError`` that merely
mentions memory is never taken for an allocation failure.
"""

from __future__ import annotations

import errno

__all__ = ["OOM_MESSAGES", "is_oom"]

# Substrings of RuntimeError messages that mean an allocation failed.
OOM_MESSAGES: tuple[str, ...] = (
    # CUDA caching allocator: "CUDA out of memory. Tried to allocate 2.00 GiB ..."
    # (torch.OutOfMemoryError since 1.13; older builds and wrappers raise RuntimeError)
    "CUDA out of memory",
    # ROCm builds use the same allocator under the HIP name
    "HIP out of memory",
    # Intel GPUs (torch.xpu)
    "XPU out of memory",
    # Apple silicon: "MPS backend out of memory (MPS allocated: ...)"
    "MPS backend out of memory",
    # the CUDA / HIP runtime itself failed (cudaMalloc outside the allocator,
    # context or kernel-launch resources): "CUDA error: out of memory"
    "CUDA error: out of memory",
    "HIP error: out of memory",
    # cuBLAS could not allocate its workspace / handle
    "CUBLAS_STATUS_ALLOC_FAILED",
    # cuDNN could not allocate (NB: CUDNN_STATUS_NOT_SUPPORTED is *not* an OOM,
    # although accelerate's find_executable_batch_size treats it as one)
    "CUDNN_STATUS_ALLOC_FAILED",
    # torch's CPU allocator (posix_memalign failed, e.g. under RLIMIT_AS):
    # "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8192000 bytes"
    "DefaultCPUAllocator: can't allocate memory",
    # Gaudi (HPU) device memory
    "PT_DEVMEM Allocation failed",
    # a C++ `new` failed (oneDNN, tokenizers, ...); also what a crashed child prints
    "std::bad_alloc",
)


def is_oom(exc: BaseException | None) -> bool:
    """True when ``exc`` (or the exception it was raised from) is an allocation failure.

    Recognised: ``torch.OutOfMemoryError`` (CUDA/accelerator caching allocators),
    Python's ``MemoryError``, ``OSError`` with ``ENOMEM``, and ``RuntimeError``\\ s whose
    message contains one of ``OOM_MESSAGES`` (CUDA/HIP/XPU/MPS, cuBLAS/cuDNN
    allocation failures, the CPU allocator, C++ ``bad_alloc``).

    Example:
        >>> is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
        True
    """
    seen = 0
    while exc is not None and seen < 8:  # follow `raise X from oom` a few levels
        if _is_oom_one(exc):
            return True
        exc = exc.__cause__
        seen += 1
    return False


def _is_oom_one(exc: BaseException) -> bool:
    # Python could not allocate (also raised by torch for some host allocations)
    if isinstance(exc, MemoryError):
        return True
    # mmap/fork/... failed with ENOMEM ("[Errno 12] Cannot allocate memory")
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        return True
    oom_type = _torch_oom_type()
    # torch.OutOfMemoryError (== torch.cuda.OutOfMemoryError), raised by the allocators
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    message = " ".join(str(a) for a in exc.args) if exc.args else str(exc)
    return any(pattern in message for pattern in OOM_MESSAGES)


def _torch_oom_type() -> type | None:
    import sys

    torch = sys.modules.get("torch")  # no exception can come from torch before it is imported
    return getattr(torch, "OutOfMemoryError", None) if torch is not None else None
