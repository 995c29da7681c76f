"""A fake-tensor clone of a model, prepared as the Trainer prepares it, and its batch.

`fake_clone` copies a module (meta-built or real) with ``copy.deepcopy`` and a memo
that maps every parameter, buffer and tensor attribute to a FakeTensor of the same
shape and requires_grad, so the copy costs no memory, the user's module is never
touched, and tied weights stay tied. `prepare_for_training` then does what
``Trainer`` does to the model before the first step, on the clone only.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from autofit.errors import BadInputError

__all__ = [
    "fake_clone",
    "prepare_for_training",
    "make_batch",
    "unpacked_batches",
    "unwrap",
    "weight_tensors",
]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PeftModel or DDP (or the module itself)."""
    if type(module).__name__ == "DistributedDataParallel":
        module = module.module
    get_base = getattr(module, "get_base_model", None)
    if callable(get_base) and hasattr(module, "peft_config"):
        return get_base()
    return module


def weight_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and quantization states (4-bit QuantState, 8-bit row scales),
    each storage once."""
    from autofit.memory.simulate._bnb import quant_tensors

    seen: set[int] = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        t = getattr(t, "_local_tensor", t)  # an FSDP2 DTensor: this rank's shard
        for x in [t, *quant_tensors(t)]:
            key = id(x.untyped_storage())
            if key not in seen:
                seen.add(key)
                out.append(x)
    return out


def fake_clone(module: torch.nn.Module, *, float_dtype: torch.dtype | None) -> torch.nn.Module:
    """A deep copy of ``module`` whose tensors are FakeTensors on the CPU.

    Must run inside the FakeTensorMode that will run the step.

    Args:
        module: the model (meta or real); it is only read.
        float_dtype: cast floating parameters and buffers to this dtype (what
            ``model.to(dtype)`` does for the "-true" precisions); None keeps them. A
            bitsandbytes-quantized model is never cast (transformers refuses it): it
            keeps the dtypes it was loaded (or built) in.
    """
    from autofit.memory.simulate._bnb import (
        fake_int8_params,
        fake_int8_state,
        fake_params4bit,
        has_quantized,
    )

    if has_quantized(module):
        float_dtype = None
    memo: dict[int, Any] = {}

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        dtype = t.dtype
        if float_dtype is not None and dtype.is_floating_point:
            dtype = float_dtype
        return torch.empty(tuple(t.shape), dtype=dtype, device="cpu")

    for m in module.modules():
        for p in m._parameters.values():
            if p is None or id(p) in memo:
                continue
            if type(p).__name__ == "Params4bit":
                memo[id(p)] = fake_params4bit(p, dtype=float_dtype)
            elif type(p).__name__ == "Int8Params":
                memo[id(p)] = fake_int8_params(p, m)
                state = getattr(m, "state", None)
                if state is not None and id(state) not in memo:
                    memo[id(state)] = fake_int8_state(state)
            else:
                memo[id(p)] = torch.nn.Parameter(fake_like(p), requires_grad=p.requires_grad)
        for b in m._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = fake_like(b)
        qs = getattr(m, "quant_state", None)  # Linear4bit keeps a reference too
        if qs is not None and not isinstance(qs, torch.Tensor):
            memo[id(qs)] = None
        for v in m.__dict__.values():  # plain tensor attributes (e.g. original_inv_freq)
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = fake_like(v)
            elif isinstance(v, (dict, list, tuple)):  # PEFT: prompt_tokens, FourierFT's indices
                for x in v.values() if isinstance(v, dict) else v:
                    if isinstance(x, torch.Tensor) and id(x) not in memo:
                        memo[id(x)] = fake_like(x)
    clone = copy.deepcopy(module, memo)
    for m in clone.modules():
        # LayerDrop (M2M100, NLLB-MoE, SeamlessM4T, wav2vec2...) skips a layer when
        # ``torch.rand([]) < layerdrop``: on fake tensors that comparison skipped every
        # layer (the zoo's rows 42% under); the step to plan for runs them all
        if isinstance(getattr(m, "layerdrop", None), float) and m.layerdrop > 0:
            m.layerdrop = 0.0
    if float_dtype in (torch.float16, torch.bfloat16):
        from autofit.probe.peft import upcast_adapters

        upcast_adapters(clone)  # adapters stay fp32 on a 16-bit base, as peft keeps them
    return clone


def prepare_for_training(
    model: torch.nn.Module,
    *,
    gradient_checkpointing: bool,
    recompute_context: object = None,
    activation_offloading: bool = False,
) -> None:
    """What ``Trainer`` does to the model before training, applied to the clone.

    Args:
        model: the clone.
        gradient_checkpointing: enable it as the Trainer does.
        recompute_context: a factory of a context manager to enter while checkpointed
            blocks are recomputed in backward (``checkpoint(context_fn=...)``): the
            simulation's torch-function mode is not active inside ``backward()``.
        activation_offloading: checkpointing with ``offload=True``, as the Trainer enables
            ``activation_checkpointing_kwargs={"offload": True}`` (the step runs it under
            ``simulate._step.offloaded_to_host``, which gives torch's ``save_on_cpu`` its
            device semantics on fake CPU tensors).
    """
    base = unwrap(model)
    config = getattr(base, "config", None)
    if config is not None:
        # Sequence classification with batch > 1 needs a pad token (users set one).
        if getattr(config, "pad_token_id", None) is None and hasattr(config, "pad_token_id"):
            config.pad_token_id = 0
        if (
            getattr(config, "is_encoder_decoder", False)
            and getattr(config, "decoder_start_token_id", None) is None
        ):
            config.decoder_start_token_id = config.pad_token_id or 0
    if gradient_checkpointing:
        # Trainer: model.activation_checkpointing_enable() (gradient_checkpointing_enable
        # before transformers 5), non-reentrant by default; it also calls
        # enable_input_require_grads() for input_ids models (needed by PEFT).
        ckpt_kwargs: dict[str, Any] = {"use_reentrant": False}
        if recompute_context is not None:
            ckpt_kwargs["context_fn"] = lambda: (contextlib.nullcontext(), recompute_context())
        if hasattr(model, "activation_checkpointing_enable"):
            enable, key = model.activation_checkpointing_enable, "activation_checkpointing_kwargs"
        elif hasattr(model, "gradient_checkpointing_enable"):  # transformers < 5
            enable, key = model.gradient_checkpointing_enable, "gradient_checkpointing_kwargs"
        else:
            raise BadInputError(
                f"{type(model).__name__} has no gradient_checkpointing_enable(); "
                "simulate it with gradient_checkpointing=False"
            )
        extra: dict[str, Any] = {}
        if activation_offloading:
            import inspect

            if "offload" not in inspect.signature(enable).parameters:
                raise BadInputError(
                    f"{type(model).__name__}.{enable.__name__}() of the installed transformers "
                    "cannot offload activations; simulate it with activation_offloading=False")
            extra["offload"] = True
        try:
            enable(**{key: ckpt_kwargs}, **extra)
        except ValueError as e:  # "... does not support activation checkpointing."
            raise BadInputError(
                f"{str(e).splitlines()[0]} Simulate it with gradient_checkpointing=False"
            ) from None
        if key == "gradient_checkpointing_kwargs" and hasattr(model, "peft_config"):
            model.enable_input_require_grads()
        if config is not None:
            config.use_cache = False
    model.train()


@contextlib.contextmanager
def unpacked_batches() -> Iterator[None]:
    """Tell transformers the batch is not packed, as it finds on real tensors.

    With no attention mask and no cache (``use_cache=False``, e.g. with gradient
    checkpointing) transformers looks for packed sequences in ``position_ids``;
    it cannot read fake values, so it would assume packing and build a (B, 1, T, T)
    mask (and, on CUDA, repeat the KV heads and leave flash attention). The batch
    simulated is one sequence per row, for which the real check returns None.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover
        yield
        return
    orig = getattr(masking_utils, "find_packed_sequence_indices", None)
    if orig is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = orig


def _token_ids(config: object, task: str, batch: int, seq_len: int, vocab: int
               ) -> torch.Tensor:
    """Fake token ids carrying real ones (``autofit.memory.simulate._values``): random in
    [0, vocab), from a generator of their own (the user's RNG untouched), and, for an
    encoder-decoder's classifier, each sample closed by its end-of-sequence token and
    holding no other, as a tokenizer writes it and BART's classifier requires (the
    harness's batch, ``benchmarks/measure_cpu.py``, is made so)."""
    from torch._guards import detect_fake_mode
    from torch.utils._python_dispatch import _disable_current_modes

    from autofit.memory.simulate._values import with_values

    mode = detect_fake_mode()
    with _disable_current_modes():
        real = torch.randint(0, vocab, (batch, seq_len), dtype=torch.long,
                             generator=torch.Generator().manual_seed(0))
        eos = getattr(config, "eos_token_id", None)
        if task == "seq-cls" and isinstance(eos, int) and getattr(config, "is_encoder_decoder",
                                                                    False):
            body = real[:, :-1]
            body[body == eos] = (eos + 1) % vocab
            real[:, -1] = eos
    if mode is None:  # (outside a fake mode: the real ids themselves)
        return real
    return with_values(mode.from_tensor(real), real)


def make_batch(model: torch.nn.Module, task: str, batch: int, seq_len: int) -> dict[str, Any]:
    """The tensors a Trainer batch holds (fake; must run inside the fake mode).

    Returns a dict of tensors that live on the device during the step; the key
    ``"_model_kwargs"`` lists the ones passed to ``model(...)``.
    NB: the batch has no padding, so transformers drops the all-ones attention mask
    and uses SDPA's ``is_causal``; the mask is allocated (the batch holds it) but not
    passed, which takes that same path on fake tensors (transformers cannot read the
    values of a fake mask and would otherwise build a (B, 1, T, T) mask).
    """
    config = getattr(unwrap(model), "config", None)
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    out: dict[str, Any] = {}
    ids = _token_ids(config, task, batch, seq_len, vocab)  # (B, T) int64, with its values
    out["input_ids"] = ids
    out["attention_mask"] = torch.ones((batch, seq_len), dtype=torch.long)  # (B, T), not passed
    if task in ("causal-lm", "masked-lm"):
        out["labels"] = ids.clone()  # (B, T): the collator's copy of input_ids
    elif task == "seq2seq":
        out["labels"] = torch.zeros((batch, seq_len), dtype=torch.long)  # (B, T) targets
    elif task == "seq-cls":
        out["labels"] = torch.zeros((batch,), dtype=torch.long)  # (B,)
    elif task == "token-cls":
        out["labels"] = torch.zeros((batch, seq_len), dtype=torch.long)  # (B, T): a class a token
    else:
        raise BadInputError(f"unknown task {task!r}")
    out["_model_kwargs"] = ("input_ids", "labels")
    return out
