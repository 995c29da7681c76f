"""Ground-truth peak memory of one evaluation step on the CPU, measured from outside torch.

The yardstick for ``autofit.memory.eval``: it shares no code with the ``autofit``
package (torch, transformers and the standard library only), and memory is read
from the kernel (``/proc/self/statm``, ``VmHWM``), never from torch's counters.

Usage::

    python benchmarks/measure_eval.py --spec '{"model_type": "llama", "config": {...},
        "task": "causal-lm", "batch": 4, "seq": 128, "precision": "32-true"}'
    python benchmarks/measure_eval.py --compare      # the table of results/eval_accuracy.md

    >>> from measure_eval import measure            # doctest: +SKIP
    >>> measure(spec)["peak_bytes"]                 # doctest: +SKIP

Spec keys: ``model_type``, ``config`` (``AutoConfig.for_model`` kwargs), ``task``
(``causal-lm`` | ``masked-lm`` | ``seq-cls``), ``batch``, ``seq``, ``precision``
(``32-true`` | ``bf16-mixed`` | ``bf16-true``), optional ``attn_implementation``,
``generate_max_new_tokens``, ``num_beams`` and ``in_training`` (``{"optimizer":
"adamw_torch" | "sgd", "batch": B, "seq": T}``: the evaluation runs inside a
training run, as the Trainer's ``eval_steps`` do — one real training step with
that optimizer (torch's own class; foreach off, as on the CPU), ``zero_grad(set_to_none=True)``,
then ``eval()``; the optimizer's states stay alive and are reported as
``state_bytes``, counted from the optimizer's own tensors).

Protocol (one configuration per fresh child process), as ``measure_cpu.py``: glibc
set to mmap every block >= 64 KiB and trim on free, one arena, one thread; the
model is built (fp32 weights from a fixed seed, cast for ``*-true``) and put in
``eval()`` mode; a warm-up step at batch 1 x seq 8 of the same kind is freed; the
baseline RSS is read (weights and the batch are inside it); one full-size step
runs, the high-water mark is reset, two more steps run, and
``peak_bytes = VmHWM - baseline``; ``steady_peak_bytes`` takes its baseline after
the first full-size step instead, leaving out the one-time caches that step
creates (kernel scratch and heap residue, ~11 MiB here, never released). ``weights_bytes`` is the parameters' and
buffers' storage, so ``peak_bytes + weights_bytes`` compares with an estimator's
absolute peak.

The step is the one ``Trainer.prediction_step`` runs: ``torch.no_grad()``, the
model's forward with labels (the loss computed inside the model, the outputs
alive until the step returns), under ``torch.autocast("cpu", bfloat16)`` with the
outputs then copied to fp32 for ``bf16-mixed`` (accelerate's
``convert_outputs_to_fp32``). With ``generate_max_new_tokens``:
``model.generate`` (greedy or beam search, exactly that many new tokens), then the
forward with labels, as ``Seq2SeqTrainer.prediction_step(predict_with_generate)``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

CHILD_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TRIM_THRESHOLD_": "0",
    "MALLOC_ARENA_MAX": "1",
    "OMP_NUM_THREADS": "1",
}
TASK_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq-cls": "AutoModelForSequenceClassification",
}
RESULT_MARK = "@@MEASURE_EVAL@@ "
WARMUP_BATCH, WARMUP_SEQ = 1, 8

# The configurations of benchmarks/results/eval_accuracy.md (small: seconds each).
LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8000,
         "max_position_embeddings": 1024}
GPT2 = {"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 8000, "n_positions": 1024}
BERT = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 4, "vocab_size": 8000, "max_position_embeddings": 512}
# small vocabulary, so the blocks and the KV cache (not the logits) set the peak
LLAMA_V256 = {**LLAMA, "vocab_size": 256, "num_hidden_layers": 8}
SPECS: list[dict[str, Any]] = [
    {"name": "llama-b8s256", "model_type": "llama", "config": LLAMA, "task": "causal-lm",
     "batch": 8, "seq": 256, "precision": "32-true"},
    {"name": "llama-b8s256-bf16", "model_type": "llama", "config": LLAMA, "task": "causal-lm",
     "batch": 8, "seq": 256, "precision": "bf16-mixed"},
    {"name": "llama-b4s256-eager", "model_type": "llama", "config": LLAMA, "task": "causal-lm",
     "batch": 4, "seq": 256, "precision": "32-true", "attn_implementation": "eager"},
    {"name": "gpt2-b8s256", "model_type": "gpt2", "config": GPT2, "task": "causal-lm",
     "batch": 8, "seq": 256, "precision": "32-true"},
    {"name": "bert-mlm-b8s256", "model_type": "bert", "config": BERT, "task": "masked-lm",
     "batch": 8, "seq": 256, "precision": "32-true"},
    {"name": "llama-gen-b4s128+128", "model_type": "llama", "config": LLAMA,
     "task": "causal-lm", "batch": 4, "seq": 128, "precision": "32-true",
     "generate_max_new_tokens": 128},
    {"name": "llama-gen-b2s64+64-beam4", "model_type": "llama", "config": LLAMA,
     "task": "causal-lm", "batch": 2, "seq": 64, "precision": "32-true",
     "generate_max_new_tokens": 64, "num_beams": 4},
    {"name": "llama-v256-b8s512", "model_type": "llama", "config": LLAMA_V256,
     "task": "causal-lm", "batch": 8, "seq": 512, "precision": "32-true"},
    {"name": "llama-v256-b4s512-eager", "model_type": "llama", "config": LLAMA_V256,
     "task": "causal-lm", "batch": 4, "seq": 512, "precision": "32-true",
     "attn_implementation": "eager"},
    {"name": "llama-v256-gen-b8s64+448", "model_type": "llama", "config": LLAMA_V256,
     "task": "causal-lm", "batch": 8, "seq": 64, "precision": "32-true",
     "generate_max_new_tokens": 448},
    # evaluation inside a training run: the optimizer's states stay alive
    {"name": "llama-b8s256-in-training-adamw", "model_type": "llama", "config": LLAMA,
     "task": "causal-lm", "batch": 8, "seq": 256, "precision": "32-true",
     "in_training": {"optimizer": "adamw_torch", "batch": 2, "seq": 128}},
    {"name": "gpt2-b8s256-bf16-in-training-adamw", "model_type": "gpt2", "config": GPT2,
     "task": "causal-lm", "batch": 8, "seq": 256, "precision": "bf16-mixed",
     "in_training": {"optimizer": "adamw_torch", "batch": 2, "seq": 128}},
    {"name": "bert-mlm-b8s256-in-training-sgd", "model_type": "bert", "config": BERT,
     "task": "masked-lm", "batch": 8, "seq": 256, "precision": "32-true",
     "in_training": {"optimizer": "sgd", "batch": 2, "seq": 128}},
]


def measure(spec: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """Measure one spec in a fresh child process; returns peak_bytes and weights_bytes.

    Raises:
        RuntimeError: the child failed (its stderr tail is in the message).
    """
    env = {**os.environ, **CHILD_ENV}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    raise RuntimeError(f"measuring {spec} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


# --------------------------------------------------------------------------- child side


# the kernel's counters, as the training measurement reads them (measure_cpu.py, beside this)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_cpu import _hwm_bytes as _hwm  # noqa: E402
from measure_cpu import _reset_hwm  # noqa: E402
from measure_cpu import _rss_bytes as _rss  # noqa: E402


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    import contextlib

    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    kwargs = {}
    if spec.get("attn_implementation"):
        kwargs["attn_implementation"] = spec["attn_implementation"]
    model = getattr(transformers, TASK_CLASSES[spec["task"]]).from_config(cfg, **kwargs)
    precision = spec["precision"]
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    mixed = precision == "bf16-mixed"
    state_bytes = 0
    training = spec.get("in_training")
    if training:  # one real training step first: the optimizer's states stay alive
        model.train()
        if training["optimizer"] == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        g = torch.Generator().manual_seed(99)
        ids = torch.randint(1, cfg.vocab_size, (training["batch"], training["seq"]), generator=g)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
        with ctx:
            loss = model(input_ids=ids, labels=ids.clone()).loss
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, ids
        state_bytes = sum(v.untyped_storage().nbytes() for s in opt.state.values()
                          for v in s.values() if torch.is_tensor(v))
        gc.collect()
    model.eval()
    new_tokens = spec.get("generate_max_new_tokens")
    beams = int(spec.get("num_beams", 1))

    def batch(b: int, t: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(1234)
        ids = torch.randint(1, cfg.vocab_size, (b, t), generator=g)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        out["labels"] = torch.zeros(b, dtype=torch.long) if spec["task"] == "seq-cls" else ids.clone()
        return out

    def step(inputs: dict[str, Any]) -> None:
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext()
        with torch.no_grad():
            if new_tokens:
                with ctx:
                    out = model.generate(input_ids=inputs["input_ids"],
                                         attention_mask=inputs["attention_mask"],
                                         max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                         num_beams=beams, do_sample=False, pad_token_id=0,
                                         eos_token_id=None)
                del out
            with ctx:
                outputs = model(**inputs)
            if mixed:  # accelerate's convert_outputs_to_fp32
                outputs = {k: (v.float() if torch.is_tensor(v) else v) for k, v in outputs.items()}
            loss = outputs["loss"]
            float(loss)
            del outputs, loss

    warm = batch(WARMUP_BATCH, WARMUP_SEQ)
    step(warm)
    del warm
    gc.collect()
    inputs = batch(spec["batch"], spec["seq"])
    base = _rss()
    step(inputs)
    gc.collect()
    steady = _rss()  # + the one-time caches of the first full-size step
    _reset_hwm()
    for _ in range(2):
        step(inputs)
    peak = _hwm() - base
    steady_peak = _hwm() - steady
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in list(model.parameters()) + list(model.buffers())}
    return {"peak_bytes": int(peak), "steady_peak_bytes": int(steady_peak),
            "weights_bytes": int(sum(storages.values())), "state_bytes": int(state_bytes),
            "spec": spec}


def _estimate(spec: dict[str, Any]) -> dict[str, Any]:
    """autofit's estimate for ``spec`` (the comparison only; imported here, not above)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import transformers

    from autofit.config import TrainConfig
    from autofit.memory.eval import estimate_eval
    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model

    cfg = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    if spec.get("attn_implementation"):
        cfg._attn_implementation = spec["attn_implementation"]
    import torch

    with torch.device("meta"):
        kwargs = {}
        if spec.get("attn_implementation"):
            kwargs["attn_implementation"] = spec["attn_implementation"]
        module = getattr(transformers, TASK_CLASSES[spec["task"]]).from_config(cfg, **kwargs)
    info = probe_model(module, task=spec["task"])
    training = spec.get("in_training")
    est = estimate_eval(info, spec["batch"], spec["seq"], resolve_device("cpu"),
                        precision=spec["precision"],
                        training=TrainConfig(precision=spec["precision"],
                                             optimizer=training["optimizer"])
                        if training else None,
                        generate_max_new_tokens=spec.get("generate_max_new_tokens"),
                        num_beams=int(spec.get("num_beams", 1)))
    return est.to_dict()


def compare(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Measure every spec and put autofit's estimate beside it (absolute peaks)."""
    rows = []
    for spec in specs:
        m = measure(spec)
        est = _estimate(spec)
        held = m["weights_bytes"] + m.get("state_bytes", 0)  # inside the baseline
        measured = m["peak_bytes"] + held
        steady = m["steady_peak_bytes"] + held
        estimated = est["peak_allocated_bytes"]
        rows.append({"name": spec.get("name", ""), "measured_bytes": measured,
                     "steady_measured_bytes": steady, "estimated_bytes": estimated,
                     "error": (estimated - measured) / measured,
                     "steady_error": (estimated - steady) / steady,
                     "weights_bytes": m["weights_bytes"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help="one spec as JSON")
    ap.add_argument("--compare", action="store_true", help="measure SPECS against the estimate")
    ap.add_argument("--out", default=None, help="write the comparison as JSON")
    a = ap.parse_args()
    if a.child:
        print(RESULT_MARK + json.dumps(_child(json.loads(a.child))), flush=True)
        return
    if a.spec:
        print(json.dumps(measure(json.loads(a.spec)), indent=2))
        return
    rows = compare(SPECS)
    mib = 1 << 20
    print(f"{'config':28} {'measured':>10} {'steady':>10} {'estimate':>10} {'error':>8} "
          f"{'vs steady':>9}")
    for r in rows:
        print(f"{r['name']:28} {r['measured_bytes'] / mib:8.1f}Mi "
              f"{r['steady_measured_bytes'] / mib:8.1f}Mi {r['estimated_bytes'] / mib:8.1f}Mi "
              f"{100 * r['error']:+7.1f}% {100 * r['steady_error']:+8.1f}%")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
