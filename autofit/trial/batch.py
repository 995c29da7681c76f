"""The batch of a trial: one micro batch of the user's data (its worst case), of a batch
given as is (rows repeated or cut), or of random tokens, checked against the model.

    >>> from autofit.trial.batch import trial_batch  # measure() calls it
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.errors import BadInputError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from autofit.config import Batch, Collator

__all__ = ["trial_batch"]


def _fit_rows(batch: Mapping[str, object], rows: int) -> Batch:
    """Repeat or cut a batch's rows to ``rows`` samples."""
    import torch

    out = {}
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            try:
                v = torch.as_tensor(v)
            except (TypeError, ValueError, RuntimeError):
                raise BadInputError(f"batch[{k!r}] is not a tensor or a list of numbers") from None
        out[k] = v
    ids = out.get("input_ids")
    if ids is None or ids.dim() != 2:
        raise BadInputError("a batch needs 'input_ids' of shape (batch, seq_len)")
    b0 = ids.shape[0]
    if b0 == 0 or ids.shape[1] == 0:
        raise BadInputError(f"the batch is empty (input_ids of shape {tuple(ids.shape)})")
    if b0 == rows:
        return out
    index = torch.tensor([i % b0 for i in range(rows)])
    return {
        k: (v.index_select(0, index) if v.dim() >= 1 and v.shape[0] == b0 else v)
        for k, v in out.items()
    }


def _model_config(module: torch.nn.Module) -> PretrainedConfig | None:
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return getattr(base, "config", None)


def _make_batch(
    data: object,
    config: TrainConfig,
    module: torch.nn.Module,
    task: str,
    *,
    seq_len: int | None,
    tokenizer: PreTrainedTokenizerBase | None,
    collator: Collator | None,
) -> Batch:
    from autofit.probe.data import random_batch, worst_case_batch

    rows = config.micro_batch_size
    length = seq_len if seq_len is not None else config.seq_len
    if data is None:
        if length is None:
            raise BadInputError("give a dataset, a batch or seq_len (tokens per sample)")
        cfg = _model_config(module)
        vocab = getattr(cfg, "vocab_size", None)
        if not vocab:
            raise BadInputError("the model has no config.vocab_size; pass a batch instead")
        return random_batch(
            rows,
            int(length),
            vocab_size=int(vocab),
            task=task,
            num_labels=int(getattr(cfg, "num_labels", 2) or 2),
        )
    if isinstance(data, dict):
        return _fit_rows(data, rows)
    return worst_case_batch(
        data, rows, max_seq_len=length, tokenizer=tokenizer, collator=collator, task=task
    )


def _with_decoder_inputs(batch: Batch, module: torch.nn.Module) -> Batch:
    """Seq2seq: decoder inputs = labels shifted right, as DataCollatorForSeq2Seq makes them.

    Done here rather than by the model, whose shift needs ``decoder_start_token_id``
    (absent from some configs).
    """
    import torch

    if "decoder_input_ids" in batch or "labels" not in batch or batch["labels"].dim() != 2:
        return batch
    cfg = _model_config(module)
    pad = getattr(cfg, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    start = getattr(cfg, "decoder_start_token_id", None)
    start = pad if start is None else int(start)
    labels = batch["labels"]
    shifted = torch.full_like(labels, pad)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = start
    shifted[shifted == -100] = pad
    return {**batch, "decoder_input_ids": shifted}


def trial_batch(dataset_or_batch: object, config: TrainConfig, module: torch.nn.Module,
                task_name: str, *, seq_len: int | None,
                tokenizer: PreTrainedTokenizerBase | None, collator: Collator | None,
                block_size: int | None) -> Batch:
    """The batch of one micro step of ``config``, checked against the model's vocabulary
    and positions (with decoder inputs for a seq2seq model)."""
    from autofit.probe.model import token_limits

    if block_size is not None:
        from autofit.probe.packing import check_block_size

        check_block_size(block_size, max_positions=token_limits(module)[1])
    batch = _make_batch(
        dataset_or_batch,
        config,
        module,
        task_name,
        seq_len=seq_len,
        tokenizer=tokenizer,
        collator=collator,
    )
    from autofit.probe.data import check_batch

    vocab, positions = token_limits(module)  # an id or length past them is an IndexError
    check_batch(batch, vocab_size=vocab, max_positions=positions)
    if task_name == "seq2seq":
        batch = _with_decoder_inputs(batch, module)
    return batch
