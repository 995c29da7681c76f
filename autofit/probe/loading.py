"""Where a model's configuration comes from: a config bundled with autofit
(``bundled_models()``), a ``config.json`` or a model directory, or the hub (offline when
it cannot be reached); and the task it is usually trained for.

    >>> from autofit.probe.loading import load_config
    >>> load_config("tiny-llama").model_type
    'llama'
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError, UnknownModelError, UnknownTaskError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PretrainedConfig

__all__ = ["TASKS", "CLASSIFIER_TASKS", "bundled_models", "load_config", "default_task",
           "module_task"]

# Task name -> transformers Auto class.
TASKS: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "seq-cls": "AutoModelForSequenceClassification",
    "token-cls": "AutoModelForTokenClassification",
}

# Tasks whose head is a classifier (``num_labels`` wide), not a vocabulary-wide LM head:
# no (B, T, V) logits. seq-cls labels one class per sample, token-cls one per token.
CLASSIFIER_TASKS: tuple[str, ...] = ("seq-cls", "token-cls")

_BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data" / "models"


def bundled_models() -> list[str]:
    """Names of the model configs that ship with autofit (usable offline)."""
    if not _BUNDLED_DIR.is_dir():
        return []
    names = []
    for p in sorted(_BUNDLED_DIR.glob("*.json")):
        with open(p) as f:
            names.append(json.load(f).get("_autofit_name", p.stem))
    return names


def _bundled_path(name: str) -> Path | None:
    if not _BUNDLED_DIR.is_dir():
        return None
    for p in _BUNDLED_DIR.glob("*.json"):
        with open(p) as f:
            if json.load(f).get("_autofit_name", p.stem).lower() == name.lower():
                return p
    return None


# Sizes a config gives as positive integers (a negative or zero one fails deep inside
# the model's constructor: "Trying to create tensor with negative dimension").
_DIMENSIONS = (
    "vocab_size", "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer",
    "num_layers", "num_attention_heads", "n_head", "num_heads", "num_key_value_heads",
    "intermediate_size", "n_inner", "d_ff", "ffn_dim", "head_dim", "d_kv",
    "max_position_embeddings", "n_positions",
)


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message as one short line (transformers' are often several)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    text = text.rstrip(".") or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unknown_model_type(where: str, model_type: str) -> UnknownModelError:
    import difflib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close else
            "list the known ones with python -c \"from transformers import CONFIG_MAPPING; "
            "print(sorted(CONFIG_MAPPING))\", or upgrade transformers")
    return UnknownModelError(f"{where}: model_type {model_type!r} is not known to transformers "
                             f"{transformers.__version__}; {hint}")


def _check_dimensions(config: PretrainedConfig, where: str) -> None:
    """Every size the config gives (a config object or its dict) is a positive integer;
    all problems in one line."""
    problems = []
    for name in _DIMENSIONS:
        v = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if isinstance(v, str) or (isinstance(v, int) and (isinstance(v, bool) or v <= 0)):
            problems.append(f"{name} must be a positive integer, got {v!r}")
    if problems:
        raise BadInputError(f"{where}: {'; '.join(problems)}; fix the config")


def _config_from_json(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnknownModelError(f"{path}: not a readable JSON config ({_one_line(e)}); give a "
                                "transformers config.json") from None
    if not isinstance(d, dict):
        raise UnknownModelError(f"{path}: a config.json holds a JSON object, got "
                                f"{type(d).__name__}; give a transformers config.json")
    d = {k: v for k, v in d.items() if not k.startswith("_autofit")}
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise UnknownModelError(f"{path} has no 'model_type'; is it a transformers config.json?")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise _unknown_model_type(str(path), model_type)
    _check_dimensions(d, str(path))  # before the config class divides by them
    try:
        config = AutoConfig.for_model(model_type, **d)
    except Exception as e:  # noqa: BLE001 - config classes validate with many error types
        raise BadInputError(f"{path}: {_one_line(e)}; fix the config") from None
    _check_dimensions(config, str(path))
    return config


def _hub_offline() -> str | None:
    """Why the hub cannot be reached (a reason to print), or None when it may be.

    HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE say so; otherwise one TCP connection to the
    endpoint with a 3 s timeout (huggingface_hub itself retries for ~30 s).
    """
    import socket
    from urllib.parse import urlparse

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}:
            return f"{var} is set"
    from huggingface_hub import constants

    if getattr(constants, "HF_HUB_OFFLINE", False):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "huggingface.co",
                                  url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=3).close()
    except OSError:
        return f"{url.hostname} cannot be reached"
    return None


def _config_from_hub(ref: str) -> Any:
    """A hub id's config: from the local cache, else (when the hub can be reached) the hub."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    from transformers import AutoConfig

    try:
        validate_repo_id(ref)
    except HFValidationError:
        raise UnknownModelError(
            f"cannot load model {ref!r}: not a local file or directory, not a bundled config "
            f"({', '.join(bundled_models())}), and not a hub id (namespace/name)") from None
    try:
        config = AutoConfig.from_pretrained(ref, local_files_only=True)
    except OSError:  # not in the local cache
        config = None
    except Exception as e:  # noqa: BLE001 - cached, but transformers cannot read it
        raise UnknownModelError(f"cannot load model {ref!r}: {_one_line(e)}") from None
    if config is None:
        offline = _hub_offline()
        if offline is not None:
            raise UnknownModelError(
                f"cannot load model {ref!r}: not found locally and no network ({offline}); give a local "
                f"directory or config.json, a bundled name ({', '.join(bundled_models())}), "
                "or download it first (huggingface-cli download)")
        try:
            config = AutoConfig.from_pretrained(ref)
        except Exception as e:  # noqa: BLE001 - hub errors come in many types
            raise UnknownModelError(
                f"cannot load model {ref!r}: not a local path, not a bundled config, and the "
                f"hub said: {_one_line(e)}") from None
    _check_dimensions(config, ref)
    return config


def load_config(ref: str | os.PathLike) -> Any:
    """Load a ``PretrainedConfig`` from a bundled name, a config.json, a directory or a hub id."""
    ref_s = os.fspath(ref)
    path = Path(ref_s).expanduser()
    if path.is_file():
        return _config_from_json(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"{ref_s} is a directory without a config.json")
        return _config_from_json(path / "config.json")
    bundled = _bundled_path(ref_s)
    if bundled is not None:
        return _config_from_json(bundled)
    if ref_s.endswith(".json"):
        raise UnknownModelError(f"{ref_s}: no such file")
    return _config_from_hub(ref_s)


# what a model class's name says it trains for (transformers' naming)
_CLASS_TASKS: tuple[tuple[str, str], ...] = (
    ("ForSequenceClassification", "seq-cls"),
    ("ForTokenClassification", "token-cls"),
    ("ForMaskedLM", "masked-lm"),
    ("ForPreTraining", "masked-lm"),
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
)


def _class_task(name: str, config: object) -> str | None:
    t = next((t for suffix, t in _CLASS_TASKS if name.endswith(suffix)), None)
    # an encoder-decoder's LM head generates from its encoder (T5's "T5WithLMHeadModel")
    return "seq2seq" if t == "causal-lm" and getattr(config, "is_encoder_decoder", False) else t


def default_task(config: PretrainedConfig) -> str:
    """The task a config is usually trained for: its ``architectures`` first (a BART
    classifier's config is an encoder-decoder's too), then an encoder-decoder is seq2seq."""
    for a in getattr(config, "architectures", None) or []:
        t = _class_task(a, config)
        if t is not None:
            return t
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if getattr(config, "model_type", "") in {"bert", "roberta", "distilbert", "deberta", "deberta-v2", "electra", "xlm-roberta", "modernbert"}:
        return "masked-lm"
    return "causal-lm"


def module_task(module: object) -> str:
    """The task a module trains for: its class's (``BertForSequenceClassification`` is
    seq-cls whatever its config's ``architectures`` say: a classifier fine-tuned from a
    masked LM keeps ``["BertForMaskedLM"]``), a PEFT model's base's, else its config's."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    config = getattr(base, "config", None)
    t = _class_task(type(base).__name__, config)
    if t is not None:
        return t
    return default_task(config) if config is not None else "causal-lm"


def _check_task(task: str) -> str:
    t = task.strip().lower().replace("_", "-")
    if t not in TASKS:
        raise UnknownTaskError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return t
