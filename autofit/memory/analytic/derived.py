"""Analytic coefficients derived from the simulator, for what the fitted table lacks.

``coefficients.json`` holds activation coefficients fitted per block family
(llama-like, GPT-2, BERT, T5), precision, attention and LoRA regime. A model or a
PEFT method outside it — IA3, prefix tuning, DoRA, an OPT or GPT-NeoX block — gets
coefficients of the same form derived from its own forward: the model is cloned on
fake tensors (``simulate._model``) and run, forward and backward, at four small shapes
(micro batch 2 at ``T1 < T2 < T3`` tokens, and 4 at ``T1``; not 1: some steps take
another path for one sample, AXK2's indexer among them; 32, 64 and 128 tokens, doubled
until ``T3`` reaches the step's length: ``probe_shapes``; after one step at ``T1`` that is
not kept, whose one-time allocations, a model's lazily built caches, would otherwise
enter the first shape's fits), with each block's
allocations told apart by forward hooks. The clone keeps one block of each kind
(blocks alike in modules, parameters and buffers; adaption prompt's adapted top
layers are a second kind), which stands for all blocks of its kind; an encoder-decoder's
encoder and decoder are two stacks, each with coefficients of its own (``layer`` and
``layer_decoder``; the cross-attention's scores, at the one length the analytic model
takes for source and target, in the quadratic term). What is still alive when the loss is
computed is what backward needs (the saved activations, the adapters' dtype casts
and dropout copies, virtual tokens, merged delta weights); it splits exactly into

    per block:  F + B * (s + a*T + b*T^2)        outside the blocks: the same form

(``F``: the same for every micro batch, e.g. DoRA's weight norms; autocast's weight
copies are taken out, the analytic model counts them apart), which the four shapes
determine. More terms of that form: the forward's transient above what it keeps
(``forward``; where the four forwards run the same events, ``forward_moments``: each
moment's own fit, the highest at the step's shape taken, since the forward's highest
point moves from one moment to another as the shape grows); per stack, a block's backward scratch above what is alive when it starts
(``block_backward``, ``block_backward_decoder``: a linear-attention block's chunked
recurrence makes more of it than a standard block's rule says); from the top block's
backward on, the most held above what was alive at the loss (``top_backward``, its moments
as the forward's: the backward's candidate without checkpointing, beside every
activation, where the head's backward has freed what it kept); and for what
checkpointing recomputes one block at a time, the largest kind of block's saved bytes
(``layer_largest``: a hybrid's linear-attention block keeps ten times its full-attention
block) and a block forward's highest point (``block_forward``). Results are cached per
(model, precision, attention, chunked loss, target):
in memory, and on disk beside the trial cache (``$AUTOFIT_CACHE_DIR/derived/``, one JSON
file per key, library versions and a hash of the code that derives them), so a new process — every ``autofit estimate`` —
pays the four forwards once per model. A cache folder that cannot be written is one
warning, and the coefficients are derived again next time; a file that does not read
as coefficients is derived again and replaced.

    >>> from autofit import TrainConfig
    >>> from autofit.probe.model import build_model, describe
    >>> from autofit.probe.device import resolve_device
    >>> module, task = build_model("tiny-llama", peft_config={"peft_type": "IA3"})
    >>> c = derived_coefficients(module, describe(module, task=task), TrainConfig(),
    ...                          resolve_device("cpu"))
    >>> c["layer"]["c0"] > 0
    True
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import tempfile
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError, ValueDependentShapeError, fix
from autofit.memory.analytic._kept import below_kept, first_of_stacks, grads_outside, hidden_in
from autofit.memory.analytic._moments import (
    SHAPES,
    _add_moments,
    _AtShape,
    _form,
    _signed_form,
    _solve,
)
from autofit.memory.breakdown import Component

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from autofit.memory.simulate._recorder import Record, StorageRecorder
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import BlockSpec, ModelInfo

__all__ = ["derived_coefficients", "probe_shapes", "SHAPES"]


def probe_shapes(seq_len: int | None, limit: object = None) -> tuple[tuple[int, int], ...]:
    """The shapes a step of ``seq_len`` tokens is derived at: ``SHAPES``, their lengths
    doubled until the longest reaches ``seq_len`` (while within ``limit`` positions), so
    that the fits interpolate at the step's length rather than extrapolate from 128 tokens.
    A quadratic in the length is exact wherever the memory is one (every attention kept
    whole or not at all: the lengths scaled give the same coefficients); where it is not
    (a chunked linear attention, a block-padded encoder), the fit through 32, 64 and 128
    tokens put Bailing's hybrid 47% over at 256 tokens (doubled: 0.7% under).

        >>> probe_shapes(128) == SHAPES, probe_shapes(256)
        (True, ((2, 64), (2, 128), (2, 256), (4, 64)))
        >>> probe_shapes(4096, limit=1024)[2]
        (2, 1024)
    """
    top = max(t for _, t in SHAPES)
    k = 1
    while (seq_len is not None and top * k < seq_len
           and (not isinstance(limit, int) or top * k * 2 <= limit)):
        k *= 2
    return SHAPES if k == 1 else tuple((b, t * k) for b, t in SHAPES)


class _Memory:
    """What a process keeps: the coefficients derived or read (by key) and the folders it
    warned about (once each)."""

    def __init__(self) -> None:
        self.coefficients: dict[str, dict[str, Any]] = {}
        self.warned: set[str] = set()


@functools.lru_cache(maxsize=1)
def _memory() -> _Memory:
    """This process's one ``_Memory``."""
    return _Memory()


def _simulate() -> str:
    """How the caller asks for the simulation (the flag on the command line)."""
    return fix("--method simulate", "method='simulate'")
_log = logging.getLogger("autofit")


def _key(info: ModelInfo, config: TrainConfig, device: DeviceInfo,
         shapes: tuple[tuple[int, int], ...] = SHAPES) -> str:
    from autofit.knobs.registry import patch_key
    from autofit.probe.model import fingerprint

    target = device.name if device.allocator == "cuda" else "cpu"
    scaled = [] if shapes == SHAPES else [shapes]  # (the base shapes' keys as they were)
    grads_in = ["input_grads"] if input_grads(info, config) else []
    return json.dumps([fingerprint(info), config.precision, config.chunked_loss, target,
                       *patch_key(config), *scaled, *grads_in], sort_keys=True, default=str)


def input_grads(info: ModelInfo, config: TrainConfig) -> bool:
    """Whether the step's input embeddings' output requires grad where the probe's would not:
    checkpointing makes it (transformers' ``activation_checkpointing_enable`` calls
    ``enable_input_require_grads``), which matters where the embeddings are frozen (an
    adapter's step): the ops between them and the first block then save their inputs
    (Pegasus', BART's and T5's scaling, norm and dropout; with LoRA and checkpointing
    Pegasus, BART, mBART and T5 were 7-10% under their simulations), and the first block's
    own ops theirs."""
    return bool(config.gradient_checkpointing) and not any(
        g.trainable for g in info.params if g.role == "embedding")


def _kinds(blocks: list[torch.nn.Module]) -> list[tuple[int, int]]:
    """The blocks to keep, as (index, how many blocks it stands for), in order: per kind
    of block (alike in modules, parameters — shape, dtype, trainable — and buffers; most
    models have one kind, adaption prompt's adapted top layers are a second) its first
    block for itself and its second for the rest. The first block of a model is not like
    the others: its input (a frozen embedding's output) needs no gradient, so it keeps
    less for backward than the blocks after it. A block's forward hooks are part of its
    kind: ShadowPEFT wraps the hidden states at the first block and unwraps them at the
    last, which a stack cut to its first blocks never ran (its step failed: "'ShadowCarrier'
    object has no attribute 'dtype'")."""
    def hooks(blk: torch.nn.Module) -> tuple[str, ...]:
        return tuple(getattr(h, "__name__", type(h).__name__)
                     for d in (blk._forward_pre_hooks, blk._forward_hooks) for h in d.values())

    seen: dict[tuple, list[int]] = {}
    for i, blk in enumerate(blocks):
        sig = (tuple((n, type(m).__name__) for n, m in blk.named_modules()),
               tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                     for n, p in blk.named_parameters()),
               tuple((n, tuple(b.shape), str(b.dtype)) for n, b in blk.named_buffers()),
               hooks(blk))
        seen.setdefault(sig, []).append(i)
    kept = []
    for idx in seen.values():
        kept.append((idx[0], 1))
        if len(idx) > 1:
            kept.append((idx[1], len(idx) - 1))
    return sorted(kept)


def _stacks(base: torch.nn.Module) -> list[tuple[str, torch.nn.ModuleList]]:
    """The stacks of blocks of ``base``: one, or an encoder-decoder's two (encoder first)."""
    from autofit.probe.model import _layer_lists

    lists = _layer_lists(base)
    if len(lists) == 2:
        lists.sort(key=lambda nl: "decoder" in nl[0])
        if "decoder" in lists[0][0] or "decoder" not in lists[1][0]:
            lists = []  # two stacks, but not an encoder's and a decoder's
    if len(lists) not in (1, 2):
        raise BadInputError("analytic coefficients are derived for one stack of blocks, or "
                            "an encoder's and a decoder's; use " + _simulate())
    return lists


def _forward_saved(module: torch.nn.Module, config: TrainConfig, task: str, device: DeviceInfo,
                   shapes: tuple[tuple[int, int], ...] = SHAPES, grads_in: bool = False
                   ) -> tuple[list[_AtShape], tuple[int, list[list[int]]]]:
    """What the forward keeps and makes (``_AtShape``) at each of ``SHAPES``, on one fake
    clone that keeps one block of each kind per stack; and the trainable elements no
    gradient reaches (``_unreached``: their elements and shapes).

    The transient is what the forward holds at its highest beyond what it keeps for
    backward by then, with the share of all it keeps that it keeps by then
    (``_forward_transient``). The largest kind matters where kinds differ: a hybrid's
    linear-attention block keeps ten times its full-attention block (Qwen3-Next), and
    checkpointing recomputes one block at a time (27% under with their mean)."""
    import contextlib
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.knobs.registry import patched, recorded
    from autofit.memory.simulate._bnb import bnb_target
    from autofit.memory.simulate._model import fake_clone, prepare_for_training, unwrap
    from autofit.memory.simulate._step import (
        forward_loss,
        graph_host_bytes,
        graph_nodes,
    )

    spec = config.precision_spec
    target = "cuda" if device.allocator == "cuda" else "cpu"
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    out: list[_AtShape] = []
    dead: tuple[int, list[list[int]]] = (0, [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake_mode:
            model = fake_clone(module, float_dtype=getattr(torch, spec.param_dtype))
            prepare_for_training(model, gradient_checkpointing=False)
            if grads_in and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()  # as checkpointing does (``input_grads``)
        stacks = _one_block_per_kind(unwrap(model))
        all_kept = [blk for kept, _, _ in stacks for blk in kept]
        # a first step at the first shape, not kept: one-time allocations (a model's
        # lazily built caches) would make its events other than the other shapes'
        for step, (batch, seq_len) in enumerate((shapes[0], *shapes)):
            rec = _recorder(model, device)
            spans: list[list[int]] = [[0, 0] for _ in all_kept]
            back: list[int] = [-1 for _ in all_kept]  # where each block's backward starts
            fired: list[int] = []  # ... every start (a block run twice, ALBERT's, starts twice)
            runs = [0 for _ in all_kept]  # each block's forward runs
            # each block's hidden states in: bytes, their record's id, its other inputs'
            inputs = [(0, 0, frozenset[int]()) for _ in all_kept]
            handles = _mark_blocks(all_kept, rec, spans, back, fired, runs, inputs)
            ctx: Any = contextlib.nullcontext()
            if device.allocator == "cuda":
                from autofit.memory.simulate._cuda import CudaSemantics

                ctx = CudaSemantics(device)
            recorded(config, rec, target)  # what a knob's value runs differently
            with (fake_mode, rec, ctx, bnb_target(model, rec, target),
                  patched(config, model)):
                rec.phase = "forward"
                loss, data, kwargs = forward_loss(model, config, task, batch, seq_len, rec,
                                                   "cuda" if device.allocator == "cuda" else "cpu")
                alive = {id(r) for r in rec.live_records() if r.category != Component.WEIGHTS}
                log = rec.events()
                per_kind = [
                    sum(r.size for kind, r, _ in log[a:b] if kind == "alloc" and id(r) in alive)
                    for a, b in spans
                ]
                total = sum(r.size for r in rec.live_records() if id(r) in alive)
                if device.allocator != "cuda":  # the graph's own host memory, as simulated
                    total += graph_host_bytes(loss)
                transient, moments = _forward_transient(log, alive, spans)
                heights = _block_heights(log, spans)
                if step == 1:  # (the graph is the same at every shape)
                    dead = _unreached(loss, model, stacks)
                del data, kwargs
                rec.phase = "backward"
                if loss.requires_grad:
                    with rec.eager_accumulation(graph_nodes(loss)):
                        loss.backward()
                del loss
                grads = {id(r) for p in model.parameters() if p.grad is not None
                         and (r := rec.record_of(p.grad)) is not None}
                events = rec.events()  # (the forward's and the backward's)
                block_bwd, block_moments = _block_backward(events, back, grads, stacks)
                top_bwd, top_moments = _top_backward(events, len(log), fired, grads)
                below = below_kept(events, spans[0][0], back[0], grads, *inputs[0][1:])
                outside = grads_outside(events, back[0], rec, model, all_kept)
                model.zero_grad(set_to_none=True)
            for h in handles:
                h.remove()
            per_block, largest, highest, stack_runs, blocks = _per_stack(stacks, per_kind,
                                                                          heights, runs)
            if step:
                out.append(_AtShape(per_block, largest, highest,
                                    int(total - sum(per_kind) + blocks), transient, moments,
                                    block_bwd, block_moments, stack_runs, top_bwd,
                                    top_moments,
                                    len(rec.half_matmuls), rec.half_step(),
                                    first_of_stacks(stacks, [b for b, _, _ in inputs]),
                                    below, outside, rec.log_softmax[1]))
    return out, dead


def _recorder(model: torch.nn.Module, device: DeviceInfo) -> StorageRecorder:
    """A recorder of one probe step: ``model``'s weights tracked, and on a CPU what its
    kernels copy inside (as the simulation records them)."""
    from autofit.memory.simulate._model import weight_tensors
    from autofit.memory.simulate._recorder import StorageRecorder

    rec = StorageRecorder()
    if device.allocator != "cuda":
        rec.on_cpu()
    for t in weight_tensors(model):
        rec.track(t, Component.WEIGHTS)
    return rec


def _per_stack(stacks: list[tuple], per_kind: list[int], heights: list[int], runs: list[int]
               ) -> tuple[list[float], list[float], list[float], list[float], float]:
    """Per stack, from its kept blocks' (``per_kind``: alive at the loss, ``heights``,
    ``runs``): a block's mean alive at the loss, the largest kind's, a block forward's
    highest point, a block's forward runs; and all the kept blocks stand for together."""
    per_block, largest, highest, stack_runs, at = [], [], [], [], 0
    blocks = 0.0
    for kept, kinds, n in stacks:
        mine = per_kind[at:at + len(kept)]
        ran = runs[at:at + len(kept)]
        highest.append(float(max(heights[at:at + len(kept)])))
        at += len(kept)
        stack = sum(b * c for b, (_, c) in zip(mine, kinds, strict=True))
        per_block.append(stack / n)  # the kept blocks stand for all of their kind
        largest.append(float(max(mine)))
        # a block's span is its last run's: its earlier runs' activations are in the
        # total, outside the spans (a looped model's, Dory's, run twice)
        stack_runs.append(sum(r * c for r, (_, c) in zip(ran, kinds, strict=True)) / n)
        blocks += stack
    return per_block, largest, highest, stack_runs, blocks


def _one_block_per_kind(base: torch.nn.Module) -> list[tuple[Any, list[tuple[int, int]], int]]:
    """Keep one block of each kind in each of ``base``'s stacks (in place, on the fake
    clone); per stack: (the kept blocks, [(index, how many it stands for)], blocks)."""
    import torch

    stacks = []
    for owner_name, layers in _stacks(base):
        kinds = _kinds(list(layers))
        kept = torch.nn.ModuleList([layers[i] for i, _ in kinds])
        parent_name, _, attr = owner_name.rpartition(".")
        setattr(base.get_submodule(parent_name) if parent_name else base, attr, kept)
        stacks.append((kept, kinds, sum(c for _, c in kinds)))
    return stacks


def _mark_blocks(blocks: list[torch.nn.Module], rec: StorageRecorder,
                 spans: list[list[int]], back: list[int], fired: list[int],
                 runs: list[int], inputs: list[tuple[int, int, frozenset[int]]]
                 ) -> list[Any]:
    """Hooks that note, in ``spans``, where each block's forward starts and ends in
    ``rec``'s log (its last run), in ``runs`` how many times it runs forward, in ``inputs``
    the bytes of the hidden states it takes in (``hidden_in``; its last run), in ``back``
    where its backward starts (the last time: a block run twice, ALBERT's shared layer,
    starts twice) and in ``fired`` every block backward's start; their handles."""
    def started(i: int) -> None:
        back[i] = len(rec._log)
        fired.append(len(rec._log))

    def entered(i: int, args: tuple, kwargs: dict) -> None:
        spans[i][0] = len(rec._log)
        runs[i] += 1
        inputs[i] = hidden_in(args, kwargs, rec)

    import torch

    def ended(i: int, out: object) -> None:
        spans[i][1] = len(rec._log)
        # a block that returns a list (OpenAI-GPT's) gets no full backward hook from torch:
        # its backward starts where its output's gradient is made (3.1% under with the
        # standard block's rule in its place)
        if isinstance(out, list) and out and isinstance(out[0], torch.Tensor) \
                and out[0].requires_grad:
            out[0].register_hook(lambda _g: started(i))

    handles = []
    for i, blk in enumerate(blocks):
        handles.append(blk.register_forward_pre_hook(
            lambda _m, a, kw, i=i: entered(i, a, kw), with_kwargs=True))
        handles.append(blk.register_forward_hook(lambda _m, _a, o, i=i: ended(i, o)))
        handles.append(blk.register_full_backward_pre_hook(
            lambda _m, _g, i=i: started(i)))
    return handles


def _block_heights(log: list[tuple[str, Record, str]], spans: list[list[int]]) -> list[int]:
    """Per kept block, the most bytes (weights apart) alive during its forward above what
    was alive when it started: what it keeps and its scratch at their highest together.
    Checkpointing's recompute reaches it again in backward: Qwen3-Next's chunked delta
    rule is 21% above what its block keeps."""
    live, series = 0, []
    for kind, r, _ in log:
        if r.category != Component.WEIGHTS:
            live += r.size if kind == "alloc" else -r.size
        series.append(live)
    out = []
    for a, b in spans:
        start = series[a - 1] if a > 0 else 0
        out.append(max(series[a:b], default=start) - start)
    return out


def _block_backward(log: list[tuple[str, Record, str]], back: list[int], grads: set[int],
                    stacks: list[tuple]) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """Per stack, the most bytes one of its blocks' backward adds above what is alive when
    it starts, weights and the parameters' gradients apart (those are counted as the model
    state): the block's scratch and its input's gradient. ``back``: per kept block, the
    log's index where its backward starts; a block's backward runs to the next block's
    start (they go in reverse), the first block's to the end (its full backward hook, an
    end, fires at once when its input needs no gradient). Kimi-Linear's chunked delta rule
    makes 1.5 GiB of it at 4 x 128 tokens where a standard block's rule says 0.3 GiB.
    Also per stack its moments, as ``_top_backward``'s: the events of its kept blocks'
    backwards (``"a"``/``"f"``) and at each the same difference (Ergo's dense first block
    peaks at its weight's 16-bit gradient at 64 tokens and at its squared ReLU's backward,
    three (N, 32768) temporaries, at 512: one fit of the highest points was 32 MiB low)."""
    live, series = 0, []
    for kind, r, _ in log:
        if r.category != Component.WEIGHTS and id(r) not in grads:
            live += r.size if kind == "alloc" else -r.size
        series.append(live)
    order = sorted((a, i) for i, a in enumerate(back) if a > 0)
    # (none where no block's backward hook fired: OpenAI-GPT's blocks)
    nexts = [e for e, _ in order[1:]] + [len(series)] if order else []
    ends = {i: e for (_, i), e in zip(order, nexts, strict=True)}
    out, moments, at = [], [], 0
    for kept, _, _ in stacks:
        most, kinds, values = 0, [], []
        for i in range(at, at + len(kept)):
            a = back[i]
            if a > 0:
                most = max(most, max(series[a:ends[i]], default=series[a - 1]) - series[a - 1])
                kinds += ["a" if log[j][0] == "alloc" else "f" for j in range(a, ends[i])]
                values += [v - series[a - 1] for v in series[a:ends[i]]]
        out.append(most)
        moments.append(("".join(kinds), values))
        at += len(kept)
    return out, moments


def _top_backward(log: list[tuple[str, Record, str]], loss_at: int, fired: list[int],
                  grads: set[int]) -> tuple[int, tuple[str, list[int]]]:
    """What backward holds from the top block's backward on above what was alive at the
    loss (``loss_at``: the log's length then), at its highest: weights and the parameters'
    gradients apart, but for the gradients made from the loss on (the head's and the
    blocks': they stand beside the activations not yet freed). At the top block, the first
    to run: what the head's backward freed (a classifier's input, the final norm's), then
    the block's scratch; a lower block's is beside fewer activations (the blocks above it
    freed theirs: in the clone some of them) and more gradients, and may be the larger
    (Kimi-Linear's linear-attention first block: 25% under with the top block's alone;
    Ergo's dense first block below a mixture-of-experts one, whose own gradients its
    32768-wide feed-forward's backward stands beside: 5.2% under without them).
    ``fired``: every block backward's start (a shared block's each time, ALBERT's).
    The standard block's rule (two of its widest activations' gradients and two of its
    inputs', beside all the activations) put the zoo's small LoRA token classifiers 2-3 MiB
    of ~30 high (8-13% over). Also the moments, as ``_forward_transient``'s: the events
    from the top block's backward on (``"a"``/``"f"``) and at each the same difference
    (ALBERT's classifier peaks at one moment at 2 x 32 tokens and at another at 2 x 64: one
    fit of the highest points was 1 MiB low at 4 x 128). 0 where no block's backward ran."""
    starts = sorted(a for a in fired if a > 0)
    if not starts:
        return 0, ("", [])
    live = at_loss = made = 0
    kinds, series = [], []
    for i, (kind, r, _) in enumerate(log):
        if id(r) in grads:
            if kind == "alloc" and loss_at <= i:
                made += r.size
        elif r.category != Component.WEIGHTS:
            live += r.size if kind == "alloc" else -r.size
        if i == loss_at - 1:
            at_loss = live
        if i >= starts[0] - 1:
            kinds.append("a" if kind == "alloc" else "f")
            series.append(live + made)
    series = [v - at_loss for v in series]
    return max(series), ("".join(kinds), series)


def _unreached(loss: torch.Tensor, model: torch.nn.Module, stacks: list[tuple]
               ) -> tuple[int, list[list[int]]]:
    """Trainable elements the loss's graph does not reach: they get no gradient, so the
    optimizer keeps no state for them (DeepSeek sparse attention's indexer, which picks
    the keys by ``topk``: 57% of GLM-MoE-DSA's small model; its analytic estimate was
    55% over), nor steps them. The kept blocks stand for all blocks of their kind. Also
    the shapes no trainable parameter of which is reached (sorted)."""
    import torch

    from autofit.memory.simulate._step import graph_nodes

    reached = {id(var) for fn in graph_nodes(loss)  # AccumulateGrad nodes: leaves' gradients
               if isinstance(var := getattr(fn, "variable", None), torch.Tensor)}
    times = {}
    for kept, kinds, _ in stacks:
        for blk, (_, count) in zip(kept, kinds, strict=True):
            for p in blk.parameters():
                times[id(p)] = count
    trainable = [p for p in model.parameters() if p.requires_grad]
    dead = [p for p in trainable if id(p) not in reached]
    live_shapes = {tuple(p.shape) for p in trainable if id(p) in reached}
    shapes = sorted({tuple(p.shape) for p in dead} - live_shapes)
    return sum(p.numel() * times.get(id(p), 1) for p in dead), [list(s) for s in shapes]


def _forward_fit(at: list[_AtShape], config: TrainConfig,
                 shapes: tuple[tuple[int, int], ...] = SHAPES) -> tuple[dict[str, float], float]:
    """The forward's transient fitted over the shapes, and the share of the activations it
    stands beside (the largest of the shapes').

    Without checkpointing the forward candidate is the transient beside ``share`` of the
    activations, so each shape's transient is fitted as it stands beside that share of
    what its forward keeps: the fit then gives back every fitted shape's forward peak.
    Where the forward's events differ with the shape its peak is at moments of other
    shares (Qwen3-Next's causal LM with LoRA: at 4 x 32 inside the first block's
    recurrence, at 0.65, at the other shapes at the loss); its transient fitted as it
    was, beside the largest share, counted that shape's activations not yet made on top,
    and doubled in the batch (21% over at 4 x 128). With checkpointing the share is 1 and
    what the forward keeps is the checkpoints': the transients as they are."""
    share = max(a.transient[1] for a in at)
    return _solve([float(a.transient[0]) if config.gradient_checkpointing
                   else a.transient[0] - (share - a.transient[1]) * a.transient[2]
                   for a in at], shapes), share


def _forward_transient(log: list[tuple[str, Record, str]], alive: set[int],
                       spans: list[list[int]] = ()
                       ) -> tuple[tuple[int, float, int], tuple[str, list[int], list[float],
                                                                list[int]]]:
    """At the forward's highest point (weights apart), the bytes alive then that backward
    does not keep: an op's scratch, a block's intermediate results (an indexer's (T, T)
    scores over every head of AXK2's sparse attention, freed within the block). A model
    whose forward peaks above what backward starts with has its peak there: the analytic
    phases take it as the ``forward`` candidate. Also the share of what backward keeps that
    is made by then, and all it keeps.

    In the same walk, the moments: the forward's events (``"a"``/``"f"`` per allocation
    and free, weights apart: the same string at every shape when the forward runs the same
    ops) and, at each event, the same transient and share (at every moment, not only at
    the highest), and what backward keeps that was made outside the blocks (``spans``) by
    then: with checkpointing the blocks keep their inputs only, and a moment at the head
    stands beside all of them but beside none of what the loss keeps after it."""
    in_block = bytearray(len(log))
    for a, b in spans:
        in_block[a:b] = b"\x01" * (b - a)
    kinds, series, made, outside = [], [], [], []
    live = kept = base = peak = peak_at = 0
    for i, (kind, r, _) in enumerate(log):
        if r.category == Component.WEIGHTS:
            continue
        live += r.size if kind == "alloc" else -r.size
        if kind == "alloc" and id(r) in alive:
            kept += r.size
            base += 0 if in_block[i] else r.size
        if live > peak:
            peak, peak_at = live, len(series)
        kinds.append("a" if kind == "alloc" else "f")
        series.append(live - kept)
        made.append(kept)
        outside.append(base)
    shares = [k / kept if kept else 1.0 for k in made]
    highest = (max(series[peak_at], 0), shares[peak_at], kept) if series else (0, 1.0, 0)
    return highest, ("".join(kinds), series, shares, outside)


def _probe(module: torch.nn.Module, info: ModelInfo, config: TrainConfig, device: DeviceInfo,
           shapes: tuple[tuple[int, int], ...]
           ) -> tuple[list[_AtShape], tuple[int, list[list[int]]]]:
    """``_forward_saved``, with what it cannot follow refused in one line."""
    try:
        return _forward_saved(module, config, info.task, device, shapes,
                              input_grads(info, config))
    except ValueDependentShapeError as e:  # (the table's coefficients were 33% under: LED)
        raise ValueDependentShapeError(
            f"{info.name}: its step makes tensors whose shapes depend on values ({e.op}), "
            "which neither estimate can follow; measure it ("
            + fix("autofit measure", "autofit.measure") + ")", e.op) from None
    except RuntimeError as e:  # xLSTM's step trains with checkpointing only (transformers')
        from autofit.errors import inplace_autograd_error

        refused = inplace_autograd_error(e, info.name or "the model", config)
        if refused is None:
            raise
        if not config.gradient_checkpointing:  # a run fails the same way
            raise refused from None
        raise BadInputError(f"{info.name}: its step without checkpointing fails in autograd "
                            "(a tensor saved for backward is modified in place), so the "
                            "analytic coefficients cannot be derived from it; use "
                            + _simulate()) from None


def derived_coefficients(module: torch.nn.Module, info: ModelInfo, config: TrainConfig,
                         device: DeviceInfo, seq_len: int | None = None) -> dict[str, Any]:
    """Coefficients for ``estimate_analytic`` in the form of a ``coefficients.json``
    entry (``layer``: per block, ``base``: outside the blocks), derived from ``module``'s
    own forward (see the module docstring), at the shapes for a step of ``seq_len`` tokens
    (``probe_shapes``; None: ``SHAPES``)."""
    key = _key(info, config, device, shapes := probe_shapes(seq_len, info.max_position_embeddings))
    memory = _memory().coefficients
    hit = memory.get(key)
    if hit is None:
        hit = _load(key)
        if hit is not None:
            memory[key] = hit
    if hit is not None:
        return hit
    limit = info.max_position_embeddings
    if isinstance(limit, int) and max(t for _, t in shapes) > limit:
        raise BadInputError(f"{info.name} takes at most {limit} positions; "
                            "use " + _simulate())
    roles: tuple[str | None, ...] = (("encoder", "decoder") if info.is_encoder_decoder
                                     else (None,))
    counts = ([_role_count(info, r) for r in roles] if info.is_encoder_decoder
              else [info.num_layers or 0])
    if 0 in counts:
        raise BadInputError(f"{info.name}: no transformer blocks found; use " + _simulate())
    at, dead = _probe(module, info, config, device, shapes)
    if any(len(a.per_block) != len(roles) for a in at):
        raise BadInputError(f"{info.name}: its stacks of blocks are not the ones it "
                            "describes; use " + _simulate())
    lays = [_solve([a.per_block[k] for a in at], shapes) for k in range(len(roles))]
    largest = [_solve([a.largest[k] for a in at], shapes) for k in range(len(roles))]
    highest = [_solve([a.block_forward[k] for a in at], shapes) for k in range(len(roles))]
    runs = at[0].runs  # a block's runs (Dory's twice: in the base, 23% over with checkpointing)
    base_vals = [a.total - sum(p * c * r for p, c, r in zip(a.per_block, counts, runs, strict=True))
                 for a in at]
    bas = _solve(base_vals, shapes)
    fwd, share = _forward_fit(at, config, shapes)
    kept_all = _solve([float(a.transient[2]) for a in at], shapes)  # all the forward keeps
    bwds = [_solve([float(a.block_backward[k]) for a in at], shapes) for k in range(len(roles))]
    top = _solve([float(a.top_backward) for a in at], shapes)
    ins = [_solve([a.block_input[k] for a in at], shapes) for k in range(len(roles))]
    below = _solve([float(a.below_kept) for a in at], shapes)
    # the share of the activations made by the forward's peak, the largest over the four
    # shapes: an encoder-decoder's peak in its encoder comes before any decoder activation
    # (Pegasus-X's padded blocks: 23% over with all of them), a hybrid's in its first,
    # linear-attention block's chunked recurrence, at 0.69-0.75 of what the forward keeps
    # (Qwen3-Next's classifier: 19-22% over with all of them). Where a one-stack model's
    # peak moves from one moment to another with the shape (CTRL's classifier: 0.59 at the
    # four shapes, 9.2% under at 4 x 128), its forwards run the same events and the
    # moments below are fitted one by one, each with its own share; this one is used
    # only where they cannot be (the events differ with the shape: a chunked recurrence)
    fwd["share"] = share
    if config.precision_spec.autocast:
        _without_copies(info, config, roles, counts, [lays, largest, highest], bas)

    def layer(lay: dict[str, float]) -> dict[str, float]:
        return {"h": 0.0, "kv": 0.0, "i": 0.0, "H": 0.0, "HT": 0.0, "c0": lay["a"],
                "T": lay["b"], "s": lay["s"], "F": max(lay["F"], 0.0)}

    coef: dict[str, Any] = {
        "layer": layer(lays[0]),
        # the largest kind of block (a hybrid's): what checkpointing recomputes at a time
        "layer_largest": _form(largest[0]),
        # ... and a block forward's highest point (what the recompute reaches again)
        "block_forward": _form(highest[0]),
        "base": {"h": 0.0, "V": 0.0, "c0": bas["a"], "T": bas["b"], "s": bas["s"],
                 "F": max(bas["F"], 0.0)},
        # the forward's transient above what it keeps (``_forward_transient``), and where
        # the forwards are alike, the moments that are its highest at some shape
        # (``_transient_moments``), each moment's share at a shape its kept bytes over all
        # the forward keeps (this)
        "forward": {**_form(fwd), "share": min(max(fwd["share"], 0.0), 1.0)},
        "forward_kept": _signed_form(kept_all),
        # a block backward's own scratch (``_block_backward``)
        "block_backward": _form(bwds[0]),
        # the top block's backward above what was alive at the loss (``_top_backward``):
        # signed, its constant too (the head's backward frees more than it makes)
        "top_backward": _signed_form(top),
        # the hidden states a block takes in: what checkpointing keeps of it
        "block_input": _form(ins[0]),
        # what the layers below the blocks keep through the blocks' backward
        # (``below_kept``): checkpointing recomputes every block beside it
        "below_kept": _form(below),
        "derived": True,
        # the step's 16-bit matmuls of distinct shapes, at one shape (the CPU's oneDNN
        # caches: ``cpu_library_cache_bytes``; blocks alike run the same ones)
        "half_matmuls": max(a.half_matmuls for a in at),
        # ... and its oneDNN primitives, whether it runs a 16-bit flash attention (an AMD
        # EPYC's rule tells the step's state from the process's: ``half_step``)
        "half_step": [max(a.half_step[0] for a in at), any(a.half_step[1] for a in at)],
    }
    _add_moments(coef, at, roles, shapes)
    _add_runs_and_dead(coef, runs, dead, at[-1].loss_elem)
    if info.is_encoder_decoder:  # "layer" is then an encoder block's, this a decoder's
        coef["layer_decoder"] = layer(lays[1])
        coef["block_backward_decoder"] = _form(bwds[1])
        coef["layer_largest_decoder"] = _form(largest[1])
        coef["block_forward_decoder"] = _form(highest[1])
        coef["block_input_decoder"] = _form(ins[1])
        # the gradients outside the blocks made by the encoder's backward (grads_outside)
        coef["encoder_grads_outside"] = float(at[-1].grads_outside)
    memory[key] = coef
    _store(key, coef)
    return coef


def _add_runs_and_dead(coef: dict[str, object], runs: list[float],
                       dead: tuple[int, list[list[int]]], loss_elem: int = 0) -> None:
    """Put a block's forward runs per stack (where not 1), the trainable parameters no
    gradient reaches (``_unreached``) and the loss's element size (``loss_elem``: its
    log-softmax's, 16-bit where the head does not upcast its 16-bit logits) into
    ``coef``."""
    if loss_elem:
        coef["loss_elem"] = loss_elem
    if any(r != 1 for r in runs):
        coef["layer_runs"] = [float(r) for r in runs]
    if dead[0]:  # trainable elements without a gradient (no state, no step either)
        coef["no_grad_numel"] = int(dead[0])
        if dead[1]:  # ... the shapes all of whose parameters are such
            coef["no_grad_shapes"] = dead[1]


def _without_copies(info: ModelInfo, config: TrainConfig, roles: tuple[str | None, ...],
                    counts: list[int], per_stack: list[list[dict[str, float]]],
                    base: dict[str, float]) -> None:
    """Take autocast's 16-bit weight copies, alive at the loss, out of the fits (in place):
    the analytic model counts them apart. Per block of a stack (``per_stack``: each a fit
    per stack) its share of the blocks' matmul weights; outside the blocks the LM head's
    (a 16-bit head is used as it is; a chunked loss is not autocast)."""
    for k, (role, count) in enumerate(zip(roles, counts, strict=True)):
        for fits in per_stack:
            fits[k]["F"] -= 2 * _matmul_numel(info, role) / count
    if not config.chunked_loss and (info.quant is None or info.dtype == "float32"):
        base["F"] -= info.head_numel * 2


def _disk_path(key: str):
    from autofit.probe.versions import cache_dir, library_versions

    text = json.dumps([key, _code_hash(), library_versions()], sort_keys=True)
    return cache_dir() / "derived" / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".json")


@functools.lru_cache(maxsize=1)
def _code_hash() -> str:
    """A hash of the code the derivation runs (the memory and probe packages): a change to
    the simulator or the model description makes stored coefficients stale by itself."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # autofit/
    h = hashlib.sha256()
    for pkg in ("memory", "probe"):  # their subpackages too
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _valid(coef: object) -> bool:
    """Whether ``coef`` reads as derived coefficients (finite numbers where they belong)."""
    if not isinstance(coef, dict) or coef.get("derived") is not True:
        return False
    parts = ["layer", "base"] + [p for p in ("layer_decoder", "forward", "block_backward",
                                             "top_backward", "forward_kept",
                                             "block_backward_decoder", "layer_largest",
                                             "layer_largest_decoder", "block_forward",
                                             "block_forward_decoder") if p in coef]
    shapes = coef.get("no_grad_shapes", [])
    if not isinstance(shapes, list) or not all(
            isinstance(s, list) and all(isinstance(d, int) for d in s) for s in shapes):
        return False
    runs = coef.get("layer_runs", [1.0])
    if not isinstance(runs, list) or not all(
            isinstance(r, int | float) and math.isfinite(r) and r > 0 for r in runs):
        return False
    moments = coef.get("forward_moments", [])
    more = [coef.get(k, []) for k in ("top_backward_moments", "block_backward_moments",
                                      "block_backward_decoder_moments")]
    if not isinstance(moments, list) or not all(isinstance(m, list) for m in more):
        return False
    moments = moments + [m for ms in more for m in ms] + [
        m["kept"] for m in moments if isinstance(m, dict) and "kept" in m]
    for d in [coef.get(part) for part in parts] + moments:
        names = ("c0", "T", "s", "F")
        if not isinstance(d, dict) or not all(
                isinstance(d.get(n), int | float) and not isinstance(d.get(n), bool)
                and math.isfinite(d[n]) for n in names):
            return False
    return True


def _load(key: str) -> dict[str, Any] | None:
    """The coefficients stored on disk for ``key``, or None (absent, unreadable, not valid)."""
    try:
        coef = json.loads(_disk_path(key).read_text())
    except (OSError, ValueError):
        return None
    return coef if _valid(coef) else None


def _store(key: str, coef: dict[str, object]) -> None:
    """Write ``coef`` for ``key`` atomically (a reader never sees half a file); a folder that
    cannot be written is warned about once per folder, and the run goes on."""
    path = _disk_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".derived-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(coef, f)
            os.replace(tmp, path)
        except BaseException:
            with _suppress():
                os.unlink(tmp)
            raise
    except OSError as e:
        folder = str(path.parent)
        warned = _memory().warned
        if folder not in warned:
            warned.add(folder)
            _log.warning("autofit: cannot keep derived coefficients in %s (%s); they are "
                         "derived again in the next process (set AUTOFIT_CACHE_DIR to a "
                         "writable folder)", folder, e.strerror or e)


def _suppress():
    import contextlib

    return contextlib.suppress(OSError)


def _in_role(block: BlockSpec, role: str | None) -> bool:
    """Whether ``block`` belongs to the stack ``role`` names (None: the only one)."""
    return role is None or (block.role == "encoder") == (role == "encoder")


def _role_count(info: ModelInfo, role: str | None) -> int:
    return sum(b.count for b in info.blocks if _in_role(b, role))


def _matmul_numel(info: ModelInfo, role: str | None) -> int:
    """Elements of the matmul weights of the blocks of stack ``role`` (what autocast copies;
    none for a bitsandbytes-quantized base)."""
    if role is None or info.quantization is not None:
        return info.block_matmul_numel
    return sum(b.count * sum(i * o for _, i, o, _ in b.linears) for b in info.blocks
               if _in_role(b, role))
