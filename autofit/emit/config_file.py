"""The tuned file: TrainingArguments fields as YAML or JSON, with autofit's metadata beside them.

The file holds ``TrainingArguments`` fields only, so
``HfArgumentParser(TrainingArguments).parse_yaml_file`` (or ``parse_json_file``)
loads it as is; tuned from a user's own arguments file (``source``:
``autofit.emit.args_file``), it is that file with the tuned fields changed, so the
script's own ``HfArgumentParser`` of its dataclasses loads it. What autofit needs to check the plan again later (model,
sequence length, device, the estimate) travels in a comment line
``# autofit: {...}`` (YAML) or in a sibling ``<name>.autofit.json`` (JSON).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tuned.yaml"
    >>> _ = write_config(path, {"per_device_train_batch_size": 4}, {"model": "tiny-llama"})
    >>> read_config(path)
    ({'per_device_train_batch_size': 4}, {'model': 'tiny-llama'})
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["write_config", "read_config", "check_config_output"]

_META_PREFIX = "# autofit: "


def check_config_output(path: str | Path, *, name: str = "") -> Path:
    """Raise ``BadInputError`` unless ``write_config`` can write ``path`` (see
    ``autofit.emit.output``): a .yaml/.yml/.json name, not a folder, in a folder files can
    be created in, not read-only. ``name`` is how the caller calls it (``"-o"``)."""
    from autofit.emit.output import check_output

    p = Path(path)
    return check_output(p, suffixes=_SUFFIXES, name=name,
                        writes=[p, _sidecar(p)] if p.suffix.lower() == ".json" else [p])


def _sidecar(p: Path) -> Path:
    return p.with_name(p.stem + ".autofit.json")  # a JSON file's metadata


def write_config(path: str | Path, args: dict[str, object], meta: dict[str, object],
                 beside: dict[Path, str] | None = None, source: Any = None) -> Path:
    """Write TrainingArguments fields (+ autofit's metadata) as YAML or JSON by suffix.

    ``beside``: more files written with it (path -> text: a run's launch configs,
    ``autofit.emit.launch``), checked before anything is written. ``source``: the user's
    arguments file (``autofit.emit.args_file.ArgsFile``) the fields were tuned from: its
    other keys, their order and (YAML to YAML) its comments are kept, only ``args``
    written in (``ArgsFile.merged_yaml``).

    Raises:
        BadInputError: ``path`` is not a .yaml/.yml/.json name, or cannot be written
            (a folder, a read-only file or folder); nothing is written then.
    """
    p = check_config_output(path)
    if beside:
        from autofit.emit.output import check_output

        check_output(p, writes=list(beside), name="path")
    suffix = p.suffix.lower()
    side = _sidecar(p)
    body = None
    if source is not None:
        if suffix in (".yaml", ".yml"):
            body, kept = source.merged_yaml(args)
            if not kept:
                meta = {**meta, "reasons": [*meta.get("reasons", []),
                                            f"{source.path.name}: its comments are not kept "
                                            "(a changed field spans several lines)"]}
        args = source.merged(args)
    if suffix in (".yaml", ".yml"):
        import yaml

        reasons = meta.get("reasons", [])
        header = ["# Tuned by autofit. Load with:",
                  "#   HfArgumentParser(TrainingArguments).parse_yaml_file(path)"]
        if source is not None and source.other:
            header[1] = "#   your script's HfArgumentParser(...).parse_yaml_file(path)"
        if meta.get("trainer"):  # which trainer the file is for (autofit.knobs.trainer)
            from autofit.knobs.trainer import header_line

            header.insert(0, header_line(meta["trainer"]))
        header += [f"#   - {r}" for r in reasons]
        header.append(_META_PREFIX + json.dumps(meta, separators=(",", ":"), default=str))
        if body is None:
            body = yaml.safe_dump(args, sort_keys=False)
        files = {p: "\n".join(header) + "\n" + body}
    else:
        files = {p: json.dumps(args, indent=2) + "\n",
                 side: json.dumps(meta, indent=2, default=str) + "\n"}
    files.update(beside or {})
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        for target, text in files.items():
            target.write_text(text)
    except OSError as e:  # e.g. the disk filled up between the check and the write
        raise BadInputError(f"could not write {p} ({e.strerror or e}); choose another path") \
            from None
    return p


def read_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read back (TrainingArguments fields, autofit metadata) from ``write_config``'s file.

    The fields are returned as the file holds them (``autofit.emit.check_training_arguments``
    checks them); the metadata is checked here, since only autofit writes it.

    Raises:
        BadInputError: a missing, unreadable, empty or malformed file, a file that is
            not a mapping of fields, or a metadata line cut off or edited by hand.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if p.is_dir():
        raise BadInputError(f"{p} is a folder: give the configuration file, e.g. {p / 'tuned.yaml'}")
    if not p.is_file():
        raise BadInputError(f"{p}: no such file")
    if suffix not in _SUFFIXES:
        raise BadInputError(f"unknown config format {p.suffix!r}; use a .yaml or .json file")
    text = _read_text(p)
    if not text.strip():
        raise BadInputError(f"{p} is empty: write TrainingArguments fields in it (e.g. "
                            "per_device_train_batch_size: 8), or tune one with autofit tune -o")
    meta: dict[str, Any] = {}
    if suffix in (".yaml", ".yml"):
        import yaml

        for line in text.splitlines():
            if line.startswith(_META_PREFIX):
                meta = _parse_meta(line[len(_META_PREFIX):], p, "the '# autofit:' line",
                                   "delete that line")
        try:
            args = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise BadInputError(f"{p}: not valid YAML ({str(e).splitlines()[0]}); write plain "
                                "'field: value' lines (no !! tags)") from None
        except RecursionError:  # pyyaml parses nesting by recursion
            raise BadInputError(f"{p}: nested too deep to be TrainingArguments fields; write "
                                "plain 'field: value' lines") from None
        if args is None:
            raise BadInputError(f"{p} holds no TrainingArguments fields, only comments: write "
                                "them in it (e.g. per_device_train_batch_size: 8)")
    else:
        try:
            args = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            why = e if isinstance(e, json.JSONDecodeError) else "nested too deep"
            raise BadInputError(f"{p}: not valid JSON ({why}); write one object of "
                                "TrainingArguments fields") from None
        side = _sidecar(p)
        if side.is_file():
            meta = _parse_meta(_read_text(side), side, "autofit's metadata",
                               f"delete {side.name}")
    if not isinstance(args, dict):
        raise BadInputError(f"{p} holds a {_KIND_OF.get(type(args), type(args).__name__)}, not "
                            "a mapping of TrainingArguments fields: write one field per line, "
                            "e.g. per_device_train_batch_size: 8")
    from autofit.emit.secrets import refuse_masked

    refuse_masked(args, p)  # "<HUB_TOKEN>" read back would be taken for the token
    return args, meta


_SUFFIXES = (".yaml", ".yml", ".json")
_KIND_OF = {list: "list", str: "single text", int: "single number", float: "single number",
            bool: "single true/false"}


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInputError(f"{p} is not a text file: give a YAML or JSON file of "
                            "TrainingArguments fields") from None
    except OSError as e:
        raise BadInputError(f"cannot read {p} ({e.strerror or e})") from None


# ---------------------------------------------------------------- the metadata
# What autofit wrote beside the fields. A hand edit or a cut-off line must not reach
# the check or the report as a wrong type: each key autofit reads is checked here.


def _text(v: object) -> bool:
    return isinstance(v, str) and bool(v)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _optional(check: Callable[[object], bool]) -> Any:
    return lambda v: v is None or check(v)


def _list_of(check: Callable[[object], bool]) -> Any:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _numbers_inside(v: object) -> bool:
    """A dict (or list of dicts) whose numeric-named entries are numbers (or null)."""
    if isinstance(v, list):
        return all(_numbers_inside(x) for x in v)
    if not isinstance(v, dict):
        return False
    for k, x in v.items():
        if k == "breakdown":
            if not (isinstance(x, dict) and all(_number(y) for y in x.values())):
                return False
        elif (str(k).endswith(_NUMERIC_SUFFIXES) or k in _NUMERIC_KEYS) and not (
                x is None or _number(x)):
            return False
    return True


def _train_config(v: object) -> bool:
    from dataclasses import fields

    from autofit.config import TrainConfig
    from autofit.errors import AutofitError

    if not isinstance(v, dict):
        return False
    names = {f.name for f in fields(TrainConfig)}
    try:
        TrainConfig(**{k: x for k, x in v.items() if k in names})
    except (AutofitError, TypeError, ValueError):
        return False
    return True


def _quantization(v: object) -> bool:
    """A tuned file's quantization settings: what ``QuantSpec.from_dict`` reads."""
    from autofit.errors import AutofitError
    from autofit.probe.quant import QuantSpec

    try:
        QuantSpec.from_dict(v)
    except AutofitError:
        return False
    return True


_NUMERIC_SUFFIXES = ("_bytes", "_params", "_per_s", "_s")
_NUMERIC_KEYS = ("micro_batch", "grad_accum", "calibration", "failed_micro_batch",
                 "micro_batch_size", "grad_accum_steps", "seq_len")

# key -> (check, what it should be)
_META_KEYS: dict[str, tuple[Any, str]] = {
    "model": (_text, "the model's name or path"),
    "trainer": (_optional(lambda v: v in ("plain", "autofit", "trl")), "plain, autofit or trl"),
    "task": (_optional(_text), "a task name"),
    "device": (_optional(_text), "a device name"),
    "seq_len": (_optional(_count), "a positive whole number"),
    "max_seq_len": (_optional(_count), "a positive whole number"),
    "target_batch_size": (_optional(_count), "a positive whole number"),
    "eval_micro_batch": (_optional(_count), "a positive whole number"),
    "predicted_run_bytes": (_optional(_count), "a positive whole number of bytes"),
    "margin": (_optional(lambda v: _number(v) and 0 <= v < 1), "a fraction in [0, 1)"),
    "cache_key": (_optional(_text), "text"),
    "model_id": (_optional(_text), "text"),
    "adapter": (_optional(lambda v: isinstance(v, dict) and "peft_type" in v),
                "a PEFT config with peft_type"),
    "quantization": (_optional(_quantization), "a quantization config (load_in_4bit / 8bit)"),
    "versions": (_optional(lambda v: isinstance(v, dict)), "a mapping"),
    "confirmed": (lambda v: isinstance(v, bool), "true or false"),
    "reasons": (_list_of(lambda v: isinstance(v, str)), "a list of text"),
    "config": (_optional(_train_config), "a training configuration"),
    "estimate": (_optional(lambda v: isinstance(v, dict) and _numbers_inside(v)),
                 "a memory estimate (numbers of bytes)"),
    "candidates": (_list_of(_numbers_inside), "a list of candidate rows"),
    "trials": (_list_of(_numbers_inside), "a list of trial rows"),
}


def _parse_meta(text: str, where: Path, what: str, drop: str) -> dict[str, Any]:
    fix = f"re-run autofit tune to write it again, or {drop} to use the file as plain " \
          "TrainingArguments"
    try:
        meta = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deep"
        raise BadInputError(f"{where}: {what} is cut off or edited (not valid JSON: {why}); "
                            f"{fix}") from None
    if not isinstance(meta, dict):
        raise BadInputError(f"{where}: {what} is not a mapping; {fix}")
    bad = [f"{k} should be {want}, got {meta[k]!r}"[:120] for k, (ok, want) in _META_KEYS.items()
           if k in meta and not ok(meta[k])]
    if bad:
        raise BadInputError(f"{where}: {what} was edited ({'; '.join(bad)}); {fix}")
    return meta
