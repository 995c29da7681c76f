"""What CPU kernels allocate inside and free before they return, measured here, beside
autofit's rule; and what MKL keeps after one fp32 product, by its widths.

    python benchmarks/cpu_kernel_copies.py          # both tables
    python benchmarks/cpu_kernel_copies.py --ops    # the copies inside ops only (printed)

Each case runs in a fresh child under the measuring environment of
``benchmarks/measure_cpu.py`` (glibc's thresholds fixed: every block above 64 KiB is its
own mapping; one thread).

``--ops``: the op runs once (one-time state), then again between a reset of the
high-water mark (``/proc/self/clear_refs``) and its reading; the transient is ``VmHWM``
above the larger of the RSS before and after (its output included). The rule is
``autofit.memory.simulate._cpu_kernels.cpu_kernel_temporaries`` on the same tensors.

``--mkl``: after an 8-row product (MKL's one-time state), one fp32 product of 512 rows
``(512, K) @ (K, N)``; what the process keeps after it beyond its output. Not in autofit's
rule yet (``docs/accuracy.md``, MobileBERT): the table is the evidence for one.

Writes ``benchmarks/results/cpu_kernel_copies.md`` (both tables).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

# (label, setup: defines the operands and run() -> the op's output; the op, its arguments
# and output as the rule sees them)
OPS = [
    ("bf16 + fp32 add (a residual add under autocast)",
     "x = torch.randn(1024, 2048).bfloat16(); y = torch.randn(1024, 2048)\n"
     "def run(): return x + y", "aten.add.Tensor", "(x, y)", "x + y"),
    ("bf16 += fp32, in place", "x = torch.randn(1024, 2048).bfloat16(); y = torch.randn(1024, 2048)\n"
     "def run(): return x.add_(y)", "aten.add_.Tensor", "(x, y)", "x"),
    ("silu_backward(fp32 grad, bf16 input)",
     "g = torch.randn(1024, 2048); x = torch.randn(1024, 2048).bfloat16()\n"
     "def run(): return torch.ops.aten.silu_backward(g, x)", "aten.silu_backward.default",
     "(g, x)", "g.clone()"),
    ("gelu_backward(fp32 grad, bf16 input)",
     "g = torch.randn(1024, 2048); x = torch.randn(1024, 2048).bfloat16()\n"
     "def run(): return torch.ops.aten.gelu_backward(g, x)", "aten.gelu_backward.default",
     "(g, x)", "g.clone()"),
    ("fp32 + fp32 add", "x = torch.randn(1024, 2048)\ndef run(): return x + x",
     "aten.add.Tensor", "(x, x)", "x"),
    ("bf16 bmm, first operand a batch transpose (32, 256, 768)",
     "a = torch.randn(256, 32, 768).bfloat16().transpose(0, 1)\n"
     "b = torch.randn(32, 768, 64).bfloat16()\ndef run(): return torch.bmm(a, b)",
     "aten.bmm.default", "(a, b)", "None"),
    ("bf16 bmm, contiguous operands", "a = torch.randn(32, 256, 768).bfloat16()\n"
     "b = torch.randn(32, 768, 64).bfloat16()\ndef run(): return torch.bmm(a, b)",
     "aten.bmm.default", "(a, b)", "None"),
]
MKL_K = (64, 128, 256, 512, 1024)
MKL_N = (256, 1024, 4096, 8192, 16384)

_INSIDE_CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
exec(sys.argv[1])  # defines run() -> the op's output, after its operands exist
out = run(); del out  # once first: the kernel's one-time state
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
out = run()
print(json.dumps(status("VmHWM") - max(before, status("VmRSS"))))
"""


def measured_inside(setup: str) -> int:
    """Bytes the op of ``setup`` (Python defining its operands and ``run()``) allocates
    inside beyond its output, in a fresh child: the module docstring's ``--ops``."""
    return int(_child(_INSIDE_CHILD, setup))


def _rule(setup: str, op: str, args: str, out: str) -> int:
    """``cpu_kernel_temporaries`` on the operands ``setup`` makes (here, in this process)."""
    import torch

    from autofit.memory.simulate._cpu_kernels import cpu_kernel_temporaries, mkldnn_cpu

    scope: dict = {"torch": torch}
    exec(setup, scope)  # noqa: S102 - this file's own cases
    func = eval("torch.ops." + op, scope)  # noqa: S307
    return cpu_kernel_temporaries(func, eval(args, scope), {}, eval(out, scope),  # noqa: S307
                                  mkldnn_cpu())


_MKL_CHILD = r"""
import gc, json, sys, torch
torch.set_num_threads(1)
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
k, n = int(sys.argv[1]), int(sys.argv[2])
o = torch.randn(8, 64) @ torch.randn(64, 64); del o
x, w = torch.randn(512, k), torch.randn(k, n); gc.collect()
before = rss(); o = x @ w; del o
print(json.dumps(rss() - before))
"""


def _child(code: str, *args: str) -> object:
    from measure_cpu import CHILD_ENV

    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **CHILD_ENV}, check=True,
                          cwd=str(HERE.parent))
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from autofit.probe.device import cpu_capability, cpu_vendor

    lines = ["# Copies inside CPU kernels, and what MKL keeps per fp32 product", "",
             f"`python benchmarks/cpu_kernel_copies.py` on {cpu_vendor()} {cpu_capability()} "
             "(see its docstring). MiB.", "",
             "| op | measured inside | autofit's rule |", "|---|---|---|"]
    for label, setup, op, args, out in OPS:
        measured, rule = measured_inside(setup), _rule(setup, op, args, out)
        lines.append(f"| {label} | {_mib(measured)} | {_mib(rule)} |")
        print(lines[-1], flush=True)
    if "--ops" not in argv:
        lines += ["", "What MKL keeps after one (512, K) @ (K, N) fp32 product (rows: K):", "",
                  "| K \\ N | " + " | ".join(map(str, MKL_N)) + " |",
                  "|---" * (len(MKL_N) + 1) + "|"]
        for k in MKL_K:
            kept = [_mib(float(_child(_MKL_CHILD, str(k), str(n)))) for n in MKL_N]
            lines.append(f"| {k} | " + " | ".join(kept) + " |")
            print(lines[-1], flush=True)
        out_path = HERE / "results" / "cpu_kernel_copies.md"
        out_path.write_text("\n".join(lines) + "\n")
        print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
