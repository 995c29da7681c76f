"""The CUDA caching allocator's reserved bytes above a step's allocated ones, in closed
form (the simulate method replays the step's allocation stream through a model of the
allocator instead: ``autofit.memory.allocator``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.memory.allocator import K_LARGE_BUFFER
from autofit.memory.analytic._states import _bytes, _param_dtype_bytes

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.model import ModelInfo

__all__ = ["cuda_reserved_bytes", "stranded_bytes"]

# CUDA: reserved above allocated (best-fit caching allocator, 20 MiB segments for 1-10 MiB
# requests, a segment of its own above, no merging across segments). An evaluation step's
# (``autofit.memory.eval``): 6% of its allocated peak.
_CUDA_FRAGMENTATION = 0.06
# A training step's: the allocated peak + 2% (3% at the optimizer step, whose foreach
# temporaries come in many sizes) + one of each of the step's largest transient buffers,
# which the cache can strand (``stranded_bytes``). Fitted on the simulated allocator's
# least capacity (below which its own free-and-retry fails: an OOM) of 64 real-size steps
# (Llama-3.2-1B, GPT-2 medium, bert-large, Qwen2-0.5B on an H100: checkpointing,
# precision, micro batch x accumulation, optimizer; ``benchmarks/cuda_reserved.py``):
# none under it by more than 3% (lowest -0.9%), +7.5% median over; on 32 held out
# (SmolLM2-360M, Gemma-2B) none under (lowest +0.2%), +6.9% median; on long sequences
# (a 1B llama at 8k-49k tokens, full and LoRA, offloaded; Qwen2-0.5B LoRA at 16k) -0.2%
# lowest. The flat allowance it replaces (6%,
# 20% with checkpointing, 10% at a checkpointed forward's end) was 8.9% under on a
# big-vocabulary step, whose (tokens, vocabulary) and (vocabulary, hidden) buffers
# fragment the cache 10-16% above the live bytes, and 19% over where a step's peak is
# its model state.
_CUDA_STEP_FRAGMENTATION = 0.02
_CUDA_OPTIMIZER_FRAGMENTATION = 0.03
# ... and the shared 20 MiB segments of 1-10 MiB requests that a step's smaller tensors keep
# partly used: three (a 512-wide llama's steps of 130-850 MiB, full and LoRA, with and
# without checkpointing, simulated 3-55 MiB above the rest of the rule)
_CUDA_STRANDED_SEGMENTS = 3


def cuda_reserved_bytes(phases: dict[str, tuple[float, dict[str, float]]],
                        stranded: int = 0) -> int:
    """The caching allocator's reserved peak over a step's candidate phases: the highest
    phase's allocated bytes with a little of the allocator's rounding and splitting, + the
    bytes it can strand (``stranded_bytes``: one of each of the step's largest transient
    buffers, whose freed segments later, smaller blocks split and keep)."""
    def frag(phase: str) -> float:
        return (_CUDA_OPTIMIZER_FRAGMENTATION if phase == "optimizer"
                else _CUDA_STEP_FRAGMENTATION)

    return int(max(b * (1 + frag(p)) for p, (b, _) in phases.items())) + stranded


def stranded_bytes(info: ModelInfo, config: TrainConfig, T: int, logits_width: int) -> int:
    """What the caching allocator can strand above a step's live bytes: the loss's fp32
    (tokens, ``logits_width``) buffer (0: none, or a chunked or fused loss, whose buffers
    are a chunk's), the largest trainable parameter's gradient and the widest activation
    of a block, each allocated in a segment of its own and, once freed, split by smaller
    blocks that keep it (what the 96 simulated real-size steps of
    ``benchmarks/cuda_reserved.py`` needed above their live bytes grew with the first two:
    a 152k vocabulary's 10-23%), + a few shared segments (``_CUDA_STRANDED_SEGMENTS``)."""
    tokens = config.micro_batch_size * (T + info.virtual_tokens)
    quantized = info.quant is not None
    grad = max((g.numel * _param_dtype_bytes(g, config, quantized)
                for g in info.params if g.trainable), default=0)
    # (all of the loss's buffer: how much of it a step strands varies with what its
    # backward carves out of it, 0.04x Qwen2-0.5B's with LoRA at 16k tokens, 0.57x a 1B
    # llama's with LoRA at 4 x 512, more than its gradients on tiny models: taking the
    # gradients as the bound put tiny-gpt2 at 8 x 512 12.5% under)
    loss = tokens * logits_width * 4
    # the widest activation a block makes (its feed-forward's): at long sequences the
    # largest buffer of all (a 1B llama at 49k tokens: 768 MiB; LoRA with the chunked loss,
    # 3.3-5.3% under the simulated least capacity without it)
    widest = max([b.intermediate_size or 0 for b in info.blocks] + [info.hidden_size or 0])
    act = tokens * widest * _bytes(config.precision_spec.compute_dtype)
    return loss + grad + act + _CUDA_STRANDED_SEGMENTS * K_LARGE_BUFFER
