"""The several-process training configurations whose per-rank CPU peak is measured.

Each entry is a spec for ``distributed_measure.measure``: measure_cpu.py's project-wide
spec plus ``nproc``, ``strategy``, ``offload``, ``reshard_after_forward``,
``gradient_as_bucket_view``, ``bucket_cap_mb``. One small llama (~31.6 M params:
sharding moves 60-250 MiB per rank, far above the < 1% noise), causal LM, 2 x 256
tokens per rank; each configuration takes about a minute with 2 processes here.

    python benchmarks/distributed_measure.py --all --out benchmarks/results/distributed_measured.json
"""

from __future__ import annotations

from typing import Any

LLAMA = {  # ~31.6 M params, untied embeddings (2 x 4.2 M), 8 x 2.9 M decoder layers
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1376,
    "vocab_size": 8192,
}
BATCH, SEQ = 2, 256


def spec(name: str, strategy: str, *, nproc: int = 2, precision: str = "32-true",
         ckpt: bool = False, offload: str = "none", reshard_after_forward: bool = True,
         gradient_as_bucket_view: bool = False, bucket_cap_mb: int = 25,
         ds_buckets: str | None = None) -> dict[str, Any]:
    """A spec in the project-wide key order, then the six distributed keys (and
    ``ds_buckets`` when given)."""
    out = {
        "name": name,
        "model_type": "llama",
        "config": dict(LLAMA),
        "task": "causal-lm",
        "batch": BATCH,
        "seq": SEQ,
        "precision": precision,
        "gradient_checkpointing": ckpt,
        "optimizer": "adamw_torch",
        "optim_args": None,
        "attn_implementation": "sdpa",
        "lora": None,
        "nproc": nproc,
        "strategy": strategy,
        "offload": offload,
        "reshard_after_forward": reshard_after_forward,
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "bucket_cap_mb": bucket_cap_mb,
    }
    if ds_buckets is not None:
        out["ds_buckets"] = ds_buckets
    return out


CONFIGS: list[dict[str, Any]] = [
    # DDP: separate gradient buckets vs gradients as views of the buckets
    spec("ddp2-fp32", "ddp"),
    spec("ddp2-fp32-gbv", "ddp", gradient_as_bucket_view=True),
    spec("ddp2-bf16", "ddp", precision="bf16-mixed"),
    spec("ddp2-fp32-ckpt", "ddp", ckpt=True),
    # FSDP2: per-layer + root fully_shard; reshard after forward or keep (SHARD_GRAD_OP)
    spec("fsdp2-fp32", "fsdp"),
    spec("fsdp2-fp32-noreshard", "fsdp", reshard_after_forward=False),
    spec("fsdp2-bf16", "fsdp", precision="bf16-mixed"),
    spec("fsdp2-bf16-noreshard", "fsdp", precision="bf16-mixed", reshard_after_forward=False),
    spec("fsdp2-fp32-ckpt", "fsdp", ckpt=True),
    # DeepSpeed ZeRO 1/2/3
    spec("zero1-fp32", "zero1"),
    spec("zero2-fp32", "zero2"),
    spec("zero3-fp32", "zero3"),
    spec("zero1-bf16", "zero1", precision="bf16-mixed"),
    spec("zero2-bf16", "zero2", precision="bf16-mixed"),
    spec("zero3-bf16", "zero3", precision="bf16-mixed"),
    spec("zero3-bf16-ckpt", "zero3", precision="bf16-mixed", ckpt=True),
    # DeepSpeed's own bucket defaults (5e8 elements) instead of the Trainer's "auto" (h*h)
    spec("zero2-bf16-dsdefault", "zero2", precision="bf16-mixed", ds_buckets="deepspeed-default"),
    # DeepSpeed offload to cpu (DeepSpeedCPUAdam)
    spec("zero2-bf16-offopt", "zero2", precision="bf16-mixed", offload="optimizer"),
    spec("zero3-bf16-offopt", "zero3", precision="bf16-mixed", offload="optimizer"),
    spec("zero3-bf16-offall", "zero3", precision="bf16-mixed", offload="optimizer+params"),
    # 4 processes
    spec("ddp4-fp32", "ddp", nproc=4),
    spec("fsdp4-fp32", "fsdp", nproc=4),
    spec("zero3-4-bf16", "zero3", nproc=4, precision="bf16-mixed"),
]
