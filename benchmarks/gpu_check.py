"""One prepared GPU validation run: measured peaks next to autofit's predictions.

Run it on the device tool (one H200), from the repository root. The package need
not be installed (this file puts the repository root on ``sys.path``, and passes it
to its children through ``PYTHONPATH``)::

    run(command="PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT",
        timeout_s=570)

The script stops starting configurations at 4:15 (the 7-minute guard ``--guard-s``
less 75 s kept for the OOM check and 90 s for the soak; 5:45 with ``--no-soak``),
starts the OOM check by 5:30 and a soak only with 30 s left, starts nothing after 7
minutes and ends within 8 (``--budget-s``); it rewrites ``$OUT/gpu_check.json`` and
``gpu_check.md`` after every configuration, so a run cut short still brings its
results back. Copy them to ``benchmarks/results/`` to keep them. Without ``--out`` it
writes to ``$OUT`` when that is set, else to ``benchmarks/results/``.

bitsandbytes is not in the device's image (KINDS.md), so the two ``adamw_bnb_8bit``
configurations are skipped there with a note; to include them, carry a Python 3.12
x86-64 wheel as ``/work/.library/device/README.md`` says (``carry=[".whl"]``) and
start the command with ``python3 -m pip install -q --no-index --no-deps --no-compile
--no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
|| exit;`` (the children keep ``PYTHONPATH``).

On this (CPU-only) machine::

    python benchmarks/gpu_check.py --dry-run                 # every config, tiny shapes
    python benchmarks/gpu_check.py --dry-run --limit 2 --no-soak --out /tmp/gc
    python benchmarks/gpu_check.py --dry-run --soak-only --out /tmp/gc   # ~4 min here

What it does:

1. **Matrix** (``MATRIX``, 16 configurations): tiny-llama, tiny-gpt2 and
   meta-llama/Llama-3.2-1B (the bundled configs: real weights from ``from_config``,
   seeded, materialised on the GPU), precisions 32-true / bf16-mixed / bf16-true,
   gradient checkpointing on and off, ``adamw_torch`` (foreach on CUDA),
   ``adamw_torch_fused``, ``adamw_bnb_8bit``, LoRA (peft, r=16, all-linear) on the
   llamas, sequences of 512-2048 tokens, micro batches sized so that each step's
   peak is 1-60 GiB on the H200 (``tests/test_gpu_check.py`` checks that with the
   analytic estimate).
2. **Measured**, each configuration in a fresh child process (``--child``; fresh
   CUDA context and caching allocator) that imports torch, transformers, peft and
   bitsandbytes only -- nothing of autofit beyond reading the same bundled config
   JSON: the model is built from the config under ``torch.device("cuda")``
   (seed 0), LoRA applied, cast for ``*-true``; the Trainer's optimizer
   (``Trainer.get_optimizer_cls_and_kwargs``, its decay / no-decay groups, bnb's
   32-bit override for embeddings); random tokens (seed 1234), all-ones attention
   mask, labels = inputs. Then ``empty_cache`` + ``reset_peak_memory_stats`` and
   two Trainer steps: forward with labels (``bf16-mixed``: under
   ``torch.autocast("cuda", bfloat16)``, half outputs copied to fp32 as
   accelerate's ``convert_outputs_to_fp32`` does), ``loss.backward()``,
   ``clip_grad_norm_(params, 1.0)``, ``optimizer.step()``,
   ``zero_grad(set_to_none=True)``. Read: ``max_memory_allocated``,
   ``max_memory_reserved`` over both steps, and ``mem_get_info`` total - free after
   them (every process on the device: this script's parent never creates a CUDA
   context; the child reports any other process NVML lists). Per-phase peaks of
   step 2 and the peak of step 1 are kept too (peak counters read and reset at
   phase boundaries; the overall peak is their maximum), and so are the optimizer
   state bytes and what stays allocated besides weights, states and batch
   (``persistent_other_bytes``: the cuBLAS workspaces of the forward and the
   autograd threads) and the memory outside the allocator (context).
3. **Predicted** in this process, while the children run: ``autofit.estimate(...,
   method="simulate")`` and ``method="analytic"`` for the live device as a child
   probed it (``resolve_device("cuda")``; its catalog card is ``product``, "H200").
   Errors are (predicted - measured) / measured for peak allocated, peak reserved
   and device total (predicted reserved + context/workspace vs. measured used).
4. **OOM boundary + recovery** (``--oom-child``, one child): a per-process memory
   fraction caps the caching allocator between the simulated reserved peaks of two
   consecutive micro batches of tiny-llama (32-true, 1024 tokens). With
   ``autofit.trial.measure(..., isolation="in-process")``: a warm trial at batch 1
   (the baseline), the batch just past the estimated boundary (must report
   ``oom=True`` and ``recovered=True``, and ``memory_allocated`` must be back at the
   baseline), then the largest batch below it (must fit), and the same
   configuration in a fresh process (``isolation="subprocess"``): peak allocated
   within 1 %. Where the estimate misplaces the boundary the batches step by one
   until the real boundary is found, and both boundaries are reported.
5. **Whole-run soak** (``gpu_soak.SOAKS``, 3 runs, after the OOM check; ``--no-soak``
   skips it, ``--soak-only`` runs only it, ``--soak-names`` picks): tiny-llama
   bf16-mixed micro batch 8 with accumulation 1 and 4, tiny-gpt2 bf16-mixed micro
   batch 8, each in a fresh child (``--soak-child``): the real ``Trainer.train()``
   for 200 optimizer steps over one epoch of seeded log-normal lengths up to 1024
   tokens (``DataCollatorForLanguageModeling`` padding to the longest, the Trainer's
   sampler with seed 42), an evaluation every 50 steps, a checkpoint every 100 (a
   temporary folder, ``save_total_limit=1``), never ``empty_cache``; a callback reads
   ``max_memory_reserved`` / ``max_memory_allocated`` / ``memory_reserved`` after each
   step, evaluation and save; then the longest micro batch's two steps alone from an
   emptied cache (the worst step: 4.5-7 GiB). Predicted in a process that sees no
   CUDA device, overlapping the matrix: ``estimate(..., method="simulate",
   dataset=<the same samples>, epochs=1, seed=42)`` (one epoch is the run's
   ``max_steps``). Reported: run peak reserved measured vs predicted
   (``run_peak_reserved_bytes``), the step's, over the run (run peak - worst step)
   measured vs predicted, where the reserved peak stopped growing, what evaluation
   and saving added, ``mem_get_info`` total - free at the end next to
   ``run_device_total_bytes``, and whether the collated order is autofit's. About
   25 s of device time each (imports and context ~10 s), ~75 s in all, 90 s kept.
6. Writes ``gpu_check.json`` (every number) and ``gpu_check.md`` (tables) with the
   environment: GPU name, memory, compute capability, driver, CUDA, torch,
   transformers, peft, bitsandbytes and accelerate versions.

``--dry-run`` (same as ``--device cpu``) runs the whole pipeline on the CPU with
tiny shapes: every model is replaced by a micro config of its family
(``DRY_CONFIGS``: 2 layers, hidden 64, vocabulary 2048), every batch by 2 x 64
tokens (the soak: micro batch 2, lengths up to 64, 8 steps, an evaluation every 4, a
save at 8); the child measures peak RSS (``VmHWM`` after a reset, minus the RSS before
the model was built; the soak: before ``train()``) instead of the CUDA counters; the
OOM check runs a micro GPT-2 with a 50257-token vocabulary at 256 tokens on a capped
CPU (``cpu:<cap>``, an address-space limit). Its numbers exercise the code; they
validate nothing (the RSS includes one-time allocations of tens of MiB, larger than
the micro models).

Packages missing where it runs (bitsandbytes, peft) make their configurations
skipped with a note, never a crash.

Known limitations:
    NB: the measurement includes accelerate's fp32 copy of half outputs (the Trainer
    does it for ``bf16-mixed``: a ``(B, T, V)`` fp32 logits tensor at the end of
    the forward); autofit's simulate does not model that copy.
    NB: ``device_total`` measured is read after the steps (allocator cache still
    held, so reserved then equals its peak unless the allocator had to free cache:
    ``num_alloc_retries`` says so).
    NB: the soak's evaluations and saves are in its measured run peak, not in autofit's
    run replay: what each added is reported apart (``gpu_soak.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GiB = 1 << 30
MiB = 1 << 20
RESULT_MARK = "@@GPU_CHECK_RESULT@@ "
SEED_MODEL = 0
SEED_BATCH = 1234
MODELS_DIR = REPO / "autofit" / "data" / "models"

BUDGET_S = 480.0  # the whole run ends within this (8 minutes)
GUARD_S = 420.0  # no configuration or check starts after this (7 minutes)
CONFIG_TIMEOUT_S = 150.0  # one measuring child
OOM_TIMEOUT_S = 150.0  # the OOM-boundary child
OOM_RESERVE_S = 75.0  # kept for the OOM check when the matrix runs long
SOAK_RESERVE_S = 90.0  # kept for the soak (after the OOM check) when the matrix runs long
SOAK_TIMEOUT_S = {"cuda": 75.0, "cpu": 300.0}  # one soak child (~25 s on the H200)
SOAK_MIN_S = 30.0  # a soak starts only with this much time left before the budget
SOAK_PREDICT_TIMEOUT_S = {"cuda": 240.0, "cpu": 600.0}  # one soak's prediction (no CUDA)
WRITE_MARGIN_S = 15.0  # kept for writing the results

# CPU children (dry run): glibc returns freed blocks, so RSS follows the tensors.
CPU_CHILD_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "0",
    "MALLOC_ARENA_MAX": "1",
    "OMP_NUM_THREADS": "1",
}

LLAMA_1B = "meta-llama/Llama-3.2-1B"
LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear", "dropout": 0.0}


@dataclass(frozen=True)
class Spec:
    """One configuration of the matrix."""

    name: str
    model: str  # a bundled autofit model name (its config JSON is in autofit/data/models)
    precision: str  # "32-true" | "bf16-mixed" | "bf16-true"
    optimizer: str  # TrainingArguments.optim
    batch: int
    seq: int
    gradient_checkpointing: bool = False
    lora: dict | None = None  # {"r", "alpha", "target_modules", "dropout"}
    activation_offloading: bool = False  # checkpointed inputs in pinned host memory (CUDA)

    def describe(self) -> str:
        parts = [self.precision, self.optimizer]
        if self.gradient_checkpointing:
            parts.append("ckpt")
        if self.activation_offloading:
            parts.append("offload")
        if self.lora:
            parts.append(f"lora r{self.lora['r']}")
        return " ".join(parts)

    def needs(self) -> list[str]:
        """Optional packages this configuration needs."""
        out = []
        if "bnb" in self.optimizer or "8bit" in self.optimizer:
            out.append("bitsandbytes")
        if self.lora:
            out.append("peft")
        return out


def _spec(model: str, short: str, precision: str, optimizer: str, batch: int, seq: int,
          ckpt: bool = False, lora: bool = False, offload: bool = False) -> Spec:
    p = {"32-true": "fp32", "bf16-mixed": "bf16m", "bf16-true": "bf16t"}[precision]
    o = {"adamw_torch": "adamw", "adamw_torch_fused": "fused", "adamw_bnb_8bit": "bnb8"}[optimizer]
    name = (f"{short}-{p}-{o}" + ("-ckpt" if ckpt else "") + ("-offl" if offload else "")
            + ("-lora" if lora else ""))
    return Spec(name=f"{name}-b{batch}s{seq}", model=model, precision=precision,
                optimizer=optimizer, batch=batch, seq=seq, gradient_checkpointing=ckpt,
                lora=dict(LORA) if lora else None, activation_offloading=offload)


# Ordered so that a run cut short by the time guard still covers every axis early.
MATRIX: list[Spec] = [
    _spec(LLAMA_1B, "llama1b", "bf16-mixed", "adamw_torch", 4, 1024),
    _spec("tiny-llama", "tinyllama", "32-true", "adamw_torch", 8, 1024),
    _spec(LLAMA_1B, "llama1b", "32-true", "adamw_torch", 2, 1024),
    _spec("tiny-gpt2", "tinygpt2", "bf16-mixed", "adamw_torch_fused", 8, 1024, ckpt=True),
    _spec(LLAMA_1B, "llama1b", "bf16-true", "adamw_torch", 8, 2048, ckpt=True),
    _spec(LLAMA_1B, "llama1b", "bf16-mixed", "adamw_torch", 4, 2048, ckpt=True, lora=True),
    _spec("tiny-llama", "tinyllama", "bf16-true", "adamw_torch_fused", 16, 2048, ckpt=True),
    _spec(LLAMA_1B, "llama1b", "bf16-mixed", "adamw_torch_fused", 4, 2048, ckpt=True),
    _spec("tiny-gpt2", "tinygpt2", "32-true", "adamw_torch", 8, 1024),
    _spec(LLAMA_1B, "llama1b", "32-true", "adamw_torch_fused", 4, 1024, ckpt=True),
    _spec("tiny-llama", "tinyllama", "bf16-mixed", "adamw_torch", 8, 1024, lora=True),
    _spec(LLAMA_1B, "llama1b", "bf16-true", "adamw_torch_fused", 8, 1024, lora=True),
    _spec("tiny-gpt2", "tinygpt2", "bf16-true", "adamw_torch", 16, 512),
    _spec("tiny-llama", "tinyllama", "bf16-mixed", "adamw_torch_fused", 16, 512),
    _spec(LLAMA_1B, "llama1b", "bf16-mixed", "adamw_bnb_8bit", 4, 1024),
    _spec("tiny-llama", "tinyllama", "32-true", "adamw_bnb_8bit", 8, 1024),
    # activation offloading: the peak at the start of backward (LoRA: every input held) and
    # in the recompute (full fine-tuning), beside their non-offloaded twins above
    _spec(LLAMA_1B, "llama1b", "bf16-mixed", "adamw_torch", 4, 2048, ckpt=True, lora=True,
          offload=True),
    _spec(LLAMA_1B, "llama1b", "bf16-mixed", "adamw_torch_fused", 4, 2048, ckpt=True,
          offload=True),
]

# --dry-run: micro configs of the same families (a CPU builds and steps them in
# milliseconds), 2 x 64 tokens. OOM_DRY: the CPU OOM check's model, whose (B, T, V)
# logits make each sample ~100 MiB, far above the slack of a capped CPU.
DRY_CONFIGS: dict[str, dict[str, Any]] = {
    "micro-llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "vocab_size": 2048, "max_position_embeddings": 512,
                    "tie_word_embeddings": False, "architectures": ["LlamaForCausalLM"]},
    "micro-gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                   "vocab_size": 2048, "n_positions": 512, "architectures": ["GPT2LMHeadModel"]},
    "oom-gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                 "vocab_size": 50257, "n_positions": 1024, "architectures": ["GPT2LMHeadModel"]},
}
DRY_BATCH, DRY_SEQ = 2, 64
OOM_MODEL = {"cuda": ("tiny-llama", 1024), "cpu": ("oom-gpt2", 256)}


def dry_models_dir(root: Path) -> Path:
    """Write the micro configs as ``<root>/<name>.json`` (a config.json autofit accepts)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, cfg in DRY_CONFIGS.items():
        (root / f"{name}.json").write_text(json.dumps(cfg))
    return root


def dry_spec(spec: Spec, models: Path) -> Spec:
    """The tiny-shape version of ``spec`` that ``--dry-run`` runs on the CPU."""
    family = "micro-gpt2" if "gpt2" in spec.model else "micro-llama"
    stem = spec.name.rsplit("-b", 1)[0]
    # NB: a CPU cannot offload activations (no pinned memory, autofit refuses it there)
    return replace(spec, name=f"{stem}-dry-b{DRY_BATCH}s{DRY_SEQ}",
                   model=str(models / f"{family}.json"), batch=DRY_BATCH, seq=DRY_SEQ,
                   activation_offloading=False)


# =========================================================================== child
# Everything in this section runs in a fresh process per configuration and uses
# torch / transformers / peft / bitsandbytes only (no autofit import).


def _read_config(model: str) -> Any:
    """The transformers config of a bundled model (or of a config JSON path), read directly."""
    import transformers

    paths = [Path(model)] if model.endswith(".json") else sorted(MODELS_DIR.glob("*.json"))
    for path in paths:
        d = json.loads(path.read_text())
        if model.endswith(".json") or d.get("_autofit_name", path.stem).lower() == model.lower():
            d = {k: v for k, v in d.items() if not k.startswith("_autofit")}
            return transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    raise ValueError(f"no bundled config named {model!r} in {MODELS_DIR}")


from benchmarks import gpu_soak  # noqa: E402 - the soak's specs, child and table

# the kernel's counters, as the CPU training measurement reads them
from benchmarks.measure_cpu import _hwm_bytes as _hwm  # noqa: E402
from benchmarks.measure_cpu import _reset_hwm  # noqa: E402
from benchmarks.measure_cpu import _rss_bytes as _rss  # noqa: E402


class _Meter:
    """Peak memory per segment; the overall peak is the maximum over the segments.

    CUDA: the caching allocator's counters (updated on the host at each malloc /
    free, so no synchronisation is needed to read them). CPU: the resident
    high-water mark above the RSS taken before the model was built.
    """

    def __init__(self, device: Any, cpu_baseline: int | None) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.base = cpu_baseline
        self.segments: dict[str, dict[str, int]] = {}
        self.current: str | None = None

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        else:
            _reset_hwm()

    def read(self) -> tuple[int, int]:
        if self.cuda:
            return (int(self.torch.cuda.max_memory_allocated()),
                    int(self.torch.cuda.max_memory_reserved()))
        peak = _hwm() - int(self.base or 0)
        return peak, peak

    def mark(self, segment: str | None) -> None:
        """Close the running segment (record its peaks) and start ``segment``."""
        if self.current is not None:
            a, r = self.read()
            self.segments[self.current] = {"allocated": a, "reserved": r}
        self.current = segment
        if segment is not None:
            self.reset()

    def peaks(self) -> tuple[int, int]:
        return (max(s["allocated"] for s in self.segments.values()),
                max(s["reserved"] for s in self.segments.values()))


def _enable_checkpointing(model: Any, offload: bool = False) -> str:
    """What ``Trainer`` does for ``gradient_checkpointing=True`` (non-reentrant; with
    ``activation_checkpointing_kwargs={"offload": True}``: ``offload=True``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        extra = {"offload": True} if offload else {}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
        return "activation_checkpointing_enable"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return "gradient_checkpointing_enable"


def _decay_names(model: Any) -> set[str]:
    from transformers import Trainer

    try:
        return set(Trainer.get_decay_parameter_names(None, model))  # uses no `self`
    except Exception:  # noqa: BLE001 - an older/newer signature: the Trainer's rule by hand
        import torch
        from transformers.trainer_pt_utils import get_parameter_names

        return set(get_parameter_names(
            model, [torch.nn.LayerNorm],
            [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]))


def _half_to_fp32(out: Any) -> Any:
    """accelerate's ``convert_outputs_to_fp32`` on a model output (a dict-like)."""
    import torch

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16):
            return v.float()
        return v

    return {k: conv(v) for k, v in out.items()}


def run_child(spec: dict[str, Any], device_name: str) -> dict[str, Any]:
    """Build, train two steps, measure. Returns a JSON-able dict (never raises for OOM)."""
    t_start = time.perf_counter()
    import torch

    cuda = device_name.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    import transformers
    from transformers import Trainer, TrainingArguments

    device = torch.device(device_name)
    result: dict[str, Any] = {"name": spec["name"], "device": device_name, "oom": False,
                              "error": None, "notes": []}
    cpu_base = None if cuda else _rss()
    if cuda:
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, optim=spec["optimizer"], report_to=[],
                                 use_cpu=not cuda)
        opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    result["optimizer_class"] = f"{opt_cls.__module__}.{opt_cls.__name__}"
    result["optimizer_kwargs"] = {k: repr(v) for k, v in opt_kwargs.items()}

    config = _read_config(spec["model"])
    torch.manual_seed(SEED_MODEL)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if spec.get("lora"):
        from peft import LoraConfig, TaskType, get_peft_model

        lo = spec["lora"]
        lora_config = LoraConfig(r=lo["r"], lora_alpha=lo["alpha"],
                                 target_modules=lo["target_modules"],
                                 lora_dropout=lo.get("dropout", 0.0), task_type=TaskType.CAUSAL_LM)
        with torch.device(device):
            model = get_peft_model(model, lora_config)
    model.to(device)
    if spec["precision"].endswith("-true") and spec["precision"] != "32-true":
        model.to(torch.bfloat16)
    if spec["gradient_checkpointing"]:
        result["checkpointing_api"] = _enable_checkpointing(
            model, bool(spec.get("activation_offloading")))
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "use_cache"):
            c.use_cache = False
    model.train()
    result["attn_implementation"] = getattr(config, "_attn_implementation", None)

    decay = _decay_names(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = opt_cls([g for g in groups if g["params"]], **opt_kwargs)
    if "bitsandbytes" in str(opt_cls) and opt_kwargs.get("optim_bits") == 8:
        import bitsandbytes  # Trainer.create_optimizer: embeddings stay 32-bit

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    params = [p for _, p in named]
    result["params"] = sum(p.numel() for p in model.parameters())
    result["trainable_params"] = sum(p.numel() for p in params)
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    result["weights_bytes"] = sum(seen.values())

    g = torch.Generator().manual_seed(SEED_BATCH)
    ids = torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"]), generator=g)
    batch = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
             "labels": ids.clone().to(device)}
    result["batch_bytes"] = sum(t.untyped_storage().nbytes() for t in batch.values())
    mixed = spec["precision"].endswith("-mixed")
    fp32_outputs = spec.get("fp32_outputs", True)
    result["fp32_outputs"] = bool(mixed and fp32_outputs)

    def step(meter: _Meter | None) -> float:
        def mark(segment: str | None) -> None:
            if meter is not None:
                meter.mark(segment)

        mark("forward")
        ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if mixed
               else contextlib.nullcontext())
        with ctx:
            out = model(**batch)
        if mixed and fp32_outputs:
            out = _half_to_fp32(out)  # accelerate wraps the Trainer's forward with this
        loss = out["loss"]
        del out  # compute_loss returns the loss only
        mark("backward")
        loss.backward()
        mark("optimizer")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark(None)
        return float(loss.detach())

    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        result["allocated_before_bytes"] = int(torch.cuda.memory_allocated())
    meter = _Meter(device, cpu_base)
    times, losses = [], []
    try:
        meter.mark("step1")  # the first step: the optimizer state appears
        t0 = time.perf_counter()
        losses.append(step(None))
        meter.mark(None)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        losses.append(step(meter))  # the second step, per phase
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError as exc:
        result["oom"] = True
        result["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0][:300]}"
    if meter.current is not None:
        meter.mark(None)
    states: dict[int, int] = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.device.type == device.type:
                states[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    result["optimizer_state_bytes"] = sum(states.values())
    if meter.segments:
        result["peak_allocated_bytes"], result["peak_reserved_bytes"] = meter.peaks()
        result["segments"] = meter.segments
        result["peak_segment"] = max(meter.segments, key=lambda k: meter.segments[k]["allocated"])
    if cuda:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        reserved_now = int(torch.cuda.memory_reserved())
        result["device_used_bytes"] = int(total - free)
        result["device_capacity_bytes"] = int(total)
        result["reserved_after_bytes"] = reserved_now
        result["outside_allocator_bytes"] = int(total - free) - reserved_now
        stats = torch.cuda.memory_stats()
        result["num_alloc_retries"] = int(stats.get("num_alloc_retries", 0))
        result["num_ooms"] = int(stats.get("num_ooms", 0))
        result["nvml"] = _nvml_processes()
        # what stays allocated between steps besides weights, optimizer states and the
        # batch: cuBLAS workspaces (one per thread: forward and autograd's), caches
        result["allocated_after_bytes"] = int(torch.cuda.memory_allocated())
        result["persistent_other_bytes"] = (result["allocated_after_bytes"]
                                            - result["weights_bytes"]
                                            - result["optimizer_state_bytes"]
                                            - result["batch_bytes"])
    else:
        peak = result.get("peak_allocated_bytes")
        result["device_used_bytes"] = peak
        result["outside_allocator_bytes"] = 0
    result["step_times_s"] = times
    result["losses"] = losses
    result["loss_finite"] = bool(losses) and all(math.isfinite(x) for x in losses)
    result["child_wall_s"] = time.perf_counter() - t_start
    return result


def _nvml_processes() -> dict[str, Any] | None:
    """The processes NVML sees on GPU 0 with their memory (None: NVML unavailable).

    ``others_bytes`` sums those whose pid is not this process's; in a PID namespace
    NVML may report host pids, so ``self_seen`` says whether this process was found.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            rows = [(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML missing or not answering in a VM
        return None
    me = os.getpid()
    return {"processes": rows, "self_pid": me, "self_seen": any(p == me for p, _ in rows),
            "others_bytes": sum(b for p, b in rows if p != me)}


# =========================================================================== probe


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def probe_environment(device_kind: str) -> dict[str, Any]:
    """Versions, the GPU and autofit's DeviceInfo for the target (creates a CUDA context)."""
    import platform

    import torch

    from autofit.probe.device import resolve_device

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {p: _version(p) for p in ("torch", "transformers", "peft", "bitsandbytes",
                                              "accelerate", "numpy", "nvidia-ml-py")},
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    if device_kind == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        env["gpu"] = {
            "name": props.name,
            "total_bytes": int(total),
            "free_bytes_with_probe_context": int(free),
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "device_count": torch.cuda.device_count(),
        }
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            env["gpu"]["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            pynvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001
            env["gpu"]["driver"] = f"unknown ({type(e).__name__})"
        dev = resolve_device("cuda")
    else:
        dev = resolve_device("cpu")
    env["device_info"] = asdict(dev)
    return env


# =========================================================================== OOM check


def oom_check(device_kind: str, method: str) -> dict[str, Any]:
    """The OOM boundary + recovery check (runs in its own child process on the GPU)."""
    import shutil

    tmp = tempfile.mkdtemp(prefix="gpu-check-oom-")
    try:
        return _oom_check(device_kind, method, Path(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _oom_check(device_kind: str, method: str, tmp: Path) -> dict[str, Any]:
    import torch

    from autofit import TrainConfig, estimate
    from autofit.probe.device import resolve_device
    from autofit.trial import measure

    cuda = device_kind == "cuda"
    model, seq = OOM_MODEL[device_kind]
    if not cuda:
        model = str(dry_models_dir(tmp) / f"{model}.json")
    base = TrainConfig(precision="32-true", optimizer="adamw_torch")
    out: dict[str, Any] = {"model": Path(model).stem, "seq_len": seq, "config": base.to_dict(),
                           "estimate_method": method, "trials": [], "checks": {}}
    t0 = time.perf_counter()

    if cuda:
        dev = resolve_device("cuda")
        extra = dev.workspace_bytes  # cuBLAS workspace: inside the allocator, outside the estimate
        target_low, target_high = 3 * GiB, 9 * GiB // 2  # a boundary near 3|4 samples
    else:
        dev = resolve_device("cpu")
        extra = 0
        target_low, target_high = 150 * MiB, 300 * MiB

    def est_bytes(b: int) -> int:
        e = estimate(model, base.replace(micro_batch_size=b), seq_len=seq, device=dev,
                     method=method)
        return (e.peak_reserved_bytes if cuda else e.device_total_bytes) + extra

    ests: dict[int, int] = {}
    b = 1
    while True:  # the first batch whose estimate passes the target (a small, fast step)
        ests[b] = est_bytes(b)
        if (ests[b] > target_low and b > 1) or ests[b] > target_high or b >= 64:
            break
        b += 1
    b_over, b_under = b, b - 1
    if b_under < 1:
        out["error"] = f"batch 1 is estimated above {target_high} bytes: no boundary to test"
        return out
    cap = (ests[b_under] + ests[b_over]) // 2
    out["estimates_bytes"] = {str(k): v for k, v in sorted(ests.items())}
    out["cap_bytes"] = cap
    out["estimated_boundary"] = {"fits": b_under, "oom": b_over}
    out["estimate_s"] = time.perf_counter() - t0

    if cuda:
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(cap / total)
        out["memory_fraction"] = cap / total
        trial_device: Any = "cuda"
    else:
        trial_device = f"cpu:{cap // MiB}MiB"
    out["trial_device"] = trial_device

    def allocated() -> int | None:
        if cuda:
            torch.cuda.synchronize()
            return int(torch.cuda.memory_allocated())
        from autofit.trial import procmem

        gc.collect()
        procmem.malloc_trim()
        return procmem.rss_bytes()

    def trial(b: int, isolation: str, role: str) -> Any:
        t = time.perf_counter()
        r = measure(model, base.replace(micro_batch_size=b), seq_len=seq, device=trial_device,
                    isolation=isolation, timeout_s=60.0)
        row = {"role": role, "batch": b, "isolation": isolation, "oom": r.oom, "fits": r.fits,
               "error": r.error, "recovered": r.recovered, "leaked_bytes": r.leaked_bytes,
               "peak_allocated_bytes": r.peak_allocated_bytes,
               "peak_reserved_bytes": r.peak_reserved_bytes,
               "device_total_bytes": r.device_total_bytes, "wall_s": time.perf_counter() - t,
               "allocated_after_bytes": allocated()}
        out["trials"].append(row)
        print(f"  oom-check {role} b={b} {isolation}: oom={r.oom} fits={r.fits} "
              f"peak_alloc={_gib(r.peak_allocated_bytes)} recovered={r.recovered}", flush=True)
        return r

    warm = trial(1, "in-process", "warm")
    baseline = allocated()
    out["baseline_allocated_bytes"] = baseline
    if not warm.fits:
        out["checks"]["warm_trial_fits"] = False
        out["error"] = f"the batch-1 trial did not fit: {warm.error}"
        return out

    # the first batch that runs out of memory, starting just past the estimated boundary
    b = b_over
    r_oom = None
    for _ in range(8):
        r = trial(b, "in-process", "over")
        if r.oom:
            r_oom = r
            break
        if not r.fits:
            out["error"] = f"trial at batch {b} failed: {r.error}"
            return out
        b += 1
    if r_oom is None:
        out["error"] = f"no out-of-memory up to batch {b - 1} under the cap"
        out["checks"]["oom_reported"] = False
        return out
    b_oom = b
    after_oom = allocated()
    tol = 1 * MiB if cuda else 32 * MiB
    out["checks"]["oom_reported"] = True
    out["checks"]["recovered_reported"] = bool(r_oom.recovered)
    out["checks"]["allocated_back_at_baseline"] = (
        after_oom is not None and baseline is not None and abs(after_oom - baseline) <= tol)
    out["allocated_after_oom_bytes"] = after_oom

    # the largest batch below it that fits (normally b_oom - 1)
    r_fit = None
    b = b_oom - 1
    while b >= 1:
        r = trial(b, "in-process", "fit")
        if r.fits:
            r_fit = r
            break
        b -= 1
    out["measured_boundary"] = {"fits": b if r_fit else None, "oom": b_oom}
    out["boundary_matches_estimate"] = (b_oom == b_over and r_fit is not None
                                        and b == b_under)
    if r_fit is None:
        out["checks"]["fit_after_oom"] = False
        out["error"] = "no batch below the out-of-memory one fits"
        return out
    out["checks"]["fit_after_oom"] = True
    fresh = trial(b, "subprocess", "fresh")
    if fresh.fits and r_fit.peak_allocated_bytes and fresh.peak_allocated_bytes:
        diff = (r_fit.peak_allocated_bytes - fresh.peak_allocated_bytes) / fresh.peak_allocated_bytes
        out["peak_vs_fresh_rel"] = diff
        within = abs(diff) <= 0.01
    else:
        within = False
        out["peak_vs_fresh_rel"] = None
    # On a CPU an in-process peak (this process's allocator) is not that of a fresh
    # one: the 1 % check is a GPU check; the dry run only reports it.
    out["checks"]["peak_equals_fresh_process_1pct"] = within
    out["peak_check_required"] = cuda
    out["passed"] = all(v for k, v in out["checks"].items()
                        if cuda or k != "peak_equals_fresh_process_1pct")
    out["wall_s"] = time.perf_counter() - t0
    return out


# =========================================================================== parent


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def _err(pred: int | None, meas: int | None) -> float | None:
    if pred is None or not meas:
        return None
    return (pred - meas) / meas


def _child_env(device_kind: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if device_kind == "cpu":
        env.update(CPU_CHILD_ENV)
    return env


def _run_json_child(argv: list[str], device_kind: str, timeout_s: float,
                    env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run this file with ``argv`` in a fresh process; its result line, or an error dict."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env={**_child_env(device_kind), **(env_extra or {})},
                              capture_output=True, text=True,
                              timeout=max(1.0, timeout_s), cwd=str(REPO))
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:]
        tail = tail.decode("utf-8", "replace") if isinstance(tail, bytes) else tail
        return {"error": f"timeout after {timeout_s:.0f}s", "stderr_tail": tail,
                "child_wall_s": time.perf_counter() - t}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = proc.stderr[-3000:]
    last = tail.strip().splitlines()[-1] if tail.strip() else ""
    return {"error": f"child failed (exit {proc.returncode}): {last}"[:500],
            "stderr_tail": tail, "child_wall_s": time.perf_counter() - t}


def _estimate(spec: Spec, method: str, device: Any) -> dict[str, Any]:
    from autofit import TrainConfig, estimate
    from autofit.probe.model import LoraSpec

    lora = None
    if spec.lora:
        lora = LoraSpec(r=spec.lora["r"], alpha=spec.lora["alpha"],
                        target_modules=spec.lora["target_modules"],
                        dropout=spec.lora.get("dropout", 0.0))
    cfg = TrainConfig(micro_batch_size=spec.batch, precision=spec.precision,
                      gradient_checkpointing=spec.gradient_checkpointing,
                      optimizer=spec.optimizer,
                      activation_offloading=spec.activation_offloading)
    t = time.perf_counter()
    try:
        e = estimate(spec.model, cfg, seq_len=spec.seq, device=device, method=method, lora=lora)
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400],
                "wall_s": time.perf_counter() - t}
    return {"peak_allocated_bytes": e.peak_allocated_bytes,
            "peak_reserved_bytes": e.peak_reserved_bytes,
            "device_total_bytes": e.device_total_bytes, "capacity_bytes": e.capacity_bytes,
            "fits": e.fits, "peak_phase": e.peak_phase, "breakdown": dict(e.breakdown),
            "host_bytes": e.host_bytes,
            "notes": list(e.notes), "wall_s": time.perf_counter() - t}


class Run:
    """The state of one run, written to disk after every change."""

    def __init__(self, args: argparse.Namespace, out_dir: Path, t0: float) -> None:
        self.args = args
        self.out_dir = out_dir
        self.t0 = t0
        self.lock = threading.RLock()
        self.data: dict[str, Any] = {
            "mode": "dry-run (CPU, tiny shapes)" if args.device == "cpu" else "gpu",
            "device": args.device,
            "settings": {"budget_s": args.budget_s, "guard_s": args.guard_s,
                         "config_timeout_s": args.config_timeout_s,
                         "methods": args.methods,
                         "fp32_outputs": not args.no_fp32_outputs},
            "environment": {}, "rows": [], "skipped": [], "notes": [], "oom_check": None,
            "soak": [],
            "summary": {}, "finished": False,
        }

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def write(self) -> None:
        with self.lock:
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            target = self.data["environment"].get("estimate_target") or {}
            self.data["summary"] = _summary(self.data["rows"], self.args.methods,
                                            target.get("overhead_bytes"))
            text = json.dumps(self.data, indent=1, default=str)
            md = _markdown(self.data)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            for name, content in (("gpu_check.json", text), ("gpu_check.md", md)):
                tmp = self.out_dir / f".{name}.tmp"
                tmp.write_text(content)
                os.replace(tmp, self.out_dir / name)


def _summary(rows: list[dict], methods: list[str], overhead: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    outside = [r["measured"]["outside_allocator_bytes"] for r in rows
               if (r.get("measured") or {}).get("outside_allocator_bytes")]
    if outside:
        out["outside_allocator"] = {"n": len(outside), "median": statistics.median(outside),
                                    "min": min(outside), "max": max(outside),
                                    "assumed": overhead}
    for method in methods:
        for metric in ("allocated", "reserved", "total"):
            errs = [abs(r[method][f"{metric}_err"]) for r in rows
                    if isinstance(r.get(method), dict) and r[method].get(f"{metric}_err") is not None]
            if errs:
                out[f"{method}_{metric}"] = {"n": len(errs), "median_abs": statistics.median(errs),
                                             "max_abs": max(errs)}
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _markdown(d: dict[str, Any]) -> str:
    env = d.get("environment") or {}
    gpu = env.get("gpu") or {}
    v = env.get("versions") or {}
    lines = [
        f"# autofit GPU check ({d['mode']})",
        "",
        f"Device: {gpu.get('name', d['device'])}"
        + (f", {gpu['total_bytes'] / GiB:.1f} GiB, cc {gpu.get('compute_capability')}, "
           f"driver {gpu.get('driver')}" if gpu else "")
        + f"; CUDA {env.get('torch_cuda')}; torch {v.get('torch')}, transformers "
        f"{v.get('transformers')}, peft {v.get('peft')}, bitsandbytes {v.get('bitsandbytes')}, "
        f"accelerate {v.get('accelerate')}; Python {env.get('python')}.",
        f"Elapsed {d.get('elapsed_s')} s{'' if d.get('finished') else ' (unfinished)'}.",
        "",
        ("Measured: a fresh process per configuration, two Trainer steps, "
         "`max_memory_allocated` / `max_memory_reserved`, device used = `mem_get_info` total - "
         "free after the steps." if d["device"] == "cuda" else
         "Measured (dry run): peak RSS of a fresh process above its RSS before the model was "
         "built, two Trainer steps on micro models; the numbers exercise the pipeline, they "
         "validate nothing.")
        + " Predicted: `autofit.estimate(method=...)` for the device "
        f"{(env.get('estimate_target') or {}).get('name')} (card "
        f"{(env.get('estimate_target') or {}).get('product')}). "
        "Error = (predicted - measured) / measured.",
        "",
    ]
    outside = (d.get("summary") or {}).get("outside_allocator")
    if outside:
        lines += [f"Device memory outside the caching allocator (context, ...), measured: median "
                  f"{outside['median'] / MiB:.0f} MiB (min {outside['min'] / MiB:.0f}, max "
                  f"{outside['max'] / MiB:.0f}); the estimates add "
                  f"{outside['assumed'] / MiB:.0f} MiB (context + cuBLAS workspace).", ""]
    summ = {k: v for k, v in (d.get("summary") or {}).items() if k != "outside_allocator"}
    if summ:
        lines += ["| method / metric | n | median abs error | max abs error |", "|---|---|---|---|"]
        for k, s in summ.items():
            lines.append(f"| {k} | {s['n']} | {100 * s['median_abs']:.1f}% | "
                         f"{100 * s['max_abs']:.1f}% |")
        lines.append("")
    methods = d["settings"]["methods"]
    head = ("| config | B×T | measured alloc / reserved / used (GiB) | "
            + " | ".join(f"{m} alloc / reserved / total (error)" for m in methods)
            + " | peak: measured / sim | step s |")
    if d["rows"]:  # none with --soak-only
        lines += [head, "|---|---|---|" + "---|" * len(methods) + "---|---|"]
    for r in d["rows"]:
        m = r.get("measured") or {}
        if m.get("error") and not m.get("peak_allocated_bytes"):
            meas = f"error: {m['error'][:80]}"
        else:
            meas = " / ".join(f"{(m.get(k) or 0) / GiB:.2f}" for k in (
                "peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes"))
            if m.get("oom"):
                meas += " (OOM)"
        cells = []
        for method in methods:
            e = r.get(method) or {}
            if "error" in e:
                cells.append(f"error: {e['error'][:60]}")
            elif e:
                cells.append(" / ".join(
                    f"{e[k] / GiB:.2f} ({_pct(e.get(f'{n}_err'))})"
                    for k, n in (("peak_allocated_bytes", "allocated"),
                                 ("peak_reserved_bytes", "reserved"),
                                 ("device_total_bytes", "total"))))
            else:
                cells.append("-")
        sim = r.get("simulate") or {}
        times = m.get("step_times_s") or []
        lines.append(f"| {r['name']} | {r['batch']}×{r['seq']} | {meas} | " + " | ".join(cells)
                     + f" | {m.get('peak_segment', '-')} / {sim.get('peak_phase', '-')} | "
                     + (f"{times[-1]:.3f}" if times else "-") + " |")
    if d.get("skipped"):
        lines += ["", "Skipped:", ""] + [f"- {s['name']}: {s['reason']}" for s in d["skipped"]]
    oc = d.get("oom_check")
    if oc:
        lines += ["", "## OOM boundary and recovery (autofit.trial.measure, in-process)", ""]
        if "checks" in oc:
            lines.append(f"{oc.get('model')} 32-true adamw_torch, {oc.get('seq_len')} tokens, "
                         f"cap {_gib(oc.get('cap_bytes'))} ({oc.get('trial_device')}); "
                         f"estimated boundary {oc.get('estimated_boundary')}, measured "
                         f"{oc.get('measured_boundary')}; in-process peak vs fresh process "
                         f"{_pct(oc.get('peak_vs_fresh_rel'))}.")
            lines += ["", "| check | result |", "|---|---|"]
            lines += [f"| {k} | {'pass' if ok else 'FAIL'} |" for k, ok in oc["checks"].items()]
            lines += ["", "| role | batch | isolation | oom | fits | recovered | peak alloc | "
                      "allocated after |", "|---|---|---|---|---|---|---|---|"]
            for t in oc.get("trials", []):
                lines.append(f"| {t['role']} | {t['batch']} | {t['isolation']} | {t['oom']} | "
                             f"{t['fits']} | {t['recovered']} | {_gib(t['peak_allocated_bytes'])}"
                             f" | {_gib(t['allocated_after_bytes'])} |")
        if oc.get("error"):
            lines += ["", f"Error: {oc['error']}"]
    lines += gpu_soak.markdown(d.get("soak") or [], d["device"] == "cuda")
    if d.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in d["notes"]]
    return "\n".join(lines) + "\n"


def _row(spec: Spec) -> dict[str, Any]:
    return {"name": spec.name, "model": Path(spec.model).stem if spec.model.endswith(".json")
            else spec.model, "batch": spec.batch, "seq": spec.seq,
            "what": spec.describe(), "spec": asdict(spec)}


def _fill_errors(row: dict[str, Any], methods: list[str]) -> None:
    m = row.get("measured") or {}
    for method in methods:
        e = row.get(method)
        if not isinstance(e, dict) or "error" in e:
            continue
        e["allocated_err"] = _err(e.get("peak_allocated_bytes"), m.get("peak_allocated_bytes"))
        e["reserved_err"] = _err(e.get("peak_reserved_bytes"), m.get("peak_reserved_bytes"))
        e["total_err"] = _err(e.get("device_total_bytes"), m.get("device_used_bytes"))


def select_specs(args: argparse.Namespace) -> list[Spec]:
    specs = list(MATRIX)
    if args.names:
        wanted = [n.strip() for n in args.names.split(",") if n.strip()]
        by_name = {s.name: s for s in specs}
        unknown = [n for n in wanted if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown config names {unknown}; known: {', '.join(by_name)}")
        specs = [by_name[n] for n in wanted]
    if args.limit:
        specs = specs[: args.limit]
    if args.device == "cpu":
        models = dry_models_dir(Path(tempfile.mkdtemp(prefix="gpu-check-models-")))
        specs = [dry_spec(s, models) for s in specs]
    return specs


def select_soaks(args: argparse.Namespace) -> list[gpu_soak.SoakSpec]:
    if args.no_soak:
        return []
    soaks = list(gpu_soak.SOAKS)
    if args.soak_names:
        wanted = [n.strip() for n in args.soak_names.split(",") if n.strip()]
        by_name = {s.name: s for s in soaks}
        unknown = [n for n in wanted if n not in by_name]
        if unknown:
            raise SystemExit(f"unknown soak names {unknown}; known: {', '.join(by_name)}")
        soaks = [by_name[n] for n in wanted]
    if args.device == "cpu":
        models = dry_models_dir(Path(tempfile.mkdtemp(prefix="gpu-check-soak-models-")))
        soaks = [gpu_soak.dry_soak(s, models) for s in soaks]
    return soaks


def _missing(spec: Spec) -> list[str]:
    return [p for p in spec.needs() if importlib.util.find_spec(p) is None]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else "
                    "benchmarks/results)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="= --device cpu: tiny shapes on the CPU")
    ap.add_argument("--names", default=None, help="comma-separated subset of MATRIX names")
    ap.add_argument("--limit", type=int, default=0, help="only the first N configurations")
    ap.add_argument("--methods", default="simulate,analytic")
    ap.add_argument("--no-oom-check", action="store_true")
    ap.add_argument("--no-soak", action="store_true", help="skip the whole-run soak (its "
                    "reserved time goes to the matrix)")
    ap.add_argument("--soak-only", action="store_true", help="only the soak (no matrix, no "
                    "OOM check)")
    ap.add_argument("--soak-names", default=None, help="comma-separated subset of SOAKS names")
    ap.add_argument("--no-fp32-outputs", action="store_true",
                    help="bf16-mixed: skip accelerate's fp32 copy of the outputs (the step "
                    "autofit.trial and the simulator run) instead of the Trainer's")
    ap.add_argument("--oom-method", default="simulate", choices=("simulate", "analytic"))
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument("--guard-s", type=float, default=GUARD_S)
    ap.add_argument("--config-timeout-s", type=float, default=CONFIG_TIMEOUT_S)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--oom-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--soak-child", help=argparse.SUPPRESS)
    ap.add_argument("--soak-predict-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    if args.soak_only:
        args.no_oom_check = True
    args.methods = [m for m in args.methods.split(",") if m in ("simulate", "analytic")]

    # ------------------------------------------------------------- child modes
    if args.child:
        spec = json.loads(args.child)
        res = run_child(spec, "cuda:0" if args.device == "cuda" else "cpu")
        print(RESULT_MARK + json.dumps(res), flush=True)
        return 0
    if args.probe_child:
        print(RESULT_MARK + json.dumps(probe_environment(args.device)), flush=True)
        return 0
    if args.oom_child:
        print(RESULT_MARK + json.dumps(oom_check(args.device, args.oom_method), default=str),
              flush=True)
        return 0
    if args.soak_child:
        spec = json.loads(args.soak_child)
        res = gpu_soak.run_soak_child(spec, "cuda:0" if args.device == "cuda" else "cpu",
                                      _read_config(spec["model"]))
        print(RESULT_MARK + json.dumps(res, default=str), flush=True)
        return 0
    if args.soak_predict_child:
        from autofit.probe.device import DeviceInfo

        job = json.loads(args.soak_predict_child)
        res = gpu_soak.predict_soak(gpu_soak.SoakSpec(**job["soak"]),
                                    DeviceInfo(**job["target"]))
        print(RESULT_MARK + json.dumps(res, default=str), flush=True)
        return 0

    # ------------------------------------------------------------- parent
    t0 = time.monotonic()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out_dir = Path(args.out or os.environ.get("OUT") or (HERE / "results"))
    run = Run(args, out_dir, t0)
    specs = [] if args.soak_only else select_specs(args)
    soaks = select_soaks(args)
    print(f"gpu_check: {len(specs)} configurations and {len(soaks)} soaks on {args.device}, "
          f"writing to {out_dir}", flush=True)

    # 1. environment + the target DeviceInfo (a child on CUDA: this process stays
    #    without a CUDA context, so each measuring child has the device to itself)
    if args.device == "cuda":
        env = _run_json_child(["--probe-child", "--device", "cuda"], "cuda", 120.0)
    else:
        env = probe_environment("cpu")
    from autofit.probe.device import DeviceInfo, resolve_device

    if "device_info" in env:
        target: Any = DeviceInfo(**env["device_info"])
    else:
        run.data["notes"].append(f"probing the device failed ({env.get('error')}); "
                                 "estimates are for the catalog card H200")
        target = resolve_device("H200") if args.device == "cuda" else resolve_device("cpu")
    env["estimate_target"] = {"name": target.name, "product": target.product,
                              "capacity_bytes": target.capacity_bytes,
                              "overhead_bytes": target.overhead_bytes}
    run.data["environment"] = env
    gpu = env.get("gpu", {})
    print(f"environment: {gpu.get('name', args.device)}, torch "
          f"{env.get('versions', {}).get('torch')}, CUDA {env.get('torch_cuda')}, estimates "
          f"for {target.name} ({target.product}) [{run.elapsed():.0f}s]", flush=True)

    rows: dict[str, dict[str, Any]] = {}
    runnable: list[Spec] = []
    for spec in specs:
        miss = _missing(spec)
        if miss:
            reason = (f"{', '.join(miss)} not installed here (carry a wheel to include it; "
                      "see /work/.library/device/README.md)")
            run.data["skipped"].append({"name": spec.name, "reason": reason})
            print(f"skip {spec.name}: {reason}", flush=True)
            continue
        row = _row(spec)
        rows[spec.name] = row
        run.data["rows"].append(row)
        runnable.append(spec)
    soak_rows: dict[str, dict[str, Any]] = {}
    for soak in soaks:
        soak_rows[soak.name] = gpu_soak.soak_row(soak)
        run.data["soak"].append(soak_rows[soak.name])
    run.write()

    # what runs after the matrix keeps its time: the OOM check, then the soak
    soak_reserve = SOAK_RESERVE_S if soaks else 0.0
    guard_oom = args.guard_s - soak_reserve
    guard_matrix = guard_oom - (0 if args.no_oom_check else OOM_RESERVE_S)

    # 2. the measuring children, one after the other, in a thread
    def measure_all() -> None:
        for i, spec in enumerate(runnable, 1):
            now = run.elapsed()
            if now > guard_matrix:
                with run.lock:
                    run.data["skipped"].append({"name": spec.name,
                                                "reason": f"time guard ({now:.0f}s used)"})
                    rows[spec.name]["measured"] = {"error": "skipped: time guard"}
                continue
            timeout = min(args.config_timeout_s, args.budget_s - WRITE_MARGIN_S - now)
            child_spec = {**asdict(spec), "fp32_outputs": not args.no_fp32_outputs}
            res = _run_json_child(["--child", json.dumps(child_spec), "--device", args.device],
                                  args.device, timeout)
            with run.lock:
                rows[spec.name]["measured"] = res
                _fill_errors(rows[spec.name], args.methods)
            run.write()
            print(f"[{i}/{len(runnable)}] measured {spec.name}: alloc "
                  f"{_gib(res.get('peak_allocated_bytes'))} reserved "
                  f"{_gib(res.get('peak_reserved_bytes'))} used {_gib(res.get('device_used_bytes'))}"
                  + (" OOM" if res.get("oom") else "")
                  + (f" ERROR {res['error']}" if res.get("error") else "")
                  + f" ({res.get('child_wall_s', 0):.1f}s) [{run.elapsed():.0f}s]", flush=True)

        if not args.no_oom_check:  # 4. the OOM boundary + recovery check, next on the device
            run_oom_check()
        run_soaks()  # 5. the whole-run soak, last

    def run_oom_check() -> None:
        now = run.elapsed()
        if now > guard_oom:
            with run.lock:
                run.data["oom_check"] = {"error": f"skipped: time guard ({now:.0f}s used)"}
            return
        print(f"OOM boundary check [{now:.0f}s]", flush=True)
        timeout = min(OOM_TIMEOUT_S, args.budget_s - WRITE_MARGIN_S - now)
        res = _run_json_child(
            ["--oom-child", "--device", args.device, "--oom-method", args.oom_method],
            args.device, timeout)
        with run.lock:
            run.data["oom_check"] = res
        run.write()

    def run_soaks() -> None:
        for i, soak in enumerate(soaks, 1):
            now = run.elapsed()
            timeout = min(SOAK_TIMEOUT_S[args.device], args.budget_s - WRITE_MARGIN_S - now)
            if now > args.guard_s or timeout < SOAK_MIN_S:
                with run.lock:
                    run.data["skipped"].append({"name": soak.name,
                                                "reason": f"time guard ({now:.0f}s used)"})
                    soak_rows[soak.name]["measured"] = {"error": "skipped: time guard"}
                continue
            print(f"soak {soak.name} [{now:.0f}s]", flush=True)
            res = _run_json_child(["--soak-child", json.dumps(asdict(soak)), "--device",
                                   args.device], args.device, timeout)
            with run.lock:
                soak_rows[soak.name]["measured"] = res
                gpu_soak.compare(soak_rows[soak.name])
            run.write()
            print(f"[soak {i}/{len(soaks)}] measured {soak.name}: run reserved "
                  f"{_gib(res.get('run_peak_reserved_bytes'))}, step alone "
                  f"{_gib(res.get('step_peak_reserved_bytes'))}, {res.get('steps_done')} steps"
                  + (f" ERROR {res['error']}" if res.get("error") else "")
                  + f" ({res.get('child_wall_s', 0):.1f}s) [{run.elapsed():.0f}s]", flush=True)

    def predict_soaks() -> None:  # a process of its own: in parallel with the matrix's
        for soak in soaks:
            now = run.elapsed()
            if now > args.guard_s:
                p: dict[str, Any] = {"error": "skipped: time guard"}
            else:
                job = json.dumps({"soak": asdict(soak), "target": asdict(target)})
                p = _run_json_child(["--soak-predict-child", job, "--device", args.device],
                                    args.device, min(SOAK_PREDICT_TIMEOUT_S[args.device],
                                                     args.budget_s - WRITE_MARGIN_S - now),
                                    env_extra={"CUDA_VISIBLE_DEVICES": ""})
            with run.lock:
                soak_rows[soak.name]["predicted"] = p
                gpu_soak.compare(soak_rows[soak.name])
            run.write()
            print(f"  predicted {soak.name}: run reserved "
                  f"{_gib(p.get('run_peak_reserved_bytes'))} step "
                  f"{_gib(p.get('peak_reserved_bytes'))} need "
                  f"{_gib(p.get('run_device_total_bytes'))} "
                  f"({p.get('wall_s', p.get('child_wall_s', 0)):.1f}s)"
                  + (f" ERROR {p['error']}" if "error" in p else ""), flush=True)

    worker = threading.Thread(target=measure_all, name="measure", daemon=True)
    worker.start()
    predictor = threading.Thread(target=predict_soaks, name="predict-soak", daemon=True)
    predictor.start()

    # 3. the predictions, here, meanwhile
    for spec in runnable:
        for method in args.methods:
            if run.elapsed() > args.guard_s:
                with run.lock:
                    rows[spec.name][method] = {"error": "skipped: time guard"}
                continue
            e = _estimate(spec, method, target)
            with run.lock:
                rows[spec.name][method] = e
                _fill_errors(rows[spec.name], args.methods)
            print(f"  predicted {spec.name} {method}: alloc {_gib(e.get('peak_allocated_bytes'))}"
                  f" reserved {_gib(e.get('peak_reserved_bytes'))} total "
                  f"{_gib(e.get('device_total_bytes'))} ({e['wall_s']:.1f}s)"
                  + (f" ERROR {e['error']}" if "error" in e else ""), flush=True)
        run.write()
    for thread, what in ((worker, "measuring"), (predictor, "soak-predicting")):
        thread.join(timeout=max(1.0, args.budget_s - 5.0 - run.elapsed()))
        if thread.is_alive():
            with run.lock:
                run.data["notes"].append(f"the {what} thread did not finish within the budget")
    if args.device == "cuda":
        import torch

        if torch.cuda.is_initialized():
            run.data["notes"].append("this (parent) process initialised CUDA: measured device "
                                     "totals may include its context")
    run.data["finished"] = True
    run.write()
    _print_table(run.data)
    print(f"wrote {out_dir / 'gpu_check.json'} and gpu_check.md [{run.elapsed():.0f}s]", flush=True)
    return 0


def _print_table(d: dict[str, Any]) -> None:
    methods = d["settings"]["methods"]
    if d["rows"]:
        print("\nconfig                                   measured alloc/resv/used GiB   "
              + "   ".join(f"{m} err alloc/resv/total" for m in methods), flush=True)
    for r in d["rows"]:
        m = r.get("measured") or {}
        meas = "/".join(f"{(m.get(k) or 0) / GiB:.2f}" for k in (
            "peak_allocated_bytes", "peak_reserved_bytes", "device_used_bytes"))
        if m.get("error"):
            meas += " ERR"
        cells = []
        for method in methods:
            e = r.get(method) or {}
            cells.append("/".join(_pct(e.get(f"{k}_err")) for k in ("allocated", "reserved",
                                                                     "total")))
        print(f"{r['name']:<40} {meas:<30} " + "   ".join(f"{c:<28}" for c in cells), flush=True)
    for k, s in (d.get("summary") or {}).items():
        if k == "outside_allocator":
            print(f"outside the allocator: median {s['median'] / MiB:.0f} MiB "
                  f"(assumed {(s['assumed'] or 0) / MiB:.0f} MiB)", flush=True)
            continue
        print(f"{k}: n={s['n']} median |err| {100 * s['median_abs']:.1f}% "
              f"max {100 * s['max_abs']:.1f}%", flush=True)
    oc = d.get("oom_check") or {}
    if oc:
        print(f"OOM check: checks {oc.get('checks')} passed={oc.get('passed')} "
              f"boundary est {oc.get('estimated_boundary')} measured {oc.get('measured_boundary')}"
              + (f" error {oc['error']}" if oc.get("error") else ""), flush=True)
    for r in d.get("soak") or []:
        m, c = r.get("measured") or {}, r.get("compare") or {}
        print(f"soak {r['name']}: run reserved {_gib(m.get('run_peak_reserved_bytes'))} "
              f"(predicted {_pct(c.get('run_peak_reserved_err'))}), over the run measured "
              f"{_gib(c.get('over_the_run_measured_bytes'))} predicted "
              f"{_gib(c.get('over_the_run_predicted_bytes'))}, order "
              f"{'same' if c.get('order_matches') else '-'}"
              + (f" error {m['error']}" if m.get("error") else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
