"""Several processes: what each rank holds, and the analytic estimate of every rank.

``_layout``: how the ranks run (`Layout`: DDP, FSDP2, HSDP, DeepSpeed ZeRO) and the shares
and buffers each strategy gives a rank, with where each number comes from (its docstring
states the rules; the simulate method's ``_dist`` and ``_zero`` use the same sizes);
``_per_rank``: the analytic per-rank estimate built on the single-rank closed form;
``_ranked``: `estimate_analytic`, the one entry point for one rank or several.

    >>> from autofit.memory.ranks import Layout, estimate_analytic
"""

from autofit.memory.ranks._layout import (
    DDP_FIRST_BUCKET_BYTES,
    ZERO_STAGE,
    Layout,
    Unit,
    ZeroSizes,
    activation_config,
    ddp_bucket_sizes,
    fsdp_local_numel,
    fsdp_shard_numel,
    fsdp_units_of_info,
    single_rank_config,
    zero3_kept_numel,
    zero3_partition_numel,
    zero_flat_numel,
)
from autofit.memory.ranks._per_rank import FSDP_MIXED_NOTE, combine_ranks, estimate_ranks_analytic
from autofit.memory.ranks._ranked import estimate_analytic

__all__ = [
    "estimate_analytic", "estimate_ranks_analytic", "combine_ranks", "FSDP_MIXED_NOTE",
    "Layout", "ZeroSizes", "Unit", "ZERO_STAGE", "DDP_FIRST_BUCKET_BYTES",
    "fsdp_shard_numel", "fsdp_local_numel", "fsdp_units_of_info", "ddp_bucket_sizes",
    "zero_flat_numel", "zero3_partition_numel", "zero3_kept_numel",
    "single_rank_config", "activation_config",
]
