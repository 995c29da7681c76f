"""The autograd graph's own host memory, per node and per saved tensor, measured here.

    python benchmarks/autograd_host.py        # writes benchmarks/results/autograd_host.md

Each chain runs in a fresh child under the measuring environment of
``benchmarks/measure_cpu.py`` (glibc's thresholds fixed, one thread): 20,000 ops on a
16-element tensor that requires grad, each making one autograd node, and the resident
bytes they add per op (the data of a 16-element fp32 tensor is an 80 B heap chunk):

* ``add``: ``y + 1.0`` saves nothing: the node alone;
* ``exp``: ``exp(y)`` saves its output: the node + a saved tensor (its data included);
* ``mul``: ``y * w`` saves ``y`` and the leaf ``w``;
* ``view``: two ``view`` nodes, nothing saved.

``autofit.memory.simulate._step`` charges 640 B a node and 400 B a saved tensor (beside
the data the simulator counts) on a CPU target: not tensors, so the allocation stream
does not show them. Negligible for a transformer's few hundred nodes; RWKV's per-token
recurrence on a CPU makes thousands (``benchmarks/results/zoo.md``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

N = 20_000
_CHILD = r"""
import gc, sys, torch
torch.set_num_threads(1)
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
n, kind = int(sys.argv[1]), sys.argv[2]
w = torch.randn(16, requires_grad=True)
x = torch.randn(16)
(x * w).sum().backward()
gc.collect()
base = rss()
y = x * w
for _ in range(n):
    if kind == "add": y = y + 1.0
    elif kind == "exp": y = torch.exp(y)
    elif kind == "mul": y = y * w
    elif kind == "view": y = y.view(4, 4).view(16)
gc.collect()
print((rss() - base) / n)
"""


def per_op(kind: str) -> float:
    from measure_cpu import CHILD_ENV

    out = subprocess.run([sys.executable, "-c", _CHILD, str(N), kind], check=True,
                         capture_output=True, text=True, env={**os.environ, **CHILD_ENV})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch

    rows = {k: per_op(k) for k in ("add", "exp", "mul", "view")}
    lines = ["# The autograd graph's host memory (benchmarks/autograd_host.py)", "",
             f"torch {torch.__version__}; {N:,} ops per chain, bytes per op "
             "(a 16-element fp32 tensor's data: an 80 B heap chunk)", "",
             "| chain | nodes per op | saved per op | bytes per op |", "|---|---|---|---|"]
    shape = {"add": (1, 0), "exp": (1, 1), "mul": (1, 2), "view": (2, 0)}
    for k, v in rows.items():
        lines.append(f"| {k} | {shape[k][0]} | {shape[k][1]} | {v:.0f} |")
    node = rows["add"]
    lines += ["", f"a node: {node:.0f} B; a saved output beyond it: {rows['exp'] - node:.0f} B "
              f"(80 of them the data). autofit charges 640 B a node and 400 B a saved tensor."]
    text = "\n".join(lines) + "\n"
    (HERE / "results" / "autograd_host.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
