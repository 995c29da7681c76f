"""The CPU math libraries' buffer caches through a training step (MKL, oneDNN): not
tensors, so neither estimator sees them otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import BlockSpec, ModelInfo

# CPU: the math libraries' buffer caches, created by the first full-size step and kept for
# the run: not tensors, measured as what a step's matmuls leave resident beyond the tensors
# (one thread, glibc's thresholds fixed as autofit measures; ``benchmarks/cpu_cache.py``
# measures them on the machine at hand). They depend on the instruction set the kernels use:
# * AVX2 (MKL's fp32 GEMM buffers, oneDNN's for 16-bit): about half the widest matmul
#   output, at most ~14 MiB, less at short steps (~1-2 MiB at 128 tokens);
# * AVX512 (AMX-capable Xeons too), an upper bound of what ``benchmarks/cpu_cache.py``
#   measured: MKL packs an fp32 weight once the rows pass ~400 (384: not; 448: packed),
#   in a buffer of up to ~15 MiB that a later, smaller weight reuses: a step keeps one
#   buffer per weight larger than every weight before it (attention, feed-forward, head:
#   a 3 MiB feed-forward then an 8 MiB head leave 12.4 MiB), at 1024 rows and more one for
#   the packed activations too; below ~400 rows at most 2 MiB x rows / 384 per such
#   weight and half the floor (an 8-bit LoRA trial at 128 rows: within 0.6%). 16-bit
#   matmuls go to oneDNN: ~10 MiB of primitive cache and scratch + the weights it
#   reorders, at most 9 MiB of them (10.5-18.3 MiB measured on one block and a head).
# An unknown instruction set takes the larger of the two rules.
_CPU_LIB_CACHE_MAX = 14 << 20  # bytes (AVX2)
_CPU_LIB_CACHE_SHARE = 0.5  # of the widest matmul output (AVX2)
_CPU_LIB_CACHE_FULL_TOKENS = 1024  # tokens per micro batch from which the cache is full size
_AVX512_PACK_ROWS = 385  # rows from which MKL packs an fp32 weight (384: not; 448: packed)
_AVX512_PACK_MAX = 15 << 20  # bytes of one packing buffer, at most
_AVX512_SMALL_MAX = 2 << 20  # ... at 384 rows (less below: 128 rows kept 1.7 MiB in all)
_AVX512_FLOOR = 2 << 20  # what any fp32 step leaves
_AVX512_ACT_ROWS = 1024  # rows from which the activations are packed too
_AVX512_HALF = 10 << 20  # oneDNN's primitive cache and scratch for 16-bit matmuls
_AVX512_HALF_WEIGHTS = 9 << 20  # + the 16-bit weights it reorders, at most


def cpu_library_cache_bytes(info: ModelInfo, config: TrainConfig, seq_len: int,
                            device: DeviceInfo, capability: str | None = None) -> int:
    """Bytes the CPU's math libraries keep cached through a training step (0 on CUDA), by
    this CPU's instruction set (``capability``: ``autofit.probe.device.cpu_capability()``
    when ``None``; the rules are in the comment above). Not a tensor, so neither the
    analytic closed form nor the simulated allocation stream sees it otherwise (up to 7%
    of a small model's step: issue 25).

        >>> from autofit.probe.model import probe_model
        >>> from autofit.probe.device import resolve_device
        >>> info = probe_model("tiny-llama")
        >>> cpu_library_cache_bytes(info, TrainConfig(micro_batch_size=4), 256,
        ...                         resolve_device("cpu")) > 0
        True
    """
    if device.allocator == "cuda":
        return 0
    if capability is None:
        from autofit.probe.device import cpu_capability

        capability = cpu_capability()
    tokens = config.micro_batch_size * seq_len
    lm = (info.task != "seq-cls" and info.vocab_size is not None and not config.chunked_loss
          and config.loss_impl != "trl")
    if info.is_transformer:
        # the matmul weights of a step in the order it first uses them: the blocks'
        # linear layers, head (a quantized base's layers run bitsandbytes'
        # kernels, not MKL's)
        weights = [k * n for b in info.blocks for k, n in _block_matmuls(b)
                   if info.quant is None]
        if lm:
            weights.append(info.head_numel)
        widest = max([info.vocab_size if lm else 0]
                     + [b.intermediate_size or b.hidden_size or 0 for b in info.blocks])
    else:
        # blocks not recognised (FNet: 9.0% under without this): the 2-D linear weights,
        # in module order, and the widest of their outputs
        linears = [g for g in info.params if g.role == "linear" and len(g.shape) == 2]
        if not linears:
            return 0
        weights = [g.numel for g in linears]
        widest = max(g.shape[0] for g in linears)
        head = [g.numel for g in info.params if lm and g.role == "embedding"
                and g.shape[0] == info.vocab_size]
        if head and info.tie_word_embeddings:  # the LM head is the input embedding
            weights.append(max(head))
            widest = max(widest, info.vocab_size)
    spec = config.precision_spec
    half = bool(spec.autocast or spec.param_dtype != "float32")
    elem = 2 if half else 4
    avx2 = int(min(_CPU_LIB_CACHE_MAX, _CPU_LIB_CACHE_SHARE * tokens * widest * elem)
               * min(1.0, tokens / _CPU_LIB_CACHE_FULL_TOKENS))
    if half:
        avx512 = _AVX512_HALF + min(_AVX512_HALF_WEIGHTS, sum(2 * w for w in set(weights)))
    else:
        if tokens >= _AVX512_PACK_ROWS:
            cap, avx512 = _AVX512_PACK_MAX, _AVX512_FLOOR
        else:  # short steps: less kept, the less the fewer rows
            cap = int(_AVX512_SMALL_MAX * tokens / (_AVX512_PACK_ROWS - 1))
            avx512 = _AVX512_FLOOR // 2
        largest = 0
        for w in weights:  # a buffer per weight larger than all before it
            if w > largest:
                avx512, largest = avx512 + min(cap, 4 * w), w
        if tokens >= _AVX512_ACT_ROWS:
            avx512 += min(_AVX512_PACK_MAX, 4 * tokens * (info.hidden_size or 0))
    if capability == "AVX2":
        return avx2
    if capability.startswith("AVX512"):
        return avx512
    return max(avx2, avx512)


def _block_matmuls(b: BlockSpec) -> list[tuple[int, int]]:
    """(in, out) of a block's matmul weights in module order: its linear layers (DeepSeek's
    low-rank attention projects 256 -> 1536 -> 768: the three-matmul block below left
    2.6 MiB of 5.3 out, the zoo's classifier 3.8% under), else attention, feed-forward in
    and out."""
    if b.linears:
        return [(i, o) for _, i, o, _ in b.linears]
    h = b.hidden_size or 0
    i = b.intermediate_size or h
    return [(h, h), (h, i), (i, h)]

