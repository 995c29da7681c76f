"""What the CPU math libraries keep after a matmul, measured here, beside autofit's rule.

    python benchmarks/cpu_cache.py                 # the default shapes, fp32 and bf16
    python benchmarks/cpu_cache.py 512x256x3072x8192 2048x1024x4096x0
    python benchmarks/cpu_cache.py --half          # 16-bit: what each matmul shape keeps
    python benchmarks/cpu_cache.py --growth        # ... over a run of new lengths (tiny-gpt2)
    python benchmarks/cpu_cache.py --warm          # 16-bit: what is kept once, what per step

Each shape ``NxHxIxV`` (tokens, hidden, feed-forward, vocabulary; 0: no LM head) runs in
a fresh child under the measuring environment of ``benchmarks/measure_cpu.py`` (glibc's
thresholds fixed, one thread): a tiny linear forward and backward first (one-time
setup), then the RSS baseline, then the matmuls of one block and the head in a step's
order, each forward and backward: ``H -> H`` (attention), ``H -> I``, ``I -> H``
(feed-forward), ``H -> V`` (head). All tensors freed, the residue is what the libraries
keep (MKL's packing buffers for fp32, oneDNN's primitive cache and scratch for 16-bit).
The rule is ``autofit.memory.analytic.cpu_library_cache_bytes`` for a model of those
sizes on this CPU's instruction set, with, in fp32, what the process keeps from its first
step (``cpu_library_once_bytes``: an AMD EPYC's rule tells it apart; the tiny warm-up here
does not make it): a row where the rule is below the residue is an underestimate.

``--half`` measures the 16-bit side per matmul shape: ``n`` linears of distinct widths
(256 -> 8, 16, ...) at 512 rows, and one 256 -> 256 linear at ``n`` row counts (a run's
sequence lengths), each forward and backward in bf16 (three matmuls per linear). oneDNN
keeps a primitive and its JIT-compiled kernels per shape, so the residue grows with the
shapes, not with their sizes; the rule is given the shapes (``half_matmuls``).

``--warm`` tells apart what a 16-bit step keeps from what the process keeps once: each
case runs a warm-up first (a tiny matmul, or the same ops at 8 rows / 8 tokens, as
``measure_cpu.py``'s warm-up step), then the ops at full size: a bf16 linear (forward and
backward) at 512 rows, a bf16 flash attention (4 x 4 heads x 128 tokens x 64, causal), both.
What the warm-up leaves is the process's (oneDNN's first 16-bit matmul); what the full-size
ops add is the step's (``cpu_library_once_bytes`` / ``half_step`` on an AMD EPYC).

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


# a bf16 linear's forward and backward, and the process's resident bytes (the 16-bit children)
_HALF_OPS = r"""
import gc, json, sys, torch
torch.set_num_threads(1)
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
def linear(m, k, n):
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.linear(x, w).float().sum().backward()
    del x, w
    gc.collect()
"""

_HALF_CHILD = _HALF_OPS + r"""
linear(1, 8, 8)
base = rss()
for m, k, n in json.loads(sys.argv[1]):
    linear(m, k, n)
print(json.dumps(rss() - base))
"""

_GROWTH_CHILD = r"""
import gc, json, sys, torch
sys.path.insert(0, sys.argv[3])
from transformers import AutoModelForCausalLM
from autofit.probe.model import load_config
torch.set_num_threads(1)
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(load_config("tiny-gpt2"))
opt = torch.optim.AdamW(model.parameters())
half, lengths = sys.argv[1] == "bf16", json.loads(sys.argv[2])
def step(t):
    x = torch.randint(0, model.config.vocab_size, (2, t))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss
    gc.collect()
step(lengths[0])
step(lengths[0])
base = rss()
for t in lengths[1:]:
    step(t)
print(json.dumps(rss() - base))
"""

GROWTH_LENGTHS = list(range(64, 64 + 21))  # the first twice, then 20 new lengths


def growth() -> None:
    """tiny-gpt2 trained at micro batch 2 over 20 new lengths, bf16-mixed and 32-true: what
    the run kept above its first length, beside ``cpu_half_run_bytes``."""
    from measure_cpu import CHILD_ENV

    from autofit.config import TrainConfig
    from autofit.memory.analytic import cpu_half_run_bytes
    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model

    info = probe_model("tiny-gpt2")
    new = len(GROWTH_LENGTHS) - 1
    print(f"| tiny-gpt2, micro batch 2, {new} new lengths | kept MiB | rule MiB |")
    print("|---|---|---|")
    for dtype, precision in (("bf16", "bf16-mixed"), ("fp32", "32-true")):
        out = subprocess.run([sys.executable, "-c", _GROWTH_CHILD, dtype,
                              json.dumps(GROWTH_LENGTHS), str(HERE.parent)],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, **CHILD_ENV})
        kept = int(json.loads(out.stdout.strip().splitlines()[-1]))
        rule = cpu_half_run_bytes(info, TrainConfig(micro_batch_size=2, precision=precision),
                                  resolve_device("cpu"), new)
        print(f"| {precision} | {kept / 2**20:.1f} | {rule / 2**20:.1f} |")


# (what varies, how many): distinct widths at 512 rows, or one width at distinct rows
HALF_CASES = [("widths", 1), ("widths", 10), ("widths", 40), ("rows", 10), ("rows", 100)]


def half_residue(vary: str, n: int) -> tuple[int, int]:
    """(residue bytes, matmul shapes) of ``n`` bf16 linears differing in ``vary``."""
    from measure_cpu import CHILD_ENV

    lins = ([(512, 256, 8 * (i + 1)) for i in range(n)] if vary == "widths"
            else [(100 + 10 * i, 256, 256) for i in range(n)])
    out = subprocess.run([sys.executable, "-c", _HALF_CHILD, json.dumps(lins)],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, **CHILD_ENV})
    return int(json.loads(out.stdout.strip().splitlines()[-1])), 3 * len(lins)


def half_rule(shapes: int) -> int:
    from autofit.config import TrainConfig
    from autofit.memory.analytic import cpu_library_cache_bytes
    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model

    info = probe_model("tiny-llama")  # one block of one 256 -> 256 linear, no LM head
    block = dataclasses.replace(info.blocks[0], count=1, linears=(("l", 256, 256, False),))
    info = dataclasses.replace(info, task="seq-cls", vocab_size=None, blocks=(block,))
    return cpu_library_cache_bytes(info, TrainConfig(micro_batch_size=1, precision="bf16-true"),
                                   1, resolve_device("cpu"), half_matmuls=shapes)


def residue(shape: str, dtype: str) -> int:
    from measure_cpu import CHILD_ENV

    out = subprocess.run([sys.executable, "-c", _CHILD, dtype, shape], capture_output=True,
                         text=True, check=True, env={**os.environ, **CHILD_ENV})
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


def rule(shape: str, dtype: str) -> int:
    from autofit.config import TrainConfig
    from autofit.memory.analytic import cpu_library_cache_bytes
    from autofit.memory.analytic._cpu_cache import cpu_library_once_bytes
    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model

    N, H, ffn, V = map(int, shape.split("x"))
    info = probe_model("tiny-llama")  # one block of these sizes and the head
    block = dataclasses.replace(info.blocks[0], hidden_size=H, intermediate_size=ffn, count=1,
                                linears=(("attn", H, H, False), ("up", H, ffn, False),
                                         ("down", ffn, H, False)))
    info = dataclasses.replace(info, task="causal-lm" if V else "seq-cls",
                               vocab_size=V or None, hidden_size=H, blocks=(block,))
    precision = "32-true" if dtype == "float32" else "bf16-true"
    # the child's matmul shapes: per linear k -> n its forward, input and weight gradients
    shapes = {s for k, n in ((H, H), (H, ffn), (ffn, H)) + (((H, V),) if V else ())
              for s in (((N, k), (k, n)), ((N, n), (n, k)), ((n, N), (N, k)))}
    config, cpu = TrainConfig(micro_batch_size=N, precision=precision), resolve_device("cpu")
    # the child's warm-up is a tiny matmul: what the process keeps from its first full-size
    # fp32 step is in the residue too (an AMD EPYC's rule tells it apart)
    once = cpu_library_once_bytes(info, config, 1, cpu) if precision == "32-true" else 0
    return cpu_library_cache_bytes(info, config, 1, cpu, half_matmuls=len(shapes)) + once


_WARM_CHILD = _HALF_OPS + r"""
def attn(b, h, t, d):
    q, k, v = (torch.randn(b, h, t, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum().backward()
def run(ops):
    for kind, *a in ops:
        (linear if kind == 'linear' else attn)(*a)
    gc.collect()
run(json.loads(sys.argv[1]))
base = rss()
run(json.loads(sys.argv[2]))
print(json.dumps(rss() - base))
"""
LINEAR, ATTENTION = ["linear", 512, 256, 512], ["attention", 4, 4, 128, 64]
WARM_CASES = [  # (what, warm-up ops, measured ops)
    ("a linear after a tiny matmul", [["linear", 1, 8, 8]], [LINEAR]),
    ("a linear after one at 8 rows", [["linear", 8, 256, 512]], [LINEAR]),
    ("a flash attention after a tiny matmul", [["linear", 1, 8, 8]], [ATTENTION]),
    ("a flash attention after one at 8 tokens", [["attention", 1, 4, 8, 64]], [ATTENTION]),
    ("both after both at 8", [["attention", 1, 4, 8, 64], ["linear", 8, 256, 512]],
     [ATTENTION, LINEAR]),
]


def warm() -> None:
    """What 16-bit ops keep after a warm-up (``--warm``), beside the EPYC's rule."""
    from measure_cpu import CHILD_ENV

    print("| bf16 ops | residue MiB |")
    print("|---|---|")
    for what, before, ops in WARM_CASES:
        out = subprocess.run([sys.executable, "-c", _WARM_CHILD, json.dumps(before),
                              json.dumps(ops)], capture_output=True, text=True, check=True,
                             env={**os.environ, **CHILD_ENV})
        got = int(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"| {what} | {got / 2**20:.2f} |")


def main() -> None:
    from autofit.probe.device import cpu_capability

    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return

    print(f"instruction set: {cpu_capability()}\n")
    if sys.argv[1:] == ["--growth"]:
        growth()
        return
    if sys.argv[1:] == ["--warm"]:
        warm()
        return
    if sys.argv[1:] == ["--half"]:
        print("| bf16 linears | matmul shapes | residue MiB | rule MiB | rule - residue |")
        print("|---|---|---|---|---|")
        for vary, n in HALF_CASES:
            got, shapes = half_residue(vary, n)
            want = half_rule(shapes)
            print(f"| {n} of distinct {vary} | {shapes} | {got / 2**20:.2f} | "
                  f"{want / 2**20:.2f} | {(want - got) / 2**20:+.2f} |")
        return
    shapes = sys.argv[1:] or SHAPES
    print("| tokens x hidden x feed-forward x vocabulary | dtype | residue MiB | rule MiB | rule - residue |")
    print("|---|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        for shape in shapes:
            got, want = residue(shape, dtype), rule(shape, dtype)
            print(f"| {shape} | {dtype} | {got / 2**20:.2f} | {want / 2**20:.2f} | "
                  f"{(want - got) / 2**20:+.2f} |")


if __name__ == "__main__":
    main()
