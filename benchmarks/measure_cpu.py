"""Ground-truth peak memory of one training step on the CPU, measured from outside torch.

This is the yardstick every autofit memory estimate is checked against, so it shares
no code with the ``autofit`` package: it imports only torch, transformers, peft,
bitsandbytes and the standard library. Memory is read from the kernel
(``/proc/self/statm``, ``VmHWM`` in ``/proc/self/status``), never from torch's own
counters.

Usage::

    python benchmarks/measure_cpu.py --names llama-b4s256-adamw,gpt2-b4s256-adamw
    python benchmarks/measure_cpu.py --all --out benchmarks/results/measured.json
    python benchmarks/measure_cpu.py --spec '{"name": "x", "model_type": "llama", ...}'
    python benchmarks/measure_cpu.py --names NAME --repeat 3    # check the spread
    python benchmarks/measure_cpu.py --names A,B --out benchmarks/results/measured.json --merge

    >>> from measure_cpu import measure                            # doctest: +SKIP
    >>> measure(spec)["peak_bytes"]                                # doctest: +SKIP

Spec (a JSON-able dict; the project-wide format)::

    {"name": "llama-b4s256", "model_type": "llama", "config": {...AutoConfig.for_model kwargs},
     "task": "causal-lm" | "masked-lm" | "seq2seq" | "seq-cls" | "token-cls",
     "batch": 4, "seq": 256,
     "precision": "32-true" | "bf16-mixed" | "bf16-true" | "16-mixed" | "16-true",
     "gradient_checkpointing": false, "optimizer": "adamw_torch", "optim_args": null,
     "attn_implementation": "sdpa" | "eager",
     "lora": null | {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0,
                     "exclude_modules": null},
     "chunked_loss": false,   # optional: the causal-LM loss by torch's chunked
                              # linear_cross_entropy (backbone + head weight, no full logits)
     "torch_compile": false,  # optional: the step's forward through
                              # torch.compile(model, backend="inductor"), as the Trainer's
                              # accelerate does for TrainingArguments(torch_compile=True)
     "torch_compile_mode": null,  # optional: its mode (TrainingArguments.torch_compile_mode)
     "torch_compile_regional": false,  # optional: accelerate's regional compilation
                              # (accelerate.utils.compile_regions: each repeated block
                              # compiled, the rest of the forward and the loss eager), as
                              # the Trainer runs under an accelerate config's
                              # dynamo_use_regional_compilation: true
     "peft": {"peft_type": "IA3", ...},  # optional, instead of "lora": any peft method, a
                              # dict as in adapter_config.json (task_type from "task")
     "trl_loss": false,      # optional: TRL's SFT loss as trl.SFTTrainer computes it
                              # (trl.trainer.utils.add_fused_lm_head with SFTTrainer's
                              # outputs, model(..., fused_lm_head=True), loss_type "nll")
     "quantization": {"load_in_4bit": true, "bnb_4bit_quant_type": "nf4", ...},
                              # optional: a bitsandbytes base, the BitsAndBytesConfig
                              # fields; the base is saved and loaded back quantized with
                              # dtype = bnb_4bit_compute_dtype (default float32)
     "grad_accum_steps": 4}  # optional (1): micro batches a step, each forward and
                              # backward, then the optimizer (its loss / 4, as the
                              # Trainer divides it)

Protocol (one configuration per fresh child process, so nothing leaks between runs):

1. The child runs with ``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0
   MALLOC_ARENA_MAX=1 OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``: every
   block >= 64 KiB is its own mmap, so freeing a tensor returns its pages and RSS
   follows the live tensors (no glibc caching, no per-thread arenas).
2. Imports, the optimizer class (via ``Trainer.get_optimizer_cls_and_kwargs``) and
   the model are built first (real fp32 weights from a fixed seed), then LoRA and the
   precision cast (or, for ``"peft"``, the precision cast, the base frozen and
   ``get_peft_model`` with ``PeftConfig.from_peft_type``) and gradient checkpointing
   are applied. With ``"quantization"`` the fp32 model is saved to a temporary
   directory and loaded back as a user loads a quantized base,
   ``from_pretrained(dir, quantization_config=BitsAndBytesConfig(**quantization),
   device_map="cpu", dtype=<compute dtype>)`` (bitsandbytes quantizes while loading;
   the fp32 model is freed first), and every tensor that is not a quantized weight is
   cloned into anonymous memory (safetensors loads by ``mmap``: file-backed pages
   would enter RSS only when first touched, inside the measured steps); the
   precision cast is skipped (transformers refuses to cast a bitsandbytes model).
3. Warm-up: one step of the same kind at batch 1 x seq 8 with a throwaway
   optimizer; its gradients (``set_to_none``) and optimizer state are freed and
   ``gc.collect()`` runs. This absorbs one-time autograd/kernel setup (16-31 MiB).
   With ``torch_compile`` the warm-up step runs at the measured shape instead, so
   that compilation (static shapes, forward and backward graphs) is over before the
   baseline: compiled code, inductor's caches and the compiler's own memory are not
   counted, as a long run amortises them. NB: nor are the math libraries' one-time
   caches (see the limitations), which that full-size warm-up creates before the
   baseline: a compiled spec reads up to ~14 MiB lower than a run holds (issue 25: a
   harness with its baseline before compiling found compiled steps 9-17% higher).
4. Baseline = RSS from ``/proc/self/statm``, taken before the measured optimizer is built
   (torch's Adagrad allocates its state in its constructor; a baseline after it missed
   one fp32 copy of the trainable weights). Weights and buffers already exist here,
   so every number below EXCLUDES them; they are reported as ``weights_bytes``
   (computed from the tensors' storages, with bitsandbytes' quantization states: a
   4-bit weight's absmax, code and nested statistics, an 8-bit weight's row scales) so
   that ``peak_bytes + weights_bytes`` can be compared with an estimator's absolute
   peak.
5. One real step (the optimizer state appears), then the high-water mark is reset
   (``5`` -> ``/proc/self/clear_refs``), two more steps run, and
   ``peak_bytes = VmHWM - baseline``.
6. ``phase_peaks`` come from the last of those steps, resetting the high-water mark
   before each phase: ``forward`` (forward + loss), ``backward`` (``loss.backward()``),
   ``optimizer`` (``clip_grad_norm_`` + ``optimizer.step()`` + ``zero_grad``); each is
   that phase's VmHWM minus the baseline, so it includes whatever was live when the
   phase began (e.g. optimizer states, gradients).
7. ``steady_rss_after_step_bytes`` = RSS after the final ``zero_grad`` minus the
   baseline: the optimizer states plus anything the steps left cached.

The step is the one ``transformers.Trainer`` runs: ``model.train()``; gradient
checkpointing via ``gradient_checkpointing_enable(use_reentrant=False)`` and
``config.use_cache = False``; ``loss = model(**batch).loss`` (labels in the batch),
for the mixed precisions under ``torch.autocast("cpu", ...)`` with the half outputs
then copied to fp32 (accelerate's ``convert_outputs_to_fp32``, which the Trainer
wraps around forward); ``loss.backward()`` outside autocast;
``clip_grad_norm_(params, 1.0)``; ``optimizer.step()``;
``optimizer.zero_grad(set_to_none=True)``. The loss (and the autograd graph it roots)
is dropped right after ``backward()``, as ``Trainer.training_step`` returns
``loss.detach()``: a graph node that holds a tensor as a Python attribute
(bitsandbytes' 8-bit matmul keeps its input so) would otherwise keep it through the
optimizer step. The optimizer and its kwargs come from
``Trainer.get_optimizer_cls_and_kwargs`` with the Trainer's two parameter groups
(decay / no-decay as ``Trainer.get_decay_parameter_names`` splits them; trainable
parameters only).

Precisions (Lightning's names): ``32-true`` fp32; ``bf16-mixed`` fp32 weights +
bf16 autocast; ``16-mixed`` fp32 weights + fp16 autocast + ``GradScaler("cpu")``;
``bf16-true`` / ``16-true`` the whole model in bf16 / fp16, no autocast. With ``"lora"``
the adapters too (the model is cast after ``get_peft_model``); with ``"peft"`` the base
is cast first and ``get_peft_model`` then keeps the adapter layers in fp32 (peft's
default ``autocast_adapter_dtype=True``), as a user who loads a bf16 base does.
NB: torch runs fp16 autocast and ``GradScaler("cpu")`` on the CPU, but the Trainer
does not (accelerate refuses fp16 mixed precision on a CPU device), so ``16-mixed``
here is the step the Trainer would run on a GPU, executed on the CPU.

Known limitations:
    NB: RSS counts touched pages only; a tensor allocated with ``torch.empty`` and
    never written costs nothing here, although it would on a GPU allocator.
    NB: allocations below 64 KiB come from the glibc heap, which is trimmed only
    at its top, so a few small blocks may stay resident (tens of KiB).
    NB: one-time caches created by the first full-size step are counted in the peak
    and in ``steady_rss_after_step_bytes``, because the baseline precedes that step.
    On this machine they are 11-15 MiB: they grow with the step's size up to about
    4 x 128 tokens, then stay constant and are never released (kernel scratch and
    heap residue, not tensors).
    NB: the Trainer passes ``num_items_in_batch`` to models that accept loss kwargs
    (sum-reduced loss divided by the token count); this harness uses the model's mean
    loss. The tensors involved are the same size.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Environment of every measuring child (see the protocol above).
CHILD_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",  # bytes; larger blocks are mmap'd, freed to the OS
    "MALLOC_TRIM_THRESHOLD_": "0",  # trim the heap top on every free
    "MALLOC_ARENA_MAX": "1",  # one arena: no per-thread heaps
    "OMP_NUM_THREADS": "1",
}

SPEC_KEYS = (
    "name",
    "model_type",
    "config",
    "task",
    "batch",
    "seq",
    "precision",
    "gradient_checkpointing",
    "optimizer",
    "optim_args",
    "attn_implementation",
    "lora",
)
OPTIONAL_KEYS = ("chunked_loss", "torch_compile", "torch_compile_mode", "torch_compile_regional",
                 "peft", "trl_loss",
                 "quantization", "grad_accum_steps")

TASK_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "seq-cls": "AutoModelForSequenceClassification",
    "token-cls": "AutoModelForTokenClassification",
}

# precision -> (dtype of the whole model or None, autocast dtype or None, GradScaler)
PRECISIONS = {
    "32-true": (None, None, False),
    "bf16-mixed": (None, "bfloat16", False),
    "16-mixed": (None, "float16", True),
    "bf16-true": ("bfloat16", None, False),
    "16-true": ("float16", None, False),
}

MASKED_LM_IGNORED = 0.85  # share of masked-lm labels set to -100 (not predicted)
SEED_MODEL = 0
SEED_BATCH = 1234
WARMUP_BATCH, WARMUP_SEQ = 1, 8
RESULT_MARK = "@@MEASURE_RESULT@@ "
HERE = Path(__file__).resolve().parent


def check_spec(spec: dict[str, Any]) -> None:
    """Raise ValueError listing every problem of ``spec`` (missing/unknown keys, bad values)."""
    problems = []
    missing = [k for k in SPEC_KEYS if k not in spec]
    unknown = [k for k in spec if k not in SPEC_KEYS + OPTIONAL_KEYS]
    if missing:
        problems.append(f"missing keys {missing}")
    if unknown:
        problems.append(f"unknown keys {unknown}")
    if spec.get("task") not in TASK_CLASSES:
        problems.append(f"task {spec.get('task')!r} not in {sorted(TASK_CLASSES)}")
    if spec.get("precision") not in PRECISIONS:
        problems.append(f"precision {spec.get('precision')!r} not in {sorted(PRECISIONS)}")
    if spec.get("attn_implementation") not in ("eager", "sdpa"):
        problems.append("attn_implementation must be 'eager' or 'sdpa'")
    if spec.get("chunked_loss") and spec.get("task") != "causal-lm":
        problems.append("chunked_loss needs task causal-lm")
    if spec.get("trl_loss") and (spec.get("task") != "causal-lm" or spec.get("chunked_loss")):
        problems.append("trl_loss needs task causal-lm, without chunked_loss")
    accum = spec.get("grad_accum_steps", 1)
    if isinstance(accum, bool) or not isinstance(accum, int) or accum < 1:
        problems.append("grad_accum_steps must be a positive integer")
    if spec.get("torch_compile") and spec.get("chunked_loss"):
        problems.append("torch_compile with chunked_loss is not measured here")
    if spec.get("torch_compile_regional") and not spec.get("torch_compile"):
        problems.append("torch_compile_regional needs torch_compile")
    lora = spec.get("lora")
    if lora is not None and not {"r", "alpha", "target_modules"} <= set(lora):
        problems.append("lora needs r, alpha, target_modules (and optionally dropout)")
    peft = spec.get("peft")
    if peft is not None:
        if not isinstance(peft, dict) or "peft_type" not in peft:
            problems.append("peft must be a dict with peft_type (as in adapter_config.json)")
        if lora is not None:
            problems.append("give lora or peft, not both")
    q = spec.get("quantization")
    if q is not None:
        if not isinstance(q, dict) or bool(q.get("load_in_4bit")) == bool(q.get("load_in_8bit")):
            problems.append("quantization must be a dict with one of load_in_4bit / load_in_8bit")
        elif PRECISIONS.get(spec.get("precision"), (None,))[0] not in (None, _compute_dtype(q)):
            problems.append("a *-true precision casts the model; a bitsandbytes base is loaded "
                            "in its bnb_4bit_compute_dtype instead (use the same, or 32-true)")
        if spec.get("lora") is None and spec.get("peft") is None:
            problems.append("a quantized base trains through adapters: give lora or peft")
        if spec.get("torch_compile"):
            problems.append("torch_compile with a quantized base is not measured here")
    if problems:
        raise ValueError(f"spec {spec.get('name')!r}: " + "; ".join(problems))


def _compute_dtype(q: dict[str, Any]) -> str:
    """The dtype a quantized base is loaded in: its ``bnb_4bit_compute_dtype``."""
    return str(q.get("bnb_4bit_compute_dtype") or "float32").replace("torch.", "")


# --------------------------------------------------------------------------- parent side


def measure(spec: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
    """Measure one spec in a fresh child process and return its result dict.

    ``timeout_s``: default 900 s, 2400 s for a compiled spec (compilation comes first).

    Raises:
        ValueError: the spec is malformed.
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    check_spec(spec)
    if timeout_s is None:
        timeout_s = 2400.0 if spec.get("torch_compile") else 900.0
    env = {**os.environ, **CHILD_ENV}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    raise RuntimeError(
        f"measuring {spec['name']!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    )


# --------------------------------------------------------------------------- child side


def _rss_bytes() -> int:
    """Current resident set size, bytes (second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _hwm_bytes() -> int:
    """Resident high-water mark since the last reset, bytes (VmHWM, reported in kB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _quant_state_tensors(model) -> list:
    """bitsandbytes' tensors beside the parameters: a 4-bit weight's QuantState (absmax,
    code, offset, nested absmax and code); an 8-bit layer's row scales (SCB) and int8
    weight, on the weight or, after its first forward, on the layer's state."""
    import torch

    out = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            out += [qs.absmax, qs.code, qs.offset]
            if qs.state2 is not None:
                out += [qs.state2.absmax, qs.state2.code]
        for owner in (w, getattr(m, "state", None)):
            out += [getattr(owner, "CB", None), getattr(owner, "SCB", None)]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _weights_bytes(model) -> int:
    """Bytes of the storages behind all parameters, buffers and quantization states, each
    storage once (ties)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers(), *_quant_state_tensors(model)]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _load_quantized(model, config, cls, spec: dict[str, Any]):
    """``model`` (fp32) saved and loaded back quantized, as a user loads a quantized base;
    every tensor but the quantized weights cloned into anonymous memory (see the protocol)."""
    import torch
    import transformers

    q = dict(spec["quantization"])
    dtype = getattr(torch, _compute_dtype(q))
    if "bnb_4bit_compute_dtype" in q:
        q["bnb_4bit_compute_dtype"] = dtype
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        gc.collect()
        # (the built config, not the saved one read back: BART's classifier saved with 2
        # labels came back with its config's default 3, a size mismatch)
        model = cls.from_pretrained(tmp, config=config,
                                    quantization_config=transformers.BitsAndBytesConfig(**q),
                                    device_map="cpu", dtype=dtype,
                                    attn_implementation=spec["attn_implementation"])
    with torch.no_grad():
        for p in model.parameters():
            if type(p).__name__ not in ("Params4bit", "Int8Params"):
                p.data = p.data.clone()
        for m in model.modules():
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = b.clone()
    gc.collect()
    return model


def _build_model(spec: dict[str, Any]):
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    if spec["task"] == "seq-cls":
        config.num_labels = 2
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0  # sequence classification with batch > 1 needs one
    cls = getattr(transformers, TASK_CLASSES[spec["task"]])
    torch.manual_seed(SEED_MODEL)
    model = cls.from_config(config, attn_implementation=spec["attn_implementation"])
    quantized = spec.get("quantization") is not None
    if quantized:
        model = _load_quantized(model, config, cls, spec)

    task_type = {
        "causal-lm": "CAUSAL_LM",
        "seq2seq": "SEQ_2_SEQ_LM",
        "seq-cls": "SEQ_CLS",
        "token-cls": "TOKEN_CLS",
        "masked-lm": None,
    }[spec["task"]]
    # a quantized base is never cast: it was loaded in its compute dtype
    model_dtype = None if quantized else PRECISIONS[spec["precision"]][0]
    lora = spec["lora"]
    if spec.get("peft") is not None:
        # A user's script: the base loaded in its dtype, frozen, then get_peft_model
        # (which keeps the adapter layers in fp32 on a 16-bit base).
        import peft

        if model_dtype is not None:
            model = model.to(getattr(torch, model_dtype))
        for p in model.parameters():
            p.requires_grad_(False)
        kwargs = dict(spec["peft"])
        if task_type is not None:
            kwargs.setdefault("task_type", task_type)
        model = peft.get_peft_model(model, peft.PeftConfig.from_peft_type(**kwargs))
        model_dtype = None  # cast already
    elif lora is not None:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=lora["r"],
            lora_alpha=lora["alpha"],
            target_modules=lora["target_modules"],
            lora_dropout=lora.get("dropout", 0.0),
            task_type=task_type,
            **({"exclude_modules": lora["exclude_modules"]} if lora.get("exclude_modules")
               else {}),
        )
        model = get_peft_model(model, lora_config)

    if model_dtype is not None:
        model = model.to(getattr(torch, model_dtype))  # "true" half: params, grads, states

    if spec["gradient_checkpointing"]:
        # What Trainer.train() does when args.gradient_checkpointing is set.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model.train()
    return model, config


def _make_batch(spec: dict[str, Any], config, batch: int, seq: int) -> dict[str, Any]:
    """Random token ids in [0, vocab), all-ones attention mask, labels per task (seeded)."""
    import torch

    g = torch.Generator().manual_seed(SEED_BATCH)
    if getattr(config, "vocab_size", None) is None and hasattr(config, "get_text_config"):
        config = config.get_text_config()  # a multimodal model's text side (Mllama, Qwen3.5)
    vocab = config.vocab_size
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)  # (B, T) int64
    out = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    task = spec["task"]
    if task == "causal-lm":
        out["labels"] = input_ids.clone()  # the model shifts them
    elif task == "masked-lm":
        labels = input_ids.clone()
        labels[torch.rand(batch, seq, generator=g) < MASKED_LM_IGNORED] = -100
        labels[:, 0] = input_ids[:, 0]  # at least one predicted token per row
        out["labels"] = labels
    elif task == "seq2seq":
        out["labels"] = torch.randint(0, vocab, (batch, seq), generator=g)  # (B, T) targets
    elif task == "seq-cls":
        out["labels"] = torch.randint(0, 2, (batch,), generator=g)  # (B,)
        eos = getattr(config, "eos_token_id", None)
        if isinstance(eos, int) and config.is_encoder_decoder:
            # a tokenizer ends each sample with </s>: BART's classifier reads its state there
            input_ids[:, -1] = eos
            input_ids[:, :-1][input_ids[:, :-1] == eos] = (eos + 1) % vocab
    elif task == "token-cls":
        # a class per token (the config's num_labels, e.g. 9 for CoNLL NER); a word's
        # later pieces are ignored as run_ner.py's label_all_tokens=False does (~1 in 4)
        labels = torch.randint(0, int(config.num_labels), (batch, seq), generator=g)
        labels[torch.rand(batch, seq, generator=g) < 0.25] = -100
        labels[:, 0] = 0  # at least one labelled token per row
        out["labels"] = labels
    return out


def _make_optimizer(model, opt_cls, opt_kwargs: dict[str, Any], weight_decay: float):
    """The Trainer's optimizer: two groups (decay / no-decay), trainable parameters only."""
    from transformers import Trainer

    # get_decay_parameter_names does not use `self`; call it as the Trainer would.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = opt_cls(groups, **opt_kwargs)
    if "bitsandbytes" in opt_cls.__module__ and opt_kwargs.get("optim_bits") == 8:
        # Trainer.create_optimizer keeps embeddings in 32-bit optimizer states
        import bitsandbytes
        import torch

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


class _PhaseMarks:
    """Resets VmHWM at each phase start and records each phase's peak above a baseline."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.current: str | None = None
        self.before: int | None = None  # VmHWM - baseline up to the first mark, bytes
        self.peaks: dict[str, int] = {}

    def __call__(self, phase: str | None) -> None:
        if self.current is not None:  # (a phase run again, a micro batch's: its highest)
            self.peaks[self.current] = max(self.peaks.get(self.current, 0),
                                           _hwm_bytes() - self.baseline)
        elif self.before is None:
            self.before = _hwm_bytes() - self.baseline
        self.current = phase
        if phase is not None:
            _reset_hwm()


def _half_to_fp32(obj):
    """accelerate's convert_to_fp32: fp16/bf16 tensors in nested dicts/lists/tuples -> fp32."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, Mapping):
        return {k: _half_to_fp32(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_half_to_fp32(v) for v in obj)
    return obj


def _chunked_loss(model, batch):
    """The causal-LM loss without the full logits, written here from torch's API alone: the
    backbone's last hidden states (B, T, h), labels shifted left (-100 padded at the end),
    ``F.linear_cross_entropy`` with the head's weight and chunking options (mean)."""
    import torch.nn.functional as F
    from torch.nn import LinearCrossEntropyOptions

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    # (a PEFT model's own base_model is the tuner around the causal LM: its model's)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = inner.base_model(**inputs, use_cache=False).last_hidden_state
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    head = inner.get_output_embeddings()
    return F.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                  labels.reshape(-1), linear_bias=head.bias,
                                  ignore_index=-100, options=LinearCrossEntropyOptions())


def _trl_loss(model, batch):
    """TRL's SFT loss as ``SFTTrainer.compute_loss`` computes it (loss_type "nll", no
    ``num_items_in_batch``): the forward with ``fused_lm_head=True`` (the head added once,
    in ``_child``), ``-log_probs`` summed over the labelled tokens / their count."""
    outputs = model(**batch, use_cache=False, fused_lm_head=True)
    loss = (-outputs.log_probs).sum() / outputs.label_mask.sum().clamp(min=1)
    # compute_loss reads its metrics (entropy, top-1 accuracy) and drops the outputs
    float(outputs.entropy.detach().sum()), float(outputs.is_top1.sum())
    del outputs
    return loss


def _step(model, batch, optimizer, params, autocast_dtype, scaler, mark=None,
          chunked=False, trl=False, accum=1) -> float:
    """One Trainer optimizer step: ``accum`` micro batches' training steps (gradient
    accumulation: the gradients of the earlier ones held through the next), then the
    optimizer step; returns the loss. ``mark(phase)`` hooks. ``model`` may be the
    ``torch.compile`` wrapper of the model (its forward compiled)."""
    import torch

    mark = mark or (lambda phase: None)
    for _ in range(accum):
        value = _micro_step(model, batch, autocast_dtype, scaler, mark, chunked, trl, accum)
    mark("optimizer")
    if scaler is not None:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, 1.0)  # Trainer default max_grad_norm
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark(None)
    return value


def _micro_step(model, batch, autocast_dtype, scaler, mark, chunked, trl, accum) -> float:
    """One Trainer training_step: forward under the Trainer's autocast, the loss (divided
    by the accumulation steps, as the Trainer does), backward."""
    import torch

    mark("forward")
    ctx = (
        torch.autocast("cpu", dtype=getattr(torch, autocast_dtype))
        if autocast_dtype
        else contextlib.nullcontext()
    )
    if chunked:  # the backbone and the loss under the same autocast, the loss a scalar
        with ctx:
            loss = _chunked_loss(model, batch)
    elif trl:  # SFTTrainer: the fused forward under the Trainer's autocast, a scalar loss
        with ctx:
            loss = _trl_loss(model, batch)
    else:
        with ctx:
            outputs = model(**batch)
        if autocast_dtype:
            # Trainer (accelerate's prepare_model) wraps forward as convert_outputs_to_fp32(
            # autocast(forward)): half outputs get an fp32 copy, e.g. (B, T, V) fp32 logits.
            outputs = _half_to_fp32(outputs)
        loss = outputs["loss"]
        del outputs  # compute_loss returns the loss only: logits etc. are dropped here
    if accum > 1:
        loss = loss / accum
    mark("backward")
    if scaler is not None:
        scaler.scale(loss).backward()
    else:
        loss.backward()
    value = float(loss.detach())
    del loss  # Trainer.training_step returns loss.detach(): the graph is freed here
    return value


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    import transformers
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            optim=spec["optimizer"],
            optim_args=spec["optim_args"],
            use_cpu=True,
            report_to=[],
        )
        opt_cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(args)

    model, config = _build_model(spec)
    trl = bool(spec.get("trl_loss"))
    if trl:  # as SFTTrainer.__init__ does (before the Trainer compiles), with its metrics' outputs
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model,
                          outputs=("log_probs", "entropy", "is_top1"))
    # the module the steps call: the Trainer's accelerate wraps the prepared model last,
    # torch.compile(model, backend="inductor") (TorchDynamoPlugin.to_kwargs()), or with
    # use_regional_compilation accelerate's compile_regions (Accelerator.prepare_model)
    stepped = model
    if spec.get("torch_compile") and spec.get("torch_compile_regional"):
        from accelerate.utils import compile_regions

        stepped = compile_regions(model, backend="inductor", mode=spec.get("torch_compile_mode"))
    elif spec.get("torch_compile"):
        stepped = torch.compile(model, backend="inductor", mode=spec.get("torch_compile_mode"))
    rss_after_build = _rss_bytes()  # bytes; for the warm-up residue below
    params = [p for p in model.parameters() if p.requires_grad]
    _, autocast_dtype, use_scaler = PRECISIONS[spec["precision"]]

    def new_scaler():
        return torch.amp.GradScaler("cpu") if use_scaler else None

    # Warm-up: same kind of step, tiny batch, throwaway optimizer; then free everything.
    # (compiled: at the measured shape, so that the step's graphs are compiled here)
    warm_shape = ((spec["batch"], spec["seq"]) if spec.get("torch_compile")
                  else (WARMUP_BATCH, WARMUP_SEQ))
    warm_batch = _make_batch(spec, config, *warm_shape)
    warm_opt = _make_optimizer(model, opt_cls, opt_kwargs, args.weight_decay)
    chunked = bool(spec.get("chunked_loss"))
    t_warm = time.perf_counter()
    accum = int(spec.get("grad_accum_steps", 1))
    _step(stepped, warm_batch, warm_opt, params, autocast_dtype, new_scaler(), chunked=chunked,
          trl=trl, accum=accum)
    model.zero_grad(set_to_none=True)
    warm_opt.state.clear()
    del warm_opt, warm_batch
    gc.collect()
    warmup_s = time.perf_counter() - t_warm

    batch = _make_batch(spec, config, spec["batch"], spec["seq"])
    scaler = new_scaler()
    gc.collect()

    baseline = _rss_bytes()  # bytes; weights, batch and imports already resident
    # after the baseline: torch's Adagrad allocates its state in its constructor
    optimizer = _make_optimizer(model, opt_cls, opt_kwargs, args.weight_decay)
    _reset_hwm()
    _step(stepped, batch, optimizer, params, autocast_dtype, scaler,
          chunked=chunked, trl=trl, accum=accum)  # optimizer state appears
    first_step_peak = _hwm_bytes() - baseline

    _reset_hwm()
    t0 = time.perf_counter()
    _step(stepped, batch, optimizer, params, autocast_dtype, scaler, chunked=chunked, trl=trl,
          accum=accum)
    marks = _PhaseMarks(baseline)
    loss = _step(stepped, batch, optimizer, params, autocast_dtype, scaler, mark=marks,
                 chunked=chunked, trl=trl, accum=accum)
    step_time_s = (time.perf_counter() - t0) / 2
    # VmHWM is a running max, so the peak over both steps is the high-water mark up to
    # the last step's first reset (read by `marks`) or any phase peak after it.
    peak = max(marks.before, *marks.peaks.values())
    steady = _rss_bytes() - baseline

    return {
        "name": spec["name"],
        "peak_bytes": peak,
        "phase_peaks": marks.peaks,
        "first_step_peak_bytes": first_step_peak,
        "baseline_rss_bytes": baseline,
        "warmup_residue_bytes": baseline - rss_after_build,  # what warm-up + batch left
        "steady_rss_after_step_bytes": steady,
        "weights_bytes": _weights_bytes(model),
        "param_count": sum(p.numel() for p in model.parameters()),
        "trainable_param_count": sum(p.numel() for p in params),
        "loss": loss,
        "step_time_s": step_time_s,
        "warmup_s": warmup_s,  # compiled: includes compilation
        "wall_s": time.perf_counter() - t_start,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "spec": spec,
    }


# --------------------------------------------------------------------------- CLI


def load_configs() -> list[dict[str, Any]]:
    """CONFIGS from benchmarks/configs.py (loaded by path: benchmarks/ is not a package)."""
    mod_spec = importlib.util.spec_from_file_location("_autofit_bench_configs", HERE / "configs.py")
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.CONFIGS


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def _row(r: dict[str, Any]) -> str:
    ph = r["phase_peaks"]
    return (
        f"{r['name']:<28} peak {_mib(r['peak_bytes'])} MiB | fwd {_mib(ph['forward'])} "
        f"bwd {_mib(ph['backward'])} opt {_mib(ph['optimizer'])} | weights "
        f"{_mib(r['weights_bytes'])} | steady {_mib(r['steady_rss_after_step_bytes'])} "
        f"| step {r['step_time_s']:5.2f} s, child {r['wall_s']:5.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--names", help="comma-separated spec names from configs.py")
    parser.add_argument("--all", action="store_true", help="every spec in configs.py")
    parser.add_argument("--spec", help="one spec as a JSON object")
    parser.add_argument("--repeat", type=int, default=1, help="measure each spec N times")
    parser.add_argument("--out", help="write the list of results here (JSON)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds one measuring child may run (a loaded machine is slow)")
    parser.add_argument("--merge", action="store_true",
                        help="with --out: keep that file's other results, replace those "
                             "measured again (by name)")
    args = parser.parse_args(argv)

    if args.child:
        result = _child(json.loads(args.child))
        print(RESULT_MARK + json.dumps(result), flush=True)
        return 0

    if args.spec:
        specs = [json.loads(args.spec)]
    else:
        configs = load_configs()
        if args.all:
            specs = configs
        elif args.names:
            by_name = {c["name"]: c for c in configs}
            wanted = [n.strip() for n in args.names.split(",") if n.strip()]
            unknown = [n for n in wanted if n not in by_name]
            if unknown:
                parser.error(f"unknown names {unknown}; known: {', '.join(by_name)}")
            specs = [by_name[n] for n in wanted]
        else:
            parser.error("give --names, --all or --spec")

    results, failed = [], []
    for i, spec in enumerate(specs, 1):
        peaks = []
        for rep in range(args.repeat):
            print(f"[{i}/{len(specs)}] {spec['name']} (run {rep + 1})...", end=" ", flush=True)
            try:
                r = measure(spec, timeout_s=args.timeout)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                print(f"FAILED\n{e}", flush=True)
                failed.append(spec["name"])
                break
            peaks.append(r["peak_bytes"])
            print(_row(r), flush=True)
            if rep == 0:
                results.append(r)
        if len(peaks) > 1:
            spread = (max(peaks) - min(peaks)) / max(peaks)
            print(f"    spread over {args.repeat} runs: {spread:.4%} ({peaks})", flush=True)

    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.merge and out.exists():
            new = {r["name"] for r in results}
            results = [r for r in json.loads(out.read_text()) if r["name"] not in new] + results
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {len(results)} results to {out}")
    if failed:
        print(f"{len(failed)} failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
