"""What the CPU math libraries keep after a matmul, measured here, beside autofit's rule.

    python benchmarks/cpu_cache.py                 # the default shapes, fp32 and bf16
    python benchmarks/cpu_cache.py 512x256x3072x8192 2048x1024x4096x0

Each shape ``NxHxIxV`` (tokens, hidden, feed-forward, vocabulary; 0: no LM head) runs in
a fresh child under the measuring environment of ``benchmarks/measure_cpu.py`` (glibc's
thresholds fixed, one thread): a tiny linear forward and backward first (one-time
setup), then the RSS baseline, then the matmuls of one block and the head in a step's
order, each forward and backward: ``H -> H`` (attention), ``H -> I``, ``I -> H``
(feed-forward), ``H -> V`` (head). All tensors freed, the residue is what the libraries
keep (MKL's packing buffers for fp32, oneDNN's primitive cache and scratch for 16-bit).
The rule is ``autofit.memory.analytic.cpu_library_cache_bytes`` for a model of those
sizes on this CPU's instruction set: a row where the rule is below the residue is an
underestimate.

NB: the libraries keep buffers per thread; autofit's trials and this harness run one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SHAPES = ["128x256x512x8192", "384x256x512x8192", "448x256x512x8192", "512x256x512x8192",
          "2048x256x512x8192", "512x256x3072x8192", "512x256x3072x0", "1024x512x2048x16384",
          "512x2048x5632x32000", "2048x1024x4096x0"]

_CHILD = r"""
import gc, json, sys, torch
torch.set_num_threads(1)
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
dtype = getattr(torch, sys.argv[1])
M, H, I, V = map(int, sys.argv[2].split('x'))
def linear(k, n):
    x = torch.randn(M, k, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, dtype=dtype, requires_grad=True)
    torch.nn.functional.linear(x, w).sum().backward()
    del x, w
    gc.collect()
M0, M = M, 1
linear(8, 8)
M = M0
base = rss()
for k, n in ((H, H), (H, I), (I, H)) + (((H, V),) if V else ()):
    linear(k, n)
print(json.dumps(rss() - base))
"""


def residue(shape: str, dtype: str) -> int:
    from measure_cpu import CHILD_ENV

    out = subprocess.run([sys.executable, "-c", _CHILD, dtype, shape], capture_output=True,
                         text=True, check=True, env={**os.environ, **CHILD_ENV})
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def rule(shape: str, dtype: str) -> int:
    from autofit.config import TrainConfig
    from autofit.memory.analytic import cpu_library_cache_bytes
    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model

    N, H, ffn, V = map(int, shape.split("x"))
    info = probe_model("tiny-llama")  # one block of these sizes and the head
    block = dataclasses.replace(info.blocks[0], hidden_size=H, intermediate_size=ffn, count=1)
    info = dataclasses.replace(info, task="causal-lm" if V else "seq-cls",
                               vocab_size=V or None, hidden_size=H, blocks=(block,))
    precision = "32-true" if dtype == "float32" else "bf16-true"
    return cpu_library_cache_bytes(info, TrainConfig(micro_batch_size=N, precision=precision), 1,
                                   resolve_device("cpu"))


def main() -> None:
    from autofit.probe.device import cpu_capability

    shapes = sys.argv[1:] or SHAPES
    print(f"instruction set: {cpu_capability()}\n")
    print("| tokens x hidden x feed-forward x vocabulary | dtype | residue MiB | rule MiB | rule - residue |")
    print("|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        for shape in shapes:
            got, want = residue(shape, dtype), rule(shape, dtype)
            print(f"| {shape} | {dtype} | {got / 2**20:.2f} | {want / 2**20:.2f} | "
                  f"{(want - got) / 2**20:+.2f} |")


if __name__ == "__main__":
    main()
