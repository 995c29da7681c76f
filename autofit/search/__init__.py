"""The search: the space of candidates (``space``), the engine that estimates, ranks and
confirms them (``engine``), the throughput model (``speed``), the optuna study behind it
(``study``), and the "nothing fits" suggestions (``suggest``)."""

from autofit.search.engine import DEFAULT_MARGIN, ENGINE_VERSION, Candidate, Engine, SearchOutcome
from autofit.search.space import SearchSpace, build_space, micro_batch_options
from autofit.search.study import cache_key

__all__ = ["DEFAULT_MARGIN", "ENGINE_VERSION", "Candidate", "Engine", "SearchOutcome",
           "SearchSpace", "build_space", "cache_key", "micro_batch_options"]
