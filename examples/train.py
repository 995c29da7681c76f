"""The training step of a pipeline: train with the TrainingArguments autofit tuned.

    python examples/train.py examples/tuned.yaml          # after `autofit check` said it fits

The tuned file is plain TrainingArguments YAML (``HfArgumentParser`` loads it); the
model and the sequence length come from autofit's metadata line in it. The model
is built from its config with random weights and trained for a few steps on the
bundled ``tiny-samples`` data, so the example runs on a laptop CPU in seconds.
Replace both with your own.
"""

from __future__ import annotations

import json
import sys
from importlib.resources import files

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)

from autofit.emit import read_config


def pad_collate(features: list[dict], max_len: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample (truncated at ``max_len``); labels ignore padding."""
    rows = [f["input_ids"][:max_len] for f in features]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(path: str) -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(path)
    _, meta = read_config(path)  # the model and sequence length autofit tuned for
    args.max_steps, args.report_to, args.save_strategy = 2, [], "no"  # a demo: two steps
    args.output_dir = "examples/out"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(meta["model"]))
    text = (files("autofit") / "data" / "datasets" / "tiny-samples.jsonl").read_text()
    data = [json.loads(line) for line in text.splitlines() if line.strip()]
    max_len = int(meta.get("max_seq_len") or meta["seq_len"])
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      data_collator=lambda f: pad_collate(f, max_len))
    out = trainer.train()
    print(f"trained {trainer.state.global_step} steps: micro batch "
          f"{args.per_device_train_batch_size} x accumulation {args.gradient_accumulation_steps}, "
          f"loss {out.training_loss:.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "examples/tuned.yaml")
