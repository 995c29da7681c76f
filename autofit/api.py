"""The public functions: they resolve names, validate, and call the stages.

    >>> from autofit import estimate, TrainConfig
    >>> est = estimate("tiny-llama", TrainConfig(micro_batch_size=4), seq_len=512, device="cpu")
    >>> sorted(est.breakdown)
    ['activations', 'gradients', 'optimizer_states', 'overhead', 'temporaries', 'weights']
"""

from __future__ import annotations

import importlib.util
from typing import Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError, MissingDependencyError
from autofit.memory.breakdown import MemoryEstimate
from autofit.probe.device import DeviceInfo, check_precision, resolve_device

__all__ = ["estimate", "METHODS"]

METHODS = ("analytic", "simulate")


def _check_dependencies(config: TrainConfig) -> None:
    if config.optimizer_spec.bnb and importlib.util.find_spec("bitsandbytes") is None:
        raise MissingDependencyError(
            f"optimizer {config.optimizer} needs bitsandbytes: pip install 'autofit[bnb]' "
            "(or choose --optim adamw_torch / adafactor)"
        )


def estimate(
    model: Any,
    config: TrainConfig | None = None,
    *,
    seq_len: int | None = None,
    device: str | DeviceInfo = "auto",
    method: str = "analytic",
    task: str | None = None,
    attn_implementation: str | None = None,
    lora: Any = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
) -> MemoryEstimate:
    """Estimate the device memory of one training step.

    Args:
        model: an ``nn.Module`` / ``PreTrainedModel`` / ``PeftModel``, a hub id, a
            local model directory, a ``config.json`` path or a bundled name.
        config: the training configuration (default ``TrainConfig()``).
        seq_len: tokens per sample of the worst-case batch (default ``config.seq_len``).
        device: ``"cpu"``, ``"cpu:8GiB"``, ``"cuda"``, ``"cuda:1"`` or a catalog
            name such as ``"H100-80GB"``.
        method: ``"analytic"`` (closed form, microseconds) or ``"simulate"``
            (the real step on fake tensors, replayed through an allocator model).
        task: ``causal-lm``, ``masked-lm``, ``seq2seq`` or ``seq-cls`` (default:
            from the model's config).
        attn_implementation: ``"eager"`` or ``"sdpa"`` for a model built by name.
        lora: a ``LoraSpec``, a dict of its fields or a ``peft.LoraConfig``, for a
            model built by name.
        load_in_4bit: QLoRA-style 4-bit base (bitsandbytes), for a model built by name.

    Returns:
        A ``MemoryEstimate``.

    Raises:
        AutofitError: on bad input (unknown model, device, precision; no
            trainable parameter; missing bitsandbytes ...), with what to do.

    Example:
        >>> est = estimate("tiny-gpt2", TrainConfig(micro_batch_size=2, precision="bf16-mixed"),
        ...                seq_len=256, device="A100-80GB")
        >>> est.fits
        True
    """
    from autofit.memory.analytic import estimate_analytic
    from autofit.probe.model import build_model, describe

    config = config if config is not None else TrainConfig()
    if not isinstance(config, TrainConfig):
        raise BadInputError(f"config must be a TrainConfig, got {type(config).__name__}")
    if method not in METHODS:
        raise BadInputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    seq = seq_len if seq_len is not None else config.seq_len
    if seq is None:
        raise BadInputError("give seq_len (tokens per sample), e.g. seq_len=1024")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise BadInputError(f"seq_len must be a positive integer, got {seq!r}")
    dev = resolve_device(device)
    check_precision(dev, config.precision)
    _check_dependencies(config)
    module, t = build_model(
        model,
        task=task,
        attn_implementation=attn_implementation,
        lora=lora,
        load_in_4bit=load_in_4bit,
        load_in_8bit=load_in_8bit,
    )
    name = model if isinstance(model, str) else None
    info = describe(module, task=t, name=str(name) if name else None)
    if method == "simulate":
        from autofit.memory.simulate import simulate

        return simulate(module, config, seq_len=seq, device=dev, task=t, model_name=info.name)
    return estimate_analytic(info, config, seq, dev)
