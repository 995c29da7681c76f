"""bitsandbytes' quantized layers (QLoRA's 4 bits, LLM.int8's 8 bits) as fake tensors.

4 bits: a meta-built quantized model holds ``Params4bit`` that were never quantized (full
shape, no ``quant_state``); a real one holds packed uint8 data and a ``QuantState``.
Either way the clone gets what a quantized layer holds on the device: the packed
weight, ``(numel + 1) // 2`` uint8 as a ``((numel + 1) // 2, 1)`` tensor, and its
``QuantState`` (fp32 absmax per block, the 16-entry code; with double quantization
uint8 absmax + an fp32 absmax per 256 blocks + offset). bitsandbytes' ops have fake
implementations, so ``Linear4bit.forward`` (``MatMul4Bit``) runs as it is; its
``gemm_4bit`` dequantizes the weight inside the op, which the recorder is told about
as a workspace (`gemm_4bit_workspace`); the backward's ``dequantize_4bit`` is a
visible op.

8 bits: the clone's ``Int8Params`` are int8 ``(out, in)`` with their fp32 row scales
(``SCB``, one per output row), as ``Linear8bitLt`` holds them after loading; its layer
state starts empty and takes them at the first forward (``init_8bit_state``), as on the
device. ``Linear8bitLt.forward`` runs as it is. In training it calls
``bitsandbytes.matmul``, which picks the autograd function by the input's device:

* CPU: ``MatMul8bitFp`` — the weight dequantized to the input's dtype (a temporary
  the size of the weight), a plain ``linear``; it keeps its input ``A`` as a ``ctx``
  attribute for backward, which dequantizes the weight again;
* CUDA (``cuda_int8_matmul``): ``MatMul8bitLt`` — the input cast to fp16 and quantized
  row-wise to int8 (``int8_vectorwise_quant``), an int8 GEMM into int32, dequantized to
  fp16 and cast to the input's dtype; it keeps ``(CAt, subA, A)`` in ``ctx.tensors``:
  the input itself, and the outlier columns. Its CUDA kernels run here as their
  allocations (``int8_cuda_kernels``, following bitsandbytes' CUDA ops).

Either way the input is held by the autograd node itself, not through
``save_for_backward``: gradient checkpointing's saved-tensor hooks never see it, and it
lives until the graph is freed (the Trainer's ``training_step`` drops the loss after
``backward()``).

Known limitations:
    NB: LLM.int8's outlier columns (activations above ``llm_int8_threshold``, kept in
    16 bits as ``subA``) depend on the data; none are assumed (the CUDA fast path).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from autofit.memory.simulate._recorder import StorageRecorder

__all__ = ["fake_params4bit", "fake_int8_params", "fake_int8_state", "is_fake_4bit",
           "is_quantized", "has_quantized", "quant_tensors", "gemm_4bit_workspace",
           "int8_cuda_kernels", "cuda_int8_matmul", "bnb_target", "dora_dequantizes_fake_4bit",
           "matmul_4bit_keeps_input"]

_QUANTIZED = frozenset({"Params4bit", "Int8Params"})


def is_quantized(p: object) -> bool:
    """A bitsandbytes weight: ``Params4bit`` / ``Int8Params``, or a fake one of them."""
    return type(p).__name__ in _QUANTIZED or getattr(p, "_autofit_quant", None) is not None


def has_quantized(module: torch.nn.Module) -> bool:
    """Whether ``module`` has a bitsandbytes-quantized weight (it is never cast)."""
    return any(is_quantized(p) for p in module.parameters())


def is_fake_4bit(p: torch.Tensor) -> bool:
    """True for the stand-in `fake_params4bit` builds."""
    return getattr(p, "_autofit_4bit", False)


def fake_params4bit(p: torch.nn.Parameter, *, dtype: torch.dtype | None) -> torch.nn.Parameter:
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
    new._autofit_quant = "4bit"
    return new


def fake_int8_params(p: torch.nn.Parameter, layer: torch.nn.Module) -> torch.nn.Parameter:
    """The fake int8 weight of a ``Linear8bitLt`` (inside the fake mode): ``(out, in)`` int8,
    ``CB`` its own data, ``SCB`` one fp32 scale per row (``(out,)``)."""
    scb = getattr(p, "SCB", None)
    if scb is None:
        scb = getattr(getattr(layer, "state", None), "SCB", None)
    rows = int(scb.shape[0]) if scb is not None else int(p.shape[0])
    data = torch.empty(tuple(p.shape), dtype=torch.int8)  # (out, in)
    new = torch.nn.Parameter(data, requires_grad=False)
    new.CB = new.data  # Int8Params after quantization: CB is the weight's data
    new.SCB = torch.empty((rows,), dtype=torch.float32)
    new.has_fp16_weights = False
    new._autofit_quant = "8bit"
    return new


def fake_int8_state(state: object) -> Any:
    """A ``MatmulLtState`` like ``state`` without its tensors: the layer's first forward
    takes the weight's ``CB``/``SCB`` (``init_8bit_state``), as after loading."""
    import bitsandbytes as bnb

    new = bnb.MatmulLtState()
    for k, v in vars(state).items():
        setattr(new, k, None if isinstance(v, torch.Tensor) else v)
    return new


def quant_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that live with a quantized weight: a 4-bit weight's QuantState, an
    8-bit weight's row scales (``SCB``)."""
    scb = getattr(p, "SCB", None)
    if isinstance(scb, torch.Tensor):
        return [scb]
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


# ---------------------------------------------------------------------------- CUDA int8


def _int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple:
    """bitsandbytes' CUDA ``int8_vectorwise_quant``: row stats and the int8 rows, then (with
    a threshold) the outlier mask of ``|A| >= threshold``; no outliers (NB, module doc)."""
    rows = A.numel() // A.shape[-1]
    row_stats = torch.empty((rows,), dtype=torch.float32)  # (N,) fp32
    out_row = torch.empty(tuple(A.shape), dtype=torch.int8)  # (N, in) int8
    outlier_cols = None
    if threshold > 0.0:
        outliers = A.abs() >= threshold  # (N, in) fp16 |A|, then its bool mask
        del outliers
        outlier_cols = torch.empty((0,), dtype=torch.int64)
    return out_row, row_stats, outlier_cols


def _int8_scaled(CA: torch.Tensor, CB: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype | None) -> torch.Tensor:
    """``int8_scaled_mm`` on CUDA: the int8 GEMM into int32 (cuBLASLt), dequantized to fp16
    (the kernel's only output dtype), the bias added, cast to ``dtype``; the int32 result is
    alive until the cast is done."""
    out_i32 = torch.ops.bitsandbytes.int8_linear_matmul.default(CA, CB)  # (N, out) int32
    out = torch.empty_like(out_i32, dtype=torch.float16)  # (N, out) fp16
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    result = out.to(dtype or torch.float16)
    del out, out_i32
    return result


def _int8_scaled_mm(A: torch.Tensor, B: torch.Tensor, row_stats: torch.Tensor,
                    col_stats: torch.Tensor, bias: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    return _int8_scaled(A, B, bias, dtype)


def _int8_mixed_scaled_mm(A: torch.Tensor, CA: torch.Tensor, CB: torch.Tensor,
                          SCA: torch.Tensor, SCB: torch.Tensor,
                          outlier_cols: torch.Tensor | None = None,
                          bias: torch.Tensor | None = None) -> tuple:
    """bitsandbytes' default composition with no outlier column: an empty ``subA``."""
    sub_a = torch.empty((0,), dtype=A.dtype)
    return _int8_scaled(CA, CB, bias, A.dtype), sub_a


def int8_cuda_kernels() -> dict[Any, Any]:
    """bitsandbytes' int8 ops -> what their CUDA kernels allocate (Python over torch ops),
    run instead of the ops' fake implementations on a CUDA target (which leave out the
    int32 GEMM result and fp16 dequantization, and give the outliers a data-dependent
    size)."""
    import bitsandbytes  # noqa: F401  (registers the ops)

    ops = torch.ops.bitsandbytes
    return {
        ops.int8_vectorwise_quant.default: _int8_vectorwise_quant,
        ops.int8_scaled_mm.default: _int8_scaled_mm,
        ops.int8_mixed_scaled_mm.default: _int8_mixed_scaled_mm,
    }


@contextlib.contextmanager
def cuda_int8_matmul() -> Iterator[None]:
    """While inside, ``Linear8bitLt`` trains through ``MatMul8bitLt``, as on a CUDA device
    (``bitsandbytes.matmul`` picks ``MatMul8bitFp`` for the fake CPU tensors); the
    function and bitsandbytes' logger level are restored on exit."""
    import bitsandbytes as bnb
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    original = bnb.matmul

    def matmul(A: torch.Tensor, B: torch.Tensor, out: torch.Tensor | None = None,
               state: MatmulLtState | None = None, threshold: float = 0.0,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        state = state or MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return MatMul8bitLt.apply(A, B, out, bias, state)

    log = logging.getLogger("bitsandbytes.autograd._functions")
    level = log.level
    bnb.matmul = matmul
    log.setLevel(logging.ERROR)  # "inputs will be cast ... to float16", once per layer
    try:
        yield
    finally:
        bnb.matmul = original
        log.setLevel(level)


@contextlib.contextmanager
def bnb_target(model: torch.nn.Module, rec: StorageRecorder, target: str) -> Iterator[None]:
    """What a step of ``model``'s quantized layers needs while recorded for ``target``
    (``"cpu"`` | ``"cuda"``): ``gemm_4bit``'s workspace; on CUDA, the int8 path; with a
    bitsandbytes before 0.43.2, 4-bit layers that keep their inputs (a real model's too).
    A model without quantized layers gets nothing."""
    from autofit.probe.versions import bnb_4bit_keeps_input

    kinds = {getattr(p, "_autofit_quant", None) for p in model.parameters()}
    with contextlib.ExitStack() as stack:
        if "4bit" in kinds:
            import bitsandbytes  # noqa: F401  (registers its ops)

            rec.workspaces[torch.ops.bitsandbytes.gemm_4bit.default] = gemm_4bit_workspace
            stack.enter_context(dora_dequantizes_fake_4bit())
        if bnb_4bit_keeps_input() and ("4bit" in kinds or any(
                type(p).__name__ == "Params4bit" for p in model.parameters())):
            stack.enter_context(matmul_4bit_keeps_input())  # (a real model's layers too)
        if "8bit" in kinds and target == "cuda":
            rec.decompositions.update(int8_cuda_kernels())
            stack.enter_context(cuda_int8_matmul())
        yield


@contextlib.contextmanager
def matmul_4bit_keeps_input() -> Iterator[None]:
    """While inside, ``MatMul4Bit`` keeps its input for backward as bitsandbytes did up to
    0.43.1 (``ctx.tensors = (A, B)`` whenever ``A`` needs a gradient; PR #1270 keeps
    ``(None, B)``): the step of an installed bitsandbytes that old (the fake ops autofit
    runs are today's) holds every 4-bit layer's input until the graph is freed."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    original = MatMul4Bit.__dict__["forward"]

    def forward(ctx: torch.autograd.function.FunctionCtx, A: torch.Tensor, B: torch.Tensor,
                out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                quant_state: object = None) -> torch.Tensor:
        y = original.__func__(ctx, A, B, out, bias, quant_state)
        if not ctx.is_empty and any(ctx.needs_input_grad[:2]):
            ctx.tensors = (A, ctx.tensors[1])
        return y

    MatMul4Bit.forward = staticmethod(forward)
    try:
        yield
    finally:
        MatMul4Bit.forward = original


def dora_dequantizes_fake_4bit() -> contextlib.AbstractContextManager[None]:
    """While inside, DoRA on a 4-bit base (QDoRA) dequantizes the clone's fake packed
    weights as peft dequantizes a real ``Params4bit`` in every forward
    (``bitsandbytes.functional.dequantize_4bit``: the layer's full weight in its compute
    dtype, a temporary). peft tells the weight by its class name, which the fake one does
    not carry (``autofit.probe.peft.dora_dequantize``)."""
    from autofit.probe.peft import dora_dequantize

    def fake_4bit(module: torch.nn.Module) -> torch.Tensor | None:
        w = getattr(module, "weight", None)
        if w is None or not is_fake_4bit(w):
            return None
        import bitsandbytes.functional as F

        return F.dequantize_4bit(w.data, w.quant_state)

    return dora_dequantize(fake_4bit)
