"""Train with the configuration `autofit tune` wrote.

    autofit tune tiny-gpt2 --dataset tiny-samples --device cpu:1GiB --target-batch-size 16 -o tuned.yaml
    python examples/train_tuned.py tuned.yaml

The tuned file holds TrainingArguments fields only, so HfArgumentParser loads it
as is; everything else (learning rate, schedule, logging) stays yours.
"""

import sys
import tempfile

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

from autofit.cli.datasets import load_dataset_ref
from autofit.probe.model import load_config


def main(path: str = "tuned.yaml", model_name: str = "tiny-gpt2") -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(path)
    args.max_steps = 3  # a short demonstration run
    args.report_to = []
    args.logging_steps = 1
    args.save_strategy = "no"  # a demonstration: write no checkpoint
    args.output_dir = tempfile.mkdtemp(prefix="autofit-example-")  # nothing in the checkout
    torch.manual_seed(0)
    config: AutoConfig = load_config(model_name)  # bundled config: no download
    model = AutoModelForCausalLM.from_config(config)
    data = load_dataset_ref("tiny-samples")

    def collate(rows):
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    print(f"micro batch {args.per_device_train_batch_size} x accumulation "
          f"{args.gradient_accumulation_steps}, bf16={args.bf16}, optim={args.optim}, "
          f"gradient checkpointing={args.gradient_checkpointing}")
    Trainer(model=model, args=args, train_dataset=data, data_collator=collate).train()


if __name__ == "__main__":
    main(*sys.argv[1:])
