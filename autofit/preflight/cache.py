"""The pre-flight cache: one measured trial per exact configuration, in the optuna storage.

A check is keyed by everything that decides a step's memory: the model (its
config file's hash for a reference, the shapes of its parameters for a module),
the task, the exact ``TrainConfig`` (micro batch, accumulation, precision,
checkpointing, optimizer and its arguments, world size) at the worst-case
sequence length, the eval settings, the device (name, product, physical memory;
for a capped CPU the cap is in the name) and the library versions. The entry is
an optuna study ``autofit-check-<key>`` in the same storage as the tuning studies
(``autofit.search.storage.default_storage``), holding the trial, the estimate and the
model-level problems as user attributes, so a hit needs neither torch nor the model
(with the default SQLite storage, a JSON copy per entry answers without opening the
storage: see ``CheckCache``).

A tuning run's trials count too: ``lookup_tune`` searches the study a tuned file
names (``cache_key`` in its metadata) for a trial of exactly this configuration on
this device, when the file's ``model_id`` and ``versions`` are those of now.

What the device offers is not in the key (free memory on a GPU moves a little from
run to run): a cached measured need is compared with the capacity of now, and a
cached out-of-memory trial is reused only when the capacity is not larger than
the one it failed at.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.trial.result import trial_from_dict

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

    from autofit.config import ModelSource, ModelSpec
    from autofit.probe.device import DeviceInfo

__all__ = ["model_identity", "check_key", "CheckCache", "reusable"]


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def model_identity(model: ModelSource | ModelSpec, adapter: dict[str, object] | None = None,
                   quantization: dict[str, object] | None = None) -> str:
    """A short hash of what a model's memory depends on, cheap for a reference.

    A bundled name, a config.json or a model directory hashes its config file
    (no torch import); a hub id is its name; a module hashes its parameter shapes,
    dtypes, trainability and quantization (``autofit.probe.model.fingerprint``).
    ``adapter``: the PEFT config put on a reference (``autofit.probe.peft.config_dict``),
    ``quantization``: how its base is quantized (``QuantSpec.to_dict``), hashed too.
    """
    if quantization:
        from autofit.probe.quant import QuantSpec

        key = QuantSpec.read(quantization).key  # the same spec however it was written
        blob = json.dumps([model_identity(model, adapter), key], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
    if adapter:
        blob = json.dumps([model_identity(model), adapter], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
    if isinstance(model, (str, os.PathLike)):
        from autofit.probe.loading import _bundled_path

        ref = os.fspath(model)
        p = Path(ref).expanduser()
        if p.is_dir() and (p / "config.json").is_file():
            digest = _file_hash(p / "config.json")
        elif p.is_file():
            digest = _file_hash(p)
        else:
            bundled = _bundled_path(ref)
            digest = _file_hash(bundled) if bundled is not None else "hub"
        blob = json.dumps({"ref": ref, "config": digest})
    else:
        from autofit.probe.loading import module_task
        from autofit.probe.model import describe, fingerprint

        info = describe(model, task=module_task(model))
        blob = json.dumps(fingerprint(info), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_key(
    model_id: str,
    task: str | None,
    config: TrainConfig,
    seq_len: int,
    device: DeviceInfo,
    versions: dict[str, str],
    extra: dict[str, object] | None = None,
) -> str:
    """The key of one exact check (see the module docstring)."""
    from autofit.search import cache_key

    return cache_key({
        "kind": "preflight",
        "model": model_id,
        "task": task,
        "config": config.replace(seq_len=seq_len).to_dict(),
        "device": [device.name, device.product, device.total_bytes],
        "versions": versions,
        "extra": extra or {},
    })


def reusable(trial: Any, device: DeviceInfo) -> bool:
    """Whether a recorded trial answers for ``device`` as it is now."""
    if trial is None:
        return False
    if trial.oom:
        cap = trial.capacity_bytes
        return cap is not None and device.capacity_bytes <= cap
    return trial.error is None and trial.device_total_bytes is not None


def _same_config(recorded: dict[str, object], config: TrainConfig, seq_len: int) -> bool:
    want = config.replace(seq_len=seq_len).to_dict()
    return all(recorded.get(k) == v for k, v in want.items())


class _NotOpened(Exception):
    """``open_storage`` gave None (it warned): not cached, the next cache tries again."""


@cache
def _opened_storage(url: str) -> BaseStorage:
    """The optuna storage at ``url``, opened once per process (opening checks the schema)."""
    from autofit.search.storage import open_storage

    opened = open_storage(url)  # None: warned already
    if opened is None:
        raise _NotOpened(url)
    return opened


class CheckCache:
    """Check entries (and tuning trials) in the optuna storage.

    With the default SQLite storage every entry is also written as
    ``<cache dir>/checks/<key>.json``, read first: opening the optuna storage
    (sqlalchemy + alembic imports, schema check) takes about a second, more than a
    cache hit may; the study stays the record.

    A fault of the cache (a corrupt ``studies.db``, a read-only folder, a garbage
    entry; see ``autofit.search.storage``) is one warning line: the check goes on
    without the cache (a lookup misses, a store does nothing).
    """

    def __init__(self, storage: str | None = None) -> None:
        from autofit.search.storage import default_storage, sqlite_path

        self.url = storage or default_storage()
        self._storage: Any = None
        path = sqlite_path(self.url)
        self.index = path.parent / "checks" if path is not None else None
        from autofit.search.storage import FaultGuard

        # the first cache fault: one warning, then on without the cache
        where = self.index.parent if self.index is not None else self.url
        self._guarded = FaultGuard(f"autofit check cache {where}")

    @property
    def storage(self) -> Any:
        if self._storage is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            try:
                self._storage = _opened_storage(self.url)
            except _NotOpened:
                self._guarded.broken = True
                return None
        return self._storage

    def _load(self, name: str) -> Any:
        import optuna

        storage = self.storage
        if storage is None:
            return None
        try:
            return optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            return None

    def lookup(self, key: str) -> dict[str, Any] | None:
        """The entry of ``key`` with its ``trial`` as a ``TrialResult``, or None."""
        return self._guarded(None, self._lookup, key)

    def _lookup(self, key: str) -> dict[str, Any] | None:
        raw = None
        side = self.index / f"{key}.json" if self.index is not None else None
        if side is not None and side.is_file():
            raw = side.read_text()
            if not _entry(raw):  # garbage (a torn copy): the study is the record
                raw = None
        if raw is None:
            study = self._load(f"autofit-check-{key}")
            if study is not None:
                raw = study.user_attrs.get("entry")
                if raw and side is not None:
                    self._write_index(key, raw)
        entry = _entry(raw) if raw else None
        if entry is None:
            return None
        entry["trial"] = trial_from_dict(entry["trial"]) if entry.get("trial") else None
        return entry

    def store(self, key: str, entry: dict[str, object]) -> None:
        """Record ``entry`` (trial as a ``TrialResult``, estimates as dicts) under ``key``."""
        self._guarded(None, self._store, key, entry)

    def _store(self, key: str, entry: dict[str, object]) -> None:
        import optuna

        data = dict(entry)
        if data.get("trial") is not None and hasattr(data["trial"], "to_dict"):
            data["trial"] = data["trial"].to_dict()
        raw = json.dumps(data, default=str)
        storage = self.storage
        if storage is None:
            return
        study = optuna.create_study(study_name=f"autofit-check-{key}", storage=storage,
                                    load_if_exists=True)
        study.set_user_attr("entry", raw)
        if self.index is not None:
            self._write_index(key, raw)

    def _write_index(self, key: str, raw: str) -> None:
        assert self.index is not None
        self.index.mkdir(parents=True, exist_ok=True)
        tmp = self.index / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(raw)
        tmp.replace(self.index / f"{key}.json")  # atomic: a reader sees all or nothing

    def lookup_tune(self, tune_key: str, config: TrainConfig, seq_len: int, device: DeviceInfo
                    ) -> Any:
        """A tuning trial of exactly ``config`` on ``device`` in study ``autofit-<tune_key>``."""
        return self._guarded(None, self._lookup_tune, tune_key, config, seq_len, device)

    def _lookup_tune(self, tune_key: str, config: TrainConfig, seq_len: int, device: DeviceInfo
                     ) -> Any:
        import optuna

        study = self._load(f"autofit-{tune_key}")
        if study is None:
            return None
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            d = t.user_attrs.get("trial")
            if not d or d.get("device") != device.name:
                continue
            if _same_config(d.get("config") or {}, config, seq_len):
                trial = trial_from_dict(d)
                if reusable(trial, device):
                    return trial
        return None


def _entry(raw: str) -> dict[str, Any] | None:
    """A stored entry, or None when the text is not one (a torn or edited file)."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None
