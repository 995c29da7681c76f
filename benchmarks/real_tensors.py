"""A zoo row's real step, its tensors read by torch's memory profiler (no autofit code),
beside the simulated step's tensor stream: where the two peak and what is alive there.

    python benchmarks/real_tensors.py zoo-rwkv-causal-lm-s-lora

The real side runs the harness's own step (``benchmarks/measure_cpu.py``: its model, batch,
warm-up and glibc settings, re-executed with them in the environment) and reads the
profiler's memory timeline of the third step (``torch.profiler._memory_profiler``): the
live tensor bytes above the step's start, and the sizes alive at their peak. The simulated
side is ``autofit.memory.simulate.Simulator``'s event stream of the same configuration
(its second step). Written for issue 25 (RWKV's small steps were 3.6-5.5% over: the tensors
agree to the byte; what differed was the autograd graph's host memory, one block beside
them, where the real process keeps its nodes in the heap's holes).
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0",
       "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
MiB = 2**20


def _sizes(sizes: list[int]) -> str:
    c = collections.Counter(sizes)
    top = ", ".join(f"{n} x {k / MiB:.3f}" for k, n in sorted(c.items(), reverse=True)[:6])
    return f"{len(sizes)} tensors ({top}, ...)"


def real(spec: dict) -> tuple[float, list[int]]:
    """The real step's live tensor bytes above its start at their peak, and the sizes then."""
    import measure_cpu as mc
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile
    from transformers import Trainer, TrainingArguments

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, optim=spec["optimizer"],
                                 optim_args=spec["optim_args"], use_cpu=True, report_to=[])
        opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    model, config = mc._build_model(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    _, autocast, _ = mc.PRECISIONS[spec["precision"]]
    warm = mc._make_batch(spec, config, mc.WARMUP_BATCH, mc.WARMUP_SEQ)
    opt = mc._make_optimizer(model, opt_cls, opt_kwargs, args.weight_decay)
    mc._step(model, warm, opt, params, autocast, None)
    model.zero_grad(set_to_none=True)
    del opt, warm
    gc.collect()
    batch = mc._make_batch(spec, config, spec["batch"], spec["seq"])
    opt = mc._make_optimizer(model, opt_cls, opt_kwargs, args.weight_decay)
    for _ in range(2):
        mc._step(model, batch, opt, params, autocast, None)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        mc._step(model, batch, opt, params, autocast, None)
    live, peak, alive, snap = 0, 0, {}, []
    for _, action, (key, _), size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if str(key.device) != "cpu" or action == Action.PREEXISTING:
            continue
        if action == Action.CREATE:
            live += size
            alive[key] = size
        elif action == Action.DESTROY:
            live -= size
            alive.pop(key, None)
        if live > peak:
            peak, snap = live, list(alive.values())
    return peak / MiB, snap


def simulated(spec: dict) -> tuple[float, list[int]]:
    """The simulated step's live bytes above its start at their peak (the autograd graph's
    host memory included, node by node, as the estimate holds it) and the sizes then."""
    from accuracy import lora_spec

    from autofit import TrainConfig
    from autofit.memory.simulate import Simulator
    from autofit.probe.model import build_model

    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps({"model_type": spec["model_type"], **spec["config"]}))
    module, task = build_model(str(path), task=spec["task"],
                               attn_implementation=spec.get("attn_implementation"),
                               lora=lora_spec(spec.get("lora")))
    config = TrainConfig(micro_batch_size=spec["batch"], precision=spec["precision"],
                         gradient_checkpointing=spec.get("gradient_checkpointing", False),
                         optimizer=spec["optimizer"])
    res = Simulator(module, task=task, device="cpu").run(config, seq_len=spec["seq"])
    start = dict(res.marks)["step1/micro0"]
    live, sizes, cats = 0, {}, {}
    base = peak = 0.0
    snap: list[int] = []
    for i, e in enumerate(res.events):
        if i == start:
            base = live
        if e.kind == "alloc":
            sizes[e.id], cats[e.id] = e.size, e.category
            live += e.size
        else:
            live -= sizes.pop(e.id, 0)
            cats.pop(e.id, None)
        if i >= start and live - base > peak:
            peak = live - base
            snap = [s for k, s in sizes.items() if cats[k] not in ("weights", "optimizer_states")]
    return peak / MiB, snap


def main() -> int:
    name = sys.argv[1]
    if os.environ.get("_REAL_TENSORS_CHILD") != "1":  # the harness's glibc settings
        os.execvpe(sys.executable, [sys.executable, *sys.argv],
                   {**os.environ, **ENV, "_REAL_TENSORS_CHILD": "1"})
    warnings.simplefilter("ignore")
    sys.path.insert(0, str(HERE))
    spec = json.loads((HERE / "results" / "zoo.json").read_text())["rows"][name]["spec"]
    r_peak, r_sizes = real(spec)
    s_peak, s_sizes = simulated(spec)
    print(f"{name}: real tensors {r_peak:.2f} MiB above the step's start at their peak: "
          f"{_sizes(r_sizes)}")
    print(f"{name}: simulated {s_peak:.2f} MiB (with the graph's host memory, node by "
          f"node): {_sizes(s_sizes)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
