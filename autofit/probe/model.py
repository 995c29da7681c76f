"""Model probing: what a model is made of, without its weights.

``probe_model`` accepts an ``nn.Module``, a ``PreTrainedModel`` (a ``PeftModel``
too), a hub id, a local model directory, a path to a ``config.json``, or the name
of a config bundled with autofit (``autofit.probe.model.bundled_models()``), and
returns a frozen ``ModelInfo``. Models given by name or config are built on the
meta device, so a 70B config is probed in about a second with no memory.

    >>> from autofit.probe.model import probe_model
    >>> info = probe_model("tiny-llama")
    >>> info.model_type, info.num_layers
    ('llama', 4)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autofit.errors import (
    BadInputError,
    MissingDependencyError,
    UnknownModelError,
    UnknownTaskError,
    fix,
)
from autofit.probe.loading import (
    CLASSIFIER_TASKS,
    TASKS,
    _check_task,
    _one_line,
    bundled_models,
    default_task,
    load_config,
    module_task,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PretrainedConfig

    from autofit.probe.quant import QuantSpec

    # what names a model: a module, or a hub id / local directory / config.json / bundled name
    ModelReference = str | os.PathLike[str] | torch.nn.Module

__all__ = [
    "fingerprint",
    "TASKS",
    "CLASSIFIER_TASKS",
    "LoraSpec",
    "ParamGroup",
    "BlockSpec",
    "ModelInfo",
    "bundled_models",
    "load_config",
    "build_model",
    "probe_model",
    "describe",
    "module_of",
    "OUTPUT_PROJECTIONS",
    "default_task",
    "token_limits",
]


# Linear-like output projections: they never share their input with a sibling.
OUTPUT_PROJECTIONS = _OUTPUT_PROJECTIONS = {"o_proj", "o", "out_proj", "c_proj", "down_proj", "wo", "fc2", "dense_4h_to_h"}


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter to put on the model (what ``peft.LoraConfig`` says)."""

    r: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] | str = "all-linear"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise BadInputError(f"LoRA rank must be positive, got {self.r}")
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))


@dataclass(frozen=True)
class ParamGroup:
    """Parameters that share shape, dtype and role (e.g. the 32 q_proj weights)."""

    shape: tuple[int, ...]
    count: int
    dtype: str  # "float32", "bfloat16", "uint8" (packed 4-bit), ...
    trainable: bool
    quantized: str | None = None  # "4bit" | "8bit" | None
    role: str = "other"  # "linear" | "embedding" | "norm" | "bias" | "lora" | "adapter" | "prompt" | "other"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BlockSpec:
    """One kind of transformer block, as the analytic model needs it.

    ``linears`` lists (name, in_features, out_features, shares_input) in module
    order; ``shares_input`` marks a linear that reads the same tensor as the
    linear before it (q/k/v, gate/up), which autograd saves only once.
    """

    role: str  # "decoder" | "encoder" | "decoder-cross"
    count: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    linears: tuple[tuple[str, int, int, bool], ...]
    gated_mlp: bool
    activation: str
    norm: str  # "rmsnorm" | "layernorm"
    num_norms: int
    dropout: float  # residual / hidden dropout probability
    attention_dropout: float
    num_dropouts: int  # hidden-sized dropout modules with p > 0 per block (residual stream)
    num_inner_dropouts: int = 0  # intermediate-sized dropouts (T5's DenseReluDense.dropout)
    cross_attention: bool = False
    relative_bias: bool = False  # T5-style position bias added to the scores


@dataclass(frozen=True)
class ModelInfo:
    """What a model is made of: parameter counts and the shape of its blocks."""

    name: str
    model_type: str
    task: str
    architecture: str
    num_params: int
    trainable_params: int
    frozen_params: int
    quantized_params: int
    params: tuple[ParamGroup, ...]
    blocks: tuple[BlockSpec, ...]
    num_layers: int | None
    hidden_size: int | None
    num_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    intermediate_size: int | None
    vocab_size: int | None
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    attn_implementation: str | None
    is_encoder_decoder: bool = False
    num_labels: int | None = None
    embedding_dropout: float = 0.0
    peft: str | None = None
    lora_r: int | None = None
    lora_targets: tuple[str, ...] = ()
    quantization: str | None = None  # "4bit" | "8bit" (``quant.name``)
    dtype: str = "float32"
    supports_gradient_checkpointing: bool = True
    peft_config: str = ""  # the PEFT config as canonical JSON (autofit.probe.peft.config_key)
    virtual_tokens: int = 0  # prompt tokens a PEFT method prepends to every sample
    adapter_buffer_bytes: int = 0  # buffers a PEFT method adds (VeRA's shared projections)
    buffer_bytes: int = 0  # the model's own floating-point buffers (I-BERT's quantization state)
    int_buffer_bytes: int = 0  # ... and its other buffers (position ids), never cast
    quant: Any = None  # autofit.probe.quant.QuantSpec of a bitsandbytes-quantized base
    # elements of the 2-D weights outside the blocks with a column per vocabulary token
    # (MobileBERT's head multiplies by its tied embedding and such a weight stacked, not by
    # a linear layer: its weight gradient is a (hidden, rows) @ (rows, vocabulary) product),
    # and whether they train
    head_columns: int = 0
    head_columns_trained: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def block_matmul_numel(self) -> int:
        """Elements of the blocks' matmul weights (what autocast copies per op; none for a
        bitsandbytes-quantized base, which dequantizes per op and saves the packed weight)."""
        if self.quantization is not None:
            return 0
        return sum(b.count * sum(i * o for _, i, o, _ in b.linears) for b in self.blocks)

    @property
    def lm_logits(self) -> bool:
        """Whether the step computes vocabulary-wide (B, T, V) logits: a vocabulary and an
        LM head, not a classifier's (seq-cls, token-cls: ``num_labels`` wide)."""
        return self.task not in CLASSIFIER_TASKS and self.vocab_size is not None

    @property
    def head_numel(self) -> int:
        """Elements of the LM head's weight (0 for a classifier or without a vocabulary):
        the largest 2-D parameter with a row per token of the vocabulary, else hidden x
        vocabulary; + a 2-D parameter with a column per token (MobileBERT's head multiplies
        by its 128-wide tied embedding and a (hidden - 128, vocabulary) weight stacked:
        ``head_columns``; a block's weight that happens to be vocabulary-wide, as Ergo's
        shared expert's 8192 -> 256, is not the head's).
        ConvBERT's, RemBERT's and DeBERTa's heads project from an embedding width other than
        the hidden size (768 x vocabulary beside a 256 hidden size), ALBERT's and ELECTRA's
        generator from a narrower one."""
        vocab = self.vocab_size
        if not vocab or self.task in CLASSIFIER_TASKS:
            return 0
        two_d = [g for g in self.params if len(g.shape) == 2 and g.quantized is None]
        rows = [g.shape[0] * g.shape[1] for g in two_d if g.shape[0] == vocab]
        return max(rows, default=(self.hidden_size or 0) * vocab) + self.head_columns

    @property
    def is_transformer(self) -> bool:
        """True when the blocks were recognised (the analytic method needs them)."""
        return bool(self.blocks) and self.hidden_size is not None


def adapter_request(lora: object, peft_config: object) -> object:
    """One adapter request from the LoRA shorthand (``lora=``) or a PEFT config
    (``peft_config=``): what ``build_model(lora=...)`` and a trial's ``ModelRef`` carry."""
    if lora is not None and peft_config is not None:
        raise BadInputError("give either the LoRA shorthand ("
                            + fix("--lora-r", "lora=") + ") or a PEFT config ("
                            + fix("--peft-config", "peft_config=") + "), not both")
    return peft_config if peft_config is not None else lora


def _peft_config(request: object, task: str) -> Any:
    """The PeftConfig of an adapter request: a ``LoraSpec`` or a dict of its fields (the
    LoRA shorthand), or anything ``autofit.probe.peft.peft_config`` reads."""
    from autofit.probe.peft import peft_config as read_peft_config

    if isinstance(request, dict) and "peft_type" not in request:
        request = LoraSpec(**request)
    if isinstance(request, LoraSpec):
        targets = request.target_modules
        request = {"peft_type": "LORA", "r": request.r, "lora_alpha": request.alpha,
                   "target_modules": list(targets) if isinstance(targets, tuple) else targets,
                   "lora_dropout": request.dropout}
    return read_peft_config(request, task)


def _quantize_on_meta(model: torch.nn.Module, spec: QuantSpec) -> None:
    """Replace the base model's Linear / Conv1D layers by bitsandbytes' quantized layers
    (meta), leaving out what transformers leaves out when it loads the model quantized
    (the output head and tied modules, ``_keep_in_fp32_modules``, ``spec.skip_modules``).
    The new layers' weights take the compute dtype, the dtype ``from_pretrained`` casts a
    checkpoint to before quantizing it (what a 4-bit weight dequantizes back to)."""
    import torch

    try:
        import bitsandbytes as bnb  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            fix("--load-in-4bit / --load-in-8bit", "load_in_4bit / load_in_8bit")
            + " needs bitsandbytes: pip install 'autofit[bnb]'"
        ) from None
    from transformers.integrations import bitsandbytes as hf_bnb
    from transformers.quantizers.base import HfQuantizer

    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    skip = HfQuantizer.get_modules_to_not_convert(model, list(spec.skip_modules) or None, keep)
    with torch.device("meta"):
        hf_bnb.replace_with_bnb_linear(model, modules_to_not_convert=skip,
                                       quantization_config=spec.to_bnb_config())
    for m in model.modules():
        w = getattr(m, "weight", None)
        if type(w).__name__ in {"Params4bit", "Int8Params"} and w.is_floating_point():
            w.data = w.data.to(spec.torch_dtype)
    config = getattr(model, "config", None)
    if config is not None:  # as from_pretrained leaves it (a config.json's dict here)
        config.quantization_config = spec.to_dict()


def build_model(
    model: ModelReference,
    *,
    task: str | None = None,
    attn_implementation: str | None = None,
    lora: LoraSpec | dict[str, object] | object | None = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    peft_config: object = None,
    quantization_config: object = None,
) -> tuple[torch.nn.Module, str]:
    """Return (module, task). A model given by reference is built on the meta device.

    A quantized base (``load_in_4bit`` / ``load_in_8bit`` / ``quantization_config``:
    anything ``autofit.probe.quant.resolve`` reads; a checkpoint saved quantized brings
    its own) is built as ``from_pretrained(..., quantization_config=...,
    torch_dtype=compute dtype)`` loads it: the model in the compute dtype, its linear
    layers bitsandbytes' (``_quantize_on_meta``).

    An ``nn.Module`` is returned as is (never modified); asking for LoRA or
    quantization on a module is an error, since that would change the user's model.
    """
    import torch

    quant_asked = load_in_4bit or load_in_8bit or quantization_config is not None
    if isinstance(model, torch.nn.Module):
        if lora is not None or peft_config is not None or quant_asked:
            raise BadInputError(
                "PEFT/quantization options apply to a model given by name or config; "
                "for a module, pass the PeftModel / quantized model itself"
            )
        t = _check_task(task) if task else module_task(model)
        return model, t
    if not isinstance(model, (str, os.PathLike)):
        raise UnknownModelError(
            f"model must be an nn.Module, a hub id, a directory or a config.json path, "
            f"got {type(model).__name__}"
        )
    import transformers

    config = load_config(model)
    t = _check_task(task) if task else default_task(config)
    if t == "seq2seq" and not getattr(config, "is_encoder_decoder", False):
        raise UnknownTaskError(f"task 'seq2seq' needs an encoder-decoder model; {model} is not one")
    auto = getattr(transformers, TASKS[t])
    kwargs: dict[str, Any] = {}
    if attn_implementation:
        if attn_implementation not in {"eager", "sdpa", "flash_attention_2", "flex_attention"}:
            raise BadInputError(
                f"unknown attention implementation {attn_implementation!r}; use eager or sdpa"
            )
        kwargs["attn_implementation"] = attn_implementation
    from autofit.probe.quant import resolve

    spec = resolve(load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
                   quantization_config=quantization_config,
                   saved=getattr(config, "quantization_config", None))
    if spec is not None:
        kwargs["dtype"] = spec.torch_dtype  # from_pretrained(..., torch_dtype=compute dtype)
    try:
        with torch.device("meta"):
            module = auto.from_config(config, **kwargs)
    except ValueError as e:
        raise UnknownTaskError(
            f"{model} ({config.model_type}) cannot be built for task {t!r}: {_one_line(e)}"
        ) from None
    except Exception as e:  # noqa: BLE001 - a config the model class cannot be built from
        raise BadInputError(
            f"{model} ({config.model_type}) cannot be built from its config: "
            f"{type(e).__name__}: {_one_line(e)}; fix the config"
        ) from None
    if spec is not None:
        _quantize_on_meta(module, spec)
    request = adapter_request(lora, peft_config)
    if request is not None:
        from autofit.probe.peft import apply_peft

        module = apply_peft(module, _peft_config(request, t))
    return module, t


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).replace("torch.", "")


def _quant_kind(p: torch.Tensor) -> str | None:
    cls = type(p).__name__
    if cls == "Params4bit":
        return "4bit"
    if cls == "Int8Params":
        return "8bit"
    return None


def _param_groups(module: torch.nn.Module) -> tuple[ParamGroup, ...]:
    import torch

    groups: dict[tuple, int] = {}
    adapters = set(getattr(module, "peft_config", None) or ())  # adapter names ("default")
    tuner_layers: tuple[str, ...] = ()
    if adapters:
        from peft.tuners.tuners_utils import BaseTunerLayer

        tuner_layers = tuple(n + "." for n, m in module.named_modules()
                             if isinstance(m, BaseTunerLayer))
    # an embedding's weight by identity: a tied head registered first names it (CamemBERT's
    # lm_head.decoder), and the Trainer's 32-bit override for 8-bit optimizers goes by the
    # module (10.9% under as a linear's)
    embedding_weights = {id(m.weight) for m in module.modules()
                         if isinstance(m, torch.nn.Embedding) and m.weight is not None}
    for name, p in module.named_parameters():
        leaf = name.rsplit(".", 1)
        if "lora_" in name:
            role = "lora"
        elif adapters & set(name.split(".")):
            # a PEFT method's parameter: in an adapter layer (ia3_l.default, hada_w1...),
            # which peft keeps in fp32 on a 16-bit base, or a prompt encoder's, which it casts
            role = "adapter" if name.startswith(tuner_layers) else "prompt"
        elif p.ndim >= 2 and id(p) in embedding_weights:
            role = "embedding"
        elif p.ndim >= 2:
            role = "linear"
        elif leaf[-1] == "bias":
            role = "bias"
        else:
            role = "norm"
        key = (tuple(p.shape), _dtype_name(p.dtype), bool(p.requires_grad), _quant_kind(p), role)
        groups[key] = groups.get(key, 0) + 1
    return tuple(
        ParamGroup(shape=k[0], count=c, dtype=k[1], trainable=k[2], quantized=k[3], role=k[4])
        for k, c in groups.items()
    )


def _first(config: object, *names: str, default: object = None) -> Any:
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _layer_lists(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """The ModuleLists of transformer blocks (the largest ones; two for encoder-decoders)."""
    import torch

    lists = [
        (n, m)
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and any(True for _ in m[0].parameters())
    ]
    # keep lists that are not nested inside another list's block
    top = [
        (n, m)
        for n, m in lists
        if not any(n != o and n.startswith(o + ".") for o, _ in lists)
    ]
    return top


def _linear_dims(m: torch.nn.Module) -> tuple[int, int] | None:
    cls = type(m).__name__
    if getattr(m, "in_features", None) is not None and getattr(m, "out_features", None) is not None:
        return int(m.in_features), int(m.out_features)
    if cls == "Conv1D":  # GPT-2: weight is (in, out)
        w = m.weight
        return int(w.shape[0]), int(w.shape[1])
    return None


def _block_spec(role: str, count: int, block: torch.nn.Module, config: PretrainedConfig,
                info: dict[str, object]) -> BlockSpec:
    import torch

    linears: list[tuple[str, int, int, bool]] = []
    prev: tuple[str, int] | None = None  # (parent, in_features)
    norms = 0
    norm_kind = "layernorm"
    dropouts = 0
    inner_dropouts = 0
    gated = False
    act = str(_first(config, "hidden_act", "activation_function", "dense_act_fn", default="gelu"))
    cross = False
    rel_bias = False
    seen_base = set()
    wrappers: list[str] = []  # PEFT layers: only their base_layer is the model's own
    for name, m in block.named_modules():
        if "lora_" in name or name in seen_base:
            continue
        if any(name.startswith(w + ".") and not name.startswith(w + ".base_layer")
               for w in wrappers):
            continue  # an adapter's own module (ia3_l, vera_dropout, oft_R, ...)
        leaf = name.rsplit(".", 1)[-1]
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        # peft wraps a Linear in a LoraLayer whose `base_layer` is the Linear
        if hasattr(m, "base_layer"):
            seen_base.add(name + ".base_layer")
            wrappers.append(name)
            m_dims = _linear_dims(m.base_layer) or _linear_dims(m)
        else:
            m_dims = _linear_dims(m)
        if m_dims is not None and leaf != "base_layer":
            shares = (
                prev is not None
                and prev[0] == parent
                and prev[1] == m_dims[0]
                and leaf not in _OUTPUT_PROJECTIONS
            )
            linears.append((name, m_dims[0], m_dims[1], shares))
            prev = (parent, m_dims[0]) if leaf not in _OUTPUT_PROJECTIONS else None
            if leaf in {"gate_proj", "wi_0", "w1", "w3", "gate_up_proj"}:
                gated = True
        cls = type(m).__name__
        if "Norm" in cls and not isinstance(m, torch.nn.ModuleList):
            norms += 1
            if "RMS" in cls or cls == "T5LayerNorm":
                norm_kind = "rmsnorm"
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            owner = type(block.get_submodule(parent)).__name__ if parent else type(block).__name__
            if leaf == "attn_dropout" or (owner.endswith("SelfAttention") and "Layer" not in owner):
                pass  # dropout on attention probabilities, counted with the attention
            elif owner.startswith("T5Dense"):
                inner_dropouts += 1  # NB: T5 applies it to the (B, T, d_ff) activation
            else:
                dropouts += 1
        if "EncDec" in cls or "EncDec" in name or "crossattention" in name.lower() or "cross_attn" in name:
            cross = True
        if leaf == "relative_attention_bias":
            rel_bias = True
    hidden = int(info["hidden_size"])
    heads = int(info["num_heads"])
    return BlockSpec(
        role="decoder-cross" if cross else role,
        count=count,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(info["num_kv_heads"]),
        head_dim=int(info["head_dim"]),
        intermediate_size=int(info["intermediate_size"]),
        linears=tuple(linears),
        gated_mlp=gated,
        activation=act,
        norm=norm_kind,
        num_norms=norms,
        dropout=float(info["dropout"]),
        attention_dropout=float(info["attention_dropout"]),
        num_dropouts=dropouts,
        num_inner_dropouts=inner_dropouts,
        cross_attention=cross,
        relative_bias=rel_bias,
    )


def probe_model(
    model: ModelReference,
    *,
    task: str | None = None,
    attn_implementation: str | None = None,
    lora: LoraSpec | dict[str, object] | object | None = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    peft_config: object = None,
    quantization_config: object = None,
) -> ModelInfo:
    """Describe ``model`` (see the module docstring for the accepted forms).

    Raises:
        UnknownModelError: the reference cannot be resolved.
        UnknownTaskError: the task is unknown or does not fit the model.
    """
    module, t = build_model(
        model,
        task=task,
        attn_implementation=attn_implementation,
        lora=lora,
        load_in_4bit=load_in_4bit,
        load_in_8bit=load_in_8bit,
        peft_config=peft_config,
        quantization_config=quantization_config,
    )
    return describe(module, task=t, name=str(model) if not hasattr(model, "parameters") else None)


@functools.lru_cache(maxsize=1)
def _described() -> weakref.WeakValueDictionary[str, torch.nn.Module]:
    """The modules described in this process, by fingerprint, while they are alive."""
    return weakref.WeakValueDictionary()


def module_of(info: ModelInfo) -> Any:
    """The module ``info`` was described from, while it is alive (else None): the
    analytic model derives coefficients from it for what its table lacks."""
    return _described().get(json.dumps(fingerprint(info), sort_keys=True, default=str))


def describe(module: torch.nn.Module, *, task: str, name: str | None = None) -> ModelInfo:
    """ModelInfo of an already built module (meta or real); reads, never modifies."""
    info = _describe(module, task=task, name=name)
    with contextlib.suppress(TypeError):  # not weak-referenceable: nothing to derive from
        _described()[json.dumps(fingerprint(info), sort_keys=True, default=str)] = module
    return info


def _describe(module: torch.nn.Module, *, task: str, name: str | None = None) -> ModelInfo:
    base, peft_kind, lora_r, lora_targets, peft_key, adapter_buffers, virtual = _peft_of(module)
    config = getattr(base, "config", None)

    params = _param_groups(module)
    num = trainable = quant = 0
    for g in params:
        n = g.numel * g.count
        if g.quantized == "4bit" and g.dtype == "uint8":
            n *= 2  # a quantized Params4bit packs two 4-bit values per uint8 element
        num += n
        if g.trainable:
            trainable += n
        if g.quantized:
            quant += n
    dtypes = [g.dtype for g in params if g.role in {"linear", "embedding"} and not g.quantized]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else "float32"
    qspec = None
    if any(g.quantized for g in params):
        from autofit.probe.quant import spec_of_module

        qspec = spec_of_module(module)

    float_buffers, int_buffers = _own_buffer_bytes(module, adapter_buffers)

    if (config is not None and _first(config, "hidden_size", "n_embd", "d_model") is None
            and hasattr(config, "get_text_config")):
        # a composite's widths are its text model's (Fuyu's Persimmon: its blocks were not
        # recognised, the analytic estimate refused and the CPU caches' rule took the LM
        # head for a feed-forward: 5.0% over simulated)
        text = config.get_text_config()
    else:
        text = config
    blocks, fields = _blocks_of(base, text, task) if text is not None else ([], {})
    vocab = _first(text, "vocab_size") if text is not None else None
    tie = bool(getattr(config, "tie_word_embeddings", False)) if config is not None else False
    if tie:
        # trust the modules: tied only if the output head shares the input embedding
        try:
            out = base.get_output_embeddings()
            inp = base.get_input_embeddings()
            tie = out is not None and inp is not None and out.weight is inp.weight
        except (AttributeError, NotImplementedError):
            pass
    attn = getattr(config, "_attn_implementation", None) if config is not None else None
    num_layers = sum(b.count for b in blocks) if blocks else None
    head_columns, head_trained = _head_columns(base, vocab, task)
    return ModelInfo(
        name=name or type(module).__name__,
        model_type=getattr(config, "model_type", "custom") if config is not None else "custom",
        task=task,
        architecture=type(base).__name__,
        num_params=num,
        trainable_params=trainable,
        frozen_params=num - trainable,
        quantized_params=quant,
        params=params,
        blocks=tuple(blocks),
        num_layers=num_layers,
        hidden_size=fields.get("hidden_size"),
        num_heads=fields.get("num_heads"),
        num_kv_heads=fields.get("num_kv_heads"),
        head_dim=fields.get("head_dim"),
        intermediate_size=fields.get("intermediate_size"),
        vocab_size=int(vocab) if vocab is not None else None,
        max_position_embeddings=_first(config, "max_position_embeddings", "n_positions") if config is not None else None,
        tie_word_embeddings=tie,
        attn_implementation=attn,
        # the config's flag, where the module runs both stacks: T5's token classifier is
        # its encoder only (T5EncoderModel and a head) under an encoder-decoder's config
        is_encoder_decoder=(bool(getattr(config, "is_encoder_decoder", False))
                            and (not blocks or len({b.role for b in blocks}) > 1)
                            if config is not None else False),
        num_labels=int(getattr(config, "num_labels", 2)) if task in CLASSIFIER_TASKS and config is not None else None,
        embedding_dropout=float(_first(config, "embd_pdrop", "hidden_dropout_prob", "dropout_rate", default=0.0) or 0.0)
        if config is not None
        else 0.0,
        peft=peft_kind,
        lora_r=lora_r,
        lora_targets=lora_targets,
        quantization=qspec.name if qspec is not None else None,
        quant=qspec,
        dtype=dtype,
        peft_config=peft_key,
        adapter_buffer_bytes=adapter_buffers,
        buffer_bytes=float_buffers,
        int_buffer_bytes=int_buffers,
        virtual_tokens=virtual,
        supports_gradient_checkpointing=bool(getattr(base, "supports_gradient_checkpointing", False)),
        head_columns=head_columns,
        head_columns_trained=head_trained,
    )


def _head_columns(base: torch.nn.Module, vocab: int | None, task: str) -> tuple[int, bool]:
    """(elements, trained) of the 2-D weights outside the blocks with a column per
    vocabulary token and not a row per token (``ModelInfo.head_columns``); adapters' own
    weights are not the head's."""
    if not vocab or task in CLASSIFIER_TASKS:
        return 0, False
    prefixes = tuple(n + "." for n, _ in _layer_lists(base))
    found = [p for n, p in base.named_parameters()
             if p.ndim == 2 and p.shape[1] == vocab and p.shape[0] != vocab
             and _quant_kind(p) is None and "lora_" not in n and not n.startswith(prefixes)]
    return sum(p.numel() for p in found), any(p.requires_grad for p in found)


def _peft_of(module: torch.nn.Module) -> tuple[torch.nn.Module, str | None, int | None, tuple[str, ...], str, int, int]:
    """``_describe``'s first step: (the base model, the PEFT method, LoRA's rank and
    targets, the adapter config's key, the adapter's buffer bytes, its virtual tokens) of
    a ``PeftModel``; the module itself and no method otherwise."""
    base = module
    peft_kind = None
    lora_r = None
    lora_targets: tuple[str, ...] = ()
    peft_key = ""
    adapter_buffers = virtual = 0
    peft_config = getattr(module, "peft_config", None)
    if peft_config:
        from autofit.probe.peft import config_key, method_name

        cfg = next(iter(peft_config.values()))
        peft_kind = method_name(cfg)
        peft_key = config_key(cfg)
        r = getattr(cfg, "r", None)
        lora_r = r if isinstance(r, int) else None
        tm = getattr(cfg, "target_modules", None) or ()
        lora_targets = tuple(sorted(tm)) if not isinstance(tm, str) else (tm,)
        base = module.get_base_model()
        adapter_buffers = _adapter_buffer_bytes(module, set(peft_config))
        from autofit.probe.peft import virtual_tokens

        virtual = virtual_tokens(cfg)
    return base, peft_kind, lora_r, lora_targets, peft_key, adapter_buffers, virtual


def _blocks_of(base: torch.nn.Module, config: PretrainedConfig, task: str) -> tuple[list[BlockSpec], dict[str, Any]]:
    """``_describe``'s blocks step: the recognised blocks of ``base`` and the widths its
    ``config`` gives (none when it names no hidden size or heads)."""
    blocks: list[BlockSpec] = []
    fields: dict[str, Any] = {}
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    if hidden is not None and heads is not None:
        head_dim = _first(config, "head_dim", "d_kv", default=None) or hidden // heads
        inter = _first(config, "intermediate_size", "n_inner", "d_ff", "ffn_dim") or 4 * hidden
        fields = dict(
            hidden_size=int(hidden),
            num_heads=int(heads),
            num_kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
            head_dim=int(head_dim),
            intermediate_size=int(inter),
            dropout=float(
                _first(config, "hidden_dropout_prob", "resid_pdrop", "dropout_rate", "hidden_dropout", "dropout", default=0.0)
                or 0.0
            ),
            attention_dropout=float(
                _first(config, "attention_probs_dropout_prob", "attn_pdrop", "attention_dropout", "dropout_rate", default=0.0)
                or 0.0
            ),
        )
        lists = _layer_lists(base)
        for list_name, layers in lists:
            role = "encoder" if "encoder" in list_name else "decoder"
            # one stack read both ways for a masked LM or a classifier; an encoder-decoder's
            # (BART as a masked LM) keeps its decoder
            if len(lists) == 1 and task in ("masked-lm", *CLASSIFIER_TASKS):
                role = "encoder" if not getattr(config, "is_decoder", False) else role
            blocks.append(_block_spec(role, len(layers), layers[0], config, fields))
        if _first(config, "intermediate_size", "n_inner", "d_ff", "ffn_dim") is None:
            # no field names it (DistilBERT's ``hidden_dim``): the widest linear says it
            blocks = [dataclasses.replace(b, intermediate_size=max(
                [o for _, i, o, _ in b.linears if i == b.hidden_size and o != b.hidden_size]
                or [b.intermediate_size])) for b in blocks]
            if blocks:
                fields["intermediate_size"] = max(b.intermediate_size for b in blocks)
    return blocks, fields


def _own_buffer_bytes(module: torch.nn.Module, adapter_bytes: int) -> tuple[int, int]:
    """(floating-point, other) bytes of the model's buffers, each storage once, less the
    PEFT method's (``_adapter_buffer_bytes``, counted apart; all floating-point)."""
    seen: dict[int, tuple[int, bool]] = {}
    for _, b in module.named_buffers():
        seen[id(b)] = (b.numel() * b.element_size(), bool(b.is_floating_point()))
    floats = sum(n for n, f in seen.values() if f)
    return max(floats - adapter_bytes, 0), sum(n for n, f in seen.values() if not f)


def _adapter_buffer_bytes(module: torch.nn.Module, adapters: set[str]) -> int:
    """Bytes of the buffers a PEFT method adds: those in its adapter dicts (VeRA's shared
    projections) and those of its layers outside their ``base_layer`` (BOFT's
    permutations), each storage once."""
    seen: dict[int, int] = {}
    inside: list[str] = [n for n, m in module.named_modules() if hasattr(m, "base_layer")]
    for n, b in module.named_buffers():
        owner = n.rsplit(".", 1)[0]
        peft_layer = any(owner == w or (owner.startswith(w + ".")
                                        and not owner.startswith(w + ".base_layer"))
                         for w in inside)
        if peft_layer or adapters & set(n.split(".")):
            seen[id(b)] = b.numel() * b.element_size()
    return sum(seen.values())


def token_limits(module: torch.nn.Module) -> tuple[int | None, int | None]:
    """(vocabulary size, learned positions) of a built model: a token id must stay below
    the first, a sample's length at or below the second; None where there is no such limit.

    The vocabulary is the input embedding's row count (``config.vocab_size`` if the
    model has none). Positions limit only a learned table (GPT-2, BERT): an embedding
    other than the input one with ``max_position_embeddings`` rows, less its padding
    offset (RoBERTa's positions start after ``padding_idx``). Rotary / relative
    positions have no table and no hard limit (pre-flight only warns).
    """
    import torch

    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    config = getattr(base, "config", None)
    try:
        tokens = base.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        tokens = None
    vocab = getattr(tokens, "num_embeddings", None) or (
        _first(config, "vocab_size") if config is not None else None)
    pos = _first(config, "max_position_embeddings", "n_positions") if config is not None else None
    limit = None
    if isinstance(pos, int) and pos > 0:
        for m in base.modules():
            if isinstance(m, torch.nn.Embedding) and m is not tokens and m.num_embeddings == pos:
                offset = m.padding_idx + 1 if m.padding_idx is not None else 0
                limit = pos - offset
                break
    return (int(vocab) if vocab else None), limit


def fingerprint(info: ModelInfo) -> dict[str, Any]:
    """What a model's training memory depends on, as plain data (cache keys hash it)."""
    return {
        "model_type": info.model_type,
        "architecture": info.architecture,
        "task": info.task,
        "params": [(list(g.shape), g.count, g.dtype, g.trainable, g.quantized) for g in info.params],
        "attn": info.attn_implementation,
        "peft": info.peft,
        "lora_r": info.lora_r,
        "lora_targets": list(info.lora_targets),
        "peft_config": info.peft_config,
        "quant": info.quant.key if info.quant is not None else None,
    }
