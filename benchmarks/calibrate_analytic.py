"""Calibrate the analytic model's activation coefficients (run by hand, results committed).

The analytic estimate needs, per block kind and precision, how many bytes per
token a transformer block keeps for backward. This script measures that on tiny
real models by recording the storages autograd saves (saved-tensor hooks, real
CPU tensors), for several dimension variants, and fits

    per-layer bytes/token = c_h*h + c_kv*kv_dim + c_i*i + c_H*heads + c_HT*heads*T + c_0
    outside-the-blocks bytes/token = b_h*h + b_V*V + b_0

by least squares. It writes ``autofit/memory/analytic/coefficients.json``. The accuracy
benchmark (benchmarks/accuracy.py) checks the resulting estimates against
peak-RSS measurements of real training steps, which share no code with this.

    python benchmarks/calibrate_analytic.py                 # CPU kernels: real tensors
    python benchmarks/calibrate_analytic.py --target cuda   # CUDA kernels: the simulator

A CUDA target saves different tensors than the CPU for the same model (SDPA's
flash / memory-efficient kernels handle dropout and keep no (T, T) probabilities;
fused dropout keeps a bool mask), so it has its own coefficients (keys ending in
``/cuda``), fitted from autofit's simulator with CUDA semantics — there is no GPU
here; benchmarks/gpu_check.py checks them on one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parent.parent / "autofit" / "memory" / "analytic" / "coefficients.json"
B = 3
# (hidden, heads, kv_heads, intermediate, vocab, seq)
VARIANTS = [
    (128, 4, 2, 352, 1000, 64),
    (256, 4, 2, 352, 1000, 64),
    (128, 4, 4, 352, 1000, 64),
    (128, 4, 2, 512, 1000, 64),
    (128, 8, 4, 352, 1000, 64),
    (128, 4, 2, 352, 1500, 96),
    (192, 6, 2, 640, 700, 48),
]
FAMILIES = ["llama", "gpt2", "bert", "t5"]
PRECISIONS = ["32-true", "bf16-mixed", "bf16-true"]
ATTNS = ["sdpa", "eager"]
# LoRA regimes: adapters on the attention's query/value projections, or on every linear.
LORA_TARGETS = {
    "llama": ["q_proj", "v_proj"],
    "gpt2": ["c_attn"],
    "bert": ["query", "value"],
    "t5": ["q", "v"],
}
LORAS = ["none", "attn", "all"]


def _build(family, h, H, kvh, i, V, layers, attn):
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
    )

    if family == "llama":
        c = AutoConfig.for_model("llama", hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                                 num_attention_heads=H, num_key_value_heads=kvh, vocab_size=V)
        cls = AutoModelForCausalLM
    elif family == "gpt2":
        c = AutoConfig.for_model("gpt2", n_embd=h, n_layer=layers, n_head=H, n_inner=i, vocab_size=V)
        cls = AutoModelForCausalLM
    elif family == "bert":
        c = AutoConfig.for_model("bert", hidden_size=h, num_hidden_layers=layers, num_attention_heads=H,
                                 intermediate_size=i, vocab_size=V)
        cls = AutoModelForMaskedLM
    else:
        c = AutoConfig.for_model("t5", d_model=h, d_ff=i, d_kv=h // H, num_heads=H, num_layers=layers,
                                 vocab_size=V, decoder_start_token_id=0, pad_token_id=0)
        cls = AutoModelForSeq2SeqLM
    return cls.from_config(c, attn_implementation=attn)


def saved_bytes(family, dims, layers, precision, attn, lora="none") -> int:
    h, H, kvh, i, V, T = dims
    torch.manual_seed(0)
    m = _build(family, h, H, kvh, i, V, layers, attn)
    if lora != "none":
        from peft import LoraConfig, get_peft_model

        targets = LORA_TARGETS[family] if lora == "attn" else "all-linear"
        m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    m.train()
    if precision == "bf16-true":
        m.to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    frozen_shapes = {tuple(p.shape) for p in m.parameters() if not p.requires_grad and p.ndim == 2}
    frozen_shapes |= {s[::-1] for s in frozen_shapes}
    params |= {b.untyped_storage().data_ptr() for b in m.buffers()}
    seen: dict[int, int] = {}

    def is_weight_copy(t) -> bool:
        # autocast's low-precision copy of a parameter: modelled apart (2 B/param)
        fn = t.grad_fn
        if fn is None:  # a frozen weight's copy has no autograd history
            return t.dtype == torch.bfloat16 and tuple(t.shape) in frozen_shapes
        for _ in range(3):  # through views: t(), view()
            if fn is None:
                return False
            if fn.name() == "ToCopyBackward0":
                return type(fn.next_functions[0][0]).__name__ == "AccumulateGrad"
            if fn.name() not in ("TBackward0", "ViewBackward0", "TransposeBackward0"):
                return False
            fn = fn.next_functions[0][0]
        return False

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.data_ptr() != 0 and not is_weight_copy(t):
            seen[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(1, V, (B, T))
    kwargs = {"input_ids": ids, "labels": ids.clone()}
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed"
           else torch.autocast("cpu", enabled=False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        out = m(**kwargs)
    del out
    return sum(seen.values())


def _linear_weight_numel(model) -> int:
    """Elements of the matmul weights autocast copies (nn.Linear / GPT-2's Conv1D)."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D":
            n += m.weight.numel()
    return n


def saved_bytes_cuda(family, dims, layers, precision, attn, lora="none") -> int:
    """Bytes the forward keeps for backward on a CUDA target, from autofit's simulator.

    The simulator runs the real model on fake tensors with CUDA's kernel semantics
    (SDPA backends, fused dropout, autocast lists); what the forward allocates and
    is still alive when backward starts is what it saved. Autocast's weight copies
    are modelled apart (2 B per matmul weight element) and taken out here.
    """
    from autofit.config import TrainConfig
    from autofit.memory.simulate import Simulator

    h, H, kvh, i, V, T = dims
    with torch.device("meta"):
        m = _build(family, h, H, kvh, i, V, layers, attn)
    if lora != "none":
        from peft import LoraConfig, get_peft_model

        targets = LORA_TARGETS[family] if lora == "attn" else "all-linear"
        with torch.device("meta"):
            m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    task = "seq2seq" if family == "t5" else "masked-lm" if family == "bert" else "causal-lm"
    res = Simulator(m, task=task, device="H100-80GB").run(
        TrainConfig(micro_batch_size=B, precision=precision), seq_len=T)
    total = 0
    for ev in res.events:
        if ev.phase == "backward":
            break
        if ev.kind == "alloc" and ev.category == "activations":
            total += ev.size
    if precision == "bf16-mixed":
        total -= 2 * _linear_weight_numel(m)
    return total


def fit(family, precision, attn, lora="none", target="cpu"):
    rows_l, ys_l, rows_b, ys_b = [], [], [], []
    for dims in VARIANTS:
        h, H, kvh, i, V, T = dims
        if family in ("gpt2", "bert", "t5"):
            kvh = H
        if target == "cuda" and attn == "sdpa" and precision == "32-true":
            # fp32 grouped-query attention runs SDPA's math kernel on CUDA, which the
            # analytic model estimates with the eager coefficients; these are for the
            # memory-efficient kernel (fitting both blended them: +39% at 2048 tokens)
            kvh = H
        kv = kvh * (h // H)
        count = saved_bytes_cuda if target == "cuda" else saved_bytes
        s1 = count(family, (h, H, kvh, i, V, T), 1, precision, attn, lora)
        s2 = count(family, (h, H, kvh, i, V, T), 2, precision, attn, lora)
        per_layer = (s2 - s1) / (B * T)
        base = (s1 - (s2 - s1)) / (B * T)
        rows_l.append([h, kv, i, H, H * T, 1.0])
        ys_l.append(per_layer)
        rows_b.append([h, V, 1.0])
        ys_b.append(base)
    cl, *_ = np.linalg.lstsq(np.array(rows_l, float), np.array(ys_l), rcond=None)
    cb, *_ = np.linalg.lstsq(np.array(rows_b, float), np.array(ys_b), rcond=None)
    res_l = np.abs(np.array(rows_l) @ cl - ys_l).max()
    res_b = np.abs(np.array(rows_b) @ cb - ys_b).max()
    r = lambda x: float(round(x, 3))  # noqa: E731
    return {
        "layer": dict(zip(["h", "kv", "i", "H", "HT", "c0"], map(r, cl), strict=False)),
        "base": dict(zip(["h", "V", "c0"], map(r, cb), strict=False)),
        "max_residual_bytes_per_token": [r(res_l), r(res_b)],
    }


def main() -> None:
    torch.set_num_threads(1)
    args = sys.argv[1:]
    target = "cpu"
    if args[:2] == ["--target", "cuda"] or args[:1] == ["--target=cuda"]:
        target = "cuda"
        args = args[2:] if args[0] == "--target" else args[1:]
    families = args or FAMILIES
    table = json.loads(OUT.read_text()) if OUT.exists() else {}
    for fam in families:
        for prec in PRECISIONS:
            for attn in ATTNS:
                for lora in LORAS:
                    key = f"{fam}/{prec}/{attn}/{lora}" + ("/cuda" if target == "cuda" else "")
                    table[key] = fit(fam, prec, attn, lora, target)
                    print(key, table[key], flush=True)
    OUT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
