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

The same chains inside one non-reentrant ``torch.utils.checkpoint`` (``--checkpoint``
rows): each saved slot holds the checkpoint's handle (the data is freed), and backward
rebuilds the chain's graph beside the forward's: the bytes per op after the forward, and
at the peak through backward (VmHWM).

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
from torch.utils.checkpoint import checkpoint
torch.set_num_threads(1)
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
def hwm():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM'))
n, kind, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
w = torch.randn(16, requires_grad=True)
x = torch.randn(16)
def chain(y, n):
    for _ in range(n):
        if kind == "add": y = y + 1.0
        elif kind == "exp": y = torch.exp(y)
        elif kind == "mul": y = y * w
        elif kind == "view": y = y.view(4, 4).view(16)
    return y
def run(n):
    y = x * w
    return checkpoint(chain, y, n, use_reentrant=False) if ckpt else chain(y, n)
run(10).sum().backward()
w.grad = None
gc.collect()
base = rss()
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
y = run(n)
gc.collect()
forward = rss() - base
y.sum().backward()
print(forward / n, (hwm() - base) / n)
"""


def per_op(kind: str, checkpointed: bool = False) -> tuple[float, float]:
    """Bytes per op of a chain: after its forward, and at the peak through backward."""
    from measure_cpu import CHILD_ENV

    out = subprocess.run([sys.executable, "-c", _CHILD, str(N), kind, str(int(checkpointed))],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, **CHILD_ENV})
    forward, peak = out.stdout.strip().splitlines()[-1].split()
    return float(forward), float(peak)


def main() -> None:
    import torch

    shape = {"add": (1, 0), "exp": (1, 1), "mul": (1, 2), "view": (2, 0)}
    rows = {k: per_op(k) for k in shape}
    ckpt = {k: per_op(k, checkpointed=True) for k in ("add", "exp", "mul")}
    lines = ["# The autograd graph's host memory (benchmarks/autograd_host.py)", "",
             f"torch {torch.__version__}; {N:,} ops per chain, bytes per op "
             "(a 16-element fp32 tensor's data: an 80 B heap chunk)", "",
             "| chain | nodes per op | saved per op | bytes per op | checkpointed: after forward "
             "| checkpointed: peak through backward |", "|---|---|---|---|---|---|"]
    for k, (v, _) in rows.items():
        c = ckpt.get(k)
        extra = f"{c[0]:.0f} | {c[1]:.0f}" if c else "- | -"
        lines.append(f"| {k} | {shape[k][0]} | {shape[k][1]} | {v:.0f} | {extra} |")
    node = rows["add"][0]
    handle = (ckpt["mul"][0] - ckpt["add"][0]) / 2
    rebuilt = (ckpt["mul"][1] - ckpt["mul"][0] - node) / 2
    lines += ["", f"a node: {node:.0f} B; a saved output beyond it: {rows['exp'][0] - node:.0f} B "
              f"(80 of them the data). autofit charges 640 B a node and 400 B a saved tensor.",
              "", f"checkpointed: a saved slot (the checkpoint's handle): {handle:.0f} B; through "
              f"backward, a rebuilt node and {rebuilt:.0f} B a rebuilt saved tensor (mul). "
              "autofit charges 630 B a saved slot, and one block's rebuilt graph at 640 B a "
              "node and 870 B a saved tensor."]
    text = "\n".join(lines) + "\n"
    (HERE / "results" / "autograd_host.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
