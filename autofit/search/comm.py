"""Communication time of a data-parallel strategy: what ranks send each other per step.

Every strategy moves the same gradients to the same average; they differ in what
else moves, how often, and over which link. Per rank, with ``N`` ranks in a ring
(NCCL's and gloo's algorithms for large messages), a collective over ``S`` bytes
sends ``(N-1)/N * S`` (all-gather, reduce-scatter) or twice that (all-reduce), at the
link's bus bandwidth: ``_EFFICIENCY`` of the catalog's ``peer_link_gbs`` inside a
node, of ``network_gbs`` across nodes (a ring across nodes runs at its slowest hop).

Per micro batch (``m``) or per optimizer step (``o``), where ``P`` is the bytes of the
parameters as gathered (the compute dtype with a mixed-precision policy), ``G`` of the
gradients as reduced (fp32 with autocast), ``H`` of the parameters' host copies:

==================  =====================================================================
ddp                 o: all-reduce G (accumulation runs under ``no_sync``)
zero1               o: reduce-scatter G; after the step, all-gather P (updated partitions)
zero2               m: reduce-scatter G (gradients are partitioned as backward makes them);
                    o: after the step, all-gather P
zero3, fsdp         m: all-gather P for forward, again for backward, reduce-scatter G
fsdp-shard-grad-op  m: all-gather P once (kept from forward to backward), reduce-scatter G
hsdp                m: as fsdp inside the node; o: all-reduce G / nproc_per_node across
                    nodes (each rank its shard)
offload optimizer   o: the gradient partition to the host and the parameter partition back
                    over the host link; the optimizer step runs on the host's CPU
offload params      m: the parameter partition from the host, for forward and backward
==================  =====================================================================

Overlap: DDP's all-reduce runs bucket by bucket during the last backward, FSDP's and
ZeRO-3's gathers are prefetched a unit ahead during compute: only what exceeds the
compute it hides behind is exposed (``max(0, comm - _OVERLAP * compute)``). ZeRO-1/2's
gather of the updated partitions after the optimizer step, host copies and the host's
optimizer step are not overlapped (the next forward and DeepSpeed's CPU Adam wait for them).

    >>> from autofit import TrainConfig
    >>> from autofit.probe.device import resolve_device
    >>> from autofit.probe.model import probe_model
    >>> card = resolve_device("H100-80GB")
    >>> info = probe_model("tiny-llama")
    >>> ddp = communication(info, TrainConfig(nproc_per_node=8), card)
    >>> z3 = communication(info, TrainConfig(nproc_per_node=8, strategy="zero3"), card)
    >>> ddp.per_micro_batch_bytes, ddp.per_step_bytes > 0, z3.per_micro_batch_bytes > 0
    (0.0, True, True)

Known limitations:
    NB: bus bandwidths are the links' nominal rates x 0.8, not measured per cluster;
    small messages (latency-bound) and topology (rail-optimised networks, PCIe switches)
    are not modelled; the ranking they give is checked by trials where the ranks are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from autofit.config import TrainConfig
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo

__all__ = ["Communication", "communication", "bus_bandwidth"]

_EFFICIENCY = 0.8  # bus bandwidth reached by ring collectives, fraction of the link
_OVERLAP = 0.8  # fraction of the compute a prefetched / bucketed collective hides behind
_CPU_PEER_GBS = 5.0  # gloo between processes of one host (shared memory / loopback)
_CPU_NETWORK_GBS = 1.25  # 10 Gb/s Ethernet between hosts without a catalog entry
_PEER_GBS = 25.0  # PCIe gen4 where the card is unknown
_NETWORK_GBS = 12.5  # 100 Gb/s where the cluster is unknown
_HOST_LINK_GBS = 25.0
_HOST_ADAM_GBS = 10.0  # bytes a host CPU Adam (DeepSpeed's cpu_adam) streams per second


@dataclass(frozen=True)
class Communication:
    """Bytes one rank sends and the seconds they expose, per micro batch and per step."""

    per_micro_batch_bytes: float
    per_step_bytes: float
    per_micro_batch_s: float  # during each micro batch's compute, before overlap
    per_step_s: float  # during the last backward (gradient reduction), before overlap
    after_step_s: float  # after the optimizer step (updated partitions gathered): exposed
    host_per_micro_batch_s: float  # host link (parameter offload), not overlapped
    host_per_step_s: float  # host link + the host's optimizer step, not overlapped

    def exposed(self, micro_compute_s: float, backward_s: float, accum: int) -> float:
        """Seconds per optimizer step that communication adds to ``accum`` micro batches of
        ``micro_compute_s`` each (``backward_s``: the last micro batch's backward, which a
        DDP all-reduce hides behind)."""
        micro = max(0.0, self.per_micro_batch_s - _OVERLAP * micro_compute_s)
        step = max(0.0, self.per_step_s - _OVERLAP * backward_s)
        return (accum * (micro + self.host_per_micro_batch_s) + step + self.after_step_s
                + self.host_per_step_s)


def bus_bandwidth(device: DeviceInfo, nnodes: int = 1) -> float:
    """Bytes per second a rank's ring collectives reach on ``device``'s links across
    ``nnodes`` nodes (the slowest hop of the ring)."""
    cpu = device.kind == "cpu"
    peer = device.peer_link_gbs or (_CPU_PEER_GBS if cpu else _PEER_GBS)
    gbs = peer
    if nnodes > 1:
        gbs = min(peer, device.network_gbs or (_CPU_NETWORK_GBS if cpu else _NETWORK_GBS))
    return gbs * 1e9 * _EFFICIENCY


def _ring(n: int, size: float) -> float:
    return (n - 1) / n * size if n > 1 else 0.0


def communication(info: ModelInfo, config: TrainConfig, device: DeviceInfo) -> Communication:
    """What one rank of ``config`` (its strategy, offload and ranks) sends per micro batch and
    per optimizer step on ``device``'s links (see the module docstring)."""
    from autofit.memory.analytic import gradients_bytes, weights_bytes

    n, strategy, offload = config.world_size, config.strategy, config.offload
    if n <= 1:
        return Communication(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    trainable = sum(g.numel * g.count for g in info.params if g.trainable)
    mixed = config.precision.endswith("-mixed")
    # gathered parameters: in the compute dtype under a mixed-precision policy
    p = (trainable * 2 if mixed and config.precision.startswith(("bf16", "16"))
         else weights_bytes(info, config))
    g = trainable * 4 if mixed else gradients_bytes(info, config)
    micro = step = after = 0.0
    host_micro = host_step = 0.0
    if strategy == "ddp":
        step = 2 * _ring(n, g)
    elif strategy == "zero1":
        step, after = _ring(n, g), _ring(n, p)
    elif strategy == "zero2":
        micro, after = _ring(n, g), _ring(n, p)
    elif strategy in ("zero3", "fsdp"):
        micro = 2 * _ring(n, p) + _ring(n, g)
    elif strategy == "fsdp-shard-grad-op":
        micro = _ring(n, p) + _ring(n, g)
    elif strategy == "hsdp":
        shard, replicas = config.nproc_per_node, config.nnodes
        micro = 2 * _ring(shard, p) + _ring(shard, g)
        step = 2 * _ring(replicas, g / shard)
    bw = bus_bandwidth(device, config.nnodes)
    if strategy == "hsdp":  # the shard group stays inside a node: the peer link
        inside = bus_bandwidth(device, 1)
        micro_s, step_s = micro / inside, step / bw
    else:
        micro_s, step_s = micro / bw, step / bw
    after_s = after / bw
    if offload != "none":
        link = (device.host_link_gbs or _HOST_LINK_GBS) * 1e9
        shard_g, shard_p = g / n, trainable * 4 / n  # fp32 master partition on the host
        host_step = (shard_g + shard_p) / link + 4 * shard_p / (_HOST_ADAM_GBS * 1e9)
        if offload == "optimizer+params":
            host_micro = 2 * p / n / link
    return Communication(micro, step + after, micro_s, step_s, after_s, host_micro, host_step)
