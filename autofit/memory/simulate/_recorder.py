"""The allocation stream of a simulated training step, recorded at the dispatch level.

`StorageRecorder` is a ``TorchDispatchMode`` that sees every ATen op the step runs
(forward, autograd's backward, the optimizer) and the tensors each op returns. A
storage it has not seen before is an allocation; a ``weakref`` to the storage's
Python object (which torch keeps alive exactly as long as the C++ ``StorageImpl``)
fires when the last tensor or autograd node holding it dies: that is the free. This
is how torch's own ``MemTracker`` (torch/distributed/_tools/mem_tracker.py) sees
storages; it works the same on FakeTensors, whose storages are meta storages with
the real ``nbytes``.

Storages resized in place (``UntypedStorage.resize_``, which no dispatch mode sees: FSDP2
frees and re-allocates its unsharded parameters so, ``_fsdp_param.free_storage`` /
``alloc_storage``) are followed by patching ``resize_`` while the recorder is active, as
torch's ``MemTracker._track_resize`` does: a resize to 0 is a free, a resize of an empty
storage an allocation (category ``resize_category``). Ops on tensor subclasses that
desugar into ops on plain tensors (``DTensor``: FSDP2's sharded parameters) are handed
back to the subclass (``NotImplemented``), so the recorder sees the local tensors' ops.

Each allocation gets a category once the step is over, as the analytic breakdown
defines them: parameters and buffers are ``weights``; a storage that became a
parameter's ``.grad`` is ``gradients``; one created in the optimizer phase that
outlives it is ``optimizer_states``; one created in forward and still alive at the
end of forward is ``activations``; everything else is ``temporaries``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autofit.memory.breakdown import Component
from autofit.memory.simulate._cpu_kernels import cpu_kernel_temporaries, mkldnn_cpu
from autofit.memory.simulate._values import (
    faked,
    forget,
    made_from_nothing,
    on_values,
    real_index,
    real_item,
    values_of,
    with_values,
)

__all__ = ["StorageRecorder", "Record"]


class Record:
    """One storage: its allocation, size, phase and (once known) category."""

    __slots__ = ("id", "size", "phase", "micro", "category", "alive", "host", "param",
                 "storage", "__weakref__")

    def __init__(self, rid: int, size: int, phase: str, micro: int, category: str | None) -> None:
        self.id = rid
        self.size = size  # bytes, the storage's nbytes
        self.phase = phase
        self.micro = micro  # micro-step index (gradient accumulation) it was created in
        self.category = category
        self.alive = True
        self.host = False  # lives in host memory on the target (e.g. optimizer step counters)
        self.param = -1  # a gradient's parameter (index among the trainable ones)
        self.storage = True  # False: bytes no tensor holds (``StorageRecorder.hold``)


class StorageRecorder(TorchDispatchMode):
    """Records every storage created and freed while active (see the module docstring).

    Usage::

        rec = StorageRecorder()
        rec.track(param, "weights")          # storages made before recording
        with fake_mode, rec:
            rec.phase = "forward"
            ...
        events = rec.events()                # [(kind, Record, phase_at_event)]
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = ""
        self.micro = 0
        self._live: dict[int, tuple[Record, Any]] = {}  # id(storage) -> (record, weakref)
        self._log: list[tuple[str, Record, str]] = []  # (kind, record, phase at the event)
        self._next = 0
        self.num_ops = 0
        # op -> f(args, kwargs) -> bytes a kernel allocates internally while it runs
        self.workspaces: dict[Any, Any] = {}
        self.keepalive: list[Any] = []  # training state that outlives the recorded steps
        # op -> Python implementation to run instead of the op's fake kernel, under this
        # mode, so that the tensors it creates are seen (e.g. bitsandbytes' CPU kernels)
        self.decompositions: dict[Any, Any] = dict(_GROUPED_MM)
        self._decomposing = False
        # (label, index into the log): where each micro step and optimizer step begins
        self.marks: list[tuple[str, int]] = []
        # category of a storage grown back by resize_ (FSDP2's unsharded parameters)
        self.resize_category: str | None = Component.WEIGHTS
        self._orig_resize: Any = None
        self._depth = 0
        # > 0 while ops run that allocate nothing on the target (DTensor's sharding
        # propagation computes output metadata on global-shape fake tensors)
        self.paused = 0
        # under ``eager_accumulation``: the autograd node whose outputs the engine is
        # summing into the next nodes' buffers now, if it is
        self._summing: torch.autograd.graph.Node | None = None
        # the 16-bit matmuls of distinct shapes the step runs (op, operand shapes): on a CPU,
        # oneDNN keeps a primitive and its JIT-compiled kernels for each (``_cpu_cache``)
        self.half_matmuls: set[tuple[Any, ...]] = set()
        # ... keyed as oneDNN keys its primitives, by the operands' layouts too (a square
        # linear's forward ``x @ W.t()`` and input gradient ``g @ W`` are two), and whether
        # a 16-bit flash attention ran (its brgemm kernels keep state per length)
        self.half_primitives: set[tuple[Any, ...]] = set()
        # a CPU target's step: the copies its kernels make inside (``_cpu_kernels``), and
        # whether its 16-bit matmuls go to oneDNN (an AVX512 CPU)
        self.cpu_kernels = False
        self.cpu_mkldnn = False
        self.half_attention = False
        # the largest log-softmax the step runs, (elements, element size): the loss's over
        # the vocabulary, whose dtype tells whether the model upcasts its logits first
        # (transformers' loss functions do; a head that calls CrossEntropyLoss on 16-bit
        # logits -- BERT's and T5's -- does not)
        self.log_softmax: tuple[int, int] = (0, 0)

    def __enter__(self) -> StorageRecorder:
        if self._depth == 0:
            self._patch_resize()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *args: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._restore_resize()
        return super().__exit__(*args)

    def _patch_resize(self) -> None:
        """Follow ``UntypedStorage.resize_`` (invisible to dispatch modes) while active."""
        original = self._orig_resize = torch.UntypedStorage.resize_
        recorder = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            before = st.nbytes()
            out = original(st, size)
            after = st.nbytes()
            key = id(st)
            if after != before and key in recorder._live:
                recorder._free(key)
            if after > 0 and after != before:
                recorder._track_storage(st, recorder.resize_category)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    def _restore_resize(self) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
            self._orig_resize = None

    def mark(self, label: str) -> None:
        """Note that ``label`` (e.g. ``"step1/micro0"``, ``"step1/optimizer"``) starts here."""
        self.marks.append((label, len(self._log)))

    # ------------------------------------------------------------------ tracking
    def track(self, t: torch.Tensor, category: str | None = None) -> Record | None:
        """Record ``t``'s storage as allocated now (no-op if already seen or empty)."""
        return self._track_storage(_local(t).untyped_storage(), category)

    def _track_storage(self, st: torch.UntypedStorage, category: str | None) -> Record | None:
        key = id(st)
        hit = self._live.get(key)
        if hit is not None:
            rec = hit[0]
            size = st.nbytes()
            if size != rec.size:  # resized in place (out= ops, resize_): free + alloc
                self._free(key)
            else:
                if category is not None and rec.category is None:
                    rec.category = category
                return rec
        size = st.nbytes()
        if size == 0:
            return None
        rec = Record(self._next, size, self.phase, self.micro, category)
        self._next += 1
        # NB: the callback runs while the StorageImpl is destroyed, before its id can be
        # reused, so `key` cannot name a newer storage yet.
        ref = weakref.ref(st, lambda _r, key=key: self._free(key))
        self._live[key] = (rec, ref)
        self._log.append(("alloc", rec, self.phase))
        return rec

    def record_of(self, t: torch.Tensor) -> Record | None:
        """The live record of ``t``'s storage, if it was tracked."""
        hit = self._live.get(id(_local(t).untyped_storage()))
        return hit[0] if hit is not None else None

    def _free(self, key: int) -> None:
        hit = self._live.pop(key, None)
        if hit is None:
            return
        rec = hit[0]
        rec.alive = False
        self._log.append(("free", rec, self.phase))

    def live_records(self) -> Iterable[Record]:
        """Records alive now."""
        return [r for r, _ in self._live.values()]

    # ------------------------------------------------------------------ categories
    def mark_live(self, category: str, *, phase: str, micro: int | None = None) -> None:
        """Give ``category`` to live, uncategorised records created in ``phase``."""
        for rec, _ in self._live.values():
            if (
                rec.category is None
                and rec.phase == phase
                and (micro is None or rec.micro == micro)
            ):
                rec.category = category

    def events(self) -> list[tuple[str, Record, str]]:
        """The log so far: (``"alloc"`` | ``"free"``, record, phase at the event)."""
        return list(self._log)

    def hold(self, size: int, category: str) -> Record:
        """Record ``size`` bytes that are not a storage as allocated now (the autograd
        graph's host memory); ``release`` frees them."""
        rec = Record(self._next, size, self.phase, self.micro, category)
        rec.storage = False
        self._next += 1
        self._log.append(("alloc", rec, self.phase))
        return rec

    def release(self, rec: Record) -> None:
        """Free what ``hold`` recorded."""
        rec.alive = False
        self._log.append(("free", rec, self.phase))

    def half_step(self) -> tuple[int, bool]:
        """The 16-bit oneDNN primitives the step ran and whether it ran a 16-bit flash
        attention (``cpu_library_cache_bytes``'s ``half_step``)."""
        return len(self.half_primitives), self.half_attention

    # ------------------------------------------------------------------ accumulation
    @contextlib.contextmanager
    def eager_accumulation(self, nodes: Iterable[torch.autograd.graph.Node]) -> Iterator[None]:
        """Sum the gradients that meet at one tensor as eager autograd does, during a
        ``backward()`` over the graph of ``nodes`` (every node of it, ``graph_nodes``).

        Where two gradients of one tensor meet (a residual, a tensor read by several ops,
        slices of one tensor), autograd's ``InputBuffer::accumulate`` (input_buffer.cpp)
        adds the new one into the buffered one in place when nothing else holds that
        tensor (``can_accumulate_inplace``), else allocates ``old + new`` (only a sparse
        buffered gradient is summed into the new one). Under a Python dispatch mode every
        tensor has a Python owner, and fake tensors are tensor subclasses, so the
        simulated step always took the last branch: one gradient-sized allocation too
        many at each meeting (Pegasus-X's padded blocks: 9.6% over, Mamba's per-position
        ``select``: 8.2% over). The engine sums a node's outputs into the next nodes'
        buffers after the node's post hooks and before the next node's pre-hooks, with
        the node still current (``torch._C._current_autograd_node``): an ``aten.add`` of
        two like tensors there is that sum. (A post hook keeps nothing alive past the
        node: the engine's ``call_function`` frees its copy of the inputs on return, and
        ``AccumulateGrad`` nodes, whose stealing of a gradient counts post hooks, get
        none: nothing is summed after them.)"""
        handles = []
        for node in nodes:
            if type(node).__name__ == "AccumulateGrad":
                continue
            handles.append(node.register_prehook(self._node_starts))
            handles.append(node.register_hook(functools.partial(self._node_ends, node)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            self._summing = None

    def _node_starts(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        self._summing = None

    def _node_ends(self, node: torch.autograd.graph.Node,
                   grad_inputs: tuple[torch.Tensor | None, ...],
                   grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        # (a tensor subclass's gradients are never summed in place: ``DTensor``'s come
        # back here as their local tensors' ops, which must stay out of place)
        subclass = _has_subclass({type(g) for g in grad_inputs if g is not None})
        self._summing = None if subclass else node

    def _accumulate(self, old: object, new: object) -> torch.Tensor | None:
        """``old + new`` as the engine sums two gradients; None: not that sum here."""
        if torch._C._current_autograd_node() is not self._summing:
            return None  # e.g. a hook of the next node's gradients
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return None
        if (old.shape != new.shape or old.dtype != new.dtype or old.device != new.device
                or old.layout != torch.strided or new.layout != torch.strided):
            return None
        if old.untyped_storage() is new.untyped_storage():
            return None  # one tensor twice (``z + z``): both buffers hold it
        if not _stealable(old):
            return None
        self.num_ops += 1
        return torch.ops.aten.add_.Tensor(old, new)

    # ------------------------------------------------------------------ dispatch
    def _track_out(self, out: object) -> None:
        """Track the tensors an op returned (in tuples and lists, nested)."""
        if isinstance(out, torch.Tensor):
            self.track(out)
        elif isinstance(out, (tuple, list)):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.track(t)

    def on_cpu(self) -> None:
        """Record a CPU target's step: with the copies its kernels make inside
        (``_cpu_kernels``), its 16-bit matmuls in oneDNN where this CPU's torch runs them."""
        self.cpu_kernels, self.cpu_mkldnn = True, mkldnn_cpu()

    def _workspace(self, size: int) -> Record:
        return self.hold(size, Component.TEMPORARIES)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if _has_subclass(types):
            return NotImplemented  # the subclass desugars; its local ops come back here
        if self.paused:
            return func(*args, **kwargs)
        if func is torch.ops._c10d_functional.wait_tensor.default:
            return args[0]  # eager waits in place (its fake kernel makes a new tensor)
        if func is _ADD and self._summing is not None and len(args) == 2 and not kwargs:
            summed = self._accumulate(*args)
            if summed is not None:
                return summed
        if func is torch.ops.aten._local_scalar_dense.default:
            if (known := values_of(args[0])) is not None:
                return real_item(known)  # a value computed from the batch's ids alone
            try:
                return func(*args, **kwargs)
            except DataDependentOutputException:
                return _scalar_read(args[0], optimizer=self.phase == "optimizer")
        if func in _FILLS:
            _check_fill(func, args, kwargs)
        if func is torch.ops.aten.index.Tensor and (positions := real_index(args)) is not None:
            args = positions  # a boolean mask with values: its positions
        impl = self.decompositions.get(func) if self.decompositions else None
        if impl is not None and not self._decomposing:
            self._decomposing = True
            try:
                with self:  # re-enter: the implementation's own ops are recorded
                    return impl(*args, **kwargs)
            finally:
                self._decomposing = False
        ws_fn = self.workspaces.get(func) if self.workspaces else None
        ws = self._workspace(ws_fn(args, kwargs)) if ws_fn is not None else None
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            from autofit.errors import ValueDependentShapeError, fix

            if (real := on_values(func, args, kwargs)) is not None:
                out = faked(real, args)  # its shape from the values: BART's eos pooling
                self._track_out(out)
                return out

            # e.g. Longformer's global attention (``nonzero`` of its mask): skipping the
            # branch instead was 9.7% under
            op = func.overloadpacket.__name__
            analytic = fix("--method analytic", "method='analytic'")
            raise ValueDependentShapeError(
                f"the model's step makes a tensor whose shape depends on values ({op}); "
                f"simulate cannot follow it: use {analytic} or measure it "
                f"({fix('autofit measure', 'autofit.measure')})", op) from None
        self.num_ops += 1
        if func in _MATMULS and out.dtype in _HALF and out.numel() * args[-1].shape[-2] > 4096:
            # (a matmul of at most 16^3 multiply-adds takes torch's own kernel, not oneDNN:
            # the size check of aten/native/mkldnn/Matmul.cpp)
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            self.half_matmuls.add((func, *(tuple(a.shape) for a in operands)))
            self.half_primitives.add(tuple((tuple(a.shape), a.dim() < 2 or a.stride(-1) == 1)
                                           for a in operands))
        elif func in _FLASH_CPU and args[0].dtype in _HALF:
            self.half_attention = True
        elif func is _LOG_SOFTMAX and out.numel() > self.log_softmax[0]:
            self.log_softmax = (out.numel(), out.element_size())
        self._track_out(out)
        if self.cpu_kernels and (
                inside := cpu_kernel_temporaries(func, args, kwargs, out, self.cpu_mkldnn)):
            # what the CPU kernel made beside its output and freed before it returned
            self.release(self._workspace(inside))
        if isinstance(out, torch.Tensor) and out.dtype == torch.bool:
            out._autofit_origin = _origin(func.overloadpacket.__name__, args)  # _scalar_read
        if _has_values(args, kwargs):
            if (real := on_values(func, args, kwargs)) is None:
                forget(func, args, kwargs)  # written without values: none known there
            _carry(out, real)
        elif made_from_nothing(func, args, out):
            _carry(out, on_values(func, args, kwargs, factory=True))
        # In-place ops and out= variants return their (possibly resized) argument,
        # which the branches above re-check through `track`.
        if ws is not None:  # the kernel's internal workspace dies with the op
            self.release(ws)
        return out


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``aten._grouped_mm`` on fake tensors of any dtype (mixture-of-experts layers:
    transformers' ``grouped_mm`` experts). Its meta kernel checks CUDA's rule (bf16 only),
    but the CPU kernel takes fp32 too, which a fp32 MoE model runs; the output is the meta
    kernel's own (``_create_grouped_mm_output_tensor``: the shape, dtype and strides), made
    under the recorder so that it is seen. bf16 goes to the op as it is."""
    if mat_a.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16):
        return torch.ops.aten._grouped_mm.default(mat_a, mat_b, offs, bias, out_dtype)
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)


# the matmuls oneDNN runs for 16-bit operands on a CPU (``half_matmuls``)
_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                      torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default})
_HALF = frozenset({torch.bfloat16, torch.float16})
# the CPU's flash attention (its 16-bit kernels are oneDNN's brgemm: ``half_attention``)
_FLASH_CPU = frozenset(getattr(torch.ops.aten, n).default for n in (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward")
    if hasattr(torch.ops.aten, n))

_LOG_SOFTMAX = torch.ops.aten._log_softmax.default

_GROUPED_MM = ({torch.ops.aten._grouped_mm.default: _grouped_mm}
               if hasattr(torch.ops.aten, "_grouped_mm") else {})


_ADD = torch.ops.aten.add.Tensor
# ops that convert a Python number to their tensor's dtype, which torch's kernels check and
# fake kernels do not: (op, index of the number in args, or its keyword)
_FILLS = {torch.ops.aten.masked_fill.Scalar: 2, torch.ops.aten.masked_fill_.Scalar: 2,
          torch.ops.aten.fill.Scalar: 1, torch.ops.aten.fill_.Scalar: 1,
          torch.ops.aten.full.default: 1, torch.ops.aten.clamp.default: "min/max",
          torch.ops.aten.clamp_.default: "min/max"}


def _check_fill(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """Refuse, as torch's kernel does, a number beyond the range of the 16-bit tensor it
    fills ("value cannot be converted to type c10::BFloat16 without overflow"): DeBERTa's
    attention masks its bf16 scores with float32's lowest value under bf16-mixed, so its
    every mixed-precision step fails, which the fake kernels let through."""
    at = _FILLS[func]
    if func is torch.ops.aten.full.default:
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
    else:
        dtype = args[0].dtype if args and isinstance(args[0], torch.Tensor) else None
    if dtype not in (torch.bfloat16, torch.float16):
        return
    if at == "min/max":
        values = [kwargs.get(k, args[i] if len(args) > i else None)
                  for i, k in ((1, "min"), (2, "max"))]
    else:
        values = [args[at] if len(args) > at else kwargs.get("value", kwargs.get("fill_value"))]
    top = torch.finfo(dtype).max
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                and abs(v) > top:
            from autofit.errors import StepFailsError, fix

            name = str(dtype).removeprefix("torch.")
            raise StepFailsError(
                f"the model's step fills a {name} tensor with {v:.4g}, beyond {name}'s range "
                f"({func.overloadpacket.__name__}), which torch refuses (\"value cannot be "
                "converted ... without overflow\"): a run fails at its first step in this "
                "precision; train it in 32-true (" + fix("--precision 32-true",
                                                         "precision='32-true'") + ")")


# ``storage.use_count()`` of a tensor's storage held by that tensor alone, as read here:
# the tensor plus the Python storage object that ``untyped_storage()`` hands out
_SOLE_USE = 2


def _stealable(t: torch.Tensor) -> bool:
    """``can_accumulate_inplace`` (input_buffer.cpp): dense, not overlapping, and nothing
    else holds its storage. NB: a tensor's own use count is not readable from Python, so
    one gradient tensor that two pending buffers share (``AddBackward`` hands the same
    tensor to both of its inputs) reads as sole here, where eager allocates the sum: one
    gradient fewer alive until the other buffer is consumed. The zoo and the accuracy
    table show no such underestimate (benchmarks/results/zoo.md, accuracy.md).
    """
    return (is_non_overlapping_and_dense_or_false(t)
            and torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= _SOLE_USE)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s storage: a DTensor's local shard, else ``t``."""
    return getattr(t, "_local_tensor", t)


def _has_values(args: tuple, kwargs: dict) -> bool:
    """Whether an op's arguments (or a list among them) hold a tensor with values."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            if any(values_of(x) is not None for x in a):
                return True
        elif values_of(a) is not None:
            return True
    return False


def _carry(out: object, real: object) -> None:
    """Give ``out``'s fake tensors the values of ``real``'s (None: it has none)."""
    if real is None:
        return
    fakes, reals = tree_flatten(out)[0], tree_flatten(real)[0]
    if len(fakes) != len(reals):
        return
    for f, r in zip(fakes, reals, strict=True):
        if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor) and f.shape == r.shape:
            with_values(f, r)


def _has_subclass(types: Iterable[type]) -> bool:
    """Whether an op's tensor types include a subclass that desugars into plain tensors
    (``DTensor``), only when ``torch.distributed`` was imported."""
    import sys

    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None) if mod is not None else None
    return dtensor is not None and any(t is dtensor for t in types)


# Checks whose usual answer is False (``x.isinf().any()``: no inf in the weights).
_FALSE_CHECKS = frozenset({"isinf", "isnan", "is_nonzero", "isneginf", "isposinf"})
# Ops that pass a bool tensor's meaning on (a view or copy of the same mask)
_SAME_MASK = frozenset({"view", "_unsafe_view", "reshape", "flatten", "expand", "clone",
                        "squeeze", "unsqueeze", "t", "transpose", "permute", "contiguous",
                        "slice", "select", "alias", "detach"})


def _origin(name: str, args: tuple[object, ...]) -> str:
    """What a bool tensor means for ``_scalar_read``: the op that made it, through views of
    a mask; ``any`` / ``all`` of a mask keep what the mask was (``any:isinf``: a sanity
    check; ``any:gt``: whether some token is marked, e.g. Longformer's global attention)."""
    first = args[0] if args else None
    inner = getattr(first, "_autofit_origin", "") if isinstance(first, torch.Tensor) else ""
    if name in _SAME_MASK and inner:
        return inner
    if name in ("any", "all"):
        return f"{name}:{inner.split(':')[-1]}"
    return name


def _scalar_read(t: torch.Tensor, optimizer: bool = False) -> bool | float:
    """The value of a one-element bool tensor read by Python (``if`` on a tensor).

    Fake tensors have no values, so a step that branches on one cannot be traced as
    is. PEFT methods do it in two ways, both answered with the common case: a sanity
    check (VB-LoRA's ``logits.isinf().any()``: False) and a random draw against a
    probability (LoHa's / LoKr's ``torch.rand(1) > module_dropout``: True, the adapter
    runs). A number read in the ``optimizer`` phase is the step count (torch's Adagrad
    and RMSprop read ``state["step"]`` made in their constructor): 1, which sizes
    nothing. Any other read of a number is an error: its value would change shapes.
    """
    if t.dtype != torch.bool and optimizer:
        return 1 if not t.dtype.is_floating_point else 1.0
    if t.dtype != torch.bool:
        from autofit.errors import ValueDependentShapeError, fix

        raise ValueDependentShapeError(
            "the model reads a tensor's value into Python during its step (.item()); "
            "simulate cannot follow data-dependent steps: use "
            + fix("--method analytic", "method='analytic'") + " or measure it ("
            + fix("autofit measure", "autofit.measure") + ")", "item")
    return getattr(t, "_autofit_origin", "").split(":")[-1] not in _FALSE_CHECKS
