"""One FSDP2 training step of a tuned file, under torchrun: the sharding the file asks for.

    autofit tune examples/tiny-model --dataset tiny-samples --device cpu:1GiB \\
        --nproc-per-node 2 --strategy fsdp -o tuned.yaml
    torchrun --nproc-per-node 2 examples/fsdp_step.py tuned.yaml

On GPUs ``accelerate launch --config_file tuned-accelerate.yaml examples/train.py
tuned.yaml`` trains with FSDP2; on a CPU accelerate falls back to DDP (every rank a full
replica). This script shards the model itself, as accelerate does on GPUs: each layer of
the model's ``_no_split_modules`` and then the root with ``fully_shard``
(``reshard_after_forward`` from the file's ``fsdp_config``), over gloo on a CPU, NCCL on
GPUs; then one step of the Trainer's kind (forward with labels, backward, gradient
clipping at ``max_grad_norm``, AdamW, zero_grad) on ``per_device_train_batch_size``
samples of the bundled data. Each rank prints its share of the parameters.
"""

from __future__ import annotations

import json
import os
import sys
from importlib.resources import files

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, TrainingArguments

from autofit.emit import read_config


def main(path: str) -> None:
    fields, meta = read_config(path)
    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(path)
    if not args.fsdp or int(args.fsdp_config.get("version", 1)) != 2:
        sys.exit(f"{path} does not train with FSDP2 (fsdp / fsdp_config.version 2)")
    cuda = torch.cuda.is_available() and not args.use_cpu
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if not dist.is_initialized():  # TrainingArguments' accelerate state joins it already
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta["model"]))
    if device is not None:
        model.to(device)
    full = sum(p.numel() for p in model.parameters())
    reshard = bool(args.fsdp_config.get("reshard_after_forward", True))
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, reshard_after_forward=reshard)
    fully_shard(model)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
                for p in model.parameters())
    text = (files("autofit") / "data" / "datasets" / "tiny-samples.jsonl").read_text()
    rows = [json.loads(line)["input_ids"] for line in text.splitlines() if line.strip()]
    b, t = args.per_device_train_batch_size, int(meta.get("seq_len") or 64)
    start = rank * b  # each rank its own samples, as the Trainer's sampler gives them
    ids = torch.zeros(b, t, dtype=torch.long)
    for i in range(b):
        r = rows[(start + i) % len(rows)][:t]
        ids[i, : len(r)] = torch.tensor(r)
    if device is not None:
        ids = ids.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"rank {rank}/{world}: FSDP2 step done, loss {loss.item():.3f}, grad norm "
          f"{float(norm.full_tensor() if isinstance(norm, DTensor) else norm):.3f}; "
          f"holds {local} of {full} parameters ({local / full:.0%})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tuned.yaml")
