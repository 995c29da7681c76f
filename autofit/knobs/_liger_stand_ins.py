"""The stand-ins of liger's kernels (``autofit.knobs.liger``): autograd functions that allocate
and save what liger's do, imported only when a simulated step runs them (torch is not
imported with the knobs)."""

from __future__ import annotations

import torch

__all__ = ["rms_norm_forward", "swiglu_forward", "rope"]

# the (SMs, h) float32 scratch of the RMSNorm backward: an H100 SXM's 132 SMs (0.5 KiB x h)
_SMS = 132


def _real(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor)


class _RMSNorm(torch.autograd.Function):
    """``LigerRMSNormFunction`` (llama casting, ``in_place=True``) as allocations: the output
    and a float32 rstd per row; saves the input, the weight and rstd. Backward: the input's
    gradient in the incoming one's storage, the weight's from an (SMs, h) float32 scratch.
    On real tensors it computes the values too (their temporaries are not liger's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        if _real(x):
            with torch.no_grad():
                xf = x2.float()
                rstd.copy_(torch.rsqrt(xf.pow(2).mean(-1) + eps))
                y.copy_((xf * rstd[:, None]).to(x.dtype) * weight)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight, rstd = ctx.saved_tensors
        shape = dy.shape
        dy2 = dy.contiguous().view(-1, shape[-1])
        scratch = torch.empty((_SMS, shape[-1]), dtype=torch.float32, device=dy.device)
        if _real(dy):
            norm = x2.float() * rstd[:, None]
            g = dy2.float() * weight.float()
            dx = rstd[:, None] * (g - norm * (g * norm).mean(-1, keepdim=True))
            scratch.zero_()
            scratch[0] = (dy2.float() * norm.to(x2.dtype).float()).sum(0)
            dy2.copy_(dx)
        dw = scratch.sum(0).to(weight.dtype)
        return dy2.view(shape), dw, None


class _SiLUMul(torch.autograd.Function):
    """``LigerSiLUMulFunction``: ``silu(a) * b`` into one new tensor, saving ``a`` and ``b``;
    backward writes their gradients into their own storage."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.contiguous(), b.contiguous()
        c = torch.empty_like(a)
        if _real(a):
            with torch.no_grad():
                c.copy_(torch.nn.functional.silu(a) * b)
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx, dc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        dc = dc.contiguous()
        if _real(dc):
            af = a.float()
            s = torch.sigmoid(af)
            silu = af * s
            db = dc.float() * silu
            a.copy_(dc.float() * b.float() * (s + silu * (1 - s)))
            b.copy_(db)
        return a, b


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Rope(torch.autograd.Function):
    """``LigerRopeFunction``: q and k rotated in their own storage (made contiguous in their
    (B, T, heads, d) layout first), saving ``cos`` and ``sin``; backward likewise in place."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        if _real(q):
            c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # (B, T, 1, d) against (B, T, heads, d)
            with torch.no_grad():
                for t in (qt, kt):
                    t.copy_(t * c + _rotate_half(t) * s)
        ctx.save_for_backward(cos, sin)
        return qt.transpose(1, 2), kt.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        dqt, dkt = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        if _real(dq):
            c, s = cos.unsqueeze(2), sin.unsqueeze(2)
            for t in (dqt, dkt):
                t.copy_(t * c - _rotate_half(t * s))
        return dqt.transpose(1, 2), dkt.transpose(1, 2), None, None


def rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", 1e-6)
    return _RMSNorm.apply(hidden_states, self.weight, eps)


def swiglu_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          position_ids: object = None, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return _Rope.apply(q, k, cos, sin)
