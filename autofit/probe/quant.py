"""Quantized bases: what bitsandbytes keeps of a model's linear layers, as one frozen spec.

``QuantSpec`` says how a base model's ``Linear`` (and GPT-2's ``Conv1D``) layers are
quantized by bitsandbytes, the way ``transformers.BitsAndBytesConfig`` says it:

* 4 bits (QLoRA): ``quant_type`` ``"nf4"`` or ``"fp4"`` (same size: two 4-bit values
  per byte), one absmax per 64 values (fp32, or with ``double_quant`` 8-bit absmax +
  one fp32 per 256 of them), ``compute_dtype`` the dtype ``Linear4bit`` casts its input
  to, dequantizes its weight into and multiplies in;
* 8 bits (LLM.int8): int8 weights + one fp32 scale per row, ``llm_int8_threshold`` the
  activation magnitude above which a column is multiplied in 16 bits (CUDA).

A base that autofit builds (from a name, a directory or a config) is loaded with
``torch_dtype=compute_dtype``: its other weights (embeddings, norms, output head) are
in the compute dtype, and so are its activations. bitsandbytes layers are never cast
afterwards (transformers refuses ``.to(dtype)`` on them).

``resolve`` reads what a caller gives — ``load_in_4bit=True`` / ``load_in_8bit=True``
(autofit's shorthands: QLoRA's nf4 in bfloat16; LLM.int8 in float32), a
``BitsAndBytesConfig``, a dict as in a config.json's ``quantization_config``, a JSON
file or inline JSON, or a saved model whose config.json has one — with the command
line's overrides, and says in one line what to change when they disagree.

    >>> spec = resolve(load_in_4bit=True, double_quant=True)
    >>> spec.bits, spec.quant_type, spec.double_quant, spec.compute_dtype
    (4, 'nf4', True, 'bfloat16')
    >>> resolve(quantization_config={"load_in_8bit": True}).describe()
    '8-bit (LLM.int8, threshold 6), float32'
    >>> QuantSpec.from_dict(spec.to_dict()) == spec
    True
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError, fix

if TYPE_CHECKING:
    import torch

    from autofit.probe.device import DeviceInfo

__all__ = ["QuantSpec", "resolve", "spec_of_module", "check_precision", "DTYPES", "QUANT_TYPES"]

# The compute dtypes bitsandbytes' layers run in, by the names users write.
DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "32": "float32",
          "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16", "16": "float16"}
QUANT_TYPES = ("nf4", "fp4")
_MIXED = {"bfloat16": "bf16-mixed", "float16": "16-mixed"}  # autocast to a 16-bit base's dtype
BLOCKSIZE = 64  # Params4bit's default: one absmax per 64 values
NESTED_BLOCKSIZE = 256  # double quantization: one fp32 absmax per 256 8-bit absmax

# config.json keys of a BitsAndBytesConfig that do not change what is stored or computed
_IGNORED_KEYS = {"quant_method", "_load_in_4bit", "_load_in_8bit"}

# every key autofit reads -> the JSON type its value must have (None: unset, always allowed)
_BOOL, _STR, _NUMBER, _NAMES, _DTYPE = ("a JSON bool (true/false)", "a string", "a number",
                                        "a list of module names", "a dtype name")
_TYPES = {"load_in_4bit": _BOOL, "load_in_8bit": _BOOL, "bnb_4bit_use_double_quant": _BOOL,
          "llm_int8_has_fp16_weight": _BOOL, "llm_int8_enable_fp32_cpu_offload": _BOOL,
          "bnb_4bit_quant_type": _STR, "bnb_4bit_quant_storage": _DTYPE,
          "bnb_4bit_compute_dtype": _DTYPE, "llm_int8_threshold": _NUMBER,
          "llm_int8_skip_modules": _NAMES}


def _has_type(value: object, kind: str) -> bool:
    if value is None:
        return True
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    if kind == _NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == _NAMES:
        return isinstance(value, str) or (isinstance(value, list | tuple)
                                          and all(isinstance(v, str) for v in value))
    return not isinstance(value, bool | int | float | list | tuple | dict)  # str or torch.dtype


def _type_problems(d: dict[str, object]) -> list[str]:
    """Each key whose value is not of its JSON type ("no" for a bool reads as true)."""
    types = {**_TYPES, "_load_in_4bit": _BOOL, "_load_in_8bit": _BOOL}
    return [f"{k} must be {kind}, got {d[k]!r}" for k, kind in types.items()
            if k in d and not _has_type(d[k], kind)]


def _dtype_name(value: object, where: str) -> str:
    name = str(value).replace("torch.", "").strip().lower()
    if name not in DTYPES:
        raise BadInputError(f"{where} {value!r} is not a dtype bitsandbytes computes in; "
                            "use bfloat16, float16 or float32")
    return DTYPES[name]


@dataclass(frozen=True)
class QuantSpec:
    """How bitsandbytes quantizes a base model (see the module docstring).

    Attributes:
        bits: 4 (``Linear4bit``) or 8 (``Linear8bitLt``).
        quant_type: ``"nf4"`` or ``"fp4"`` (4 bits; None for 8).
        double_quant: 4 bits: the absmax are quantized again (8-bit + fp32 per 256).
        compute_dtype: the dtype the base is loaded in and its quantized layers compute in.
        quant_storage: the packed 4-bit weights' container dtype (``"uint8"``).
        llm_int8_threshold: 8 bits: outlier threshold (0 turns the decomposition off).
        skip_modules: modules left unquantized besides transformers' defaults (the
            output head, ``_keep_in_fp32_modules``); empty: the defaults only.
    """

    bits: int
    quant_type: str | None = "nf4"
    double_quant: bool = False
    compute_dtype: str = "bfloat16"
    quant_storage: str = "uint8"
    llm_int8_threshold: float = 6.0
    skip_modules: tuple[str, ...] = ()
    # the compute dtype is the shorthand's default, not asked for: bf16, or fp16 on a
    # device without bf16 (``resolve(device=...)``); not part of the spec's identity
    auto_dtype: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if self.bits not in (4, 8):
            problems.append(f"bits must be 4 or 8, got {self.bits!r}")
        if self.bits == 4 and self.quant_type not in QUANT_TYPES:
            problems.append(f"bnb_4bit_quant_type must be nf4 or fp4, got {self.quant_type!r}")
        if self.bits == 8:
            object.__setattr__(self, "quant_type", None)
            object.__setattr__(self, "double_quant", False)
        try:
            object.__setattr__(self, "compute_dtype",
                               _dtype_name(self.compute_dtype, "compute dtype"))
        except BadInputError as e:
            problems.append(str(e).split(";")[0])
        if str(self.quant_storage).replace("torch.", "") != "uint8":
            problems.append(f"bnb_4bit_quant_storage {self.quant_storage!r} is not modelled "
                            "(use uint8, the default)")
        object.__setattr__(self, "quant_storage", "uint8")
        t = self.llm_int8_threshold
        if isinstance(t, bool) or not isinstance(t, int | float) or t < 0:
            problems.append(f"llm_int8_threshold must be a number >= 0, got {t!r}")
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules or ()))
        if problems:
            raise BadInputError("quantization: " + "; ".join(problems))

    # ------------------------------------------------------------------ views
    @property
    def torch_dtype(self) -> Any:
        """The compute dtype as a ``torch.dtype`` (the dtype the base is loaded in)."""
        import torch

        return getattr(torch, self.compute_dtype)

    @property
    def name(self) -> str:
        """``"4bit"`` or ``"8bit"`` (``ModelInfo.quantization``)."""
        return f"{self.bits}bit"

    def describe(self) -> str:
        """One phrase for reasons and notes: ``4-bit nf4 (double quant), bfloat16``."""
        if self.bits == 8:
            return f"8-bit (LLM.int8, threshold {self.llm_int8_threshold:g}), {self.compute_dtype}"
        dq = " (double quant)" if self.double_quant else ""
        return f"4-bit {self.quant_type}{dq}, {self.compute_dtype}"

    def to_dict(self) -> dict[str, Any]:
        """The spec as a config.json ``quantization_config`` (plain JSON; ``from_dict`` reads it)."""
        d: dict[str, Any] = {"quant_method": "bitsandbytes", "load_in_4bit": self.bits == 4,
                             "load_in_8bit": self.bits == 8,
                             "bnb_4bit_compute_dtype": self.compute_dtype}
        if self.bits == 4:
            d.update(bnb_4bit_quant_type=self.quant_type,
                     bnb_4bit_use_double_quant=self.double_quant,
                     bnb_4bit_quant_storage=self.quant_storage)
        else:
            d["llm_int8_threshold"] = float(self.llm_int8_threshold)
        if self.skip_modules:
            d["llm_int8_skip_modules"] = list(self.skip_modules)
        return d

    @property
    def key(self) -> str:
        """A stable string of everything that changes memory (fingerprints, cache keys)."""
        d = asdict(self)
        d.pop("auto_dtype")
        return json.dumps(d, sort_keys=True)

    def to_bnb_config(self) -> Any:
        """The ``transformers.BitsAndBytesConfig`` to load the base with."""
        from transformers import BitsAndBytesConfig

        kw: dict[str, Any] = dict(load_in_4bit=self.bits == 4, load_in_8bit=self.bits == 8,
                                  bnb_4bit_compute_dtype=self.torch_dtype,
                                  llm_int8_threshold=float(self.llm_int8_threshold),
                                  llm_int8_skip_modules=list(self.skip_modules) or None)
        if self.bits == 4:
            kw.update(bnb_4bit_quant_type=self.quant_type,
                      bnb_4bit_use_double_quant=self.double_quant,
                      bnb_4bit_quant_storage="uint8")
        return BitsAndBytesConfig(**kw)

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_dict(cls, d: dict[str, object], where: str = "quantization_config") -> QuantSpec:
        """A spec from a config.json-style ``quantization_config`` dict (all problems at once)."""
        if not isinstance(d, dict):
            raise BadInputError(f"{where} must be a JSON object such as "
                                "{\"load_in_4bit\": true}, got " + type(d).__name__)
        d = dict(d)
        method = str(getattr(d.get("quant_method"), "value", d.get("quant_method")
                             or "bitsandbytes")).lower()
        if method != "bitsandbytes":
            raise BadInputError(f"{where}: quant_method {method!r} is not modelled; autofit "
                                "models bitsandbytes (load_in_4bit / load_in_8bit)")
        problems = _type_problems(d)
        if problems:  # a word where a flag belongs ("no") would read as true below
            raise BadInputError(f"{where}: " + "; ".join(problems))
        four = bool(d.get("load_in_4bit", d.get("_load_in_4bit", False)))
        eight = bool(d.get("load_in_8bit", d.get("_load_in_8bit", False)))
        unknown = sorted(set(d) - set(_TYPES) - _IGNORED_KEYS)
        if unknown:
            from difflib import get_close_matches

            hints = [f"{k} (did you mean {m[0]}?)" if (m := get_close_matches(k, _TYPES, 1))
                     else k for k in unknown]
            problems.append(f"unknown key(s) {', '.join(hints)}")
        if four and eight:
            problems.append("both load_in_4bit and load_in_8bit are set; keep one")
        elif not (four or eight):
            problems.append("neither load_in_4bit nor load_in_8bit is set; set one")
        if d.get("llm_int8_has_fp16_weight"):
            problems.append("llm_int8_has_fp16_weight=True (trainable 16-bit weights in the "
                            "8-bit layers) is not modelled; set it to false")
        if d.get("llm_int8_enable_fp32_cpu_offload"):
            problems.append("llm_int8_enable_fp32_cpu_offload=True (layers left on the CPU) is "
                            "not modelled; set it to false")
        if problems:
            raise BadInputError(f"{where}: " + "; ".join(problems))
        skip = d.get("llm_int8_skip_modules") or ()
        if isinstance(skip, str):
            skip = (skip,)
        return cls(
            bits=4 if four else 8,
            quant_type=str(d.get("bnb_4bit_quant_type") or "fp4").lower() if four else None,
            double_quant=bool(d.get("bnb_4bit_use_double_quant", False)),
            compute_dtype=_dtype_name(d.get("bnb_4bit_compute_dtype") or "float32",
                                      f"{where}: bnb_4bit_compute_dtype"),
            quant_storage=str(d.get("bnb_4bit_quant_storage") or "uint8"),
            llm_int8_threshold=d.get("llm_int8_threshold", 6.0)
            if d.get("llm_int8_threshold") is not None else 6.0,
            skip_modules=tuple(str(s) for s in skip),
        )

    @classmethod
    def read(cls, value: object) -> QuantSpec:
        """A spec from a ``BitsAndBytesConfig``, a dict, a ``QuantSpec``, a JSON file (a
        config.json with a ``quantization_config``, or that object alone), a model
        directory whose config.json has one, or inline JSON."""
        if isinstance(value, QuantSpec):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_dict(*_read_json(value))
        to_dict = getattr(value, "to_dict", None)
        if callable(to_dict) and type(value).__name__ == "BitsAndBytesConfig":
            return cls.from_dict(to_dict(), "BitsAndBytesConfig")
        raise BadInputError(
            "quantization_config must be a transformers.BitsAndBytesConfig, a dict such as "
            "{\"load_in_4bit\": true}, or a path to a JSON file; got " + type(value).__name__)


def _read_json(value: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(the quantization_config dict, where it came from) of a path or inline JSON."""
    text = str(value).strip()
    if text.startswith("{"):
        where = "inline quantization config"
    else:
        path = Path(text).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise BadInputError(f"quantization config {text!r} is neither a JSON file nor an "
                                "inline JSON object; give a path or '{\"load_in_4bit\": true}'")
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise BadInputError(f"quantization config {where} is not a text file; give a JSON "
                                "file such as {\"load_in_4bit\": true}") from None
        except OSError as e:
            raise BadInputError(f"cannot read quantization config {where} "
                                f"({e.strerror or e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInputError(f"{where} is not valid JSON: {e}") from None
    except RecursionError:
        raise BadInputError(f"{where} is nested too deep; give one JSON object such as "
                            "{\"load_in_4bit\": true}") from None
    if isinstance(d, dict) and isinstance(d.get("quantization_config"), dict):
        return d["quantization_config"], f"{where}: quantization_config"  # a config.json
    if isinstance(d, dict) and "model_type" in d:
        raise BadInputError(f"{where} is a model config without a quantization_config; "
                            "give the BitsAndBytesConfig fields, e.g. {\"load_in_4bit\": true}")
    return d, where


def _shorthand(bits: int) -> QuantSpec:
    """autofit's shorthands: QLoRA's nf4 base computing in bfloat16; LLM.int8 in float32."""
    if bits == 4:
        return QuantSpec(bits=4, quant_type="nf4", compute_dtype="bfloat16", auto_dtype=True)
    return QuantSpec(bits=8, compute_dtype="float32")


def resolve(
    *,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    quantization_config: Any = None,
    quant_type: str | None = None,
    compute_dtype: str | None = None,
    double_quant: bool | None = None,
    saved: Any = None,
    device: DeviceInfo | None = None,
) -> QuantSpec | None:
    """The spec a caller asks for, or None for a base in full precision.

    Args:
        load_in_4bit, load_in_8bit: the shorthands (mutually exclusive).
        quantization_config: anything ``QuantSpec.read`` takes.
        quant_type, compute_dtype, double_quant: the command line's overrides
            (``--bnb-4bit-quant-type``, ``--bnb-4bit-compute-dtype``,
            ``--bnb-4bit-use-double-quant``); the compute dtype also sets an 8-bit
            base's load dtype.
        saved: the ``quantization_config`` of the model's own config.json (a
            checkpoint saved quantized), used when nothing else is given.
        device: the ``DeviceInfo`` trained on: ``load_in_4bit=True`` computes in fp16
            on a device without bf16 (QLoRA's recipe there); an explicit bf16 compute
            dtype on one is refused.

    Raises:
        BadInputError: conflicting or unsupported settings, in one line.
        UnsupportedPrecisionError: a bf16 compute dtype on a device without bf16.
    """
    if load_in_4bit and load_in_8bit:
        raise BadInputError("give " + fix("--load-in-4bit or --load-in-8bit",
                                          "load_in_4bit=True or load_in_8bit=True") + ", not both")
    spec = QuantSpec.read(quantization_config) if quantization_config is not None else None
    asked = 4 if load_in_4bit else 8 if load_in_8bit else None
    if spec is not None and asked is not None and spec.bits != asked:
        raise BadInputError(
            f"{fix(f'--load-in-{asked}bit', f'load_in_{asked}bit=True')} disagrees with the "
            f"quantization config ({spec.bits} bits); drop one of them")
    if spec is None and asked is not None:
        spec = _shorthand(asked)
    if spec is None and saved is not None:
        spec = QuantSpec.read(saved)
    overrides = {"quant_type": quant_type, "double_quant": double_quant,
                 "compute_dtype": compute_dtype}
    given = {k: v for k, v in overrides.items() if v is not None and v is not False}
    if spec is None:
        if given:
            raise BadInputError(
                f"{', '.join(_flag(k) for k in given)} set(s) how a base is quantized; add "
                + fix("--load-in-4bit (or --load-in-8bit, --quantization-config)",
                      "load_in_4bit=True (or load_in_8bit=True, quantization_config=)"))
        return None
    if spec.bits == 8:
        four_only = [k for k in ("quant_type", "double_quant") if k in given]
        if four_only:
            raise BadInputError(f"{', '.join(_flag(k) for k in four_only)} applies to 4-bit "
                                "bases; drop it, or load in 4 bits ("
                                + fix("--load-in-4bit", "load_in_4bit=True") + ")")
    from dataclasses import replace

    changes: dict[str, Any] = {}
    if quant_type is not None:
        changes["quant_type"] = str(quant_type).lower()
    if double_quant:
        changes["double_quant"] = True
    if compute_dtype is not None:
        changes["compute_dtype"] = _dtype_name(compute_dtype, _flag("compute_dtype"))
        changes["auto_dtype"] = False
    elif spec.auto_dtype and device is not None and not device.bf16:
        changes["compute_dtype"] = "float16"  # QLoRA without bf16 (a T4, a V100)
    spec = replace(spec, **changes) if changes else spec
    if device is not None and not device.bf16 and spec.compute_dtype == "bfloat16":
        from autofit.errors import UnsupportedPrecisionError

        raise UnsupportedPrecisionError(
            f"{device.product or device.name} does not support bf16: the base cannot compute "
            "in it; use " + fix("--bnb-4bit-compute-dtype fp16",
                                "bnb_4bit_compute_dtype=torch.float16"))
    return spec


def _flag(name: str) -> str:
    flags = {"quant_type": ("--bnb-4bit-quant-type", "bnb_4bit_quant_type"),
             "double_quant": ("--bnb-4bit-use-double-quant", "bnb_4bit_use_double_quant"),
             "compute_dtype": ("--bnb-4bit-compute-dtype", "bnb_4bit_compute_dtype")}
    return fix(*flags[name])


def spec_of_module(module: torch.nn.Module) -> QuantSpec | None:
    """The spec of a model whose layers bitsandbytes already quantized (a user's model, or
    one ``build_model`` quantized on the meta device), read from its layers; None if none is.

    The compute dtype is ``Linear4bit.compute_dtype`` for 4 bits (the weights' own dtype
    when unset); for 8 bits the dtype of the model's other floating weights.
    """
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    layer = None
    for m in base.modules():
        cls = type(m).__name__
        if cls in {"Linear4bit", "LinearNF4", "LinearFP4", "Linear8bitLt"}:
            layer = m
            break
    if layer is None:
        return None
    cfg = getattr(getattr(base, "config", None), "quantization_config", None)
    skip: tuple[str, ...] = ()
    if cfg is not None:
        with_skip = cfg if isinstance(cfg, dict) else getattr(cfg, "to_dict", dict)()
        skip = tuple(with_skip.get("llm_int8_skip_modules") or ())
    if type(layer).__name__ == "Linear8bitLt":
        floats = [p.dtype for p in base.parameters()
                  if p.is_floating_point() and type(p).__name__ not in {"Int8Params", "Params4bit"}]
        dtype = max(set(floats), key=floats.count) if floats else "float32"
        return QuantSpec(bits=8, compute_dtype=str(dtype),
                         llm_int8_threshold=float(layer.state.threshold), skip_modules=skip)
    w = layer.weight
    qs = getattr(w, "quant_state", None)
    compute = layer.compute_dtype or (qs.dtype if qs is not None else w.dtype)
    return QuantSpec(bits=4, quant_type=str(getattr(w, "quant_type", None) or "nf4"),
                     double_quant=bool(qs.nested if qs is not None
                                       else getattr(w, "compress_statistics", False)),
                     compute_dtype=str(compute), skip_modules=skip)


def check_precision(spec: QuantSpec | None, base_dtype: str, precision: str | None) -> None:
    """A bitsandbytes base is never cast (transformers refuses ``.to(dtype)`` on it): a
    ``*-true`` half precision, which casts the model, must be the dtype the base is loaded
    in (``base_dtype``: its compute dtype when autofit builds it); ``32-true`` and the
    mixed precisions leave the base as it is (no cast; autocast only).

    Raises:
        BadInputError: a half ``*-true`` precision of another dtype, with what to do.
    """
    if spec is None or precision is None:
        return
    from autofit.config import PRECISIONS, normalize_precision

    name = normalize_precision(precision)
    p = PRECISIONS[name]
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    if p.autocast and base_dtype != "float32" and p.compute_dtype != base_dtype:
        # torch's autocast cannot mix the two 16-bit types (at::autocast::prioritize)
        raise BadInputError(
            f"{name} autocasts to {p.compute_dtype} a base loaded in {base_dtype}; use "
            + fix(f"--precision {_MIXED[base_dtype]}", f"precision='{_MIXED[base_dtype]}'")
            + " or load it in " + p.compute_dtype + " ("
            + fix(f"--bnb-4bit-compute-dtype {short[p.compute_dtype]}",
                  f"bnb_4bit_compute_dtype=torch.{p.compute_dtype}") + ")")
    if name not in ("bf16-true", "16-true"):
        return
    dtype = p.param_dtype
    if dtype != base_dtype:
        raise BadInputError(
            f"{name} casts the model to {dtype}, but a bitsandbytes base cannot be cast (it "
            f"is in {base_dtype}); load it in {dtype} ("
            + fix(f"--bnb-4bit-compute-dtype {short[dtype]}",
                  f"bnb_4bit_compute_dtype=torch.{dtype}")
            + ") or use a mixed precision")
