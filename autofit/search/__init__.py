"""The search: the space of candidates, the engine that estimates, ranks and confirms them,
the throughput model, the optuna study behind it, and the "nothing fits" suggestions."""

from autofit.search.engine import (
    DEFAULT_MARGIN,
    ENGINE_VERSION,
    Candidate,
    Engine,
    SearchOutcome,
    SearchSpace,
    build_space,
    cache_key,
    micro_batch_options,
)

__all__ = ["DEFAULT_MARGIN", "ENGINE_VERSION", "Candidate", "Engine", "SearchOutcome",
           "SearchSpace", "build_space", "cache_key", "micro_batch_options"]
