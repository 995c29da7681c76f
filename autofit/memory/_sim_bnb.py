"""bitsandbytes 4-bit weights (QLoRA) as fake tensors.

A meta-built quantized model holds ``Params4bit`` that were never quantized (full
shape, no ``quant_state``); a real one holds packed uint8 data and a ``QuantState``.
Either way the clone gets what a quantized layer holds on the device: the packed
weight, ``(numel + 1) // 2`` uint8 as a ``((numel + 1) // 2, 1)`` tensor, and its
``QuantState`` (fp32 absmax per block, the 16-entry code; with double quantization
uint8 absmax + an fp32 absmax per 256 blocks + offset). bitsandbytes' ops have fake
implementations, so ``Linear4bit.forward`` (``MatMul4Bit``) runs as it is; its
``gemm_4bit`` dequantizes the weight inside the op, which the recorder is told about
as a workspace (`gemm_4bit_workspace`); the backward's ``dequantize_4bit`` is a
visible op.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["fake_params4bit", "is_fake_4bit", "quant_tensors", "gemm_4bit_workspace"]


def is_fake_4bit(p: torch.Tensor) -> bool:
    """True for the stand-in `fake_params4bit` builds."""
    return getattr(p, "_autofit_4bit", False)


def fake_params4bit(p: Any, *, dtype: torch.dtype | None) -> torch.nn.Parameter:
    """The fake packed weight of a ``Params4bit`` (inside the fake mode)."""
    from bitsandbytes.functional import QuantState

    qs = getattr(p, "quant_state", None)
    if qs is not None:  # already quantized: the packed data is the parameter
        shape = tuple(qs.shape)
        blocksize = int(qs.blocksize)
        quant_type = qs.quant_type
        nested = bool(qs.nested)
        orig_dtype = qs.dtype
    else:  # never quantized (meta): the parameter has the full shape
        shape = tuple(p.shape)
        blocksize = int(getattr(p, "blocksize", 64) or 64)
        quant_type = getattr(p, "quant_type", "nf4") or "nf4"
        nested = bool(getattr(p, "compress_statistics", False))
        orig_dtype = p.dtype
    if dtype is not None:
        orig_dtype = dtype  # the dtype the weights were loaded in (dequantize's output)
    n = math.prod(shape)
    blocks = -(-n // blocksize)
    data = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8)  # two 4-bit values per byte
    code = torch.empty((16,), dtype=torch.float32)
    if nested:
        state2 = QuantState(
            absmax=torch.empty((-(-blocks // 256),), dtype=torch.float32),
            code=torch.empty((256,), dtype=torch.float32),
            blocksize=256,
            quant_type=None,
            dtype=torch.float32,
        )
        qs_new = QuantState(
            absmax=torch.empty((blocks,), dtype=torch.uint8),
            shape=torch.Size(shape),
            code=code,
            blocksize=blocksize,
            quant_type=quant_type,
            dtype=orig_dtype,
            offset=torch.empty((), dtype=torch.float32),
            state2=state2,
        )
    else:
        qs_new = QuantState(
            absmax=torch.empty((blocks,), dtype=torch.float32),
            shape=torch.Size(shape),
            code=code,
            blocksize=blocksize,
            quant_type=quant_type,
            dtype=orig_dtype,
        )
    new = torch.nn.Parameter(data, requires_grad=False)
    new.quant_state = qs_new  # what Linear4bit.forward reads
    new._autofit_4bit = True
    return new


def quant_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a fake 4-bit weight's QuantState (they live with the weight)."""
    qs = getattr(p, "quant_state", None)
    if qs is None:
        return []
    out = [qs.absmax, qs.code]
    if qs.offset is not None:
        out.append(qs.offset)
    if qs.state2 is not None:
        out += [qs.state2.absmax, qs.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


def gemm_4bit_workspace(args: tuple, kwargs: dict) -> int:
    """``bitsandbytes::gemm_4bit`` (default kernel, CPU and CUDA): the weight is
    dequantized to the input's dtype, ``shapeB`` elements, for the matmul."""
    a, shape = args[0], args[2]
    return math.prod(shape) * a.element_size()
