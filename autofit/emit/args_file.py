"""The user's arguments file: TrainingArguments fields beside the script's own keys, read and
written back with only the tuned fields changed.

A training script's args file often holds more than ``TrainingArguments``: the
transformers examples (``run_clm.py``) parse ``ModelArguments``,
``DataTrainingArguments`` and ``TrainingArguments`` from one YAML/JSON file
(``model_name_or_path``, ``train_file``, ``block_size``, ...), and ``trl sft --config``
reads ``ScriptArguments`` + ``ModelConfig`` + ``SFTConfig`` keys (``dataset_name``,
``use_peft``, ``max_length``, ...). ``read_args_file`` splits such a file: the
TrainingArguments fields (checked as TrainingArguments would, elsewhere) and the other
keys, kept untouched and named in one note; a key that looks like a misspelled
TrainingArguments field is kept too, with a did-you-mean warning (not refused: the
script's own dataclasses may take it).

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "args.yaml"
    >>> _ = p.write_text("model_name_or_path: gpt2\\nper_device_train_batch_size: 4\\n")
    >>> f = read_args_file(p)
    >>> f.fields, f.other, f.model
    ({'per_device_train_batch_size': 4}, ('model_name_or_path',), 'gpt2')

Paths in the file (``model_name_or_path``, ``train_file``) are read as the script reads
them: relative to the working directory (``HfArgumentParser`` hands the text through and
the script opens it from where it runs). A path found only beside the file is taken from
there, and a reason line says so.

``merged_yaml`` / ``merged_mapping`` write the tuned fields back into the file's mapping:
every other key, its value and its place are kept; a tuned field the file has changes in
place, one it lacks goes at the end. A YAML file keeps its comments when each changed
field is a one-line ``key: value`` at the top level (the usual shape); otherwise the YAML
is written again without them and a note says so (no round-trip YAML library is used).

Known limitations:
    NB: a file whose top level holds anchors, aliases or several documents is rewritten
    without its comments (the result is checked to load as the intended mapping).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from autofit.errors import BadInputError

__all__ = ["ArgsFile", "read_args_file", "merged_mapping", "merged_yaml", "TRL_MARKERS"]

def _words(text: str) -> list[str]:
    return text.split()


# Keys of the transformers examples' ModelArguments / DataTrainingArguments (run_clm.py,
# run_mlm.py, run_clm_no_trainer.py, run_ner.py, run_glue.py, run_classification.py):
# known, so no did-you-mean is offered for them.
_EXAMPLE_KEYS = frozenset(_words("""task_name label_column_name label_all_tokens
return_entity_level_metrics ignore_mismatched_sizes shuffle_seed remove_splits
remove_columns
model_name_or_path model_type config_overrides config_name tokenizer_name cache_dir
use_fast_tokenizer model_revision token use_auth_token trust_remote_code torch_dtype dtype
low_cpu_mem_usage dataset_name dataset_config_name train_file validation_file test_file
max_train_samples max_eval_samples max_predict_samples streaming block_size overwrite_cache
validation_split_percentage preprocessing_num_workers keep_linebreaks max_seq_length
pad_to_max_length line_by_line mlm_probability text_column_name
"""))

# TRL's own keys besides SFTConfig's (ModelConfig, ScriptArguments of TRL 1.16), when TRL
# cannot be imported to list them
_TRL_SCRIPT_KEYS = frozenset(_words("""
model_name_or_path model_revision dtype attn_implementation use_peft lora_r lora_alpha
lora_dropout lora_target_modules lora_target_parameters lora_modules_to_save lora_task_type
use_rslora use_dora load_in_8bit load_in_4bit bnb_4bit_quant_type use_bnb_nested_quant
bnb_4bit_quant_storage dataset_name dataset_config dataset_train_split dataset_test_split
dataset_streaming ignore_bias_buffers datasets streaming test_split_size
"""))

# a key only a TRL file has (ModelConfig / ScriptArguments; SFTConfig's own fields are
# found from the class): the file is an SFTConfig run by SFTTrainer
TRL_MARKERS = frozenset(_TRL_SCRIPT_KEYS - _EXAMPLE_KEYS - {"attn_implementation"})

_MODEL_KEYS = ("model_name_or_path",)
_DATA_KEYS = ("train_file", "dataset_name")


@dataclasses.dataclass(frozen=True)
class ArgsFile:
    """One arguments file, split.

    Attributes:
        path: the file.
        keys: every key of the file with its value, in the file's order.
        fields: the TrainingArguments fields among them (SFTConfig's too when TRL is here).
        other: the keys outside TrainingArguments, in the file's order (kept untouched).
        meta: autofit's metadata (a tuned file's), else empty.
        text: the file's text as read.
        sft: TRL keys are present: the fields are an ``SFTConfig`` (SFTTrainer runs it).
        notes: the reason lines about the file (the keys kept, did-you-mean warnings).
        model: ``model_name_or_path``, as a path when it names one, else as written.
        dataset: ``train_file`` (else ``dataset_name`` when it names a local file or
            folder), resolved as a path; None when the file names no local data.
        mixture: a TRL file's ``datasets`` (``DatasetMixtureConfig``: what ``trl sft``
            loads instead of ``dataset_name``), each entry's ``data_files`` resolved as
            paths; empty otherwise. ``load_mixture`` loads its train split.
    """

    path: Path
    keys: dict[str, Any]
    fields: dict[str, Any]
    other: tuple[str, ...]
    meta: dict[str, Any]
    text: str
    sft: bool = False
    notes: tuple[str, ...] = ()
    model: str | None = None
    dataset: str | None = None
    dataset_key: str | None = None
    mixture: tuple[dict[str, Any], ...] = ()

    @property
    def is_yaml(self) -> bool:
        return self.path.suffix.lower() in (".yaml", ".yml")

    def load_mixture(self) -> Any:
        """The train split of ``mixture`` as ``trl sft`` loads it (``autofit.probe.mixture.
        load_trl_mixture``)."""
        from autofit.probe.mixture import load_trl_mixture

        k = self.keys
        return load_trl_mixture(self.mixture, streaming=bool(k.get("streaming")),
                                test_split_size=k.get("test_split_size"),
                                split=str(k.get("dataset_train_split") or "train"),
                                name=self.path.name)

    @property
    def peft_config(self) -> dict[str, Any] | None:
        """The LoRA adapter a TRL file asks for (``use_peft: true`` and ModelConfig's
        ``lora_*`` keys), as ``trl.get_peft_config`` builds it; None otherwise."""
        k = self.keys
        if not self.sft or k.get("use_peft") is not True:
            return None
        out = {"peft_type": "LORA", "task_type": k.get("lora_task_type") or "CAUSAL_LM",
               "r": k.get("lora_r", 16), "target_modules": k.get("lora_target_modules"),
               "lora_alpha": k.get("lora_alpha", 32), "lora_dropout": k.get("lora_dropout", 0.05),
               "bias": "none", "use_rslora": bool(k.get("use_rslora")),
               "use_dora": bool(k.get("use_dora")),
               "modules_to_save": k.get("lora_modules_to_save")}
        if k.get("lora_target_parameters") is not None:
            out["target_parameters"] = k["lora_target_parameters"]
        return out

    def merged(self, args: dict[str, object]) -> dict[str, Any]:
        """``merged_mapping(self, args)``."""
        return merged_mapping(self, args)

    def merged_yaml(self, args: dict[str, object]) -> tuple[str, bool]:
        """``merged_yaml(self, args)``."""
        return merged_yaml(self, args)


@lru_cache(maxsize=1)
def _trl_fields() -> tuple[frozenset[str], frozenset[str]]:
    """(SFTConfig's fields that TrainingArguments lacks, TRL's script keys), kept on disk per
    library versions (``validate.library_cached``: no transformers or trl import)."""
    from autofit.emit.validate import library_cached

    sft_only, script = library_cached(
        "trl-fields", lambda: [sorted(names) for names in _trl_fields_now()])
    return frozenset(sft_only), frozenset(script)


def _trl_fields_now() -> tuple[frozenset[str], frozenset[str]]:
    """``_trl_fields`` read from the installed classes."""
    if importlib.util.find_spec("trl") is None:
        return frozenset(), _TRL_SCRIPT_KEYS
    try:
        from transformers import Seq2SeqTrainingArguments
        from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig
    except Exception:  # noqa: BLE001 - a broken TRL install must not stop reading a file
        return frozenset(), _TRL_SCRIPT_KEYS
    base = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    sft_only = {f.name for f in dataclasses.fields(SFTConfig) if f.init} - base
    script = {f.name for c in (ModelConfig, ScriptArguments, DatasetMixtureConfig)
              for f in dataclasses.fields(c)}
    return frozenset(sft_only), frozenset(script) | _TRL_SCRIPT_KEYS


def read_args_file(path: str | Path) -> ArgsFile:
    """Read a (mixed) arguments file: see the module.

    Raises:
        BadInputError: as ``read_config`` (a missing, empty, malformed file).
    """
    from autofit.emit.config_file import _read_text, read_config
    from autofit.emit.validate import field_names

    p = Path(path)
    keys, meta = read_config(p)
    names = field_names()
    sft_only, script = _trl_fields()
    fields = {k: v for k, v in keys.items() if isinstance(k, str) and k in names}
    other = tuple(k for k in keys if k not in fields)
    sft = any(k in sft_only or k in TRL_MARKERS for k in keys)
    known = _EXAMPLE_KEYS | script
    notes: list[str] = []
    if other:
        listed = ", ".join(_short(k) for k in other[:_LISTED])
        more = f" and {len(other) - _LISTED} more" if len(other) > _LISTED else ""
        notes.append(f"{p.name}: {len(other)} key{'s' if len(other) > 1 else ''} outside "
                     f"TrainingArguments kept untouched (your script's): {listed}{more}")
    for k in other:
        if isinstance(k, str) and k not in known:
            near = difflib.get_close_matches(k, list(names), n=1, cutoff=0.8)
            if near:
                notes.append(f"warning: {p.name}: {_short(k)!r} is not a TrainingArguments "
                             f"field (did you mean {near[0]}?); kept as your script's key")
    model, why_model = _path_key(keys, _MODEL_KEYS, p, must_exist=False)
    dataset, why_data = _path_key(keys, _DATA_KEYS, p, must_exist=True)
    notes += [w for w in (why_model, why_data) if w]
    data_key = next((k for k in _DATA_KEYS if keys.get(k) and dataset is not None), None)
    mixture: tuple[dict[str, Any], ...] = ()
    if sft and keys.get("datasets") is not None:  # trl sft loads it over dataset_name
        mixture, why_mix = _mixture(keys["datasets"], p)
        notes += why_mix
        dataset, data_key = None, "datasets"
    return ArgsFile(path=p, keys=keys, fields=fields, other=other, meta=meta,
                    text=_read_text(p), sft=sft, notes=tuple(notes), model=model,
                    dataset=dataset, dataset_key=data_key, mixture=mixture)


_MIXTURE_KEYS = frozenset(("path", "name", "data_dir", "data_files", "split", "columns",
                           "fraction"))  # trl.scripts.utils.DatasetConfig's fields


def _mixture(value: object, p: Path) -> tuple[tuple[dict[str, Any], ...], list[str]]:
    """A TRL file's ``datasets`` list checked as ``DatasetConfig`` takes it, with each local
    path (``data_files``, a ``path`` naming a file or folder) resolved as ``_path_key``
    resolves one: from the working directory, else beside the file (with why)."""
    if not isinstance(value, list) or not value or not all(isinstance(e, dict) for e in value):
        raise BadInputError(f"{p.name}: datasets must be a list of mappings with a path each "
                            "(TRL's DatasetMixtureConfig), got "
                            f"{type(value).__name__}")
    out, notes = [], []
    for i, entry in enumerate(value):
        unknown = sorted(set(entry) - _MIXTURE_KEYS)
        if unknown or not isinstance(entry.get("path"), str):
            what = (f"unknown key {unknown[0]!r}" if unknown else "no path")
            raise BadInputError(f"{p.name}: datasets[{i}] has {what} (TRL's DatasetConfig takes "
                                f"{', '.join(sorted(_MIXTURE_KEYS))})")
        entry = dict(entry)
        for key in ("path", "data_dir", "data_files"):
            v = entry.get(key)
            values = v if isinstance(v, list) else [v]
            resolved = []
            for one in values:
                found, why = _path_key({key: one}, (key,), p, must_exist=False)
                resolved.append(found if found is not None else one)
                if why:
                    notes.append(f"datasets[{i}] {why}")
            entry[key] = resolved if isinstance(v, list) else resolved[0]
        out.append(entry)
    return tuple(out), notes


_LISTED = 24  # keys named in the note; the rest counted


def _short(key: object, limit: int = 40) -> str:
    text = str(key)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _path_key(keys: dict[str, object], names: tuple[str, ...], p: Path,
              must_exist: bool) -> tuple[str | None, str | None]:
    """The first of ``names`` the file sets, as a path when it names one: relative to the
    working directory (as the script reads it), else beside the file (with why)."""
    for name in names:
        value = keys.get(name)
        if not isinstance(value, str) or not value.strip():
            continue
        here = Path(value).expanduser()
        if here.exists() or here.is_absolute():
            return value, None
        beside = p.parent / here
        if beside.exists():
            return str(beside), (f"{name} {value}: not found in the working directory, taken "
                                 f"beside {p.name} ({beside}); your script reads it from "
                                 "where it runs")
        if not must_exist:
            return value, None  # a hub id or a bundled name
        if name == "train_file":
            raise BadInputError(f"{p}: train_file {value} not found (relative paths are read "
                                "from the working directory, as your script reads them); run "
                                "from the script's folder or give --dataset")
        return value, None  # dataset_name: a hub dataset, or a bundled name
    return None, None


# ---------------------------------------------------------------- writing back


def merged_mapping(source: ArgsFile, args: dict[str, object]) -> dict[str, Any]:
    """The file's mapping with ``args`` (the tuned TrainingArguments fields, every one)
    written in: other keys kept in place, a field the file has changed in place, a new
    field at the end, a field of the file that ``args`` drops (a secret) left out."""
    out: dict[str, Any] = {}
    for k, v in source.keys.items():
        if k in args:
            out[k] = args[k]
        elif k not in source.fields:
            out[k] = v
    for k, v in args.items():
        out.setdefault(k, v)
    return out


def merged_yaml(source: ArgsFile, args: dict[str, object]) -> tuple[str, bool]:
    """The YAML text of ``merged_mapping``, and whether the file's comments are kept.

    Each changed field is edited on its own line (its trailing comment kept), new fields
    appended; an earlier autofit header (a tuned file tuned again) is dropped. When a
    line cannot be edited safely the YAML is dumped again, without comments."""
    import yaml

    want = merged_mapping(source, args)
    if source.is_yaml:
        text = _edited(source, want)
        if text is not None:
            try:
                if yaml.safe_load(text) == want:
                    return text, True
            except yaml.YAMLError:
                pass
    return yaml.safe_dump(want, sort_keys=False, allow_unicode=True), not _has_comments(source)


def _has_comments(source: ArgsFile) -> bool:
    return source.is_yaml and any(line.lstrip().startswith("#") or " #" in line
                                  for line in _body(source.text.splitlines()))


def _body(lines: list[str]) -> list[str]:
    """The lines below an autofit header (``# Tuned by autofit`` ... ``# autofit: {...}``)."""
    from autofit.emit.config_file import _META_PREFIX

    for i, line in enumerate(lines):
        if line.startswith(_META_PREFIX):
            head = lines[:i]
            if head and head[0].startswith("# Tuned by autofit") and all(
                    h.startswith("#") for h in head):
                return lines[i + 1:]
            return lines[:i] + lines[i + 1:]
    return lines


def _line(key: str, value: object) -> list[str]:
    import yaml

    text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=False,
                          width=10**6, allow_unicode=True)
    return text.rstrip("\n").splitlines()


_COMMENT = re.compile(r"\s+#.*$")


def _edited(source: ArgsFile, want: dict[str, object]) -> str | None:
    """The file's text with ``want``'s changed keys edited line by line (None: not safely)."""
    lines = _body(source.text.splitlines())
    old = source.keys
    for key in list(old):
        if key in want and want[key] == old[key]:
            continue
        if not isinstance(key, str):
            return None
        at = [i for i, line in enumerate(lines)
              if re.match(rf"{re.escape(key)}\s*:(\s|$)", line)]
        if len(at) != 1:
            return None
        i = at[0]
        rest = lines[i].split(":", 1)[1]
        value_text = _COMMENT.sub("", rest).strip()
        nxt = next((line for line in lines[i + 1:] if line.strip()
                    and not line.lstrip().startswith("#")), "")
        if not value_text or value_text[0] in "|>&*!" or nxt[:1] in (" ", "\t", "-"):
            return None  # a block value over several lines, or an anchor: not edited here
        if key not in want:
            del lines[i]
            continue
        comment = _COMMENT.search(rest)
        new = _line(key, want[key])
        if comment and len(new) == 1:
            new[0] += comment.group(0)
        lines[i:i + 1] = new
    for key, value in want.items():
        if key not in old:
            lines += _line(key, value)
    return "\n".join(lines) + "\n"
