"""Check TrainingArguments fields (a tuned file, a plain YAML/JSON, a dict) the way
TrainingArguments itself would, and report every problem at once.

    >>> problems = training_arguments_problems({"learning_rte": 1e-4, "bf16": True,
    ...                                         "fp16": True})
    >>> problems[0]
    "unknown field 'learning_rte' (did you mean learning_rate?)"
    >>> len(problems)
    2

Why not simply ``TrainingArguments(**fields)``: the constructor checks the
hardware as well as the fields. ``bf16=True`` raises on a machine without a bf16
GPU unless ``use_cpu=True``, ``tf32=True`` without an Ampere GPU, a ``deepspeed``
file that lives on the cluster is opened; and it resets accelerate's process state
in the caller's process (a training script calling ``autofit.preflight``). A plan
made for an A100 must stay checkable on a laptop, so the fields are checked from
the definitions transformers itself uses, without building the object:

- names against ``dataclasses.fields`` of ``TrainingArguments`` (and of
  ``Seq2SeqTrainingArguments`` and TRL's ``SFTConfig`` when installed), with a
  did-you-mean for a misspelling (what ``HfArgumentParser.parse_yaml_file``
  refuses as "keys not used");
- values against the field's declared type. ``parse_yaml_file`` / ``parse_json_file``
  hand values to the constructor unconverted, so ``per_device_train_batch_size:
  "4"`` or ``learning_rate: 1e-4`` (YAML reads that as text) reach the Trainer as
  strings; ``HfArgumentParser``'s own per-field conversion (``int``, ``float``,
  ``string_to_bool``, the enum choices) tells a value that merely needs its quotes
  removed from one that is wrong. Fields the parser reads as free text (``str``)
  are left to TrainingArguments, which interprets them itself;
- the cross-field rules of ``TrainingArguments.__post_init__`` that do not depend on
  the machine (``_RULES``), plus autofit's own: batch sizes and accumulation >= 1.

Known limitations:
    NB: the hardware rules (bf16 / tf32 need a GPU that has them) are left to the
    check on the device (``autofit.preflight.check``), which knows the device.
    NB: ``load_best_model_at_end`` with fractional save/eval steps (ratios) is not
    restated; whole steps are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import os
import typing
from collections.abc import Callable, Iterable
from enum import Enum
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from autofit.errors import InvalidArgumentsError

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["training_arguments_problems", "check_training_arguments", "field_names"]


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    hint: Any           # the declared type (typing.get_type_hints)
    convert: Any        # HfArgumentParser's conversion of a command-line string
    choices: tuple[str, ...] | None
    many: bool          # nargs="+": a list of values is allowed
    default: Any


def _classes() -> list[type]:
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    out = [TrainingArguments, Seq2SeqTrainingArguments]
    if importlib.util.find_spec("trl") is not None:  # SFTConfig files, when TRL is here
        try:
            from trl import SFTConfig

            out.append(SFTConfig)
        except Exception:  # noqa: BLE001 - a broken TRL install must not stop a check
            pass
    return out


@lru_cache(maxsize=1)
def _definitions() -> dict[str, _Field]:
    """Every init field of the TrainingArguments family: declared type + the parser's reading."""
    from transformers import HfArgumentParser

    out: dict[str, _Field] = {}
    for cls in _classes():
        hints = typing.get_type_hints(cls)
        actions: dict[str, Any] = {}
        for a in HfArgumentParser(cls)._actions:
            actions.setdefault(a.dest, a)  # the field's own action, not its --no_ twin
        for f in dataclasses.fields(cls):
            if not f.init or f.name in out:
                continue
            a = actions.get(f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            out[f.name] = _Field(
                name=f.name, hint=hints.get(f.name, Any), convert=getattr(a, "type", None),
                choices=tuple(str(c) for c in a.choices) if a is not None and a.choices else None,
                many=getattr(a, "nargs", None) == "+", default=_plain(default))
    return out


def field_names() -> frozenset[str]:
    """Every field name the TrainingArguments family takes (TRL's ``SFTConfig`` when here);
    kept on disk per library versions (``library_cached``): reading a file needs no
    transformers import."""
    return frozenset(library_cached("field-names", lambda: sorted(_definitions())))


def _versions_key(*parts: object) -> str | None:
    """A hash of ``parts``, the library versions (trl's too: SFTConfig's fields) and the
    source of this module and of ``args_file`` (what reads them); None when not JSON."""
    import hashlib
    import json
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    from autofit.probe.versions import library_versions

    versions = library_versions()
    try:  # installed and importable here (a test may hide it): SFTConfig's fields count
        versions["trl"] = version("trl") if importlib.util.find_spec("trl") else "-"
    except (PackageNotFoundError, ValueError):
        versions["trl"] = "-"
    try:
        blob = json.dumps([parts, versions], sort_keys=True).encode()
    except (TypeError, ValueError):
        return None
    h = hashlib.sha256(blob)
    here = Path(__file__)
    for source in (here, here.with_name("args_file.py")):
        with contextlib.suppress(OSError):
            h.update(source.read_bytes())
    return h.hexdigest()[:24]


def library_cached(name: str, compute: Callable[[], object]) -> Any:
    """``compute()`` (plain JSON data that depends only on the installed libraries, e.g. the
    field names of TrainingArguments), kept in the cache directory per library versions: a
    second run reads it without importing transformers (seconds of imports)."""
    import json

    from autofit.probe.versions import cache_dir

    key = _versions_key(name)
    path = cache_dir() / "library" / f"{name}-{key}.json" if key else None
    if path is not None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
    value = compute()
    if path is not None:
        with contextlib.suppress(OSError):  # a read-only cache: computed again next time
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(value))
            tmp.replace(path)
    return value


def _plain(v: object) -> Any:
    return v.value if isinstance(v, Enum) else v


# ---------------------------------------------------------------- one field


def _matches(value: object, hint: object) -> bool:
    """Whether ``value`` is of the declared type ``hint`` as the constructor receives it."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or (origin is not None and origin.__name__ == "UnionType"):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (list, tuple):
        return isinstance(value, list) and (not args or all(_matches(v, args[0]) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    if not isinstance(hint, type):
        return True  # a type we cannot read: left to TrainingArguments
    if issubclass(hint, Enum):
        return isinstance(value, hint) or value in {e.value for e in hint}
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


_KINDS = {int: "a whole number", float: "a number"}


def _kind(convert: object) -> str:
    if convert in _KINDS:
        return _KINDS[convert]
    if getattr(convert, "__name__", "") == "string_to_bool":
        return "true or false"
    return f"a {getattr(convert, '__name__', 'value')}"


def _as_written(value: object) -> str:
    """How a value is written in the file (YAML's spelling is valid JSON for scalars)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("...").strip()


def _short(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to one short phrase (a pasted blob must not flood the line)."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _near(name: str, names: Iterable[str]) -> str | None:
    near = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return near[0] if near else None


def _value_problem(f: _Field, value: object) -> str | None:
    value = _plain(value)
    if value is None:
        return None if _matches(None, f.hint) else f"{f.name}: needs a value, not null"
    if f.choices:  # an enum / Literal field: one of the parser's choices
        items = value if (f.many and isinstance(value, list)) else [value]
        for item in items:
            if str(_plain(item)) not in f.choices or not isinstance(_plain(item), str):
                near = _near(str(item), f.choices)
                hint = f"did you mean {near}?" if near else "one of " + ", ".join(f.choices[:8])
                return f"{f.name}: {_short(item)} is not a value it takes ({hint})"
        return None
    if f.convert is str or f.convert is None or _matches(value, f.hint):
        return None  # free text (TrainingArguments reads it itself), or of the declared type
    what = _kind(f.convert)
    if isinstance(value, str):
        try:
            converted = f.convert(value)
        except Exception:  # noqa: BLE001 - the parser's own conversion refused it
            return f"{f.name}: {_short(value)} is not {what}"
        if _matches(converted, f.hint):
            return (f"{f.name}: {_short(value)} is text, not {what}: write "
                    f"{_as_written(converted)} without quotes")
    return f"{f.name}: {_short(value)} is not {what}"


# ---------------------------------------------------------------- across fields
# Each rule reads the resolved fields (the file's valid values over the defaults) and
# returns its problems. The first ones restate TrainingArguments.__post_init__ /
# _validate_args; the last is autofit's own.


def _one_half_precision(v: dict[str, object]) -> list[str]:
    out = []
    if v["bf16"] and v["fp16"]:
        out.append("bf16 and fp16 are both true and TrainingArguments takes one: keep bf16 "
                   "(a GPU with bf16: Ampere or newer) or fp16, set the other to false")
    if v["bf16_full_eval"] and v["fp16_full_eval"]:
        out.append("bf16_full_eval and fp16_full_eval are both true: set one to false")
    return out


def _steps(v: dict[str, object]) -> list[str]:
    out = []
    if v["logging_strategy"] == "steps" and v["logging_steps"] == 0:
        out.append("logging_strategy steps needs a non-zero logging_steps")
    if v["eval_strategy"] == "steps" and not v["eval_steps"] and v["logging_steps"] <= 0:
        out.append("eval_strategy steps needs a non-zero eval_steps (or logging_steps)")
    for kind in ("logging", "eval", "save"):
        n = v[f"{kind}_steps"]
        if v[f"{kind}_strategy"] == "steps" and n is not None and n > 1 and n != int(n):
            out.append(f"{kind}_steps above 1 must be a whole number of steps, got {n}")
    return out


def _best_model(v: dict[str, object]) -> list[str]:
    if not v["load_best_model_at_end"] or v["save_strategy"] == "best":
        return []
    if v["eval_strategy"] != v["save_strategy"]:
        return [f"load_best_model_at_end needs save_strategy and eval_strategy to match (or "
                f"save_strategy best), got {v['save_strategy']} and {v['eval_strategy']}"]
    save, ev = v["save_steps"], v["eval_steps"] or v["logging_steps"]
    if v["eval_strategy"] == "steps" and save >= 1 and ev >= 1 and save % ev:
        return [f"load_best_model_at_end needs save_steps ({save}) to be a multiple of "
                f"eval_steps ({ev})"]
    return []


def _scheduler(v: dict[str, object]) -> list[str]:
    if v["lr_scheduler_type"] in ("reduce_lr_on_plateau", "greedy") and v["eval_strategy"] == "no":
        return [f"lr_scheduler_type {v['lr_scheduler_type']} needs an eval_strategy other "
                "than no"]
    return []


def _loading(v: dict[str, object]) -> list[str]:
    out = []
    if v["warmup_steps"] < 0:
        out.append(f"warmup_steps must be >= 0, got {v['warmup_steps']}")
    if v["dataloader_num_workers"] == 0 and v["dataloader_prefetch_factor"] is not None:
        out.append("dataloader_prefetch_factor needs dataloader_num_workers > 0")
    if v["torch_empty_cache_steps"] is not None and v["torch_empty_cache_steps"] <= 0:
        out.append(f"torch_empty_cache_steps must be > 0, got {v['torch_empty_cache_steps']}")
    return out


def _batches(v: dict[str, object]) -> list[str]:
    return [f"{n} must be at least 1, got {v[n]}"
            for n in ("per_device_train_batch_size", "gradient_accumulation_steps",
                      "per_device_eval_batch_size") if v[n] < 1]


_RULES: tuple[Callable[[dict[str, Any]], list[str]], ...] = (
    _one_half_precision, _steps, _best_model, _scheduler, _loading, _batches)


# ---------------------------------------------------------------- the check


def training_arguments_problems(fields: dict[str, object], *,
                                extra: Iterable[str] = ()) -> list[str]:
    """Every reason TrainingArguments would refuse ``fields``, one line each ([] when none).

    Args:
        fields: TrainingArguments field names -> values, as a YAML/JSON file holds them.
        extra: further names the caller reads itself (not checked).
    """
    defs = _definitions()
    extra = set(extra)
    problems: list[str] = []
    resolved = {name: f.default for name, f in defs.items()}
    for name, value in fields.items():
        if not isinstance(name, str):
            problems.append(f"{_short(name)}: field names are text (a TrainingArguments field "
                            "name)")
        elif name in extra:
            continue
        elif name not in defs:
            near = _near(name, defs)
            problems.append(f"unknown field {_short(name)} "
                            + (f"(did you mean {near}?)" if near else "(not a TrainingArguments "
                               "field: remove it)"))
        elif (p := _value_problem(defs[name], value)) is not None:
            problems.append(p)
        else:
            resolved[name] = _plain(value)
    for rule in _RULES:
        problems += rule(resolved)
    return problems


@lru_cache(maxsize=1)
def _clean() -> set[str]:
    """The keys (``_clean_key``) of fields found clean in this process."""
    return set()


def _clean_key(fields: dict[str, object]) -> str | None:
    """A key of ``fields`` and of what their check depends on (``_versions_key``)."""
    return _versions_key("clean", fields)


def _found_clean(fields: dict[str, object], memo: bool) -> tuple[bool, str | None]:
    """(whether ``fields`` were found clean before, their key). In this process always; in
    the cache directory (``checked-fields/<key>``) with ``memo``: a cached ``autofit check``
    then answers without importing transformers, whose ``TrainingArguments`` definitions
    cost seconds of imports."""
    key = _clean_key(fields)
    if key is None:
        return False, None
    if key in _clean():
        return True, key
    if memo:
        from autofit.probe.versions import cache_dir

        if (cache_dir() / "checked-fields" / key).exists():
            _clean().add(key)
            return True, key
    return False, key


def _remember_clean(key: str, memo: bool) -> None:
    _clean().add(key)
    if memo:
        from autofit.probe.versions import cache_dir

        marker = cache_dir() / "checked-fields" / key
        with contextlib.suppress(OSError):  # a read-only cache: checked again next time
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()


def check_training_arguments(fields: Mapping[str, object], *,
                             source: str = 'the TrainingArguments fields',
                             extra: Iterable[str] = (), memo: bool = False) -> None:
    """Raise ``InvalidArgumentsError`` listing every problem of ``fields`` (see the module).

    Fields found clean are not checked again in this process; with ``memo`` they are
    remembered in the cache directory too (keyed by the fields, the library versions and
    this module's source). Problems are never remembered.

    Example:
        >>> check_training_arguments({"per_device_train_batch_size": "four"}, source="args.yaml")
        Traceback (most recent call last):
        ...
        autofit.errors.InvalidArgumentsError: args.yaml: 1 problem TrainingArguments would \
refuse: per_device_train_batch_size: 'four' is not a whole number; fix it and run again
    """
    if not isinstance(fields, dict):
        raise InvalidArgumentsError(f"{source}: expected a mapping of TrainingArguments fields, "
                                    f"got {type(fields).__name__}")
    # a verdict that does not depend on ``extra`` (none of its keys is among the fields) is
    # remembered: these exact fields, found clean by this code and these library versions
    keyed = not set(extra) & set(fields)
    clean, key = _found_clean(fields, memo) if keyed else (False, None)
    if clean:
        return
    problems = training_arguments_problems(fields, extra=extra)
    if not problems and key is not None:
        _remember_clean(key, memo)
    if problems:
        n = len(problems)
        raise InvalidArgumentsError(
            f"{source}: {n} problem{'s' if n > 1 else ''} TrainingArguments would refuse: "
            + "; ".join(problems) + f"; fix {'them' if n > 1 else 'it'} and run again",
            tuple(problems))
