"""A Trainer script with autofit's pre-flight: check (and fix) before training starts.

    python examples/train_with_callback.py              # micro batch 32 does not fit in 512 MiB:
                                                        # fixed to 8 x 4 (same effective batch)
    python examples/train_with_callback.py --no-fix     # stops with PreflightError, every reason
    python examples/train_with_callback.py --device auto --batch-size 8   # the real machine

``autofit.preflight(trainer, fix=True)`` runs before ``trainer.train()``: it may
shrink ``per_device_train_batch_size`` and raise ``gradient_accumulation_steps`` by
the same factor (logged, and in the returned report). ``AutofitCallback`` then
checks again at ``on_train_begin`` — from the cache, with no new trial — and would
stop the run with every reason if the configuration had changed since.

The model (``examples/tiny-model``: a 2.4M-parameter llama) and the data (the
bundled ``tiny-samples``) are small so that this runs on a laptop CPU in well
under a minute; ``cpu:512MiB`` is a CPU capped at 512 MiB, standing in for a
small GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
from importlib.resources import files
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

import autofit

HERE = Path(__file__).resolve().parent


def pad_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; labels ignore the padding."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu:512MiB", help="auto, cuda, cpu, cpu:512MiB, ...")
    ap.add_argument("--batch-size", type=int, default=32, help="per_device_train_batch_size")
    ap.add_argument("--no-fix", action="store_true", help="stop instead of fixing")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    for name in ("transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(HERE / "tiny-model"))
    text = (files("autofit") / "data" / "datasets" / "tiny-samples.jsonl").read_text()
    data = [json.loads(line) for line in text.splitlines() if line.strip()]
    args = TrainingArguments(
        output_dir=str(HERE / "out"), per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=1, max_steps=2, optim="adamw_torch",
        use_cpu=not a.device.startswith(("auto", "cuda")), report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=pad_collate,
                      callbacks=[autofit.AutofitCallback(device=a.device)])

    try:
        report = autofit.preflight(trainer, fix=not a.no_fix, device=a.device)
    except autofit.PreflightError as e:
        print(e)
        raise SystemExit(e.exit_code) from None
    print(report.summary())

    trainer.train()
    print(f"trained {trainer.state.global_step} steps at micro batch "
          f"{args.per_device_train_batch_size} x accumulation {args.gradient_accumulation_steps} "
          f"(effective batch {args.per_device_train_batch_size * args.gradient_accumulation_steps})")


if __name__ == "__main__":
    main()
