"""The optuna study behind a search: trial log, resume and cache.

One study per cache key (model, data shape, device, library versions, the
space: every knob's values). Every trial the engine runs is told to the study with its measured
numbers as user attributes; an out-of-memory trial is COMPLETE with a positive
constraint value (optuna's constraint convention: feasible when <= 0), so a
constrained sampler learns from it instead of ignoring it. With SQLite storage:

* resume: a trial whose parameters already have a COMPLETE record is not run
  again (``lookup``);
* cache: the final answer is stored as the study's ``result`` user attribute, and
  a repeated search with the same key returns it with no trials.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from autofit.config import TrainConfig
from autofit.search.space import SearchSpace
from autofit.trial.result import trial_from_dict

__all__ = ["TrialRecorder", "default_storage", "cache_key"]


def default_storage() -> str:
    """``sqlite:///<cache dir>/studies.db``; the dir is $AUTOFIT_CACHE_DIR or ~/.cache/autofit."""
    root = Path(os.environ.get("AUTOFIT_CACHE_DIR", Path.home() / ".cache" / "autofit"))
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'studies.db'}"


def _params(config: TrainConfig, knobs: tuple[str, ...]) -> dict[str, Any]:
    """The study's parameters of a configuration: each searched knob, and the micro batch."""
    return {**{n: getattr(config, n) for n in knobs}, "micro_batch_size": config.micro_batch_size}


def _constraint(trial: Any) -> list[float]:
    return [float(trial.user_attrs.get("constraint", 0.0))]


class TrialRecorder:
    """Records trials in an optuna study; looks them up for resume; holds the cached answer."""

    def __init__(
        self,
        key: str,
        *,
        storage: str | None,
        space: SearchSpace,
        capacity_bytes: int,
    ) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.capacity = capacity_bytes
        self.study = optuna.create_study(
            study_name=f"autofit-{key}",
            storage=storage,
            direction="maximize",
            sampler=optuna.samplers.TPESampler(seed=0, constraints_func=_constraint),
            load_if_exists=True,
        )
        D = optuna.distributions
        self.knobs = tuple(space.choices)
        self.distributions = {
            **{n: D.CategoricalDistribution(list(v)) for n, v in space.choices.items()},
            "micro_batch_size": D.IntDistribution(1, max(1, space.micro_batches[-1])),
        }

    # -- cache -------------------------------------------------------------------
    def cached_result(self) -> dict[str, Any] | None:
        raw = self.study.user_attrs.get("result")
        return json.loads(raw) if raw else None

    def store_result(self, result: dict[str, Any]) -> None:
        self.study.set_user_attr("result", json.dumps(result, default=str))

    # -- trials ------------------------------------------------------------------
    def lookup(self, config: TrainConfig) -> Any:
        """The TrialResult already recorded for these parameters, or None."""
        import optuna

        want = _params(config, self.knobs)
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if t.params == want and "trial" in t.user_attrs:
                return trial_from_dict(t.user_attrs["trial"])
        return None

    def record(self, config: TrainConfig, result: Any, estimate_bytes: int, budget: int) -> None:
        """Tell the study one trial: value = measured tokens/s, constraint = total - budget."""
        self.study.enqueue_trial(_params(config, self.knobs), skip_if_exists=False)
        trial = self.study.ask(self.distributions)
        total = result.device_total_bytes
        if result.oom or total is None:
            violation = float(self.capacity - budget + 1)  # needed more than the capacity
        else:
            violation = float(total - budget)
        trial.set_user_attr("constraint", violation)
        trial.set_user_attr("estimate_bytes", int(estimate_bytes))
        trial.set_user_attr("trial", result.to_dict())
        self.study.tell(trial, float(result.tokens_per_s or 0.0))

    def all_trials(self) -> list[Any]:
        import optuna

        return [
            trial_from_dict(t.user_attrs["trial"])
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if "trial" in t.user_attrs
        ]


def cache_key(parts: dict[str, Any]) -> str:
    """A stable short hash of what determines a search's answer."""
    import hashlib
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
