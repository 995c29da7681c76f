"""Throughput model: predicted tokens per second of a configuration, to rank candidates.

The search engine ranks candidates by this prediction before it confirms the best
few with real micro-steps (whose measured speed then decides). The model:

* FLOPs per token of a training step: ``2 * P_matmul`` forward (weights of every
  matmul, the output head included) + attention scores ``4 * L * T * d_attn``
  (causal: half of ``QK^T`` and ``PV`` is skipped by flash kernels, not by eager);
  backward is ``2x`` forward when the weights train, ``1x`` when they are frozen
  (LoRA: only input gradients); gradient checkpointing adds one forward.
* Achieved FLOP/s = the device's peak dense FLOP/s for the precision
  (``DeviceInfo.peak_tflops``) x a utilisation that grows with the tokens of the
  micro batch: ``mfu_max * tokens / (tokens + half_tokens)``.
* The optimizer step reads and writes weights, gradients and states once per
  optimizer step: ``bytes / bandwidth``, amortised over the accumulation steps;
  ``foreach`` and fused kernels are faster than per-tensor loops.
* A lever's own time (``step_seconds`` of its knob, summed by
  ``autofit.knobs.registry.step_seconds``; this model names no lever): a chunked loss
  runs the head's matmuls chunk by chunk: each chunk reads the head's weight twice and
  reads and writes its fp32 weight gradient (``chunks * V * h`` bytes moved per micro
  batch, at the device's bandwidth), so small chunks cost time; on a CPU it is charged
  its measured cost instead (``autofit.knobs.chunked_loss._CPU_CHUNKED_LOSS``).
* On a CPU (one thread in a trial) the utilisation does not grow with the micro batch:
  measured, tiny-gpt2's full-logits step runs 82.8 tokens/s at micro batch 4 x 256 and
  78.7 at 8 x 256; the GPU curve above made a large chunked-loss micro batch look faster
  than a small full-logits one, which it is not (``_CPU_HALF_TOKENS``).
* Activation offloading copies every checkpointed block's input to pinned host memory
  in the forward and back in the backward, on the compute stream (transformers does not
  overlap them): ``2 * offloaded bytes / host link`` per micro batch, at the card's
  ``host_link_gbs`` (PCIe, ``catalog.toml``; 25 GB/s, PCIe gen4 x16, where unknown).
* Several ranks: what the strategy sends (``autofit.search.comm``: all-reduce,
  all-gather, reduce-scatter, host copies) beyond what compute hides, per optimizer
  step; a sharded strategy's optimizer step updates one partition per rank (on the
  host with offload). Throughput is per rank.

    >>> from autofit.probe.model import probe_model
    >>> from autofit.probe.device import resolve_device
    >>> from autofit import TrainConfig
    >>> s = predict_speed(probe_model("tiny-llama"), TrainConfig(micro_batch_size=8), 512,
    ...                   resolve_device("A100-80GB"))
    >>> s.tokens_per_s > 0
    True

Known limitations:
    NB: the utilisation curve is generic, not fitted per card; the ranking it gives
    is checked by measured trials, which decide the final choice.
    NB: on the CPU no peak FLOP/s is catalogued; a nominal rate is used, so only
    the relative ranking is meaningful there. Half precision is charged what it costs
    on this CPU (``autofit.probe.device.cpu_matmul_speed``, measured once): as fast as
    fp32 where it runs natively (AVX512-BF16, AMX), 32x slower on an AVX2-only CPU.
    NB: torch.compile is predicted at the eager step's speed (its gain depends on the
    model, the device and the graph breaks); the trials, which compile before they time,
    measure it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from autofit.config import TrainConfig
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo

__all__ = ["SpeedEstimate", "predict_speed", "flops_per_token"]

_MFU_MAX = 0.55  # well-tuned dense training reaches ~40-60% of peak
_HALF_TOKENS = 1024  # tokens per micro batch at which utilisation is half its maximum
_CPU_TFLOPS = 0.2  # nominal, ranking only
_CPU_HALF_TOKENS = 16  # one CPU thread: as fast per token at 1024 tokens as at 2048 (measured)
_CPU_BANDWIDTH_GBS = 20.0
_HOST_LINK_GBS = 25.0  # pinned copies over PCIe gen4 x16 (~80% of 31.5 GB/s), where unknown
# relative cost of the optimizer's memory traffic (per byte moved) by implementation
_BACKWARD_SHARE = 2 / 3  # of a micro batch's compute: backward is twice the forward
_OPT_EFFICIENCY = {"fused": 1.0, "foreach": 0.8, "loop": 0.35, "bnb": 0.9}


@dataclass(frozen=True)
class SpeedEstimate:
    """Predicted speed of one configuration (per device)."""

    tokens_per_s: float
    samples_per_s: float
    step_time_s: float  # one micro batch: forward + backward
    optimizer_time_s: float  # one optimizer step
    flops_per_token: float
    utilisation: float
    communication_s: float = 0.0  # per optimizer step, what overlap does not hide


def _matmul_params(info: ModelInfo) -> tuple[int, int]:
    """(trainable, frozen) elements of matmul weights: blocks + output head."""
    trainable_frac = info.trainable_params / max(info.num_params, 1)
    n = 0
    for b in info.blocks:
        n += b.count * sum(i * o for _, i, o, _ in b.linears)
    n += info.head_numel
    if info.peft is not None or info.quantization is not None:
        return 0, n  # the base is frozen; adapters are negligible in FLOPs
    if n == 0:  # unknown structure: every parameter is a matmul weight
        n = info.num_params
    trainable = int(n * min(1.0, trainable_frac))
    return trainable, n - trainable


def flops_per_token(info: ModelInfo, config: TrainConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward [+ recompute])."""
    trainable, frozen = _matmul_params(info)
    fwd_matmul = 2.0 * (trainable + frozen)
    attn = 0.0
    for b in info.blocks:
        d_attn = b.num_heads * b.head_dim
        causal = 0.5 if (b.role.startswith("decoder") and info.attn_implementation != "eager") else 1.0
        attn += b.count * 4.0 * seq_len * d_attn * causal
    fwd = fwd_matmul + attn
    # backward: input grads for everything (~1x fwd), weight grads for trainable (~1x)
    bwd = fwd + 2.0 * trainable + attn
    recompute = fwd if config.gradient_checkpointing else 0.0
    return fwd + bwd + recompute


def _opt_kind(config: TrainConfig, device: DeviceInfo) -> str:
    spec = config.optimizer_spec
    if spec.bnb:
        return "bnb"
    if spec.fused:
        return "fused"
    return "foreach" if device.allocator == "cuda" else "loop"


def predict_speed(
    info: ModelInfo, config: TrainConfig, seq_len: int, device: DeviceInfo
) -> SpeedEstimate:
    """Predicted throughput of ``config`` (see the module docstring)."""
    from autofit.knobs.base import StepContext
    from autofit.knobs.registry import step_seconds
    from autofit.memory.analytic import (
        gradients_bytes,
        offloaded_bytes,
        optimizer_state_bytes,
        weights_bytes,
    )
    from autofit.probe.device import cpu_matmul_speed
    from autofit.search.comm import communication

    tokens = config.micro_batch_size * seq_len
    fpt = flops_per_token(info, config, seq_len)
    peak = device.peak_tflops(config.precision)
    cpu = device.kind == "cpu"
    if peak is None:
        peak = _CPU_TFLOPS * (cpu_matmul_speed(config.precision) if cpu else 1.0)
    util = _MFU_MAX * tokens / (tokens + (_CPU_HALF_TOKENS if cpu else _HALF_TOKENS))
    rate = peak * 1e12 * util
    step = tokens * fpt / rate
    bw = (device.bandwidth_gbs or _CPU_BANDWIDTH_GBS) * 1e9
    step += step_seconds(StepContext(
        info, config, seq_len, device, flops=rate, bandwidth=bw,
        host_link=(device.host_link_gbs or _HOST_LINK_GBS) * 1e9,
        offloaded_bytes=offloaded_bytes(info, config, seq_len)))
    moved = 2 * (weights_bytes(info, config) + gradients_bytes(info, config)) + 2 * optimizer_state_bytes(
        info, config
    )
    opt = moved / (bw * _OPT_EFFICIENCY[_opt_kind(config, device)])
    if config.sharded:  # each rank updates its own partition (on the host, with offload)
        opt = 0.0 if config.offload != "none" else opt / (
            config.nproc_per_node if config.strategy == "hsdp" else config.world_size)
    comm = communication(info, config, device).exposed(
        step, step * _BACKWARD_SHARE, config.grad_accum_steps)
    total = config.grad_accum_steps * step + opt + comm
    tps = config.grad_accum_steps * tokens / total
    return SpeedEstimate(
        tokens_per_s=tps,
        samples_per_s=tps / seq_len,
        step_time_s=step,
        optimizer_time_s=opt,
        flops_per_token=fpt,
        utilisation=util,
        communication_s=comm,
    )
