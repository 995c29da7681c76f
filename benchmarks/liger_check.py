"""liger's kernels as autofit simulates them, against liger's own published memory measurements.

The numbers are liger-kernel's (``benchmark/data/all_benchmark_data.csv`` of
linkedin/Liger-Kernel: an A100-SXM4-80GB, liger 0.2.1, 2024-09-03), measured by its scripts
of that commit (b5672a15, ``benchmark/scripts/benchmark_swiglu.py``,
``benchmark_rms_norm.py``): ``torch.cuda.max_memory_allocated()`` over one forward and
backward (``y.backward(dy, retain_graph=True)``), the median of 10 calls in a process
holding the inputs, both modules and the gradients of the calls before.

This script replays each of those calls on fake tensors under autofit's recorder, with
CUDA's semantics (``autofit.memory.simulate``), and liger's kernels replaced by the stand-ins
autofit's estimates use (``autofit.knobs.liger``): transformers' ``LlamaMLP`` against
``LigerSwiGLUMLP``, the scripts' ``LlamaRMSNorm`` against ``LigerRMSNorm``. The "huggingface"
rows check the simulator on the code liger replaces, the "liger" rows the stand-ins.

RMSNorm of liger 0.2.1 differs from today's in one buffer: its backward's weight-gradient
scratch was an (rows, h) tensor in the weight's dtype (``torch.empty_like(X, dtype=W.dtype)``),
today's is (SMs, h) in float32. The 0.2.1 rows are replayed with 0.2.1's scratch
(``--scratch-rows all``); the stand-in keeps today's.

    python benchmarks/liger_check.py   # writes benchmarks/results/liger_check.md
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autofit.knobs import _liger_stand_ins as stand_ins
from autofit.memory.simulate._cuda import CudaSemantics
from autofit.memory.simulate._recorder import StorageRecorder
from autofit.probe.device import resolve_device

OUT = Path(__file__).parent / "results" / "liger_check.md"
SOURCE = ("https://github.com/linkedin/Liger-Kernel/blob/main/benchmark/data/"
          "all_benchmark_data.csv")
# (kernel, provider, x, published MiB): the csv's memory rows, "full" mode, A100-SXM4-80GB
SWIGLU = {"B": 4, "hidden_size": 4096, "intermediate_size": 11008}  # bf16, silu
SWIGLU_ROWS = [(1024, 1100.25, 1294.25), (2048, 1582.25, 1992.25), (4096, 2546.25, 3452.25),
               (8192, 4474.25, 6372.25)]  # (T, liger, huggingface)
RMS_M = 2048  # rows; bf16 input, float32 weight (the script's modules are not cast)
RMS_ROWS = [(1024, 36.02392578125, 80.01953125), (2048, 72.03955078125, 160.03125),
            (4096, 144.07080078125, 320.0546875), (8192, 268.13330078125, 640.1015625),
            (16384, 432.25830078125, 1280.1953125), (32768, 752.5087890625, 2560.3828125)]


class LlamaRMSNorm(torch.nn.Module):
    """benchmark_rms_norm.py's own copy of transformers' RMSNorm (float32 weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _module(cls, args, dtype, rec):
    """``cls(*args)`` with fake parameters of ``dtype``, each recorded (as the script's
    modules sit on the card)."""
    from autofit.memory.simulate._model import fake_clone

    with torch.device("meta"):
        meta = cls(*args)
    module = fake_clone(meta, float_dtype=dtype)
    for p in module.parameters():
        rec.track(p)
    return module


def _peak_mib(setup, full, calls: int = 3) -> float:
    """Peak allocated MiB (blocks of 512 B) of the last of ``calls`` calls of ``full`` after
    ``setup`` (what the script's process holds), replayed on fake CUDA tensors."""
    rec = StorageRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, rec, CudaSemantics(
            resolve_device("A100-80GB")):
        state = setup(rec)
        starts = []
        for _ in range(calls):
            starts.append(len(rec.events()))
            full(state)
        log = rec.events()
    del mode
    live, sizes, peak = 0, {}, 0
    for i, (kind, r, _) in enumerate(log):
        if kind == "alloc":
            sizes[id(r)] = -(-r.size // 512) * 512
            live += sizes[id(r)]
        else:
            live -= sizes.pop(id(r), 0)
        if i >= starts[-1]:
            peak = max(peak, live)
    return peak / 2**20


def swiglu_rows(only: tuple[int, ...] | None = None) -> list[tuple[str, str, int, float, float]]:
    """The SwiGLU rows (``only``: those sequence lengths)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(hidden_size=SWIGLU["hidden_size"],
                      intermediate_size=SWIGLU["intermediate_size"], hidden_act="silu")
    out = []
    for T, pub_liger, pub_hf in SWIGLU_ROWS:
        if only is not None and T not in only:
            continue
        for provider, published in (("liger", pub_liger), ("huggingface", pub_hf)):
            def setup(rec, T=T, provider=provider):
                x = torch.randn(SWIGLU["B"], T, SWIGLU["hidden_size"], device="cpu",
                                dtype=torch.bfloat16, requires_grad=True)
                layer = _module(LlamaMLP, (cfg,), torch.bfloat16, rec)
                if provider == "liger":
                    layer.forward = stand_ins.swiglu_forward.__get__(layer)
                return x, layer

            def full(state):
                x, layer = state
                y = layer(x)
                y.backward(torch.randn_like(y), retain_graph=True)

            out.append(("swiglu", provider, T, published, _peak_mib(setup, full)))
    return out


@contextlib.contextmanager
def _scratch_rows_of_0_2_1():
    """liger 0.2.1's RMSNorm backward: an (rows, h) weight-gradient scratch in the weight's
    dtype instead of today's (SMs, h) float32 one."""
    old = stand_ins._RMSNorm.backward

    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.contiguous().view(-1, dy.shape[-1])
        scratch = torch.empty_like(x2, dtype=weight.dtype)
        return dy2.view(dy.shape), scratch.sum(0).to(weight.dtype), None

    stand_ins._RMSNorm.backward = staticmethod(backward)
    try:
        yield
    finally:
        stand_ins._RMSNorm.backward = old


def rms_rows() -> list[tuple[str, str, int, float, float]]:
    out = []
    for H, pub_liger, pub_hf in RMS_ROWS:
        def setup(rec, H=H):
            norms = (_module(LlamaRMSNorm, (H,), torch.float32, rec),
                     _module(LlamaRMSNorm, (H,), torch.float32, rec))
            norms[0].forward = stand_ins.rms_norm_forward.__get__(norms[0])  # the liger one
            x = torch.randn(RMS_M, H, dtype=torch.bfloat16, device="cpu")
            dy = torch.randn_like(x)
            x.requires_grad_(True)
            return x, dy, norms

        for i, (provider, published) in enumerate((("liger", pub_liger),
                                                   ("huggingface", pub_hf))):
            def full(state, i=i):
                x, dy, norms = state
                y = norms[i](x)
                y.backward(dy, retain_graph=True)

            with _scratch_rows_of_0_2_1() if provider == "liger" else contextlib.nullcontext():
                out.append(("rms_norm", provider, H, published, _peak_mib(setup, full)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    rows = swiglu_rows() + rms_rows()
    lines = ["# liger's kernels: autofit's simulation against liger's published measurements",
             "", f"Produced by `python benchmarks/liger_check.py`. Published: {SOURCE} "
             "(NVIDIA A100-SXM4-80GB, liger 0.2.1, `max_memory_allocated`, MiB; the "
             "scripts of commit b5672a15). Simulated: the same calls on fake tensors with "
             "CUDA's semantics, liger's kernels replaced by autofit's stand-ins "
             "(`autofit.knobs.liger`). Error = (simulated - published) / published.", "",
             "| kernel | provider | x | published MiB | simulated MiB | error |",
             "|---|---|---|---|---|---|"]
    errs = []
    for kernel, provider, x, pub, sim in rows:
        err = (sim - pub) / pub
        errs.append((abs(err), err, kernel, provider, x))
        lines.append(f"| {kernel} | {provider} | {x} | {pub:.2f} | {sim:.2f} | {100 * err:+.1f}% |")
    errs.sort()
    med = errs[len(errs) // 2][0]
    worst = errs[-1]
    lines += ["", f"{len(rows)} rows: median |error| {100 * med:.1f}%, worst "
              f"{100 * worst[1]:+.1f}% ({worst[2]} {worst[3]} x={worst[4]}); "
              f"lowest {100 * min(e[1] for e in errs):+.1f}%.", "",
              "x: the sequence length T for swiglu (B 4, h 4096, I 11008, bf16), the hidden "
              "size h for rms_norm (2048 rows, bf16 input, float32 weight).",
              "RMSNorm's liger rows are replayed with liger 0.2.1's weight-gradient scratch "
              "((rows, h) in the weight's dtype); the stand-in autofit estimates with keeps "
              "today's ((SMs, h) float32, liger's ops/rms_norm.py).", "",
              "Not explained: liger's RMSNorm rows measured 16-112 MiB more than the "
              "replay (8 bytes per input element up to h 4096, then ~110 MiB), while "
              "transformers' RMSNorm rows agree to the byte. The replay holds what 0.2.1's "
              "functions allocate; what it lacks is not in their Python code (a guess: the "
              "CUDA reduction over the (rows, h) scratch's rows, which today's (SMs, h) "
              "scratch does not make). Until a card measures today's kernel, read the "
              "RMSNorm part of a liger estimate as up to 8 bytes per token x h (one norm's "
              "backward) low; the SwiGLU rows, the larger saving, agree."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
