"""The analytic estimate of every rank of a several-process strategy: the single-rank
closed form (``autofit.memory.analytic.analytic_phases``) with the model state replaced by
the rank's share and the strategy's buffers added (the rules are in
``autofit.memory.ranks._layout``'s docstring)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.memory.allocator._common import pinned_bytes
from autofit.memory.breakdown import Component, MemoryEstimate
from autofit.memory.ranks._layout import (
    _BYTES,
    Layout,
    Unit,
    _rows_rest,
    activation_config,
    fsdp_local_numel,
    fsdp_shard_numel,
    fsdp_units_of_info,
    single_rank_config,
    zero3_kept_numel,
    zero3_partition_numel,
    zero_flat_numel,
)

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterable

    from autofit.memory.analytic._closed_form import AnalyticTerms
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo, ParamGroup

__all__ = ["estimate_ranks_analytic", "combine_ranks", "FSDP_MIXED_NOTE"]


def _bytes(dtype: str) -> int:
    return _BYTES.get(dtype, 4)


def _sharded_dtype(dtype: str, trainable: bool, config: TrainConfig) -> str:
    """dtype a parameter is stored in by FSDP2 / ZeRO (mixed precision: fp32 trainable)."""
    spec = config.precision_spec
    if spec.param_dtype != "float32":
        return spec.param_dtype
    return "float32" if trainable or dtype == "float32" else dtype


def _gather_dtype(dtype: str, trainable: bool, config: TrainConfig) -> str:
    spec = config.precision_spec
    if spec.autocast:
        return spec.compute_dtype
    return _sharded_dtype(dtype, trainable, config)


def _local_info(info: ModelInfo, shapes: list[ParamGroup]) -> ModelInfo:
    return dataclasses.replace(info, params=tuple(shapes))


def _fsdp_local_groups(info: ModelInfo, n: int, rank: int) -> list[ParamGroup]:
    """``info``'s parameter groups as rank ``rank``'s unpadded FSDP2 chunks."""
    out = []
    for g in info.params:
        rows, rest = _rows_rest(tuple(g.shape))
        local = fsdp_local_numel(tuple(g.shape), n, rank) // max(rest, 1)
        shape = (local, *g.shape[1:]) if g.shape else (local,)
        out.append(dataclasses.replace(g, shape=tuple(shape)))
    return out


def _zero_groups(info: ModelInfo, config: TrainConfig, layout: Layout) -> list[int]:
    """Trainable elements of each optimizer group ZeRO flattens: the Trainer's decay and
    no-decay groups (``recipe="trainer"``; biases and norms undecayed), one group with
    DeepSpeed's own optimizer."""
    train = [g for g in info.params if g.trainable]
    if layout.zero_one_group:
        return [sum(g.numel * g.count for g in train)]
    nodecay = sum(g.numel * g.count for g in train if g.role in ("norm", "bias"))
    decay = sum(g.numel * g.count for g in train) - nodecay
    return [x for x in (decay, nodecay) if x]


# The FSDP2 mixed precision estimated: accelerate's (the Trainer's path), measured within 1%
# of a hand-written MixedPrecisionPolicy(param_dtype=bf16) step (benchmarks/distributed_measure.py,
# fsdp_mp). A loop of one's own with torch.autocast and no policy is another recipe.
FSDP_MIXED_NOTE = ("mixed precision as accelerate runs FSDP2 (MixedPrecisionPolicy(param_dtype="
                   "bf16), what the Trainer does); a loop with torch.autocast and no policy "
                   "gathers fp32 weights and keeps a 16-bit copy of each: +27% measured on 2 "
                   "ranks (not modelled)")


@dataclass(frozen=True)
class _Rank:
    """One rank's candidate peaks: phase -> (bytes, components); host bytes; notes."""

    phases: dict[str, tuple[float, dict[str, float]]]
    host: int = 0
    notes: tuple[str, ...] = ()


def estimate_ranks_analytic(info: ModelInfo, config: TrainConfig, seq_len: int,
                            device: DeviceInfo, layout: Layout | None = None) -> MemoryEstimate:
    """The analytic estimate of every rank of ``config`` (``world_size > 1``): the
    single-rank closed form of the step each rank runs (``activation_config``) with the
    model state replaced by the rank's share and the strategy's buffers added at each
    candidate peak (the rules of this module's docstring); the top-level figures are
    those of the rank that peaks.

        >>> from autofit.probe.model import probe_model
        >>> from autofit.probe.device import resolve_device
        >>> info, cpu = probe_model("tiny-llama"), resolve_device("cpu")
        >>> one = estimate_ranks_analytic(info, TrainConfig(), 128, cpu, Layout())
        >>> two = estimate_ranks_analytic(info, TrainConfig(nproc_per_node=2, strategy="fsdp"), 128, cpu)
        >>> len(two.per_rank), two.peak_allocated_bytes < one.peak_allocated_bytes
        (2, True)
    """
    from autofit.memory.analytic._closed_form import analytic_phases

    layout = layout or Layout.of(config)
    act_config = activation_config(config, layout)
    terms = analytic_phases(info, act_config, seq_len, device)
    if layout.family == "single":
        ranks = [_Rank(terms.phases, terms.host)]
    elif layout.family == "ddp":
        ranks = [_ddp_rank(info, config, layout, terms)] * layout.world_size
    elif layout.family == "fsdp":
        ranks = [_fsdp_rank(info, config, layout, terms, device, r)
                 for r in range(layout.world_size)]
    else:
        ranks = [_zero_rank(info, config, layout, terms, device, r)
                 for r in range(layout.world_size)]
    ests = [_rank_estimate(info, config, seq_len, device, r, terms) for r in ranks]
    return combine_ranks(ests, layout, device, method="analytic")


def _rank_estimate(info: ModelInfo, config: TrainConfig, seq_len: int, device: DeviceInfo,
                   rank: _Rank, terms: AnalyticTerms) -> MemoryEstimate:
    """One rank's MemoryEstimate from its phases (as ``estimate_analytic`` builds one)."""
    from autofit.memory.analytic._cpu_cache import cpu_library_cache_bytes, cpu_library_once_bytes
    from autofit.memory.analytic._reserved import cuda_reserved_bytes

    phase, (peak, parts) = max(rank.phases.items(), key=lambda kv: kv[1][0])
    parts = {k: int(v) for k, v in parts.items()}
    # the CPU math libraries' caches (0 on CUDA), as a single process's estimate adds them:
    # without them the fsdp2-bf16 row on an AVX512 host was 4.8% under
    lib_cache = cpu_library_cache_bytes(info, config, seq_len, device,
                                        half_matmuls=terms.half_matmuls,
                                        half_step=terms.half_step)
    parts[Component.TEMPORARIES] = parts.get(Component.TEMPORARIES, 0) + lib_cache
    peak = int(peak) + lib_cache
    reserved = (cuda_reserved_bytes(rank.phases, terms.stranded)
                if device.allocator == "cuda" else peak)
    once = cpu_library_once_bytes(info, config, seq_len, device, half_step=terms.half_step)
    total = reserved + device.overhead_bytes + once
    breakdown = {k: parts.get(k, 0) for k in (Component.WEIGHTS, Component.GRADIENTS, Component.OPTIMIZER_STATES,
                                              Component.ACTIVATIONS, Component.TEMPORARIES)}
    breakdown[Component.OVERHEAD] = total - peak
    return MemoryEstimate(
        peak_allocated_bytes=peak, peak_reserved_bytes=reserved, device_total_bytes=total,
        capacity_bytes=device.capacity_bytes, fits=total <= device.capacity_bytes,
        breakdown=breakdown, method="analytic", device=device.name,
        peak_phase=phase if phase in ("optimizer", "forward") else "backward", model=info.name,
        num_params=info.num_params, trainable_params=info.trainable_params, seq_len=seq_len,
        config=config.to_dict(), notes=rank.notes, host_bytes=int(rank.host))


def _ddp_rank(info: ModelInfo, config: TrainConfig, layout: Layout, t: AnalyticTerms) -> _Rank:
    """DDP: every phase + the buckets (the gradients' bytes); with gradient_as_bucket_view
    the gradients are the buckets (counted once, alive from the start)."""
    from autofit.memory.analytic._states import gradients_bytes

    B = gradients_bytes(info, single_rank_config(config))
    out = {}
    for name, (total, parts) in t.phases.items():
        parts = dict(parts)
        grads = parts.get(Component.GRADIENTS, 0)
        if layout.gradient_as_bucket_view:
            parts[Component.GRADIENTS] = B  # the .grad views live in the buckets
            total = total - grads + B
        else:
            parts[Component.TEMPORARIES] = parts.get(Component.TEMPORARIES, 0) + B  # the buckets
            total = total + B
        out[name] = (total, parts)
    return _Rank(out, 0, (f"DDP buckets: {B / 2**20:.1f} MiB ("
                          + ("the gradients are views of them" if layout.gradient_as_bucket_view
                             else "a second copy of the gradients") + ")",))


def _fsdp_rank(info: ModelInfo, config: TrainConfig, layout: Layout, t: AnalyticTerms,
               device: DeviceInfo, rank: int) -> _Rank:
    """FSDP2 / HSDP on rank ``rank``: the single-rank step's candidate peaks with sharded
    state, and the units gathered at each, found by tracing ``fully_shard``:

    * ``gather``: backward starts by re-gathering the output head's unit if it was
      resharded (the torch recipe's root): its flat all-gather output and the unsharded
      buffers it is copied into (two copies) on top of the units kept from forward;
    * ``backward``: the loss's gradients with the head's unit gathered and the last block
      prefetched;
    * ``block``: a block's backward: it and the next gathered, its unsharded gradients and
      reduce-scatter input; the torch recipe's root (and the output head's gradient)
      stays until the end, a no-reshard run keeps every unit not yet reduced;
    * ``backward-end``: the first unit's backward: gathered with its unsharded gradients,
      then resharded and reduce-scattered (unsharded gradients + reduce-scatter input);
    * ``optimizer``: sharded parameters, gradients and states + the step's temporaries
      over the rank's local chunks.
    """
    n = layout.shard_ranks
    r = rank % n  # the rank within its shard group
    units = fsdp_units_of_info(info, layout)
    spec = config.precision_spec
    # the Trainer's FSDP2 reduces in the compute dtype; the torch recipe in fp32
    red = "float32" if layout.fsdp_recipe == "torch" or not spec.autocast else spec.compute_dtype

    def gdt(dtype: str, trainable: bool) -> str:  # MixedPrecisionPolicy.param_dtype
        return spec.compute_dtype if spec.autocast else _sharded_dtype(dtype, trainable, config)

    def gathered(u: Unit | None) -> int:  # a unit's unsharded (padded) parameters
        return 0 if u is None else sum(n * fsdp_shard_numel(s, n) * c * _bytes(gdt(d, tr))
                                       for s, c, tr, d in u.params)

    def ugrads(u: Unit | None) -> int:  # its unsharded gradients
        return 0 if u is None else sum(n * fsdp_shard_numel(s, n) * c * _bytes(gdt(d, tr))
                                       for s, c, tr, d in u.params if tr)

    def rs_in(u: Unit | None) -> int:  # its reduce-scatter input
        return 0 if u is None else sum(n * fsdp_shard_numel(s, n) * c * _bytes(red)
                                       for s, c, tr, _ in u.params if tr)

    W, G, S, opt_temp, host = _fsdp_state(info, config, layout, device, units, r)
    big = [u for u in units if u.params]
    blocks = [u for u in big if u.name.startswith("block")]
    head = next((u for u in reversed(big) if u.name in ("tail", "root")), None)
    first = big[0] if big else None  # gathered first in forward, reduced last in backward
    kept = sum(gathered(u) for u in big if not u.reshard_after_forward)
    regather = gathered(head) if head is not None and head.reshard_after_forward else 0
    last = blocks[-1] if blocks else None
    prefetch = gathered(last) if last is not None and last.reshard_after_forward else 0
    # the block whose backward runs (and the next, prefetched) when blocks are resharded
    blk = max((gathered(u) for u in blocks if u.reshard_after_forward), default=0)
    # the torch recipe's root keeps the output head's unsharded gradient until its
    # post-backward at the end; a no-reshard run keeps the units not yet reduced
    held = 0
    if layout.fsdp_recipe == "torch" and head is not None and info.vocab_size:
        held = max((n * fsdp_shard_numel(s, n) * _bytes(gdt(d, tr))  # one (V, h) matrix
                    for s, c, tr, d in head.params
                    if tr and s == (info.vocab_size, info.hidden_size)), default=0)
    root_kept = regather if layout.fsdp_recipe == "torch" else 0
    G_held = G if config.grad_accum_steps > 1 else 0
    A, A_base, A_tr, bbt = t.A, t.A_base, t.A_transient, t.block_bwd_temp
    base = W + S + G_held
    cur = last
    A_blk = A - A_base + A_base // 2  # the loss's saved logits are gone by then
    # the first unit's end of backward: gathered + unsharded gradients; resharded, the
    # gradients copied into the reduce-scatter input (the copies freed, but the one the
    # autograd engine still holds: the embedding's, produced last); its sharded gradients
    Gf = (0 if layout.offload != "none" or first is None
          else _sharded_bytes(first.params, n, config, only_trainable=True))
    g_last = 0 if first is None else max(
        (n * fsdp_shard_numel(s, n) * _bytes(gdt(d, tr)) for s, _, tr, d in first.params if tr),
        default=0)
    end = max(gathered(first) + ugrads(first), ugrads(first) + rs_in(first),
              rs_in(first) + Gf + g_last)
    phases = {
        "gather": (base + A + kept + 2 * regather,
                   {Component.WEIGHTS: W + kept + regather, Component.OPTIMIZER_STATES: S, Component.ACTIVATIONS: A,
                    Component.GRADIENTS: G_held, Component.TEMPORARIES: regather}),
        "backward": (base + A + kept + regather + prefetch + t.loss_temp,
                     {Component.WEIGHTS: W + kept + regather + prefetch, Component.OPTIMIZER_STATES: S,
                      Component.ACTIVATIONS: A, Component.GRADIENTS: G_held, Component.TEMPORARIES: t.loss_temp}),
        "block": (base + A_blk + kept + root_kept + blk + prefetch + held + ugrads(cur)
                  + rs_in(cur) + bbt,
                  {Component.WEIGHTS: W + kept + root_kept + blk + prefetch, Component.OPTIMIZER_STATES: S,
                   Component.ACTIVATIONS: A_blk, Component.GRADIENTS: G_held + held + ugrads(cur),
                   Component.TEMPORARIES: rs_in(cur) + bbt}),
        "backward-end": (W + S + G - Gf + A_base // 2 + A_tr + bbt + end,
                         {Component.WEIGHTS: W, Component.OPTIMIZER_STATES: S, Component.GRADIENTS: G - Gf + ugrads(first),
                          Component.ACTIVATIONS: A_base // 2 + A_tr,
                          Component.TEMPORARIES: bbt + end - ugrads(first)}),
        "optimizer": (W + S + G + opt_temp,
                      {Component.WEIGHTS: W, Component.OPTIMIZER_STATES: S, Component.GRADIENTS: G,
                       Component.ACTIVATIONS: 0, Component.TEMPORARIES: opt_temp}),
    }
    if config.gradient_checkpointing and "recompute" in t.phases:
        # the last block recomputed for its backward: it and the next gathered, one
        # checkpointed input left, its unsharded gradients and reduce-scatter input; the
        # first unit's sharded gradients not made yet
        a_kept = t.phases["recompute"][1][Component.ACTIVATIONS]
        a_last = A_tr + (a_kept - A_tr) / max(info.num_layers or 1, 1)
        extra = kept + root_kept + held + ugrads(cur) + rs_in(cur)
        phases["recompute"] = (
            W + S + G - Gf + a_last + bbt + 2 * blk + extra,
            {Component.WEIGHTS: W + kept + root_kept + 2 * blk, Component.OPTIMIZER_STATES: S,
             Component.GRADIENTS: G - Gf + held + ugrads(cur), Component.ACTIVATIONS: a_last,
             Component.TEMPORARIES: bbt + rs_in(cur)})
    return _Rank(phases, host, _fsdp_notes(config, layout, W, host, len(big)))


def _sharded_bytes(tensors: Iterable[tuple[tuple[int, ...], int, bool, str]], n: int,
                   config: TrainConfig, only_trainable: bool = False) -> int:
    """Bytes of ``tensors`` (shape, count, trainable, dtype) as FSDP2 shards them over ``n``
    ranks (each a padded chunk, in the dtype it stores them in)."""
    return sum(fsdp_shard_numel(s, n) * c * _bytes(_sharded_dtype(d, tr, config))
               for s, c, tr, d in tensors if tr or not only_trainable)


def _fsdp_state(info: ModelInfo, config: TrainConfig, layout: Layout, device: DeviceInfo,
                units: list[Unit], r: int) -> tuple[int, int, int, int, int]:
    """(W, G, S, optimizer step temporaries, host bytes) of a rank ``r`` within its shard
    group: sharded parameters and gradients, the optimizer over its local chunks; with CPU
    offload all of it on the host (the device's figures 0)."""
    from autofit.memory.analytic._states import _optimizer_step_temporaries, optimizer_state_bytes

    n = layout.shard_ranks
    every = [p for u in units for p in u.params]
    W, G = _sharded_bytes(every, n, config), _sharded_bytes(every, n, config, only_trainable=True)
    local = _local_info(info, _fsdp_local_groups(info, n, r))
    one = single_rank_config(config)
    S = optimizer_state_bytes(local, one)
    opt_temp = _optimizer_step_temporaries(local, one, device)
    host = 0
    if layout.offload != "none":
        # CPUOffloadPolicy: sharded parameters and gradients (pinned on a GPU host) and the
        # optimizer's states and step on the host; the device gathers from host copies
        pin = pinned_bytes if device.allocator == "cuda" else (lambda b: b)
        host = (sum(pin(fsdp_shard_numel(s, n) * _bytes(_sharded_dtype(d, tr, config)))
                    * c * (2 if tr else 1) for s, c, tr, d in every) + S + opt_temp)
        W = G = S = opt_temp = 0
    return W, G, S, opt_temp, host


def _fsdp_notes(config: TrainConfig, layout: Layout, W: int, host: int,
                units: int) -> tuple[str, ...]:
    """The notes of an FSDP2 rank's estimate."""
    notes = [f"FSDP2 over {layout.shard_ranks} ranks: sharded parameters {W / 2**20:.1f} MiB "
             f"per rank, {units} units"]
    if config.precision_spec.autocast:
        notes.append(FSDP_MIXED_NOTE)
    if layout.offload != "none":
        notes.append(f"CPU offload: {host / 2**20:.1f} MiB of host memory per rank")
    return tuple(notes)


def _zero_rank(info: ModelInfo, config: TrainConfig, layout: Layout, t: AnalyticTerms,
               device: DeviceInfo, rank: int) -> _Rank:
    """DeepSpeed ZeRO-1/2/3 on rank ``rank`` (see the module docstring and ``simulate._zero``):

    * state: the flat bit16 groups (ZeRO-1/2) or partitions + persistent parameters
      (ZeRO-3), the fp32 partition (a clone), the optimizer's states over it, ZeRO-3's IPG
      bucket and gradient partition buffer;
    * ``backward`` (its start): the activations, the loss's gradients, ZeRO-1/2's IPG
      bucket(s) and a gradient larger than the bucket waiting for its reduction, and with
      ZeRO-3 every parameter gathered (kept from its forward to its backward:
      ``max_reuse_distance``);
    * ``backward-end``: ``grads_in_partition`` and the flattened partition
      (``averaged_gradients``) of ZeRO-1/2;
    * ``optimizer``: the partition flattened again and cast to fp32, the optimizer's
      temporaries over the flat partition.
    """
    from autofit.memory.analytic._states import _optimizer_step_temporaries, optimizer_state_bytes
    from autofit.probe.model import ParamGroup

    n = layout.shard_ranks
    stage = layout.zero_stage
    spec = config.precision_spec
    sizes = layout.zero_sizes_of(info.hidden_size)
    mb = 2 if spec.half else 4  # DeepSpeed's bf16 / fp16 cast the module
    frozen = sum(g.numel * g.count for g in info.params if not g.trainable)
    trainable = sum(g.numel * g.count for g in info.params if g.trainable)
    largest = max((g.numel for g in info.params if g.trainable), default=0)
    groups = _zero_groups(info, config, layout)
    if stage == 3:
        parts = [sum(zero3_partition_numel(g.numel, n) * g.count
                     for g in info.params if g.trainable)]
        small = sizes.param_persistence_threshold
        persist = sum(g.numel * g.count for g in info.params if g.numel <= small)
        W = (sum(zero3_partition_numel(g.numel, n) * g.count for g in info.params)
             + persist) * mb
        gathered = zero3_kept_numel(
            sum(g.numel * g.count for g in info.params if g.numel > small),
            sizes.max_reuse_distance) * mb
    else:
        parts = [zero_flat_numel(x, n) // n for x in groups]
        W = (sum(zero_flat_numel(x, n) for x in groups) + frozen) * mb
        gathered = 0
    p = sum(parts)
    flat = [ParamGroup(shape=(x,), count=1, dtype="float32", trainable=True) for x in parts]
    one = single_rank_config(config).replace(precision="32-true")  # fp32 states
    S = optimizer_state_bytes(_local_info(info, flat), one)
    opt_temp = (0 if layout.zero_optimizer == "deepspeed"  # DeepSpeed's Adam: in place
                else _optimizer_step_temporaries(_local_info(info, flat), one, device))
    master = 4 * p
    cpu = device.allocator == "cpu"
    bucket = min(sizes.reduce_bucket_size, trainable) if cpu else sizes.reduce_bucket_size
    offload_opt = layout.offload in ("optimizer", "optimizer+params")
    offload_par = layout.offload == "optimizer+params" and stage == 3
    pin = (lambda b: b) if cpu else pinned_bytes
    host = 0
    # a CPU counts a torch.empty bucket's pages as gradients are written into it (each
    # gradient's own storage freed): at backward's start only the first gradient's
    first = min(bucket, largest) * mb if cpu else bucket * mb
    if stage == 3:
        ipg, kept_grads = bucket * mb, p * mb  # IPG bucket, grad_partitions_flat_buffer
        gip = averaged = 0
        large = 0
    else:
        ipg = (2 if sizes.overlap_comm else 1) * bucket * mb
        kept_grads = 0
        gip = averaged = p * mb  # grads_in_partition, the flattened partition
        large = largest * mb if largest > bucket else 0
    ipg_start = min(first, ipg)
    step_grad = max(2 * p * mb, p * mb + (4 * p if mb != 4 else 0), 4 * p + opt_temp)
    if offload_opt:
        host = (pin(master) + S + pin(4 * p)
                + (pin(p * mb) + pin(largest * mb) if stage < 3 else pin(kept_grads)))
        master = S = opt_temp = step_grad = 0
        kept_grads = 0
        gip = averaged = 0
        if stage < 3:
            kept_grads = largest * mb  # temp_grad_buffer_for_gpu_offload
    if offload_par:
        host += pin(W - persist * mb)
        W = persist * mb
    state = W + master + S + kept_grads + (ipg if stage == 3 else 0)
    G_held = (gip if stage < 3 else 0) if config.grad_accum_steps > 1 else 0
    A, A_base, A_tr, bbt = t.A, t.A_base, t.A_transient, t.block_bwd_temp
    bw_ipg = ipg if stage < 3 else 0
    start_ipg = ipg_start if stage < 3 else 0
    phases = {
        "backward": (state + A + G_held + t.loss_temp + gathered + start_ipg + large,
                     {Component.WEIGHTS: W + master + gathered, Component.OPTIMIZER_STATES: S,
                      Component.ACTIVATIONS: A, Component.GRADIENTS: kept_grads + G_held + large + start_ipg,
                      Component.TEMPORARIES: t.loss_temp + (ipg if stage == 3 else 0)}),
        "backward-end": (state + A_base // 2 + A_tr + bbt + bw_ipg + gip + averaged,
                         {Component.WEIGHTS: W + master, Component.OPTIMIZER_STATES: S,
                          Component.GRADIENTS: kept_grads + gip + averaged + bw_ipg,
                          Component.ACTIVATIONS: A_base // 2 + A_tr,
                          Component.TEMPORARIES: bbt + (ipg if stage == 3 else 0)}),
        "optimizer": (state + step_grad,
                      {Component.WEIGHTS: W + master, Component.OPTIMIZER_STATES: S, Component.GRADIENTS: kept_grads,
                       Component.ACTIVATIONS: 0,
                       Component.TEMPORARIES: step_grad + (ipg if stage == 3 else 0)}),
    }
    if config.gradient_checkpointing and "recompute" in t.phases:
        a_kept = t.phases["recompute"][1][Component.ACTIVATIONS]
        total = state + a_kept + bbt + gathered + bw_ipg + large
        phases["recompute"] = (total, {Component.WEIGHTS: W + master + gathered, Component.OPTIMIZER_STATES: S,
                                       Component.GRADIENTS: kept_grads + bw_ipg + large,
                                       Component.ACTIVATIONS: a_kept,
                                       Component.TEMPORARIES: bbt + (ipg if stage == 3 else 0)})
    notes = [f"ZeRO-{stage} over {n} ranks: partition {p:,} elements; reduce bucket "
             f"{sizes.reduce_bucket_size:,} elements"]
    if host:
        notes.append(f"offload ({layout.offload}): {host / 2**20:.1f} MiB of host memory per rank")
    return _Rank(phases, host, tuple(notes))


# --------------------------------------------------------------------------- combine


def combine_ranks(ests: list[MemoryEstimate], layout: Layout, device: DeviceInfo, *,
                  method: str) -> MemoryEstimate:
    """One MemoryEstimate of every rank: the top-level figures are the peaking rank's
    (the lowest rank on ties), ``per_rank`` lists each, ``host_bytes`` is the host memory
    of the node that needs the most (its ranks' shares together).

    On a CPU target the host is the device: host shares are counted in the peak and
    ``host_bytes`` stays 0."""
    if len(ests) == 1 and layout.family == "single":
        return ests[0]
    cpu = device.allocator == "cpu"
    if cpu:
        ests = [_host_on_device(e) for e in ests]
    totals = [e.device_total_bytes for e in ests]
    peak = max(range(len(ests)), key=lambda i: (totals[i], -i))
    per_node: dict[int, int] = {}
    for r, e in enumerate(ests):
        per_node[layout.node_of(r)] = per_node.get(layout.node_of(r), 0) + e.host_bytes
    host = max(per_node.values(), default=0)
    per_rank = tuple({"rank": r, "peak_allocated_bytes": e.peak_allocated_bytes,
                      "peak_reserved_bytes": e.peak_reserved_bytes,
                      "device_total_bytes": e.device_total_bytes, "host_bytes": e.host_bytes,
                      "breakdown": dict(e.breakdown)} for r, e in enumerate(ests))
    top = ests[peak]
    same = len(set(totals)) == 1
    note = (f"{layout.describe()}: per-rank estimates; "
            + ("every rank alike" if same else f"rank {peak} peaks"))
    if host:
        note += f"; host memory per node {host / 2**30:.2f} GiB"
    return dataclasses.replace(top, method=method, per_rank=per_rank, peak_rank=peak,
                               host_bytes=host, notes=(*top.notes, note))


def _host_on_device(e: MemoryEstimate) -> MemoryEstimate:
    """A CPU rank's estimate with its host share counted as device memory (the same RAM)."""
    if not e.host_bytes:
        return e
    h = e.host_bytes
    b = dict(e.breakdown)
    b[Component.OPTIMIZER_STATES] = b.get(Component.OPTIMIZER_STATES, 0) + h
    total = e.device_total_bytes + h
    return dataclasses.replace(
        e, peak_allocated_bytes=e.peak_allocated_bytes + h,
        peak_reserved_bytes=e.peak_reserved_bytes + h, device_total_bytes=total,
        fits=total <= e.capacity_bytes, breakdown=b, host_bytes=0,
        notes=(*e.notes, "offloaded state counted in RAM: on a CPU the host is the device"))
