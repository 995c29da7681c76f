"""Activation offloading: what transformers really moves to the host, against both estimators.

Needs no GPU. For bundled models (decoder, encoder, encoder-decoder; full fine-tuning and
LoRA), one real training step runs on real CPU tensors with transformers' own offloading
(``activation_checkpointing_enable(offload=True)``: torch's ``save_on_cpu`` around each
checkpointed block), with ``save_on_cpu`` replaced by hooks that record every tensor it
packs (a CPU-only torch cannot pin memory) and hand it back unchanged. The bytes packed
(and the pinned memory they take, each rounded up to a power of two as torch's host
caching allocator does) are set beside ``estimate(...).host_bytes`` of the analytic rule
(a closed form) and of the simulated step (fake tensors), for an H100 target; so are the
device peaks each method gives without and with offloading (their saving), which a GPU
run of ``benchmarks/gpu_check.py`` has to confirm.

    python benchmarks/offload_check.py      # ~5 min here, writes results/offload_check.md

A second table sets both estimators side by side on Llama-3.2-1B (LoRA and full
fine-tuning, 2 x 2048 tokens, chunked loss) without a real step (its real weights
alone would take 5 GiB here); ``--small`` leaves it out.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from autofit import TrainConfig, estimate  # noqa: E402
from autofit.memory.analytic import pinned_bytes  # noqa: E402
from autofit.probe.model import build_model  # noqa: E402

CARD = "H100-80GB"
# (model, LoRA, precision, batch, seq)
CASES = [
    ("tiny-llama", False, "bf16-mixed", 4, 256),
    ("tiny-llama", True, "bf16-mixed", 4, 256),
    ("tiny-llama", False, "32-true", 2, 512),
    ("tiny-gpt2", False, "bf16-mixed", 4, 256),
    ("tiny-gpt2", True, "32-true", 4, 256),
    ("tiny-bert", False, "bf16-mixed", 4, 128),
    ("tiny-t5", False, "32-true", 4, 128),
]


def packed_by_transformers(name: str, lora: bool, precision: str, batch: int,
                           seq: int) -> tuple[int, int, int]:
    """(bytes packed, pinned bytes, tensors packed) in one real step of the model (real
    weights, real tensors on the CPU) with transformers' offloading."""
    from torch.autograd.graph import saved_tensors_hooks
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForSeq2SeqLM,
        modeling_utils,
    )

    meta, task = build_model(name, lora={"r": 8} if lora else None)
    config = (meta.get_base_model() if lora else meta).config
    cls = {"causal-lm": AutoModelForCausalLM, "masked-lm": AutoModelForMaskedLM,
           "seq2seq": AutoModelForSeq2SeqLM}[task]
    torch.manual_seed(0)
    model = cls.from_config(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    packed: list[int] = []

    class Recording(saved_tensors_hooks):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            def pack(t: torch.Tensor) -> torch.Tensor:
                packed.append(t.numel() * t.element_size())  # a copy of this size is pinned
                return t

            super().__init__(pack, lambda t: t)

    original = modeling_utils.save_on_cpu
    modeling_utils.save_on_cpu = Recording
    try:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)
        model.config.use_cache = False
        model.train()
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        kw = {"input_ids": ids, "labels": ids.clone()}
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed"
                    else torch.autocast("cpu", enabled=False))
        with autocast:
            loss = model(**kw).loss
        loss.backward()
    finally:
        modeling_utils.save_on_cpu = original
    return sum(packed), sum(pinned_bytes(n) for n in packed), len(packed)


BIG = ("meta-llama/Llama-3.2-1B", 2, 2048)  # estimates only: (model, batch, seq)


def big_rows() -> list[str]:
    """Both estimators on a 1B Llama with and without offloading (no real step)."""
    name, batch, seq = BIG
    GiB = 1 << 30
    out = []
    for lora in (True, False):
        kw = {"lora": {"r": 16}} if lora else {}
        cfg = TrainConfig(micro_batch_size=batch, precision="bf16-mixed",
                          gradient_checkpointing=True, chunked_loss=True)
        cells = []
        for method in ("analytic", "simulate"):
            off, on = (estimate(name, cfg.replace(activation_offloading=o), seq_len=seq,
                                device=CARD, method=method, **kw) for o in (False, True))
            cells.append((on.host_bytes / GiB,
                          (off.peak_allocated_bytes - on.peak_allocated_bytes) / GiB,
                          on.peak_allocated_bytes / GiB, on.peak_phase))
        (ha, sa, pa, phase), (hs, ss, ps, _) = cells
        out.append(f"| {name} | {'r=16' if lora else 'no'} | {batch} × {seq} | {ha:.3f} | "
                   f"{hs:.3f} | {sa:.3f} | {ss:.3f} | {pa:.3f} / {ps:.3f} | {phase} |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    warnings.simplefilter("ignore")
    rows = []
    t0 = time.time()
    for name, lora, precision, batch, seq in CASES:
        real, real_pinned, count = packed_by_transformers(name, lora, precision, batch, seq)
        cfg = TrainConfig(micro_batch_size=batch, precision=precision,
                          gradient_checkpointing=True)
        kw = {"lora": {"r": 8}} if lora else {}
        got = {}
        for method in ("analytic", "simulate"):
            off = estimate(name, cfg, seq_len=seq, device=CARD, method=method, **kw)
            on = estimate(name, cfg.replace(activation_offloading=True), seq_len=seq,
                          device=CARD, method=method, **kw)
            got[method] = (on.host_bytes, off.peak_allocated_bytes - on.peak_allocated_bytes,
                           on.peak_allocated_bytes)
        rows.append((name, lora, precision, batch, seq, count, real, real_pinned, got))
        print(rows[-1], flush=True)
    MiB = 1 << 20
    lines = [
        "# Activation offloading: what transformers moves to the host",
        "",
        f"Produced by `python benchmarks/offload_check.py` ({time.strftime('%Y-%m-%d')}, "
        f"{time.time() - t0:.0f} s): one real step per row on CPU tensors with transformers' "
        "`activation_checkpointing_enable(offload=True)`, `save_on_cpu` replaced by hooks that "
        f"record what it packs; estimates for {CARD}. Host = pinned bytes (each tensor rounded "
        "up to a power of two). Device saving = peak allocated without − with offloading "
        "(not measurable without a GPU: `benchmarks/gpu_check.py`).",
        "",
        "| model | LoRA | precision | B × T | tensors packed | packed MiB | pinned MiB (real) "
        "| host MiB analytic | host MiB simulate | device saving MiB analytic "
        "| device saving MiB simulate | peak MiB analytic / simulate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, lora, precision, batch, seq, count, real, pinned, got in rows:
        a, s = got["analytic"], got["simulate"]
        lines.append(
            f"| {name} | {'yes' if lora else 'no'} | {precision} | {batch} × {seq} | {count} "
            f"| {real / MiB:.2f} | {pinned / MiB:.2f} | {a[0] / MiB:.2f} | {s[0] / MiB:.2f} "
            f"| {a[1] / MiB:.2f} | {s[1] / MiB:.2f} | {a[2] / MiB:.1f} / {s[2] / MiB:.1f} |")
    if "--small" not in sys.argv:
        lines += [
            "",
            "Estimates only (no real step), bf16-mixed, checkpointing, chunked loss, "
            f"{CARD}, GiB:",
            "",
            "| model | LoRA | B × T | host analytic | host simulate | device saving analytic "
            "| device saving simulate | peak allocated analytic / simulate | peak phase |",
            "|---|---|---|---|---|---|---|---|---|",
            *big_rows(),
        ]
    out = HERE / "results" / "offload_check.md"
    out.write_text("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
