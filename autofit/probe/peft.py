"""PEFT methods: a user's adapter configuration, read and put on a model.

``peft_config(value, task)`` turns what a user gives — a ``peft.PeftConfig``, a dict
as in an ``adapter_config.json`` (with ``peft_type``), a path to such a JSON file, an
inline JSON object — into the ``PeftConfig``
that ``get_peft_model`` takes, set for training (a saved adapter's
``inference_mode=True`` would freeze it) and for the task. ``apply_peft`` puts it on
a base model built on the meta device, as a user's script would: the base frozen,
peft's own layers, so that the simulated step runs peft's real forward (its dtype
casts, dropout copies, virtual tokens, merged delta weights).

Every method peft 0.21 offers runs, but those whose step depends on tensor values
that a simulation without data cannot know (``UNSUPPORTED``): asking for one is a
bad input naming the method and why.

    >>> cfg = peft_config({"peft_type": "IA3", "target_modules": ["k_proj", "v_proj"],
    ...                    "feedforward_modules": []}, "causal-lm")
    >>> method_name(cfg), cfg.inference_mode
    ('ia3', False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError, MissingDependencyError, fix

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from peft import PeftConfig

__all__ = [
    "UNSUPPORTED",
    "peft_config",
    "apply_peft",
    "method_name",
    "config_key",
    "config_dict",
    "upcast_adapters",
    "virtual_tokens",
    "methods",
    "default_config",
]

_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM", "seq-cls": "SEQ_CLS",
               "token-cls": "TOKEN_CLS", "masked-lm": None}

# peft_type -> why autofit cannot model it yet (its step reads tensor values).
UNSUPPORTED: dict[str, str] = {
    "CPT": "its forward selects tokens by their values (nonzero)",
    "WAVEFT": "its forward selects coefficients by their values (nonzero)",
    "SHIRA": "its sparse mask is built from the weights' values",
    "FROD": "its initialisation decomposes the real weights",
    "ADAMSS": "its adapters' shapes come from clustering the real weights' SVD",
    "MULTITASK_PROMPT_TUNING": "its forward needs a task id per sample",
    "POLY": "its forward needs a task id per sample",
    "XLORA": "it mixes adapters loaded from saved checkpoints",
}

# (method, bits of a bitsandbytes base) -> why it is refused there, in one line: only what
# peft itself cannot train. LoHa / LoKr reshape their delta weight to the base layer's
# weight shape, which a 4-bit base stores packed ((n x m / 2, 1) uint8): peft's own step
# fails ("shape '[131072, 1]' is invalid", a trial on the CPU: "mat1 and mat2 shapes cannot
# be multiplied"). DoRA on a 4-bit base (QDoRA) trains: see ``_meta_dequantize``. DoRA on
# an 8-bit base dies at its second forward on a CPU (bitsandbytes' CPU int8 matmul finds
# the row scales gone after peft's dequantization: "'NoneType' object has no attribute
# 'unsqueeze'", peft 0.21 / bitsandbytes 0.50), and no GPU run of it was measured here.
_ON_QUANTIZED: dict[tuple[str, int], str] = {
    ("dora", 8): "peft's DoRA on an 8-bit base fails in bitsandbytes at its second step on "
                 "a CPU (the int8 row scales are lost) and is not measured on a GPU; use a "
                 "4-bit base (QDoRA: --load-in-4bit), LoRA, or DoRA on a base in bf16",
    ("loha", 4): "peft's LoHa reshapes its delta to the base weight's shape, which a 4-bit "
                 "base stores packed: its step fails in peft itself; use LoRA (QLoRA) or an "
                 "8-bit base",
    ("lokr", 4): "peft's LoKr reshapes its delta to the base weight's shape, which a 4-bit "
                 "base stores packed: its step fails in peft itself; use LoRA (QLoRA) or an "
                 "8-bit base",
}


@contextlib.contextmanager
def dora_dequantize(override: Callable[[object], object]) -> Iterator[None]:
    """While inside, peft's DoRA dequantizes a base layer's weight (its
    ``dequantize_module_weight``, at initialisation and in every forward) with
    ``override(layer)`` first, peft's own where that returns None. Without peft nothing
    changes."""
    try:
        from peft.tuners.lora import dora
    except ImportError:  # pragma: no cover - peft is optional
        yield
        return
    real = dora.dequantize_module_weight

    def dequantize(module: torch.nn.Module) -> Any:
        w = override(module)
        return real(module) if w is None else w

    dora.dequantize_module_weight = dequantize
    try:
        yield
    finally:
        dora.dequantize_module_weight = real


def _meta_dequantize(quant: Any) -> contextlib.AbstractContextManager[None]:
    """DoRA on a quantized base built on the meta device (QDoRA): peft initialises each
    magnitude from the norm of the dequantized weight, which a base without values cannot
    give; here it gets an empty meta weight of the layer's full shape in the compute dtype
    (what the dequantization returns; the magnitude's values do not change the memory). A
    trial's real base is dequantized by peft itself."""
    import torch

    dtype = getattr(torch, quant.compute_dtype)

    def meta_weight(module: torch.nn.Module) -> Any:
        w = module.weight
        if type(w).__name__ not in {"Params4bit", "Int8Params"} or not w.is_meta:
            return None
        return torch.empty(tuple(w.shape), dtype=dtype, device="meta")

    return dora_dequantize(meta_weight)


# Methods whose initialisation reads values (cannot run on the meta device).
_CPU_INIT = frozenset({"BOFT", "UNILORA"})

# Names users write for a method (``--methods lora,dora,ia3``) beyond peft_type.lower().
_ALIASES = {"dora": ("LORA", {"use_dora": True}), "rslora": ("LORA", {"use_rslora": True}),
            "prefix": ("PREFIX_TUNING", {}), "prompt": ("PROMPT_TUNING", {}),
            "ptuning": ("P_TUNING", {}), "p-tuning": ("P_TUNING", {}),
            "adaption": ("ADAPTION_PROMPT", {}), "ln": ("LN_TUNING", {}),
            "tokens": ("TRAINABLE_TOKENS", {})}


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise MissingDependencyError("PEFT methods need peft: pip install peft") from None
    return peft


def methods() -> tuple[str, ...]:
    """Every peft_type autofit models (lowercase), in peft's order."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    return tuple(str(getattr(t, "value", t)).lower() for t in PEFT_TYPE_TO_CONFIG_MAPPING
                 if str(getattr(t, "value", t)) not in UNSUPPORTED)


def _read(value: str | os.PathLike) -> dict[str, Any]:
    text = str(value).strip()
    if text.startswith("{"):
        what = "inline JSON"
    else:
        path = Path(text)
        if path.is_dir():
            path = path / "adapter_config.json"
        if not path.is_file():
            raise BadInputError(f"PEFT config {text!r} is neither a JSON file nor an inline "
                                "JSON object; give a path to an adapter_config.json or "
                                "'{\"peft_type\": \"LORA\", ...}'")
        what = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise BadInputError(f"PEFT config {what} is not a text file; give an "
                                "adapter_config.json") from None
        except OSError as e:
            raise BadInputError(f"cannot read PEFT config {what} ({e.strerror or e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInputError(f"PEFT config ({what}) is not valid JSON: {e}") from None
    except RecursionError:
        raise BadInputError(f"PEFT config ({what}) is nested too deep; give one JSON object "
                            "with peft_type") from None
    if not isinstance(d, dict):
        raise BadInputError(f"PEFT config ({what}) must be a JSON object with peft_type")
    return d


def default_config(method: str) -> dict[str, Any]:
    """A config dict for a method named as users write it (``"lora"``, ``"dora"``,
    ``"ia3"``, ``"prefix"``): peft's defaults, with a few virtual tokens for the
    prompt methods and the token ids trainable tokens need."""
    m = method.strip().lower().replace("-", "_")
    peft_type, extra = _ALIASES.get(method.strip().lower(), (m.upper(), {}))
    d: dict[str, Any] = {"peft_type": peft_type, **extra}
    if peft_type in {"PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "CARTRIDGE"}:
        d["num_virtual_tokens"] = 20
    if peft_type == "ADAPTION_PROMPT":
        d.update(adapter_len=10, adapter_layers=1)
    if peft_type == "TRAINABLE_TOKENS":
        d["token_indices"] = list(range(16))
    if peft_type == "ADALORA":
        d["total_step"] = 1000
    return d


def peft_config(value: object, task: str) -> Any:
    """The ``peft.PeftConfig`` to train with (see the module docstring).

    Raises:
        BadInputError: not a config, no or unknown ``peft_type``, a method autofit
            cannot model, a field peft rejects.
    """
    peft = _peft()
    if isinstance(value, (str, os.PathLike)):
        value = _read(value)
    if isinstance(value, peft.PeftConfig):
        d = value.to_dict()
    elif isinstance(value, dict):
        d = dict(value)
    else:
        raise BadInputError(f"peft_config must be a peft.PeftConfig, a dict with peft_type, "
                            f"or a path to an adapter_config.json; got {type(value).__name__}")
    pt = d.get("peft_type")
    if pt is None:
        raise BadInputError("PEFT config has no peft_type; add e.g. \"peft_type\": \"LORA\"")
    pt = str(getattr(pt, "value", pt)).upper()
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    known = {str(getattr(t, "value", t)) for t in PEFT_TYPE_TO_CONFIG_MAPPING}
    if pt not in known:
        raise BadInputError(f"unknown PEFT method {pt!r}; peft {peft.__version__} offers: "
                            + ", ".join(sorted(k.lower() for k in known)))
    if pt in UNSUPPORTED:
        raise BadInputError(f"autofit cannot model PEFT method {pt.lower()} yet: "
                            f"{UNSUPPORTED[pt]}; choose another method (autofit compare-peft "
                            "lists those it models)")
    d["peft_type"] = pt
    d["inference_mode"] = False  # a saved adapter says True; training needs False
    if not d.get("task_type") and _TASK_TYPES.get(task):
        d["task_type"] = _TASK_TYPES[task]
    if (str(getattr(d.get("task_type"), "value", d.get("task_type"))) == "TOKEN_CLS"
            and d.get("target_modules") == "all-linear" and not d.get("exclude_modules")
            and "exclude_modules" in {f.name for f in dataclasses.fields(
                PEFT_TYPE_TO_CONFIG_MAPPING[pt])}):
        # peft leaves a classifier's head out of "all-linear" for SEQ_CLS only: for
        # TOKEN_CLS it puts an adapter on it and then fails to train it whole
        # (modules_to_save: "cannot be applied to modules of type lora.Linear")
        from peft.utils.constants import SEQ_CLS_HEAD_NAMES  # the heads it trains whole

        d["exclude_modules"] = list(SEQ_CLS_HEAD_NAMES)
    for k in ("base_model_name_or_path", "revision", "auto_mapping"):
        d.pop(k, None)
    problems = _field_problems(PEFT_TYPE_TO_CONFIG_MAPPING[pt], d, peft.__version__)
    if d.get("num_virtual_tokens", 0) is None or (
            "num_virtual_tokens" not in d and any(
                f.name == "num_virtual_tokens" and f.default is None
                for f in dataclasses.fields(PEFT_TYPE_TO_CONFIG_MAPPING[pt]))):
        # peft leaves it None and fails in get_peft_model ("'>' not supported between
        # instances of 'int' and 'NoneType'": cartridge's)
        problems.append("num_virtual_tokens is required (e.g. \"num_virtual_tokens\": 20)")
    if problems:
        raise BadInputError(f"PEFT {pt.lower()}: " + "; ".join(problems))
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return peft.PeftConfig.from_peft_type(**d)
    except (TypeError, ValueError, ImportError) as e:
        raise BadInputError(f"PEFT {pt.lower()}: {str(e).splitlines()[0]}") from None


def _json_types(hint: object) -> tuple[type, ...] | None:
    """The JSON value types a config field's annotation allows (bool apart from numbers),
    or None when the annotation allows more than plain values (lists, dicts, objects)."""
    import types
    import typing

    if hint is bool:
        return (bool,)
    if hint in (int, float):  # peft takes a float where it says int (lora_alpha 0.5)
        return (int, float)
    if hint is str:
        return (str,)
    if hint is type(None):
        return (type(None),)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return tuple({type(v) for v in typing.get_args(hint)})
    if origin in (typing.Union, types.UnionType):
        out: tuple[type, ...] = ()
        for arg in typing.get_args(hint):
            t = _json_types(arg)
            if t is None:
                return None
            out += t
        return out
    return None


def _field_problems(cls: Any, d: dict[str, object], version: str) -> list[str]:
    """Every key that is not a field of the method's config class (did-you-mean), and every
    value whose JSON type the field does not take ("no" where a bool belongs reads as true;
    peft checks neither): all problems at once."""
    import dataclasses
    import typing
    from difflib import get_close_matches

    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation this python cannot resolve: no type check
        hints = {}
    names = [f.name for f in dataclasses.fields(cls)]
    problems = []
    for key in sorted(set(d) - set(names)):
        m = get_close_matches(key, names, 1)
        problems.append(f"unknown key {key!r} (did you mean {m[0]!r}?)" if m else
                        f"{key!r} is not a field of peft {version}'s {cls.__name__} (drop it, "
                        "or upgrade peft if a newer one saved it)")
    for key in names:
        if key not in d or d[key] is None or key == "peft_type":
            continue
        allowed = _json_types(hints.get(key))
        v = d[key]
        if allowed is None or (isinstance(v, allowed) and not (isinstance(v, bool)
                                                               and bool not in allowed)):
            continue
        kind = {bool: "a JSON bool (true/false)", int: "a number", float: "a number",
                str: "a string"}
        want = " or ".join(dict.fromkeys(kind.get(t, t.__name__) for t in allowed
                                         if t is not type(None)))
        problems.append(f"{key} must be {want}, got {v!r}")
    return problems


def method_name(config: PeftConfig) -> str:
    """``"lora"``, ``"dora"``, ``"ia3"``, ... (LoRA's DoRA variant has its own name)."""
    pt = str(getattr(config.peft_type, "value", config.peft_type)).lower()
    if pt == "lora" and getattr(config, "use_dora", False):
        return "dora"
    return pt


def virtual_tokens(config: PeftConfig) -> int:
    """Tokens the method prepends to every sample's sequence (prompt tuning, P-tuning):
    the model's forward, logits and loss run over ``seq_len + virtual_tokens``. Prefix
    tuning's tokens lengthen only the attention's keys and values."""
    pt = str(getattr(config.peft_type, "value", config.peft_type))
    if pt in {"PROMPT_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING", "CPT"}:
        return int(getattr(config, "num_virtual_tokens", 0) or 0)
    return 0


def upcast_adapters(model: torch.nn.Module) -> None:
    """After a PEFT model is cast to a 16-bit dtype (the "-true" precisions), put its
    adapter layers' weights back in fp32, as ``get_peft_model`` does on a 16-bit base
    (its default ``autocast_adapter_dtype=True``): the adapters then cast each input to
    fp32 and save that copy for backward. peft's own ``cast_adapter_dtype``; a model
    without adapters is left as it is."""
    peft_config = getattr(model, "peft_config", None)
    base = getattr(model, "base_model", None)
    if not peft_config or base is None:
        return
    from peft.tuners.tuners_utils import cast_adapter_dtype

    for name in peft_config:
        cast_adapter_dtype(getattr(base, "model", base), adapter_name=name)


def config_dict(config: PeftConfig) -> dict[str, Any]:
    """The config as plain JSON data (sets as sorted lists), without what does not change
    memory: what a tuned file records and ``peft_config`` reads back."""
    d = config.to_dict()
    for k in ("base_model_name_or_path", "revision", "inference_mode", "auto_mapping"):
        d.pop(k, None)

    def plain(v: object) -> Any:
        if isinstance(v, (set, frozenset)):
            return sorted(plain(x) for x in v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return v

    return json.loads(json.dumps(plain(d), default=str))


def config_key(config: PeftConfig) -> str:
    """The config as canonical JSON (cache keys)."""
    return json.dumps(config_dict(config), sort_keys=True)


def apply_peft(module: torch.nn.Module, config: PeftConfig, *, meta: bool = True
               ) -> torch.nn.Module:
    """``get_peft_model(module, config)``, the base's weights frozen first: on a meta base
    (``meta=True``) or on a real one (a trial: peft initialises on the base's device).

    Adapters are created on the meta device; a method whose initialisation reads
    values (``_CPU_INIT``: BOFT's permutations) is initialised on the CPU and moved to
    the base's meta device by peft, which costs the adapters' size in host memory for a
    moment.
    """
    import torch
    from peft import get_peft_model

    for p in module.parameters():
        p.requires_grad_(False)
    name = method_name(config)
    pt = str(getattr(config.peft_type, "value", config.peft_type))
    from autofit.probe.quant import spec_of_module

    quant = spec_of_module(module)
    if quant is not None and (name, quant.bits) in _ON_QUANTIZED:
        raise BadInputError(f"PEFT {name} on {'an' if quant.bits == 8 else 'a'} {quant.bits}-bit base: "
                            + _ON_QUANTIZED[(name, quant.bits)])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if not meta or pt in _CPU_INIT:  # initialised on the CPU, moved to the base's meta device
                model = get_peft_model(module, config)
            else:
                qdora = quant is not None and name == "dora"
                with torch.device("meta"), (_meta_dequantize(quant) if qdora
                                            else contextlib.nullcontext()):
                    model = get_peft_model(module, config)
        except Exception as e:  # noqa: BLE001 - peft's own failure, named with the method
            raise BadInputError(f"PEFT {name} cannot be put on this model: "
                                f"{type(e).__name__}: {str(e).splitlines()[0]}") from None
    if quant is not None:
        check_trained_whole(model, name)
    check_lora_targets(model)
    return model


def check_trained_whole(model: torch.nn.Module, name: str) -> None:
    """Raise ``BadInputError`` where peft trains a module whole (``modules_to_save``: a
    classifier's head) that bitsandbytes quantized. transformers leaves unquantized only the
    output embeddings, tied modules and the module of the model's last parameter, so a head
    whose last parameter is a bias (BERT's or RoBERTa's token classifier, RoBERTa's
    sequence-classification head) is quantized, and peft's ``requires_grad_`` on its integer
    weight fails at ``get_peft_model`` ("only Tensors of floating point dtype can require
    gradients"). On the meta device the quantized weight is a float stand-in, so it would
    not fail here: checked by type."""
    wrapped = sorted({n.split(".modules_to_save.")[0].rsplit(".", 1)[-1]
                      for n, p in model.named_parameters()
                      if p.requires_grad and type(p).__name__ in ("Params4bit", "Int8Params")})
    if wrapped:
        raise BadInputError(
            f"PEFT {name} cannot be put on this model: it trains "
            f"{', '.join(repr(w) for w in wrapped)} whole (modules_to_save), which "
            "bitsandbytes quantized (transformers leaves a head whose last parameter is a "
            "bias quantized), and a quantized weight cannot require gradients; keep it "
            f'unquantized: a quantization config with "llm_int8_skip_modules": {json.dumps(wrapped)}')


def check_lora_targets(model: torch.nn.Module) -> None:
    """Raise ``BadInputError`` where LoRA wrapped a layer that subclasses ``nn.Linear`` but
    does not compute ``x @ W.T`` on a (rows, in_features) input as it does: a mixture of
    experts' router that returns (logits, weights, experts) (PhiMoE's, Llama 4's), to which
    peft's LoRA layer adds its update ("'tuple' object has no attribute 'dtype'"), or
    DeepSeek-V4's grouped output projection (a shape mismatch). The step fails, in a run
    as in the estimate."""
    import torch

    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft without LoRA's layer module
        return
    broken = []
    for name, m in model.named_modules():
        if type(m) is not LoraLinear:  # peft's own layers for bitsandbytes, ... adapt theirs
            continue
        base = m.get_base_layer()
        w = getattr(base, "weight", None)
        if (type(base).forward is torch.nn.Linear.forward or not isinstance(w, torch.Tensor)
                or "bitsandbytes" in type(base).__module__):
            continue
        # the LoRA layer's own sizes: peft reads a transposed weight (GPT-2's Conv1D) right
        rows_in, rows_out = m.in_features, m.out_features
        try:
            with torch.no_grad():
                out = base(torch.zeros(1, rows_in, dtype=w.dtype, device=w.device))
        except TypeError:  # a forward that takes more arguments: peft passes them on
            continue
        except Exception:  # noqa: BLE001 - it cannot take a (rows, in_features) input
            out = None
        if not isinstance(out, torch.Tensor) or out.shape[-1] != rows_out:
            broken.append(name.rsplit(".", 1)[-1])
    if broken:
        kinds = sorted(set(broken))
        raise BadInputError(
            f"LoRA wraps {len(broken)} layers that subclass nn.Linear but do not compute "
            "x @ W.T as it does (" + ", ".join(kinds) + "), to which peft's LoRA layer adds "
            "its update: the step fails; leave them out of the targets: name the ones to "
            "adapt (" + fix("--lora-target-modules q_proj v_proj ...",
                            "lora={'target_modules': ['q_proj', 'v_proj', ...]}")
            + ") or give a peft config with exclude_modules=" + repr(kinds))
