"""What a CPU kernel allocates while it runs beyond its outputs, and frees before it
returns: copies that the op's fake kernel does not make, so the recorder, which sees
storages at the dispatch level, would not see them otherwise.

- **Type promotion** (``TensorIteratorBase::compute_types``): on a CPU, an elementwise
  op whose inputs differ in dtype copies each input that is not of the common dtype to
  it, and casts through a temporary output of the common dtype where its output is of
  another (an in-place op). Under bf16 autocast every residual add of a 16-bit block
  output to the fp32 stream makes an fp32 copy of it (Longformer's block: 2 MiB at 4 x
  512 tokens, measured as the process's high-water mark around the op; ``mul``,
  ``silu_backward`` and ``tanh_backward`` of an fp32 gradient and a bf16 input the same,
  one copy; ``gelu_backward`` two, the second not counted). On CUDA the kernel casts as
  it reads: no copy.
- **oneDNN's 16-bit matmul** (``mkldnn_matmul`` in ``aten/native/mkldnn/Matmul.cpp``,
  the path of 16-bit ``mm`` / ``bmm`` on an AVX512 CPU): an operand that is neither
  contiguous nor its last two dimensions' transpose is copied contiguous first.
  Longformer's sliding-window attention multiplies overlapping ``as_strided`` chunks:
  12 MiB copied for a (32, 256, 768) bf16 operand, measured the same way.

``cpu_kernel_temporaries`` gives the bytes for one op; ``StorageRecorder``, recording a
CPU target's step, allocates them beside the op's output and frees them at once.
"""

from __future__ import annotations

from functools import reduce

import torch
from torch._ops import OpOverload

__all__ = ["cpu_kernel_temporaries", "mkldnn_cpu"]

_HALF = frozenset({torch.bfloat16, torch.float16})
# (op, index of its first matrix operand): the second follows it
_MATMUL_OPERANDS = {torch.ops.aten.mm.default: 0, torch.ops.aten.bmm.default: 0,
                    torch.ops.aten.addmm.default: 1, torch.ops.aten.baddbmm.default: 1}
# oneDNN takes a 16-bit matmul of more than this many multiply-adds (below: torch's own
# kernel; the size check of aten/native/mkldnn/Matmul.cpp)
_MKLDNN_MIN_MACS = 16 * 16 * 16


def cpu_kernel_temporaries(func: OpOverload, args: tuple, kwargs: dict, out: object,
                           mkldnn: bool = True) -> int:
    """Bytes ``func`` on ``args`` allocates inside its CPU kernel beside its output
    ``out`` and frees before it returns (the module docstring); ``mkldnn``: 16-bit
    matmuls go to oneDNN (an AVX512 CPU's torch)."""
    at = _MATMUL_OPERANDS.get(func)
    if at is not None:
        return _mkldnn_copies(args[at], args[at + 1]) if mkldnn else 0
    if torch.Tag.pointwise not in getattr(func, "tags", ()):
        return 0
    return _promotion_copies(args, kwargs, out)


def mkldnn_cpu() -> bool:
    """Whether this CPU's torch runs 16-bit matmuls in oneDNN (an AVX512 CPU: its bf16
    instructions)."""
    from autofit.probe.device import cpu_capability

    return cpu_capability().startswith(("AVX512", "AMX"))


def _mkldnn_copies(mat1: object, mat2: object) -> int:
    """The contiguous copies ``mkldnn_matmul`` makes of operands in another layout."""
    if not (isinstance(mat1, torch.Tensor) and isinstance(mat2, torch.Tensor)) \
            or mat1.dtype not in _HALF or mat1.dim() not in (2, 3) or mat1.dim() != mat2.dim():
        return 0
    macs = mat1.numel() * mat2.shape[-1]
    if macs <= _MKLDNN_MIN_MACS:
        return 0
    return sum(t.numel() * t.element_size() for t in (mat1, mat2) if not _mkldnn_layout(t))


def _mkldnn_layout(t: torch.Tensor) -> bool:
    """oneDNN takes ``t`` as it is: contiguous, or its last two dimensions transposed
    (``is_mkldnn_optimized_format``)."""
    if t.is_contiguous():
        return True
    sizes, strides = t.shape, t.stride()
    if t.dim() == 2:
        return strides[0] == 1 and strides[1] == sizes[0]
    return strides[0] == sizes[1] * sizes[2] and strides[1] == 1 and strides[2] == sizes[1]


def _promotion_copies(args: tuple, kwargs: dict, out: object) -> int:
    """TensorIterator's copies of an elementwise op's inputs to their common dtype, and
    its temporary output where the op's output (``out``: an in-place op's too) is of
    another (``gelu_backward`` of an fp32 gradient and a 16-bit input: both). Inputs of
    more than 0 dimensions set the common dtype (as ``result_type`` has them: 0-dim ones
    follow them); boolean ones are left out (``where``'s condition is not promoted)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
               and a.dim() > 0 and a.dtype != torch.bool]
    if len(tensors) < 2 or len({t.dtype for t in tensors}) < 2:
        return 0
    common = reduce(torch.promote_types, (t.dtype for t in tensors))
    size = common.itemsize
    copies = sum(t.numel() * size for t in tensors if t.dtype != common)
    if isinstance(out, torch.Tensor) and out.dtype != common and out.dtype != torch.bool:
        copies += out.numel() * size
    return copies
