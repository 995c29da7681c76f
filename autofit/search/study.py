"""The optuna study behind a search: trial log, resume, cache, and runs that share it.

One study per cache key (``cache_key``): the model, the data the trials are fed
(a content hash of the worst-case rows, ``batch_digest``, and the collator,
``collator_identity``), the device, library versions and the space (every knob's
values). Every trial the engine runs is told to the study with its measured
numbers as user attributes; an out-of-memory trial is COMPLETE with a positive
constraint value (optuna's constraint convention: feasible when <= 0), so a
constrained sampler learns from it instead of ignoring it. A trial that failed
otherwise (a crash, an ``IndexError``, a timeout, a killed process: ``is_failed``)
is told as FAIL: it says nothing about memory, so it is never reused and never
makes a cached answer; the next run runs it again. With SQLite storage:

* resume: a trial whose parameters already have a COMPLETE record is not run
  again (``reserve`` / ``lookup``);
* cache: the final answer is stored as the study's ``result`` user attribute, and
  a repeated search with the same key returns it with no trials;
* sharing: runs on one cache at once see each other's trials. Before running a
  trial a run claims it (a RUNNING trial naming its host and process); a run that
  wants the same parameters waits for the claim's result instead of measuring them
  again. The earliest claim wins a tie; a claim whose process is gone (or older
  than ``claim_ttl_s``) is void.

A fault of the storage (a corrupt file, a read-only folder, see
``autofit.search.storage``) is one warning line; the run goes on without the cache.

    >>> from autofit.search.study import cache_key
    >>> len(cache_key({"model": "tiny-gpt2", "batch": "0123abcd"}))
    16
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.search.space import SearchSpace
from autofit.search.storage import (
    FaultGuard,
    cache_warning,
    connect,
    default_storage,
    error_line,
    is_cache_fault,
    open_storage,
    sqlite_path,
)
from autofit.trial.result import trial_from_dict

if TYPE_CHECKING:
    from autofit.config import Collator
    from autofit.trial.result import TrialResult

__all__ = ["TrialRecorder", "open_recorder", "default_storage", "cache_key", "is_failed",
           "batch_digest", "collator_identity"]

CLAIM_POLL_S = 0.5  # how often a run waiting for another run's trial looks at the study


def is_failed(result: TrialResult) -> bool:
    """A trial that failed without running out of memory (crash, timeout, killed): no answer."""
    return not result.oom and (result.error is not None or result.device_total_bytes is None)


def _params(config: TrainConfig, knobs: tuple[str, ...]) -> dict[str, Any]:
    """The study's parameters of a configuration: each searched knob, and the micro batch."""
    return {**{n: getattr(config, n) for n in knobs}, "micro_batch_size": config.micro_batch_size}


def _constraint(trial: Any) -> list[float]:
    return [float(trial.user_attrs.get("constraint", 0.0))]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


class TrialRecorder:
    """Records trials in an optuna study; shares and resumes them; holds the cached answer.

    Args:
        key: the cache key (``cache_key``) of the question.
        storage: a storage URL (``default_storage()``), an optuna storage, or None
            (in memory: nothing outlives the process).
        space: the search space (each knob's values, the micro batches).
        capacity_bytes: what the device offers (an OOM's constraint is above it).
        claim_ttl_s: after this long another run's claim of a trial is void (a hung
            or vanished run); the trial timeout plus a margin.

    Raises:
        Whatever opening the storage raises; ``open_recorder`` turns a cache fault
        into a warning and None instead.
    """

    def __init__(
        self,
        key: str,
        *,
        storage: Any,
        space: SearchSpace,
        capacity_bytes: int,
        claim_ttl_s: float = 900.0,
    ) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.capacity = capacity_bytes
        self.claim_ttl_s = claim_ttl_s
        if storage is None:
            storage = optuna.storages.InMemoryStorage()
        elif isinstance(storage, str):
            storage = connect(storage)
        url = getattr(storage, "url", None)
        self.where = str(sqlite_path(url) or url) if url else "(in memory)"
        self.storage = storage
        self.study = optuna.create_study(
            study_name=f"autofit-{key}",
            storage=storage,
            direction="maximize",
            sampler=optuna.samplers.TPESampler(seed=0, constraints_func=_constraint),
            load_if_exists=True,
        )
        self._study_id = storage.get_study_id_from_name(self.study.study_name)
        D = optuna.distributions
        self.knobs = tuple(space.choices)
        self.distributions = {
            **{n: D.CategoricalDistribution(list(v)) for n, v in space.choices.items()},
            "micro_batch_size": D.IntDistribution(1, max(1, space.micro_batches[-1])),
        }
        self._held: dict[int, int] = {}  # number -> trial id of this run's open claims
        # the first cache fault: one warning, then on without the cache
        self._guarded = FaultGuard(f"autofit cache {self.where}")

    # -- cache ---------------------------------------------------------------------------
    def cached_result(self) -> dict[str, Any] | None:
        """The answer a finished run stored under this key, or None."""
        raw = self._guarded(None, lambda: self.study.user_attrs.get("result"))
        return json.loads(raw) if raw else None

    def store_result(self, result: dict[str, object]) -> None:
        """Store the answer: the next run with this key returns it with no trial."""
        self._guarded(None, self.study.set_user_attr, "result", json.dumps(result, default=str))

    # -- trials --------------------------------------------------------------------------
    def _same(self, want: dict[str, object]) -> list[Any]:
        import optuna

        S = optuna.trial.TrialState
        return [t for t in self.study.get_trials(deepcopy=False, states=(S.COMPLETE, S.RUNNING))
                if t.params == want]

    def lookup(self, config: TrainConfig) -> Any:
        """The TrialResult already recorded for these parameters (a COMPLETE one), or None."""
        import optuna

        def find() -> Any:
            for t in self._same(_params(config, self.knobs)):
                if t.state == optuna.trial.TrialState.COMPLETE and "trial" in t.user_attrs:
                    return trial_from_dict(t.user_attrs["trial"])
            return None

        return self._guarded(None, find)

    def reserve(self, config: TrainConfig,
                on_wait: Callable[[], None] | None = None) -> tuple[Any, int | None]:
        """The recorded result of ``config``, or this run's claim to measure it.

        Returns ``(TrialResult, None)`` when the study has one (this or another run
        measured it: resume, sharing), ``(None, claim)`` when this run is to run the
        trial and ``record`` it with ``claim``. While another live run holds the claim
        of these parameters, waits for its result (``on_wait`` is called once).
        ``(None, None)``: the cache is off (a fault): run the trial, recording is a no-op.
        """
        return self._guarded((None, None), self._reserve, config, on_wait)

    def _reserve(self, config: TrainConfig,
                 on_wait: Callable[[], None] | None) -> tuple[Any, int | None]:
        import optuna

        want = _params(config, self.knobs)
        mine: int | None = None
        waited = False
        while True:
            trials = self._same(want)
            done = [t for t in trials
                    if t.state == optuna.trial.TrialState.COMPLETE and "trial" in t.user_attrs]
            if done:
                if mine is not None:  # another run finished it meanwhile
                    self._finish(mine, None, optuna.trial.TrialState.FAIL, {"yielded": True})
                return trial_from_dict(done[0].user_attrs["trial"]), None
            claims = sorted(t.number for t in trials
                            if t.state == optuna.trial.TrialState.RUNNING
                            and (t.number == mine or self._live(t)))
            if mine is None and not claims:
                mine = self._claim(want)  # then look again: did another run claim it too?
                continue
            if mine is not None and claims and claims[0] == mine:
                return None, mine
            if mine is not None:  # an earlier claim of another run wins
                self._finish(mine, None, optuna.trial.TrialState.FAIL, {"yielded": True})
                mine = None
            if not waited and on_wait is not None:
                on_wait()
            waited = True
            time.sleep(CLAIM_POLL_S)

    def _live(self, t: object) -> bool:
        """Whether another run still holds claim ``t`` (a void one is marked FAIL)."""
        if t.number in self._held:
            return True
        c = t.user_attrs.get("claim") or {}
        live = bool(c) and time.time() - float(c.get("at", 0)) <= self.claim_ttl_s
        if live and c.get("host") == socket.gethostname():
            # this process holds no other claim; another process on this host must be alive
            live = c.get("pid") != os.getpid() and _pid_alive(int(c.get("pid", 0)))
        if not live:
            self._void(t)
        return live

    def _void(self, t: object) -> None:
        import optuna

        # another run may void it first
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError, ValueError):
            self.study.tell(t.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)

    def _claim(self, want: dict[str, object]) -> int:
        import optuna

        template = optuna.trial.create_trial(
            state=optuna.trial.TrialState.RUNNING, params=want, distributions=self.distributions,
            user_attrs={"claim": {"host": socket.gethostname(), "pid": os.getpid(),
                                  "at": time.time()}})
        trial_id = self.storage.create_new_trial(self._study_id, template_trial=template)
        number = self.storage.get_trial_number_from_id(trial_id)
        self._held[number] = trial_id
        return number

    def _finish(self, number: int, value: float | None, state: Any,
                attrs: dict[str, object]) -> None:
        trial_id = self._held.pop(number)
        for k, v in attrs.items():
            self.storage.set_trial_user_attr(trial_id, k, v)
        self.study.tell(number, value, state=state, skip_if_finished=True)

    def record(self, config: TrainConfig, result: TrialResult, estimate_bytes: int, budget: int,
               claim: int | None = None) -> None:
        """Tell the study one trial: value = measured tokens/s, constraint = total - budget.

        ``claim``: from ``reserve`` (None: claimed here). A failed trial (``is_failed``)
        is told as FAIL: it is not reused, and the next run measures it again.
        """
        self._guarded(None, self._record, config, result, estimate_bytes, budget, claim)

    def _record(self, config: TrainConfig, result: TrialResult, estimate_bytes: int, budget: int,
                claim: int | None) -> None:
        import optuna

        if claim is None or claim not in self._held:
            claim = self._claim(_params(config, self.knobs))
        total = result.device_total_bytes
        if result.oom or total is None:
            violation = float(self.capacity - budget + 1)  # needed more than the capacity
        else:
            violation = float(total - budget)
        attrs = {"constraint": violation, "estimate_bytes": int(estimate_bytes),
                 "trial": result.to_dict()}
        if is_failed(result):
            self._finish(claim, None, optuna.trial.TrialState.FAIL, attrs)
        else:
            self._finish(claim, float(result.tokens_per_s or 0.0),
                         optuna.trial.TrialState.COMPLETE, attrs)

    def release(self, claim: int | None) -> None:
        """Give up a claim whose trial did not end (interrupted): FAIL, run again next time."""
        import optuna

        if claim is not None and claim in self._held:
            self._guarded(None, self._finish, claim, None, optuna.trial.TrialState.FAIL,
                          {"interrupted": True})

    def all_trials(self) -> list[Any]:
        """Every COMPLETE trial's TrialResult (failed ones are not answers)."""
        import optuna

        def read() -> list[Any]:
            return [trial_from_dict(t.user_attrs["trial"])
                    for t in self.study.get_trials(
                        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                    if "trial" in t.user_attrs]

        return self._guarded([], read)


def open_recorder(key: str, *, storage: str | None, space: SearchSpace, capacity_bytes: int,
                  claim_ttl_s: float = 900.0) -> TrialRecorder | None:
    """A ``TrialRecorder`` on ``storage`` (a URL; None: ``default_storage()``), or None
    after one warning line when the cache cannot be used (``autofit.search.storage``)."""
    url = storage or default_storage()
    opened = open_storage(url)
    if opened is None:
        return None
    try:
        return TrialRecorder(key, storage=opened, space=space, capacity_bytes=capacity_bytes,
                             claim_ttl_s=claim_ttl_s)
    except Exception as e:
        if not is_cache_fault(e):
            raise
        where = sqlite_path(url) or url
        cache_warning(f"autofit cache {where} cannot be used ({error_line(e)}); running without "
                      "the cache")
        return None


def batch_digest(batch: dict[str, object]) -> str:
    """A short hash of a batch's content: every tensor's name, dtype, shape and values."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(batch):
        v = batch[name]
        h.update(name.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())
    return h.hexdigest()[:16]


def _plain(v: object) -> Any:
    """A setting as plain data: scalars as they are; a tokenizer by its name and vocabulary
    size; anything else by its type (not hashed deeper)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (bool, int, float, str))
                                            for x in v):
        return list(v)
    if hasattr(v, "name_or_path") and hasattr(v, "__len__"):
        return {"tokenizer": type(v).__qualname__, "name": str(v.name_or_path), "size": len(v)}
    return {"type": f"{type(v).__module__}.{type(v).__qualname__}"}


def collator_identity(collator: Collator | None) -> dict[str, Any] | None:
    """What of a collator goes into the cache key: its type and, where cheap, its settings.

    A dataclass collator (transformers' ``DataCollator*``) gives its fields; a
    ``functools.partial`` its function and arguments; any other object its plain
    attributes; a function its qualified name only (NB: its code is not hashed: a
    changed function under the same name answers from the cache; pass ``cache=False``).
    """
    import dataclasses
    import functools

    if collator is None:
        return None
    if isinstance(collator, functools.partial):
        return {"partial": collator_identity(collator.func),
                "args": [_plain(a) for a in collator.args],
                "kwargs": {k: _plain(v) for k, v in sorted(collator.keywords.items())}}
    kind = type(collator)
    if dataclasses.is_dataclass(collator):
        return {"type": f"{kind.__module__}.{kind.__qualname__}",
                "settings": {f.name: _plain(getattr(collator, f.name, None))
                             for f in dataclasses.fields(collator)}}
    if hasattr(collator, "__code__") or not hasattr(collator, "__dict__"):
        name = getattr(collator, "__qualname__", kind.__qualname__)
        return {"callable": f"{getattr(collator, '__module__', '?')}.{name}",
                "note": "identified by its qualified name only, not hashed deeper"}
    return {"type": f"{kind.__module__}.{kind.__qualname__}",
            "settings": {k: _plain(v) for k, v in sorted(vars(collator).items())
                         if not k.startswith("_")}}


def cache_key(parts: dict[str, object]) -> str:
    """A stable short hash of what determines a search's answer."""
    import hashlib
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
