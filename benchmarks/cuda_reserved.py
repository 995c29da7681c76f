"""The analytic estimate's reserved bytes on a card against the simulated allocator's.

    python benchmarks/cuda_reserved.py                 # simulate the grid (~25 min), report
    python benchmarks/cuda_reserved.py --report        # re-estimate analytic, rewrite the report

The closed form (``autofit.memory.analytic.cuda_reserved_bytes``) puts what the caching
allocator can strand over the highest candidate phase's allocated bytes; the simulate
method replays the step's recorded allocation stream through a model of the CUDA caching
allocator. On a grid of real-size models (Llama-3.2-1B, GPT-2 medium, bert-large,
Qwen2-0.5B shapes, which the rule was fitted on, and SmolLM2-360M and Gemma-2B, held out;
built from their configs: no weights) x checkpointing x precision x (micro batch, steps
accumulated) x optimizer on an H100 target, this compares the analytic reserved peak with
two figures of the simulated stream (two steps, the second finding the first's cache):

* the unconstrained reserved peak (what ``torch.cuda.max_memory_reserved`` reads on a
  card with room to spare, what a published ``nvidia-smi`` reading holds), and
* the least capacity the stream runs in (``autofit.memory.allocator.replay`` with a
  capacity, bisected to 2 MiB): below it the allocator's own retry (free every cached
  segment that holds no live block, then ``cudaMalloc`` again) fails, an OOM. Between
  the two the step runs, only slower.

An estimate below the least capacity is an OOM waiting for a user; one below the
reserved peak is not. Results: ``benchmarks/results/cuda_reserved.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
OUT = HERE / "results" / "cuda_reserved"
DEVICE = "H100-80GB"
SEQ = 512
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": ("causal-lm", {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 4096}),
    "gpt2-medium": ("causal-lm", {
        "model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16,
        "vocab_size": 50257, "n_positions": 1024}),
    "bert-large": ("seq-cls", {
        "model_type": "bert", "hidden_size": 1024, "intermediate_size": 4096,
        "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 30522,
        "max_position_embeddings": 512}),
    "qwen2-0.5b": ("causal-lm", {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096}),
    # held out from the fit of the reserved rule (``cuda_reserved_bytes``): checked on
    "smollm2-360m": ("causal-lm", {
        "model_type": "llama", "hidden_size": 960, "intermediate_size": 2560,
        "num_hidden_layers": 32, "num_attention_heads": 15, "num_key_value_heads": 5,
        "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 4096}),
    "gemma-2b": ("causal-lm", {
        "model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384,
        "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 4096}),
}
GRID = list(itertools.product([True, False], ["32-true", "bf16-mixed"], [(1, 4), (4, 1)],
                              ["adamw_torch", "adafactor"]))


def _config(gc: bool, precision: str, shape: tuple[int, int], optimizer: str) -> Any:
    from autofit import TrainConfig

    return TrainConfig(micro_batch_size=shape[0], grad_accum_steps=shape[1],
                       precision=precision, gradient_checkpointing=gc, optimizer=optimizer)


def _key(name: str, gc: bool, precision: str, shape: tuple[int, int], optimizer: str) -> str:
    return f"{name}|{'gc' if gc else 'no-gc'}|{precision}|b{shape[0]}xga{shape[1]}|{optimizer}"


def least_capacity(events: list[Any], lo: int, hi: int) -> int:
    """The least allocator capacity the stream runs in, to 2 MiB."""
    from autofit.memory.allocator import replay

    lo -= 1  # fails: below the live bytes
    while hi - lo > (2 << 20):
        mid = (lo + hi) // 2
        if replay(events, "cuda", mid).oom:
            lo = mid
        else:
            hi = mid
    return hi


def simulate_rows(rows: dict[str, Any], tmp: Path) -> None:
    """The simulated figures of every grid row not in ``rows`` (saved as they come)."""
    from autofit.memory.allocator import replay
    from autofit.memory.simulate import Simulator
    from autofit.probe.device import resolve_device
    from autofit.probe.model import build_model

    device = resolve_device(DEVICE)
    for name, (task, cfg) in MODELS.items():
        todo = [g for g in GRID if _key(name, *g) not in rows]
        if not todo:
            continue
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(cfg))
        module, _ = build_model(str(path), task=task)
        sim = Simulator(module, task=task, device=device)
        for g in todo:
            t = time.perf_counter()
            events = sim.events(_config(*g), seq_len=SEQ)
            r = replay(events, "cuda")
            rows[_key(name, *g)] = {
                "allocated": r.peak_allocated_bytes, "reserved": r.peak_reserved_bytes,
                "least": least_capacity(events, r.peak_allocated_bytes, r.peak_reserved_bytes)}
            print(f"{_key(name, *g)}: {time.perf_counter() - t:.0f} s", flush=True)
            OUT.with_suffix(".json").write_text(json.dumps(rows, indent=1, sort_keys=True))


def analytic_rows(rows: dict[str, Any], tmp: Path) -> None:
    """The analytic estimate of every row (the closed form as it is now)."""
    from autofit import estimate

    for name, (task, cfg) in MODELS.items():
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(cfg))
        for g in GRID:
            row = rows.get(_key(name, *g))
            if row is None:
                continue
            est = estimate(str(path), _config(*g), seq_len=SEQ, device=DEVICE,
                           method="analytic", task=task)
            row.update(analytic_allocated=est.peak_allocated_bytes,
                       analytic_reserved=est.peak_reserved_bytes, analytic_phase=est.peak_phase)


def report(rows: dict[str, Any]) -> str:
    mib = 2**20
    lines = ["# Analytic reserved bytes on a card vs the simulated allocator", "",
             "Produced by `python benchmarks/cuda_reserved.py` (see its docstring): "
             f"{len(rows)} configurations on an {DEVICE} target, {SEQ} tokens a sample. "
             "Error = analytic reserved / simulated figure - 1; negative = under. *Least* is "
             "the least allocator capacity the simulated stream runs in (below it, an OOM); "
             "*reserved* the unconstrained reserved peak.", ""]
    vs_least = [r["analytic_reserved"] / r["least"] - 1 for r in rows.values()]
    vs_res = [r["analytic_reserved"] / r["reserved"] - 1 for r in rows.values()]
    alloc = [r["analytic_allocated"] / r["allocated"] - 1 for r in rows.values()]
    lines += ["| analytic vs | median | median abs | lowest | highest | under -3% |",
              "|---|---|---|---|---|---|"]
    for label, e in (("simulated allocated", alloc), ("least capacity", vs_least),
                     ("reserved peak", vs_res)):
        lines.append(f"| {label} | {100 * statistics.median(e):+.1f}% | "
                     f"{100 * statistics.median(map(abs, e)):.1f}% | {100 * min(e):+.1f}% | "
                     f"{100 * max(e):+.1f}% | {sum(x < -0.03 for x in e)} |")
    lines += ["", "| configuration | sim allocated MiB | least MiB | reserved MiB | "
              "analytic MiB (phase) | vs least | vs reserved |", "|---|---|---|---|---|---|---|"]
    for k, r in sorted(rows.items()):
        lines.append(
            f"| {k} | {r['allocated'] / mib:,.0f} | {r['least'] / mib:,.0f} | "
            f"{r['reserved'] / mib:,.0f} | {r['analytic_reserved'] / mib:,.0f} "
            f"({r['analytic_phase']}) | {100 * (r['analytic_reserved'] / r['least'] - 1):+.1f}% | "
            f"{100 * (r['analytic_reserved'] / r['reserved'] - 1):+.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", action="store_true",
                    help="only re-estimate analytic and rewrite the report")
    args = ap.parse_args(argv)
    path = OUT.with_suffix(".json")
    rows = json.loads(path.read_text()) if path.exists() else {}
    with tempfile.TemporaryDirectory() as d:
        if not args.report:
            simulate_rows(rows, Path(d))
        analytic_rows(rows, Path(d))
    path.write_text(json.dumps(rows, indent=1, sort_keys=True))
    OUT.with_suffix(".md").write_text(report(rows))
    print(OUT.with_suffix(".md").read_text().split("\n\n| configuration")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
