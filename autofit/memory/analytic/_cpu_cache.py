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
#   matmuls go to oneDNN, which keeps a primitive and its JIT-compiled kernels per
#   matmul shape -- operands' shapes, the rows too (``benchmarks/cpu_cache.py --half``):
#   5.5 MiB once, 0.6-0.75 MiB per shape, the more the wider (a linear's forward and
#   backward are three; 40 linears 256 -> 8..320 left 76 MiB, one 256 -> 256 linear run
#   at 100 lengths 216 MiB, tiny-gpt2's 15 shapes 11.2 MiB a new length: ``--growth``):
#   0.75 is taken; and up to 5 MiB more for the largest weight it reorders (4096 x 4096:
#   11.0 MiB in all). A hybrid's linear-attention block brings many shapes (OLMo-hybrid,
#   Qwen3-Next: 4-7% under with a flat 10 MiB). Where a simulation counted the step's
#   oneDNN primitives (``half_step``), they are counted as on an EPYC (below), which tells
#   a 16-bit flash attention's kernels apart (the per-shape rule cannot: BERT's and GPT-2's
#   classifiers, whose attention is not flash, 5.7-5.9% over with it).
# * AVX512 on an AMD EPYC (Zen 4: ``benchmarks/cpu_cache.py`` there, and the zoo's 446 rows
#   measured on one): MKL packs no fp32 weight; a step leaves ~1.2-2 MiB with a small
#   feed-forward, +1.25 KiB per unit of its width (256 -> 3072: 5.1 MiB), at most ~8 MiB
#   at real sizes (4096 -> 11008: 8.5 MiB), and the LM head half its weight's bytes more,
#   at most 3.5 MiB (2048 -> 5632 and a 32k head: 11.4 MiB), scaled by rows / 512 below
#   512 rows. Of that, the process keeps 0.75 MiB and 0.75 of the head's part from its
#   first step at any size (after the same matmuls at 8 rows a step left 0.45-0.65 MiB
#   less without a head, 2.35 less with a 16k one; the zoo's harness, whose warm-up step
#   is at 8 tokens, measured the step's part 1.0 MiB median below the whole with a small
#   feed-forward, 1.6 with a head: its fp32, LoRA and 8-bit rows 1.1% median over, +6.3%
#   worst; with the step's part 0.3%, +4.4%, -1.6% lowest): overhead, as a CUDA context
#   is (``cpu_library_once_bytes``). oneDNN's 16-bit state is
#   smaller than on a Xeon: 4.16 MiB once + 0.56 MiB per matmul shape (1 to 100 linears, 3
#   to 300 shapes: within 1 MiB), no reordered weight kept, but a block's larger matmuls
#   leave ~1.6 MiB more (5 MiB once is taken: the zoo's bf16 rows 1.2% median, none under).
#   A simulation tells them apart (``half_step``): the once part is the process's (made by
#   a run's first step, and by the harness's warm-up before its baseline), and the "more"
#   was a 16-bit flash attention's brgemm kernels, which BERT-style models do not run.
# An unknown instruction set takes the larger of the two rules.
_CPU_LIB_CACHE_MAX = 14 << 20  # bytes (AVX2)
_CPU_LIB_CACHE_SHARE = 0.5  # of the widest matmul output (AVX2)
_CPU_LIB_CACHE_FULL_TOKENS = 1024  # tokens per micro batch from which the cache is full size
_AVX512_PACK_ROWS = 385  # rows from which MKL packs an fp32 weight (384: not; 448: packed)
_AVX512_PACK_MAX = 15 << 20  # bytes of one packing buffer, at most
_AVX512_SMALL_MAX = 2 << 20  # ... at 384 rows (less below: 128 rows kept 1.7 MiB in all)
_AVX512_FLOOR = 2 << 20  # what any fp32 step leaves, with ...
# ... what the process keeps from its first fp32 step at any size (overhead,
# ``cpu_library_once_bytes``): the zoo's Xeon fp32, LoRA and 8-bit rows, whose harness's
# warm-up step at 8 tokens makes it, measured 1.0-1.5 MiB (median by setup and task) below
# the simulated tensors + the whole rule (1.4% median over, +6.2% worst; with 0.75 taken
# 0.7%, +5.7%: FNet's classifier with LoRA, whose rule reads its linear weights alone, is
# the lowest, -2.1%)
_AVX512_ONCE = int(0.75 * (1 << 20))
_AVX512_ACT_ROWS = 1024  # rows from which the activations are packed too
_AVX512_HALF = int(5.5 * (1 << 20))  # oneDNN's state for 16-bit matmuls, once ...
# ... of which the process keeps this from its first 16-bit matmul at any size (overhead,
# ``cpu_library_once_bytes``): the zoo's Xeon bf16 + checkpointing rows, whose harness's
# warm-up step makes it, measured 3.6 MiB median below the simulated tensors + the whole
# rule (2.7% median, +9.1% worst over); an EPYC's first matmul keeps 4.21 of its 5
# (``cpu_cache.py --warm``). 2.5 is taken: the hybrids' rows (Qwen3.5, whose recurrences
# run more shapes than the rule counts) were 2.1% under already (now 1.1% median, +5.9%
# worst, -2.8% lowest)
_AVX512_HALF_ONCE = int(2.5 * (1 << 20))
_AVX512_HALF_SHAPE = int(0.75 * (1 << 20))  # + per matmul shape (a primitive, its kernels)
_AVX512_HALF_REORDER = 6  # + the largest 16-bit weight's bytes / this ...
_AVX512_HALF_REORDER_MAX = 5 << 20  # ... at most
# ... told apart where a simulation counted the step's oneDNN primitives (``half_step``), as
# on an EPYC: its 0.56 MiB per primitive and 2.06 MiB for a 16-bit flash attention's
# kernels, + the reordered weight, + this (fitted on the zoo's 76 Xeon rows in bf16 with
# checkpointing, each measured less its simulated tensors: 0.75% median, +1.5% worst,
# -2.4% lowest; with the per-shape rule, which cannot tell flash from math attention,
# 1.1%, +5.9%: BERT's and GPT-2's classifiers, whose attention is not flash)
_AVX512_HALF_STEP = int(1.5 * (1 << 20))
_AMD_FLOOR = int(0.5 * (1 << 20))  # fp32: what any step leaves (beyond the process's)
_AMD_ONCE = int(0.75 * (1 << 20))  # ... and the process keeps from its first step
_AMD_PER_WIDTH = 1280  # + bytes per unit of the widest feed-forward ...
_AMD_WIDTH_MAX = int(6.75 * (1 << 20))  # ... at most
_AMD_HEAD_SHARE = 0.5  # + the LM head weight's bytes x this ...
_AMD_HEAD_MAX = int(2.75 * (1 << 20))  # ... at most in the step (beyond the process's)
_AMD_HEAD_ONCE_MAX = int(3.5 * (1 << 20))  # ... and with the process's
_AMD_HEAD_FULL_ROWS = 512  # ... scaled by the rows below this many
# What MKL keeps after one fp32 (M, K) @ (K, N) product on an EPYC (``_amd_product``;
# ``benchmarks/cpu_kernel_copies.py``, one product per fresh process, any layout): about
# 4 B x kc x (min(M, 384) + min(N, ~6,400)), kc the inner width's block (K up to 192: K;
# below 384: K/2; else 192); a later product that needs more than every buffer before it
# adds one (3.32 MiB then 4.97: 8.29). The linear head's rule above is its forward
# product's; a head multiplied by a stacked weight (MobileBERT's: ``head_columns``) also
# runs its weight gradient as a (hidden, rows) @ (rows, vocabulary) product, whose buffer
# is added where it is the larger (MobileBERT's masked LM at 4 x 128: 4.9 MiB, the row
# 3.9% under without it; at 4 x 256 the two are alike and the row was within 0.1%)
_AMD_PRODUCT_ROWS = 384
_AMD_PRODUCT_COLS = 6400
_AMD_PRODUCT_BLOCK = 192
_AMD_HALF = 5 << 20  # oneDNN's 16-bit state, once (4.16 MiB, + what a step's larger weights keep)
_AMD_HALF_SHAPE = int(0.56 * (1 << 20))  # + per matmul shape
# ... told apart where a simulation counted the step's oneDNN primitives (``half_step``):
# what the first 16-bit matmul leaves once per process (a linear's forward and backward
# after a tiny one: 5.89 MiB, its three primitives 1.64 of it), overhead, not the step's;
# a 16-bit flash attention's brgemm kernels at a new length after a short one (2.06 MiB);
# and what a step keeps beyond its primitives (BERT's token classifier: 0.7 MiB)
_AMD_HALF_ONCE = int(4.21 * (1 << 20))
_AMD_HALF_FLASH = int(2.06 * (1 << 20))
_AMD_HALF_STEP = int(0.75 * (1 << 20))


def cpu_library_once_bytes(info: ModelInfo, config: TrainConfig, seq_len: int,
                           device: DeviceInfo, capability: str | None = None, *,
                           vendor: str | None = None,
                           half_step: tuple[int, bool] | None = None) -> int:
    """What the CPU's math libraries keep once per process that ``cpu_library_cache_bytes``
    leaves out of the step (its arguments): on an AMD EPYC, MKL's from the first fp32 step
    (at any size; the head's part from its first LM head matmul) and, where a simulation
    counted the step's oneDNN primitives (``half_step``), oneDNN's state from its first
    16-bit matmul; on another AVX512 CPU (a Xeon) part of oneDNN's state from its first
    16-bit matmul, or of MKL's from its first fp32 step; 0 elsewhere (AVX2, an unknown
    instruction set: kept in the step's part)."""
    if device.allocator == "cuda":
        return 0
    capability = _capability(capability)
    spec = config.precision_spec
    half = spec.autocast or spec.param_dtype != "float32"
    if half and _fp16_outside_onednn(config, capability):
        return 0
    if not _amd(capability, vendor):
        # a Xeon's (AVX512, the maker's own rule): oneDNN's state from its first 16-bit
        # matmul, MKL's from its first fp32 step
        if not capability.startswith("AVX512"):
            return 0
        return _AVX512_HALF_ONCE if half else _AVX512_ONCE
    if half:
        return _AMD_HALF_ONCE if half_step is not None else 0
    head = _amd_head(info, config, seq_len, _AMD_HEAD_ONCE_MAX)
    return _AMD_ONCE + head - _amd_head(info, config, seq_len, _AMD_HEAD_MAX)


def cpu_library_cache_bytes(info: ModelInfo, config: TrainConfig, seq_len: int,
                            device: DeviceInfo, capability: str | None = None,
                            half_matmuls: int | None = None, *,
                            vendor: str | None = None,
                            half_step: tuple[int, bool] | None = None,
                            probed: bool = False) -> int:
    """Bytes the CPU's math libraries keep cached through a training step (0 on CUDA), by
    this CPU's instruction set and maker (``capability``, ``vendor``:
    ``autofit.probe.device.cpu_capability()`` / ``cpu_vendor()`` when ``None``; the rules
    are in the comment above). Not a tensor, so neither the
    analytic closed form nor the simulated allocation stream sees it otherwise (up to 7%
    of a small model's step: issue 25). ``half_matmuls``: the 16-bit matmuls of distinct
    shapes the step runs, as the simulation counts them (None: from the model's linear
    layers, ``_half_matmul_shapes``). ``half_step``: a simulation's count of the step's
    oneDNN primitives (by operand layout too) and whether it ran a 16-bit flash
    attention, which then count the step's part on an AMD EPYC and a Xeon alike (what the
    process keeps once is ``cpu_library_once_bytes``, not included here). ``probed``: that
    count was made at a derivation's probe shapes, not the step's, so it may miss some (on
    a Xeon the weight shapes' rule stands as a floor: LongT5's block-padded attention ran 22
    primitives at the probes, 24 at 4 x 128 tokens; 3.7% under without it).

        >>> from autofit.probe.model import probe_model
        >>> from autofit.probe.device import resolve_device
        >>> info = probe_model("tiny-llama")
        >>> cpu_library_cache_bytes(info, TrainConfig(micro_batch_size=4), 256,
        ...                         resolve_device("cpu")) > 0
        True
    """
    if device.allocator == "cuda":
        return 0
    capability = _capability(capability)
    amd = _amd(capability, vendor)
    tokens = config.micro_batch_size * seq_len
    lm = _lm_head_matmul(info, config)
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
    if half and _fp16_outside_onednn(config, capability):
        return 0
    elem = 2 if half else 4
    avx2 = int(min(_CPU_LIB_CACHE_MAX, _CPU_LIB_CACHE_SHARE * tokens * widest * elem)
               * min(1.0, tokens / _CPU_LIB_CACHE_FULL_TOKENS))
    if half:
        if half_matmuls is None:
            half_matmuls = _half_matmul_shapes(info, lm)
        reorder = min(_AVX512_HALF_REORDER_MAX,
                      2 * max(weights, default=0) // _AVX512_HALF_REORDER)
        avx512 = _AVX512_HALF + _AVX512_HALF_SHAPE * half_matmuls + reorder
        if half_step is not None and not amd:  # (the step's part: the process's is overhead)
            primitives, flash = half_step
            counted = (_AVX512_HALF_STEP + _AMD_HALF_SHAPE * primitives
                       + (_AMD_HALF_FLASH if flash else 0) + reorder + _AVX512_HALF_ONCE)
            avx512 = max(avx512, counted) if probed else counted
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
    if amd:
        if half and half_step is not None:
            primitives, flash = half_step
            return (_AMD_HALF_STEP + _AMD_HALF_SHAPE * primitives
                    + (_AMD_HALF_FLASH if flash else 0))
        if half:
            return _AMD_HALF + _AMD_HALF_SHAPE * (
                _half_matmul_shapes(info, lm) if half_matmuls is None else half_matmuls)
        ffn = max([b.intermediate_size or b.hidden_size or 0 for b in info.blocks]
                  or [widest if not lm else info.hidden_size or 0])
        # a quantized base's linears run bitsandbytes' kernels (as above): no width part
        width = 0 if info.quant is not None else min(_AMD_WIDTH_MAX, _AMD_PER_WIDTH * ffn)
        return _AMD_FLOOR + width + _amd_head(info, config, seq_len, _AMD_HEAD_MAX)
    if capability == "AVX2":
        return avx2
    if capability.startswith("AVX512"):  # (what the process keeps once: overhead)
        return avx512 - (_AVX512_HALF_ONCE if half else _AVX512_ONCE)
    return max(avx2, avx512)


def _amd_head(info: ModelInfo, config: TrainConfig, seq_len: int, most: int) -> int:
    """An AMD EPYC's fp32 LM head part: half the head weight's bytes, at most ``most``,
    growing with the rows up to 512 (a 4-bit tiny-llama at 128 rows kept ~3 MiB less than
    512 rows would: its trial 3% under the full part); + a stacked head's weight gradient's
    buffer where it outgrows the forward's (``_AMD_PRODUCT_ROWS``); 0 without a full LM
    head matmul."""
    if not _lm_head_matmul(info, config):
        return 0
    rows = config.micro_batch_size * seq_len
    part = int(min(most, int(_AMD_HEAD_SHARE * 4 * (info.head_numel or 0)))
               * min(1.0, rows / _AMD_HEAD_FULL_ROWS))
    if info.head_columns_trained and info.vocab_size and info.hidden_size:
        forward = _amd_product(rows, info.hidden_size, info.vocab_size)
        weight_grad = _amd_product(info.hidden_size, rows, info.vocab_size)
        part += weight_grad if weight_grad > forward else 0
    return part


def _amd_product(m: int, k: int, n: int) -> int:
    """Bytes MKL keeps after an fp32 (m, k) @ (k, n) product on an AMD EPYC."""
    if k <= _AMD_PRODUCT_BLOCK:
        block = k
    elif k < 2 * _AMD_PRODUCT_BLOCK:
        block = k // 2
    else:
        block = _AMD_PRODUCT_BLOCK
    return 4 * block * (min(m, _AMD_PRODUCT_ROWS) + min(n, _AMD_PRODUCT_COLS))


def _fp16_outside_onednn(config: TrainConfig, capability: str) -> bool:
    """An AVX512 CPU's fp16 step whose matmuls oneDNN does not take (no AVX512-FP16 or
    AMX-FP16: ``cpu_onednn_fp16``): torch's own kernels, which keep nothing a step or a run
    of new shapes adds (a llama in 16-true on an AMD EPYC: 874 MiB measured, 10 MiB under
    its bf16-true step, its resident memory after the step its optimizer's states alone)."""
    if config.precision_spec.compute_dtype != "float16" or not capability.startswith("AVX512"):
        return False
    from autofit.probe.device import cpu_onednn_fp16

    return not cpu_onednn_fp16()


def _capability(capability: str | None) -> str:
    if capability is not None:
        return capability
    from autofit.probe.device import cpu_capability

    return cpu_capability()


def _amd(capability: str, vendor: str | None) -> bool:
    """An AMD EPYC's AVX512 (its own rules: MKL packs no fp32 weight, oneDNN keeps less)."""
    return capability.startswith("AVX512") and _vendor(vendor) == "AMD"


def _vendor(vendor: str | None) -> str:
    if vendor is not None:
        return vendor
    from autofit.probe.device import cpu_vendor

    return cpu_vendor()


def cpu_half_run_bytes(info: ModelInfo, config: TrainConfig, device: DeviceInfo, shapes: int,
                       *, forward_only: bool = False, capability: str | None = None) -> int:
    """What ``shapes`` more micro-batch shapes (samples x padded length) than a step's one
    add over a run, on a CPU whose 16-bit matmuls run on oneDNN: its kernels for every
    matmul shape of the step again (the rows are part of the shape), never given back.
    Measured (``benchmarks/cpu_cache.py --half``): tiny-gpt2 in bf16-mixed at micro batch
    2, 15 matmul shapes a step, +11.3 MiB for every new length, +680 MiB over 60 lengths
    (32-true: +10 MiB in all); a user's script under glibc's default thresholds kept 3x
    that. 0 on CUDA, in fp32, on AVX2 (not measured there) or for fp16 oneDNN does not
    take. ``forward_only``: an evaluation's forwards (a shape per weight shape, not three)."""
    if device.allocator == "cuda" or shapes <= 0:
        return 0
    spec = config.precision_spec
    if not (spec.autocast or spec.param_dtype != "float32"):
        return 0
    capability = _capability(capability)
    if capability == "AVX2" or _fp16_outside_onednn(config, capability):
        return 0
    per_step = _half_matmul_shapes(info, _lm_head_matmul(info, config),
                                   forward_only=forward_only)
    # the Xeon's 0.75 MiB a shape on an EPYC too: its step keeps 0.56 a shape, but a run
    # of 20 new lengths kept 170 MiB there (tiny-gpt2, --growth), 0.71 a shape counted here
    return shapes * per_step * _AVX512_HALF_SHAPE


def cpu_half_run_growth(info: ModelInfo, config: TrainConfig, device: DeviceInfo,
                        shapes: int, *, evaluates: bool, ran: int = 0) -> int:
    """What a run of ``shapes`` micro-batch shapes besides its longest adds above a trial of
    that longest step on a CPU whose 16-bit matmuls keep their oneDNN kernels
    (``cpu_half_run_bytes``), with the evaluations' forwards when the run ``evaluates``,
    less the ``ran`` shapes the trial replayed itself (0 elsewhere). The tune
    (``autofit.stages.run.WholeRun``) and ``autofit check`` count it alike."""
    extra = cpu_half_run_bytes(info, config, device, shapes)
    if extra and evaluates:
        extra += cpu_half_run_bytes(info, config, device, shapes + 1, forward_only=True)
    if extra and ran:
        extra = max(0, extra - cpu_half_run_bytes(info, config, device, ran))
    return extra


def _lm_head_matmul(info: ModelInfo, config: TrainConfig) -> bool:
    """Whether the step multiplies by the LM head in full (not a classifier's, not a chunked
    or TRL loss's own kernel)."""
    return (info.lm_logits and not config.chunked_loss
            and config.loss_impl != "trl")


def _half_matmul_shapes(info: ModelInfo, lm: bool, *, forward_only: bool = False) -> int:
    """The matmuls of distinct shapes a step runs, from the model's 2-D weights (``M``: the
    micro batch's rows): per weight ``out x in`` its forward ``(M, in) @ (in, out)``, its
    input's gradient ``(M, out) @ (out, in)`` and, where it is trained, its own
    ``(out, M) @ (M, in)``; the same shape twice is one (a square weight's forward and
    input gradient; a LoRA A's and its B's): 14 for LoRA on a small llama's q and v, as
    the simulation counts them. The LM head among them, tied or not; attention's own
    matmuls are not counted (the simulation counts every one)."""
    weights: dict[tuple[int, ...], bool] = {}
    for g in info.params:
        if len(g.shape) == 2 and (g.role in ("linear", "lora") or (
                lm and g.role == "embedding" and g.shape[0] == info.vocab_size)):
            weights[g.shape] = weights.get(g.shape, False) or g.trainable
    shapes: set[tuple] = set()
    for (out, inp), trained in weights.items():
        shapes.add(("M", inp, out))
        if not forward_only:
            shapes.add(("M", out, inp))
            if trained:
                shapes.add((out, "M", inp))
    return len(shapes)


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

