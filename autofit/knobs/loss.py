"""The causal-LM loss without the full logits: ``causal_lm_chunked_loss`` and a Trainer for it.

A causal LM's head turns the last hidden states (B, T, h) into logits (B, T, V), which
``ForCausalLMLoss`` upcasts to fp32 before its log-softmax: for a large vocabulary the
largest tensors of the step (and their gradients in backward). Here the backbone runs
without its head, and torch's ``linear_cross_entropy`` applies the head and the cross
entropy chunk by chunk, so only a (chunk, V) slice of the logits exists at a time; the
gradients of the hidden states and of the head's weight are computed during the
forward and kept until backward. The math is that of ``ForCausalLMLoss``: labels
shifted left by one, ``-100`` ignored, the mean over the tokens kept (or the sum
divided by ``num_items_in_batch`` when given).

    >>> import torch
    >>> from transformers import AutoConfig, AutoModelForCausalLM
    >>> cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                            num_hidden_layers=1, num_attention_heads=2)
    >>> model = AutoModelForCausalLM.from_config(cfg)
    >>> batch = {"input_ids": torch.randint(0, 64, (2, 8))}
    >>> batch["labels"] = batch["input_ids"].clone()
    >>> loss = causal_lm_chunked_loss(model, batch)
    >>> torch.allclose(loss, model(**batch).loss, atol=1e-5)
    True

With the ``Trainer``: ``autofit.ChunkedLossTrainer`` is a ``transformers.Trainer`` whose
``compute_loss`` uses it (built on first use, as transformers is heavy to import)::

    trainer = autofit.ChunkedLossTrainer(model=model, args=result.training_arguments, ...)

Known limitations:
    * NB: models whose logits are scaled or soft-capped after the head (Gemma 2's
      ``final_logit_softcapping``, Cohere's ``logit_scale``) are not supported
      (``unsupported_reason`` says so), nor models without an output embedding.
    * NB: the chunked op precomputes gradients in forward: ``create_graph=True``,
      ``torch.func.grad`` and double backward are not supported (torch's limitation).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from autofit.config import Batch

__all__ = ["causal_lm_chunked_loss", "unsupported_reason", "lm_parts",  # noqa: F822
           "ChunkedLossTrainer", "trainer_class", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # transformers' label for "no loss here" (padding, prompts)
# config attributes that transform the logits after the head (the chunked op cannot)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale",
                     "logits_scaling")


def _unwrap(model: torch.nn.Module) -> Any:
    """The transformers model inside a PEFT / DDP / compiled wrapper."""
    for _ in range(4):
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        elif hasattr(model, "module") and not hasattr(model, "get_output_embeddings"):
            model = model.module  # DistributedDataParallel
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        else:
            break
    return model


def lm_parts(model: torch.nn.Module) -> tuple[Any, Any]:
    """(backbone, head) of a causal LM: the base model that returns the last hidden states,
    and the output embedding (a ``Linear`` whose weight is (V, h)); raises ValueError."""
    why = unsupported_reason(model)
    if why:
        raise ValueError(f"chunked loss: {why}")
    inner = _unwrap(model)
    return inner.base_model, inner.get_output_embeddings()


def unsupported_reason(model: torch.nn.Module, task: str = "causal-lm") -> str | None:
    """Why ``model`` cannot use the chunked loss for ``task`` (None when it can)."""
    if task != "causal-lm":
        return f"a {task} model's loss is not the causal-LM loss over a vocabulary"
    inner = _unwrap(model)
    try:
        head = inner.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        head = None
    weight = getattr(head, "weight", None)
    if weight is None or getattr(weight, "dim", lambda: 0)() != 2:
        return f"{type(inner).__name__} has no output embedding (lm_head) to chunk"
    base = getattr(inner, "base_model", None)
    if base is None or base is inner:
        return f"{type(inner).__name__} has no base model to run without its head"
    config = getattr(inner, "config", None)
    for attr in _LOGIT_TRANSFORMS:
        v = getattr(config, attr, None)
        if v not in (None, 0, 1, 1.0, False):
            return f"{type(inner).__name__} transforms its logits after the head ({attr}={v})"
    return None


def causal_lm_chunked_loss(model: torch.nn.Module, inputs: Batch,
                           num_items_in_batch: torch.Tensor | int | None = None) -> Any:
    """The causal-LM loss of ``model`` on ``inputs`` (with ``labels``), logits never whole.

    Args:
        model: a transformers causal LM (or a PEFT model around one).
        inputs: the batch the model's forward takes, with ``labels`` (B, T) (``-100``
            ignored; shifted left by one here, as ``ForCausalLMLoss`` does).
        num_items_in_batch: when given (the Trainer's count of label tokens over the
            accumulated batch), the sum of the token losses divided by it; else the mean.

    Returns:
        The scalar loss (its gradient flows to the model's parameters as the ordinary
        loss's does).
    """
    import torch
    import torch.nn.functional as F
    from torch.nn import LinearCrossEntropyOptions

    backbone, head = lm_parts(model)
    kwargs = dict(inputs)
    labels = kwargs.pop("labels", None)
    if labels is None:
        raise ValueError("chunked loss: the batch has no labels")
    kwargs.pop("num_items_in_batch", None)
    kwargs.setdefault("use_cache", False)
    out = backbone(**kwargs, return_dict=True)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    del out
    # (B, T) -> labels of the next token; the last position predicts nothing
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])  # (B*T, h)
    shift = shift.reshape(-1).to(hidden.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.linear_cross_entropy(hidden, head.weight, shift,
                                  linear_bias=getattr(head, "bias", None), reduction=reduction,
                                  ignore_index=IGNORE_INDEX, options=LinearCrossEntropyOptions())
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


@lru_cache(maxsize=1)
def trainer_class() -> type:
    """``ChunkedLossTrainer``: a ``transformers.Trainer`` whose loss is the chunked one
    (built on first use, once)."""
    from transformers import Trainer

    class ChunkedLossTrainer(Trainer):
        """A ``transformers.Trainer`` whose causal-LM loss never builds the full logits.

        ``compute_loss`` runs ``autofit.causal_lm_chunked_loss`` (same loss, same
        ``num_items_in_batch`` scaling as the Trainer's); it falls back to the Trainer's
        own loss when a label smoother or ``compute_loss_func`` is set, the batch has no
        labels, the model is not a supported causal LM, or logits are asked for
        (evaluation with ``compute_metrics``).

        Example::

            trainer = ChunkedLossTrainer(model=model, args=args, train_dataset=ds)
            trainer.train()
        """

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            wants_logits = return_outputs and (self.compute_metrics is not None
                                               or self.preprocess_logits_for_metrics is not None)
            if (wants_logits or self.label_smoother is not None
                    or self.compute_loss_func is not None or "labels" not in inputs
                    or unsupported_reason(model) is not None):
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
            n = num_items_in_batch if self.model_accepts_loss_kwargs else None
            # the Trainer's autocast wraps the model's forward (accelerate's prepare_model);
            # the backbone is called here directly, so the same autocast is entered here
            with self.accelerator.autocast():
                loss = causal_lm_chunked_loss(model, inputs, num_items_in_batch=n)
            if self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs \
                    and num_items_in_batch is not None:
                # as Trainer.compute_loss: the token count is summed over the processes
                scale = self.accelerator.num_processes // self.get_tp_size()
                loss = loss * (scale if self.args.n_gpu <= 1 else self.args.n_gpu)
            return (loss, {"loss": loss}) if return_outputs else loss

    ChunkedLossTrainer.__qualname__ = "ChunkedLossTrainer"
    return ChunkedLossTrainer


def __getattr__(name: str) -> Any:
    # ChunkedLossTrainer subclasses transformers.Trainer: built on first use
    if name == "ChunkedLossTrainer":
        return trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
