"""Per-rank memory of several processes: the rules both estimators share.

With ``world_size > 1`` every rank holds its own share of the model state and the
buffers its strategy allocates. This module states those shares, where each number
comes from (torch 2.13, DeepSpeed 0.19.8, transformers 5.x, accelerate 1.15 source), and
builds the analytic per-rank estimate from the single-rank closed form
(``autofit.memory.analytic.analytic_phases``). The simulate method traces FSDP2 and DDP
themselves (``simulate._dist``) and transforms the single-rank step for ZeRO (``simulate._zero``);
both use the sizes below.

    >>> from autofit.config import TrainConfig
    >>> layout = Layout.of(TrainConfig(nproc_per_node=4, nnodes=2, strategy="hsdp"))
    >>> layout.world_size, layout.shard_ranks, layout.replicas
    (8, 4, 2)
    >>> fsdp_shard_numel((10, 3), 4)   # dim 0 padded to 4 x 3 rows: 3 rows of 3 per rank
    9
    >>> [fsdp_local_numel((10, 3), 4, r) for r in range(4)]
    [9, 9, 9, 3]

The rules (N: ranks that shard a tensor; P: parameters; bytes per element as the
precision holds them):

* **DDP** (``torch.nn.parallel.DistributedDataParallel``): a full replica of P, grads and
  optimizer states per rank, plus the Reducer's gradient buckets: one flat
  ``at::empty`` per bucket (``Reducer::initialize_buckets``), together the size of every
  trainable gradient, allocated when the model is wrapped and kept. Buckets are filled
  by ``dist._compute_bucket_assignment_by_size`` in reverse parameter order, the first
  capped at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) when ``bucket_cap_mb`` is left
  at its default, the others at ``bucket_cap_mb`` (25). With
  ``gradient_as_bucket_view=False`` (torch's, accelerate's and the Trainer's default)
  the buckets are a second copy of the gradients; with True the ``.grad`` tensors are
  views into them (no second copy, but alive for the whole run). Every rank is alike.
* **FSDP2** (``torch.distributed.fsdp.fully_shard``): each parameter is chunked on dim 0
  (``_chunk_with_empty``); every rank stores ``ceil(rows / N)`` rows, the last ranks'
  chunks padded (``FSDPParam._init_sharded_param``: ``padded_sharded_param_size =
  chunks[0].size()``), so sharded parameters and the reduce-scattered gradients (views
  into a padded output) are equal on every rank; optimizer states follow the unpadded
  local shard (``zeros_like`` of the DTensor's local tensor), so the first ranks hold
  the most and rank 0 peaks. A unit's forward and backward all-gather its parameters
  into padded unsharded buffers (``init_all_gather_outputs``: ``N x`` the padded shard,
  in ``MixedPrecisionPolicy.param_dtype``) through a flat all-gather output of the
  same size (freed after ``foreach_all_gather_copy_out``); after its backward the
  unsharded gradients are copied into a reduce-scatter input (``N x`` padded shard in
  ``reduce_dtype``) and reduced into a padded shard. ``reshard_after_forward=False``
  keeps every unit's unsharded parameters from its forward to its backward. CPU offload
  (``CPUOffloadPolicy``) keeps sharded parameters, gradients and optimizer states on the
  host (pinned parameters and gradients) and runs the optimizer there.
  Units: what the Trainer runs (accelerate 1.15 ``fsdp2_prepare_model``): one unit per
  ``_no_split_modules`` block, the input embedding alone (untied), the final norm and
  output head together with ``reshard_after_forward=False``, the root with torch's
  default for a root (kept after forward); bf16-mixed is
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` under autocast, the
  trainable parameters upcast to fp32 first. The plain torch recipe
  (``fsdp_recipe="torch"``): blocks + the root (the rest), ``MixedPrecisionPolicy(bf16,
  reduce_dtype=fp32)``, no autocast.
* **HSDP**: FSDP2 sharded over a node's ``nproc_per_node`` ranks and replicated over
  ``nnodes`` (the replicas' all-reduce runs in place on the reduce-scatter output).
* **DeepSpeed ZeRO-1/2** (``stage_1_and_2.py``): the trainable parameters of each
  optimizer group are flattened into one buffer in the module's dtype (bf16 when
  DeepSpeed's bf16 is on: the module is cast, no autocast), aligned to ``2 x N``
  elements (``nccl_start_alignment_factor``), and partitioned equally; every rank keeps
  an fp32 copy of its partition (``single_partition_of_fp32_groups``: a clone even in
  fp32) and the optimizer's states for it. With ``overlap_comm`` (emitted) or at
  stage 2, a hook copies each gradient into an IPG bucket as autograd makes it
  (``reduce_bucket_size`` elements, ``setup_buckets``; two with ``overlap_comm``) and
  the parameter's ``.grad`` becomes a view of it (the gradient's own storage is freed;
  one larger than the bucket waits for its own reduction); a reduced bucket's share of
  this rank's partition is copied into ``grads_in_partition`` (the partition in the
  module's dtype); at the end of backward the partition is flattened
  (``averaged_gradients``) and the bucket(s) and ``grads_in_partition`` released.
  ZeRO-1 without ``overlap_comm`` keeps the full gradients until the end of backward. The step makes an fp32 copy of the gradient partition
  (``flat_grad_partition.to(fp32)``; none when it already is fp32), runs the optimizer
  over the flat partition and all-gathers the partitions back into the flat buffer.
* **DeepSpeed ZeRO-3** (``stage3.py``, ``partition_parameters.py``,
  ``partitioned_param_coordinator.py``): every parameter is partitioned,
  ``ceil(numel / N)`` elements per rank (``_aligned_size``), into flat buffers;
  parameters of at most ``stage3_param_persistence_threshold`` elements stay whole on
  every rank once gathered. A module's parameters are all-gathered (full size, module
  dtype) at its forward; once the first step has traced the order, a parameter is
  released only if it is not used again within ``stage3_max_reuse_distance`` elements
  of the modules traced after it (``__params_to_release``): a parameter ``x`` elements
  before the end of the forward is used again in backward after ``~2x`` elements, so the
  last ``max_reuse_distance / 2`` elements of the forward (1e9 / 2, what autofit emits
  and DeepSpeed's default) stay gathered from their forward until their backward
  (``zero3_kept_numel``) — on a model below 5e8 parameters, the whole model is on each
  rank at the start of backward, as with FSDP2 without resharding (measured: ZeRO-3 fp32
  644 MiB against ZeRO-1's 518 on the benchmark llama); a 7B model keeps 5e8 elements. Kept from
  ``deepspeed.initialize``: an fp32 copy of the partition (a clone, in fp32 too:
  measured 3 partitions resident), the IPG bucket (``reduce_bucket_size``) and the
  gradient partition buffer (``grad_partitions_flat_buffer``, in
  ``gradient_accumulation_dtype``, which is the module's dtype unless configured:
  ``engine.get_data_types``); the optimizer's states appear at the first step.
* ZeRO sizes: what the Trainer emits is ``"auto"``, which transformers fills from the
  model (``HfTrainerDeepSpeedConfig``): ``reduce_bucket_size = hidden^2``,
  ``stage3_prefetch_bucket_size = 0.9 hidden^2``, ``stage3_param_persistence_threshold =
  10 hidden``; DeepSpeed's own defaults (``zero/config.py``, ``zero_sizes="deepspeed"``) are 5e8,
  5e7 and 1e5. Offload (``offload_optimizer`` / ``offload_param``, ``pin_memory``): the
  fp32 partition, its states and fp32 gradients (and with ``offload_param`` the
  parameter partitions) live in pinned host memory (torch's host caching allocator
  rounds each to a power of two); every node holds its ``nproc_per_node`` ranks' share.

Rank differences: FSDP2's optimizer states (the last ranks' chunks are shorter), and
ZeRO's last partition's padding (same size); the estimate reports every rank and the
one that peaks (the lowest on ties).

Known limitations:
    * NB: communication libraries' own buffers (NCCL channels, gloo's scratch) are not
      tensors and are not counted; on a GPU they sit outside PyTorch's allocator.
    * NB: a CPU target counts a buffer's pages as RSS only once written: DeepSpeed's
      ``torch.empty`` buckets and ``grads_in_partition`` count as gradients are written
      into them (measured: DeepSpeed's 5e8-element default bucket costs no more than
      the ``"auto"`` h^2 one on the CPU); a GPU holds them whole.
    * NB: on the CPU the measured peaks hold 7-17 MiB the tensors do not (MKL's and
      oneDNN's caches, as for one process; more with bf16): the estimates run 1-5 %
      low on the ~300-700 MiB benchmark ranks.
    * NB: DeepSpeed allocates its flat buffers at ``deepspeed.initialize``; the transient
      of flattening (two copies of the parameters for a moment) is before the first
      step and not estimated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.model import ModelInfo

__all__ = [
    "Layout", "ZeroSizes", "Unit", "ZERO_STAGE", "DDP_FIRST_BUCKET_BYTES",
    "fsdp_shard_numel", "fsdp_local_numel", "fsdp_units_of_info", "ddp_bucket_sizes",
    "zero_flat_numel", "zero3_partition_numel", "zero3_kept_numel",
    "single_rank_config", "activation_config",
]

ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}
DDP_FIRST_BUCKET_BYTES = 1048576  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
_DDP_BUCKET_CAP_MB = 25  # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
_NCCL_START_ALIGNMENT = 2  # stage_1_and_2.py: nccl_start_alignment_factor
_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "uint8": 1, "int8": 1}


@dataclass(frozen=True)
class ZeroSizes:
    """DeepSpeed's ZeRO sizes in elements, as ``zero/config.py`` reads them."""

    reduce_bucket_size: int
    allgather_bucket_size: int
    prefetch_bucket_size: int
    param_persistence_threshold: int
    max_live_parameters: int
    overlap_comm: bool
    contiguous_gradients: bool = True
    max_reuse_distance: int = int(1e9)  # stage3_max_reuse_distance (emitted and default)


@dataclass(frozen=True)
class Layout:
    """How the ranks of a run hold the model (``TrainConfig`` + how it is launched).

    Attributes:
        strategy, offload, nproc_per_node, nnodes: the config's fields.
        fsdp_recipe: ``"accelerate"`` — what the Trainer runs (accelerate 1.15
            ``fsdp2_prepare_model``: units, ``MixedPrecisionPolicy(bf16, bf16)`` under
            autocast); ``"torch"`` — blocks + root, ``MixedPrecisionPolicy(bf16,
            reduce_dtype=fp32)``, no autocast.
        zero_sizes: ``"auto"`` — what autofit emits as transformers resolves it
            (``reduce_bucket_size = hidden^2``, ...; ``overlap_comm`` and
            ``contiguous_gradients`` on); ``"deepspeed"`` — DeepSpeed's defaults.
        zero_optimizer: ``"torch"`` — the Trainer's torch optimizer, which ZeRO wraps (the
            emitted config has no optimizer section); ``"deepspeed"`` — DeepSpeed's own
            Adam (``{"optimizer": {"type": "AdamW"}}``: FusedAdam / DeepSpeedCPUAdam, one
            parameter group, updated in place); ``"deepspeed-torch"`` — a ``torch.optim``
            class DeepSpeed builds from its config (``{"type": "SGD"}``): one parameter
            group, torch's step and its temporaries.
        zero_overrides: ZeRO sizes a user's DeepSpeed config sets, as ``(ZeroSizes field,
            value)`` pairs over ``zero_sizes``; a value ``"auto"`` is transformers' (from
            the hidden size). Read by ``autofit.knobs.recipe``.
        bucket_cap_mb: DDP's ``bucket_cap_mb``; None: torch's default (25, first 1 MiB).
        gradient_as_bucket_view: DDP's flag (False: torch's and the Trainer's default).
    """

    strategy: str = "ddp"
    offload: str = "none"
    nproc_per_node: int = 1
    nnodes: int = 1
    fsdp_recipe: str = "accelerate"
    zero_sizes: str = "auto"
    zero_optimizer: str = "torch"
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False
    zero_overrides: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, config: TrainConfig, **overrides: object) -> Layout:
        """The layout of ``config`` (``overrides``: the launch details it does not hold)."""
        return cls(strategy=config.strategy, offload=config.offload,
                   nproc_per_node=config.nproc_per_node, nnodes=config.nnodes, **overrides)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def family(self) -> str:
        """``"single"`` (one rank), ``"ddp"``, ``"fsdp"`` (FSDP2 and HSDP) or ``"zero"``."""
        if self.world_size == 1:
            return "single"
        if self.strategy == "ddp":
            return "ddp"
        return "zero" if self.strategy in ZERO_STAGE else "fsdp"

    @property
    def shard_ranks(self) -> int:
        """Ranks a tensor is sharded over: all for FSDP / ZeRO, a node's for HSDP, 1 for DDP."""
        if self.family in ("single", "ddp"):
            return 1
        return self.nproc_per_node if self.strategy == "hsdp" else self.world_size

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_ranks

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy != "fsdp-shard-grad-op"

    @property
    def zero_stage(self) -> int:
        return ZERO_STAGE.get(self.strategy, 0)

    def zero_sizes_of(self, hidden_size: int | None) -> ZeroSizes:
        """The ZeRO sizes this recipe runs with: transformers' ``"auto"`` (from the hidden
        size, ``HfTrainerDeepSpeedConfig.trainer_config_finalize``) and what autofit
        emits (``overlap_comm`` and ``contiguous_gradients`` on), or DeepSpeed's defaults
        (``overlap_comm`` only at stage 3)."""
        own = ZeroSizes(reduce_bucket_size=int(5e8), allgather_bucket_size=int(5e8),
                        prefetch_bucket_size=int(5e7), param_persistence_threshold=int(1e5),
                        max_live_parameters=int(1e9), overlap_comm=self.zero_stage == 3)
        auto = own
        if hidden_size:
            h = int(hidden_size)
            auto = ZeroSizes(reduce_bucket_size=h * h, allgather_bucket_size=int(5e8),
                             prefetch_bucket_size=int(0.9 * h * h),
                             param_persistence_threshold=10 * h, max_live_parameters=int(1e9),
                             overlap_comm=True)
        sizes = own if self.zero_sizes == "deepspeed" else auto
        if not self.zero_overrides:
            return sizes
        # a user's config: each size as given, "auto" as transformers fills it in
        given = {k: getattr(auto, k) if v == "auto" else v for k, v in self.zero_overrides}
        return dataclasses.replace(sizes, **given)

    @property
    def zero_one_group(self) -> bool:
        """DeepSpeed builds the optimizer (one parameter group), not the Trainer."""
        return self.zero_optimizer != "torch"

    def node_of(self, rank: int) -> int:
        return rank // self.nproc_per_node

    def describe(self) -> str:
        if self.family == "single":
            return "1 rank"
        what = {"ddp": "DDP", "fsdp": "FSDP2", "fsdp-shard-grad-op": "FSDP2 (no reshard)",
                "hsdp": "HSDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
        off = f", offload {self.offload}" if self.offload != "none" else ""
        return (f"{what[self.strategy]} on {self.world_size} ranks ({self.nproc_per_node} "
                f"per node x {self.nnodes} nodes){off}")


def single_rank_config(config: TrainConfig) -> TrainConfig:
    """``config`` on one rank (the step every rank runs, before the strategy's shares)."""
    return config.replace(nproc_per_node=1, nnodes=1, world_size=1, strategy="ddp",
                          offload="none")


def activation_config(config: TrainConfig, layout: Layout) -> TrainConfig:
    """The single-rank config whose forward and backward each rank runs.

    DeepSpeed's bf16 / fp16 cast the module and run without autocast (a "-true" step);
    FSDP2's torch recipe gathers bf16 parameters without autocast (also "-true"); the
    Trainer's FSDP2 gathers them in the compute dtype under autocast (the "-mixed" step,
    whose autocast weight copies then cost nothing: the weights already are 16-bit)."""
    single = single_rank_config(config)
    spec = config.precision_spec
    if not spec.autocast:
        return single
    true = "bf16-true" if spec.compute_dtype == "bfloat16" else "16-true"
    if layout.family == "zero" or (layout.family == "fsdp" and layout.fsdp_recipe == "torch"):
        return single.replace(precision=true)
    return single


# --------------------------------------------------------------------------- FSDP2


def _rows_rest(shape: tuple[int, ...]) -> tuple[int, int]:
    if not shape:
        return 1, 1
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def fsdp_shard_numel(shape: tuple[int, ...], n: int) -> int:
    """Elements every rank stores of a parameter sharded on dim 0 over ``n`` ranks (padded:
    ``chunks[0].size()`` of ``_chunk_with_empty``)."""
    rows, rest = _rows_rest(shape)
    return -(-rows // n) * rest


def fsdp_local_numel(shape: tuple[int, ...], n: int, rank: int) -> int:
    """Elements of rank ``rank``'s unpadded chunk (what its optimizer states cover)."""
    rows, rest = _rows_rest(shape)
    chunk = -(-rows // n)
    return max(0, min(chunk, rows - rank * chunk)) * rest


@dataclass(frozen=True)
class Unit:
    """One ``fully_shard`` group: its parameters as (shape, count, trainable, dtype)."""

    name: str
    params: tuple[tuple[tuple[int, ...], int, bool, str], ...]
    reshard_after_forward: bool


def fsdp_units_of_info(info: ModelInfo, layout: Layout) -> list[Unit]:
    """FSDP2's units in forward order, from the parameter groups of ``info``.

    A group of ``c`` parameters over ``L`` blocks puts ``c // L`` in every block and the
    remaining ``c % L`` outside them (the final norm beside the blocks' norms); outside
    the blocks an ``embedding`` group is the input side, a (vocab, hidden) matrix the
    output head. NB: blocks of different shapes (an encoder and a decoder) are averaged.
    """
    L = info.num_layers or 0
    raf = layout.reshard_after_forward
    block: list[tuple[tuple[int, ...], int, bool, str]] = []
    embed, tail, rest = [], [], []
    for g in info.params:
        per, out = (g.count // L, g.count % L) if L else (0, g.count)
        if per:
            block.append((tuple(g.shape), per, g.trainable, g.dtype))
        if not out:
            continue
        item = (tuple(g.shape), out, g.trainable, g.dtype)
        if g.role == "embedding" and g.shape[0] == info.vocab_size:
            embed.append(item)
        elif info.vocab_size and tuple(g.shape) == (info.vocab_size, info.hidden_size):
            tail.append(item)  # the output head
        elif g.role == "norm":
            tail.append(item)  # the final norm
        else:
            rest.append(item)
    blocks = [Unit(f"block{i}", tuple(block), raf) for i in range(L)]
    if layout.fsdp_recipe == "torch":
        return [Unit("root", tuple(embed + rest + tail), raf), *blocks]
    units = []
    if info.tie_word_embeddings:
        tail = embed + tail  # accelerate: the tied embedding joins the tail
    elif embed:
        units.append(Unit("embed", tuple(embed), raf))
    return [Unit("root", tuple(rest), False), *units, *blocks,
            Unit("tail", tuple(tail), False)]


# --------------------------------------------------------------------------- DDP


def ddp_bucket_sizes(numels_bytes: list[tuple[int, int]], bucket_cap_mb: float | None) -> list[int]:
    """Bytes of each DDP gradient bucket for trainable parameters given as (numel, element
    bytes) in registration order: ``dist._compute_bucket_assignment_by_size`` over the
    reversed list (a tensor joins the open bucket of its dtype; the bucket closes once it
    reaches its limit), first limit 1 MiB when ``bucket_cap_mb`` is None.

        >>> [b // 2**20 for b in ddp_bucket_sizes([(2**18, 4)] * 4, None)]  # 1 MiB each
        [1, 3]
    """
    cap = int((bucket_cap_mb if bucket_cap_mb is not None else _DDP_BUCKET_CAP_MB) * 2**20)
    limits = [DDP_FIRST_BUCKET_BYTES, cap] if bucket_cap_mb is None else [cap]
    buckets: dict[int, int] = {}
    out: list[int] = []
    li: dict[int, int] = {}
    for numel, size in reversed(numels_bytes):
        b = buckets.get(size, 0) + numel * size
        limit = limits[min(li.get(size, 0), len(limits) - 1)]
        if b >= limit:
            out.append(b)
            buckets[size] = 0
            li[size] = li.get(size, 0) + 1
        else:
            buckets[size] = b
    out += [b for b in buckets.values() if b]
    return out


# --------------------------------------------------------------------------- ZeRO


def zero_flat_numel(numel: int, n: int) -> int:
    """Elements of a ZeRO-1/2 flat group: aligned to ``2 x n`` (stage_1_and_2.py)."""
    align = _NCCL_START_ALIGNMENT * n
    return -(-numel // align) * align


def zero3_kept_numel(gathered_numel: int, max_reuse_distance: int) -> int:
    """Elements of ZeRO-3's gathered parameters kept from their forward to their backward:
    those within the last ``max_reuse_distance / 2`` elements of the forward (used again
    within ``max_reuse_distance`` elements of traced modules; see the module docstring).

        >>> zero3_kept_numel(31_000_000, int(1e9)), zero3_kept_numel(7_000_000_000, int(1e9))
        (31000000, 500000000)
    """
    return min(gathered_numel, max_reuse_distance // 2)


def zero3_partition_numel(numel: int, n: int) -> int:
    """Elements of one ZeRO-3 parameter partition: ``ceil(numel / n)`` (``_aligned_size``)."""
    return -(-numel // n)
