"""CUDA semantics for a step simulated on fake CPU tensors.

Autograd on fake ``cuda`` tensors aborts a CPU-only build of torch, so a CUDA target
is simulated on fake CPU tensors. Where the CPU kernels that would run differ from
the CUDA ones in what they allocate or save for backward, `CudaSemantics` (a
``TorchFunctionMode``, above autograd, so that autograd records what CUDA records)
calls what CUDA would:

- autocast: CPU autocast stays on (the ops both devices cast alike); the ops only
  CUDA's lists hold are cast here, while CPU autocast is enabled (so the model's own
  ``torch.autocast(enabled=False)`` regions are respected): fp32 ops (``softmax``,
  ``layer_norm``, ``pow``, ``exp``, ``sum``, ...), lower-precision ops (``einsum``,
  ``mv``, ...) and promote ops (``addcmul``, ``dot``, ...).
- ``scaled_dot_product_attention``: CUDA's backend choice (flash, memory-efficient,
  math) by torch's rules, calling that backend's ATen op, so the saved logsumexp,
  the RNG state and the backward's outputs are CUDA's.
- ``dropout``: CUDA's fused ``native_dropout`` saves a bool mask; the CPU path saves
  a float noise tensor of the input's size.

`CudaSemantics.workspaces` gives the recorder the device memory some CUDA kernels
allocate internally (invisible at the dispatch level), by formula.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.device import DeviceInfo

__all__ = ["CudaSemantics"]

_LOW = (torch.float16, torch.bfloat16)

# CUDA autocast lists (aten/src/ATen/autocast_mode.cpp) minus what CPU autocast
# already casts the same way, keyed by the Python-level function name.
_FP32 = frozenset(
    {
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
        "reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus",
        "layer_norm", "group_norm", "cosine_similarity", "dist", "pdist", "renorm",
        "logsumexp",
    }
)  # fmt: skip
_FP32_SET_DTYPE = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod"})
_LOWER = frozenset({"einsum", "mv", "addmv", "addr", "chain_matmul", "multi_dot"})
_PROMOTE = frozenset(
    {
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "index_put",
        "scatter_add",
        "tensordot",
    }
)


def _map_tensors(obj: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    return obj


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW else t


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class CudaSemantics(TorchFunctionMode):
    """Calls the CUDA variants of the ops whose CPU kernels allocate differently.

    Args:
        device: the planned CUDA device (its compute capability gates flash attention
            and bf16).
    """

    def __init__(self, device: DeviceInfo) -> None:
        super().__init__()
        from autofit.probe.device import sm_version

        self.sm = sm_version(device)
        self.backends: dict[str, int] = {}  # SDPA backend -> calls (for notes)

    # ------------------------------------------------------------------ dispatch
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if func is F.dropout:
            return self._dropout(*args, **kwargs)
        if name and torch.is_autocast_enabled("cpu"):
            if name in _FP32:
                args, kwargs = _map_tensors(args, _to_fp32), _map_tensors(kwargs, _to_fp32)
            elif name in _FP32_SET_DTYPE:
                first = args[0] if args else None
                if (
                    isinstance(first, torch.Tensor)
                    and first.dtype in _LOW
                    and kwargs.get("dtype") is None
                ):
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif name in _LOWER:
                low = torch.get_autocast_dtype("cpu")

                def to_low(t: torch.Tensor) -> torch.Tensor:
                    return t.to(low) if t.is_floating_point() and t.dtype != torch.float64 else t

                args, kwargs = _map_tensors(args, to_low), _map_tensors(kwargs, to_low)
            elif name in _PROMOTE:
                dtypes = [
                    t.dtype
                    for t in [*args, *kwargs.values()]
                    if isinstance(t, torch.Tensor) and t.is_floating_point()
                ]
                if len(set(dtypes)) > 1:
                    wide = max(dtypes, key=lambda d: torch.finfo(d).bits)

                    def to_wide(t: torch.Tensor) -> torch.Tensor:
                        return t.to(wide) if t.is_floating_point() else t

                    args, kwargs = _map_tensors(args, to_wide), _map_tensors(kwargs, to_wide)
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ dropout
    def _dropout(
        self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if not training or p <= 0 or p >= 1 or input.numel() == 0 or inplace:
            return F.dropout(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]  # saves a bool mask

    # ------------------------------------------------------------------ SDPA
    def _sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if torch.is_autocast_enabled("cpu"):  # SDPA is on both lower-precision lists
            low = torch.get_autocast_dtype("cpu")

            def to_low(t: object) -> object:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    return t.to(low)
                return t

            query, key, value, attn_mask = (to_low(t) for t in (query, key, value, attn_mask))
        backend = self._sdpa_backend(query, key, value, attn_mask, is_causal, enable_gqa)
        self.backends[backend] = self.backends.get(backend, 0) + 1
        if backend == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        if backend == "efficient":
            bias = attn_mask
            if bias is not None and bias.dtype == torch.bool:
                # convert_boolean_attn_mask: an additive float mask in the query's dtype
                bias = torch.where(bias, 0.0, float("-inf")).to(query.dtype)
            if bias is not None and bias.shape[-1] % 16:
                # pad_bias: the last dim is padded to 16 elements (a copy), then sliced
                pad = _round_up(bias.shape[-1], 16) - bias.shape[-1]
                bias = F.pad(bias, (0, pad))[..., : bias.shape[-1]]
            if bias is not None:
                bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            compute_lse = any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, compute_lse, dropout_p, is_causal, scale=scale
            )[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            None,
            scale=scale,
            enable_gqa=enable_gqa,
        )[0]

    def _sdpa_backend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        enable_gqa: bool,
    ) -> str:
        """torch's CUDA choice (sdp_utils.cpp): flash, then memory-efficient, then math."""
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return "math"
        dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
        hq, hk = q.shape[1], k.shape[1]
        same_dtype = q.dtype == k.dtype == v.dtype
        heads_ok = hq == hk or (enable_gqa and hk > 0 and hq % hk == 0)
        bf16_ok = q.dtype != torch.bfloat16 or self.sm >= 80
        flash = (
            mask is None
            and same_dtype
            and q.dtype in _LOW
            and bf16_ok
            and self.sm >= 80
            and dq == dk == dv
            and dq <= 256
            and dq % 8 == 0
            and heads_ok
            and not (is_causal and q.shape[2] != k.shape[2])
            and not (self.sm in (86, 89) and dq > 192 and q.requires_grad)
        )
        if flash:
            return "flash"
        align = 8 if q.dtype in _LOW else 4
        efficient = (
            same_dtype
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and bf16_ok
            and self.sm >= 50
            and hq == hk  # no grouped-query attention in the memory-efficient kernel
            and dq == dk
            and dq % align == 0
            and dv % align == 0
        )
        return "efficient" if efficient else "math"

    # ------------------------------------------------------------------ workspaces
    def workspaces(self) -> dict[Any, Callable[..., int]]:
        """ATen op -> bytes the CUDA kernel allocates internally for the op's duration."""
        return {
            torch.ops.aten._scaled_dot_product_flash_attention_backward.default: _flash_bwd_ws,
        }


def _flash_bwd_ws(args: tuple, kwargs: dict) -> int:
    """FlashAttention-2 ``mha_bwd``: dq_accum (fp32), softmax_d (fp32), and for GQA the
    expanded dk/dv before they are summed over the head groups."""
    q, k = args[1], args[2]
    b, hq, tq, d = q.shape
    hk, tk = k.shape[1], k.shape[2]
    tq_r = _round_up(tq, 128)
    d_r = _round_up(d, 32) if d <= 192 else 256
    ws = b * tq_r * hq * d_r * 4  # dq_accum
    ws += b * hq * tq_r * 4  # softmax_d
    if hk != hq:
        ws += 2 * b * tk * hq * d * q.element_size()  # dk_expanded, dv_expanded
    return ws
