"""The analytic estimate of a configuration, one rank or several.

``autofit.memory.analytic`` holds one rank's closed form (a full replica of the model);
``autofit.memory.ranks._per_rank`` builds every rank's estimate of a several-process strategy on
its terms. This is the one entry point callers use, so that neither knows the other's
caller.

    >>> from autofit import TrainConfig
    >>> from autofit.probe.device import resolve_device
    >>> from autofit.probe.model import probe_model
    >>> info, h100 = probe_model("tiny-llama"), resolve_device("H100-80GB")
    >>> one = estimate_analytic(info, TrainConfig(micro_batch_size=2), 512, h100)
    >>> four = estimate_analytic(info, TrainConfig(micro_batch_size=2, nproc_per_node=4,
    ...                                            strategy="zero3"), 512, h100)
    >>> len(four.per_rank), four.breakdown["optimizer_states"] < one.breakdown["optimizer_states"]
    (4, True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.memory.analytic._closed_form import estimate_analytic as _one_rank
from autofit.memory.ranks._layout import Layout
from autofit.memory.ranks._per_rank import estimate_ranks_analytic

if TYPE_CHECKING:  # pragma: no cover
    from autofit.config import TrainConfig
    from autofit.memory.breakdown import MemoryEstimate
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo

__all__ = ["estimate_analytic"]


def estimate_analytic(info: ModelInfo, config: TrainConfig, seq_len: int,
                      device: DeviceInfo, layout_fields: dict[str, object] | None = None
                      ) -> MemoryEstimate:
    """One training step's memory in closed form: the rank that peaks (with ``per_rank``)
    when ``config`` has several processes, else the one device's. ``layout_fields``: how
    the ranks run beyond the config (``Layout`` fields: a user's recipe)."""
    from autofit.knobs.compile import check_compile_mode

    check_compile_mode(config, device)  # CUDA graphs' pool: refused, never estimated low
    if config.world_size > 1:
        layout = Layout.of(config, **layout_fields) if layout_fields else None
        return estimate_ranks_analytic(info, config, seq_len, device, layout)
    return _one_rank(info, config, seq_len, device)
