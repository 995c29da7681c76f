"""Several ranks simulated by transforming the single-rank step: DeepSpeed ZeRO (always).

DeepSpeed cannot run on fake tensors (its buffers are made and filled through real
data, its collectives need a real backend), so ZeRO is simulated from the single-rank
step each rank runs (``ranks.activation_config``: DeepSpeed's bf16 casts the module,
no autocast): its forward and backward allocations (activations, temporaries) are kept
as recorded; the model state is replaced by the rank's ZeRO state and DeepSpeed's
buffers are inserted where DeepSpeed allocates them (``stage_1_and_2.py``,
``stage3.py``, read for 0.19.8):

* at ``deepspeed.initialize``: the flat bit16 groups (ZeRO-1/2: the whole model,
  aligned to 2 x N elements; ZeRO-3: this rank's partitions + the persistent small
  parameters), the fp32 partition (a clone) and the optimizer's states over it
  (``initialize_optimizer_states`` steps once at init); ZeRO-3 also its IPG bucket
  (``reduce_bucket_size``) and gradient partition buffer (``grad_partitions_flat_buffer``);
* in backward, every gradient as autograd makes it, copied at once into the IPG bucket
  (``contiguous_gradients``: the parameter's ``.grad`` becomes a view of the bucket, the
  gradient's own storage is freed; one larger than the bucket waits for its own
  reduction); ZeRO-1/2 make the bucket(s) at the first gradient (two with
  ``overlap_comm``) and their ``grads_in_partition`` at the first reduction; at the end
  of backward the partition's gradients are flattened (``averaged_gradients``) and the
  bucket and ``grads_in_partition`` released. ZeRO-1 without ``overlap_comm`` keeps the
  full gradients until the end of backward, then reduces them the same way;
* ZeRO-3 gathers a module's parameters (full size) at its forward and keeps them until
  its backward (``max_reuse_distance`` 1e9: every parameter is used again within the
  step, ``PartitionedParameterCoordinator.__params_to_release``); the first step
  (trace not complete yet) releases them after each use. The module boundaries come
  from hooks on the clone (``ModuleMarks``), as DeepSpeed's own hooks see them;
* at the step: the partition's gradients flattened again and cast to fp32
  (``flat_grad_partition.to(fp32)``: a copy when they are 16-bit), the optimizer's
  temporaries over the flat partition (the Trainer's torch AdamW: as
  ``analytic._optimizer_step_temporaries``; DeepSpeed's Adam: none), then the fp32
  gradient freed and the partitions copied / all-gathered in place.

Offloaded state (``offload_optimizer``: the fp32 partition, its states and fp32
gradients, ZeRO-1/2's bit16 staging buffer; ``offload_param``: the partitions) is
host memory: left out of the device's stream, summed in ``host_bytes``.

Known limitations:
    * NB: which bucket first holds this rank's partition decides when
      ``grads_in_partition`` appears; it is taken to appear at the first reduction (its
      latest rank; a partition of at most 1/N of the gradients).
    * NB: ZeRO-3's prefetch (``stage3_prefetch_bucket_size``) only fetches early what is
      kept anyway after the first step; it is not modelled.
    * NB: DeepSpeed's communication staging (gloo / NCCL buffers, ``all_gather`` chunks
      of ``allgather_bucket_size`` written in place) is not a tensor of the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import TrainConfig
from autofit.memory.allocator._common import pinned_bytes
from autofit.memory.breakdown import Component
from autofit.memory.ranks._layout import (
    Layout,
    activation_config,
    single_rank_config,
    zero3_partition_numel,
    zero_flat_numel,
)
from autofit.memory.ranks._per_rank import combine_ranks

if TYPE_CHECKING:  # pragma: no cover
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.autograd.function import FunctionCtx

    from autofit.memory.allocator import AllocEvent
    from autofit.memory.simulate._recorder import StorageRecorder

# ``Simulator`` and ``SimulationResult`` (autofit.memory.simulate, which calls this module)
# are written ``Any`` here: importing them, even for types, would make an import cycle.
Simulator = SimulationResult = Any

__all__ = ["ModuleMarks", "simulate_transformed", "zero_events"]


class _Mark(torch.autograd.Function):
    """Identity (a view) whose backward marks the recorder: DeepSpeed's
    ``PreBackwardFunctionForModule`` / ``PostBackwardFunctionModule`` in miniature."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, rec: StorageRecorder, label: str) -> torch.Tensor:
        ctx.rec, ctx.label = rec, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> Any:
        ctx.rec.mark(ctx.label)
        return grad, None, None


def _marked(value: object, rec: StorageRecorder, label: str) -> Any:
    """``value`` with its grad-requiring tensors passed through ``_Mark`` (top level of a
    tensor, tuple, list or ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return _Mark.apply(value, rec, label) if value.requires_grad else value
    if isinstance(value, (tuple, list)) and not hasattr(value, "keys"):
        out = [_marked(v, rec, label) if isinstance(v, torch.Tensor) else v for v in value]
        return type(value)(out) if isinstance(value, list) or type(value) is tuple else value
    if hasattr(value, "keys") and hasattr(value, "__setitem__"):
        for k in list(value.keys()):
            v = value[k]
            if isinstance(v, torch.Tensor) and v.requires_grad:
                value[k] = _Mark.apply(v, rec, label)
        return value
    return value


@dataclass
class ModuleMarks:
    """A ``Simulator._run`` trace that marks every module with direct parameters:
    ``fwd-pre:i`` / ``fwd-post:i`` (its forward), ``bwd-pre:i`` (its outputs' gradients
    arrive) and ``bwd-post:i`` (its inputs' gradients are made), as DeepSpeed's ZeRO-3
    hooks see the module; ``params[i]`` lists its direct parameters as (index, numel)."""

    config: TrainConfig
    params: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    numels: list[int] = field(default_factory=list)

    @property
    def step_config(self) -> TrainConfig:
        return self.config

    def wrap(self, model: torch.nn.Module, rec: StorageRecorder, fake_mode: FakeTensorMode) -> torch.nn.Module:
        index: dict[int, int] = {}
        for p in model.parameters():
            index.setdefault(id(p), len(index))
            self.numels.append(p.numel())
        for i, m in enumerate(model.modules()):
            own = [(index[id(p)], p.numel()) for p in m.parameters(recurse=False)
                   if id(p) in index]
            if not own:
                continue
            self.params[i] = own

            def pre(mod: torch.nn.Module, args: object, kwargs: object, i: int = i) -> Any:
                rec.mark(f"fwd-pre:{i}")
                return _marked(args, rec, f"bwd-post:{i}"), kwargs

            def post(mod: torch.nn.Module, args: object, kwargs: object, out: object,
                     i: int = i) -> Any:
                rec.mark(f"fwd-post:{i}")
                return _marked(out, rec, f"bwd-pre:{i}")

            m.register_forward_pre_hook(pre, with_kwargs=True)
            m.register_forward_hook(post, with_kwargs=True)
        return model

    @contextlib.contextmanager
    def running(self, rec: StorageRecorder) -> Iterator[None]:
        yield


def _kept_modules(plan: ZeroPlan, at: dict[int, list[str]]) -> set[int]:
    """ZeRO-3's modules whose gathered parameters stay from their forward to their backward
    (``partitioned_param_coordinator.__params_to_release``): those used again within
    ``max_reuse_distance`` elements of the modules traced after them — with ``x`` elements
    of the forward after a module, its backward comes after ``~2x``
    (``ranks.zero3_kept_numel`` states the same rule in closed form)."""
    order: list[int] = []
    for k in sorted(at):
        for label in at[k]:
            if label.startswith("fwd-pre:") and (m := int(label.split(":")[1])) not in order:
                order.append(m)
    size = {m: sum(n for _, n in plan.gathered.get(m, ()) if n > plan.persist_threshold)
            for m in order}
    after, keep = sum(size.values()), set()
    for m in order:
        after -= size[m]
        if 2 * after < plan.max_reuse:
            keep.add(m)
    return keep


@dataclass(frozen=True)
class ZeroPlan:
    """One rank's ZeRO state, in bytes and elements (see the module docstring)."""

    stage: int
    mb: int  # bytes per element of the module's parameters
    flat_bytes: tuple[int, ...]  # bit16 flat groups (ZeRO-1/2) / partitions (ZeRO-3)
    frozen_bytes: int  # frozen parameters (ZeRO-1/2 keep them whole)
    persistent_bytes: int  # ZeRO-3 parameters kept whole
    master_bytes: tuple[int, ...]  # fp32 partition per group
    state_bytes: tuple[int, ...]  # optimizer states per group
    partition: int  # elements of this rank's trainable partition
    bucket: int  # IPG bucket elements (as many as the target keeps)
    n_buckets: int  # 2 with overlap_comm (ZeRO-1/2)
    hooks: bool  # gradients reduced as they are made
    opt_temp: int  # optimizer step temporaries over the flat partition
    offload_opt: bool
    offload_par: bool
    largest: int  # elements of the largest trainable parameter
    host: int  # host bytes per rank (offload)
    persist_threshold: int = 0
    gathered: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    max_reuse: int = int(1e9)  # stage3_max_reuse_distance
    # ZeRO-1/2: elements of each trainable parameter inside this rank's partition
    in_partition: dict[int, int] = field(default_factory=dict)
    touched: bool = False  # a CPU target: torch.empty buffers count as they are written


def zero_plan(sim: Simulator, config: TrainConfig, layout: Layout,
              marks: ModuleMarks | None, rank: int = 0) -> ZeroPlan:
    """``layout``'s ZeRO state on rank ``rank`` of ``sim``'s model."""
    from autofit.memory.analytic._states import _optimizer_step_temporaries, optimizer_state_bytes
    from autofit.memory.ranks._per_rank import _local_info, _zero_groups
    from autofit.probe.model import ParamGroup, describe

    info = describe(sim.module, task=sim.task, name=sim.model_name)
    n, stage = layout.shard_ranks, layout.zero_stage
    spec = config.precision_spec
    mb = 2 if spec.half else 4
    sizes = layout.zero_sizes_of(info.hidden_size)
    groups = _zero_groups(info, config, layout)
    trainable = sum(groups)
    frozen = sum(g.numel * g.count for g in info.params if not g.trainable)
    if stage == 3:
        parts = [sum(zero3_partition_numel(g.numel, n) * g.count for g in info.params
                     if g.trainable)]
        flat = (sum(zero3_partition_numel(g.numel, n) * g.count for g in info.params) * mb,)
        persistent = sum(g.numel * g.count for g in info.params
                         if g.numel <= sizes.param_persistence_threshold) * mb
    else:
        parts = [zero_flat_numel(x, n) // n for x in groups]
        flat = tuple(zero_flat_numel(x, n) * mb for x in groups)
        persistent = 0
    one = single_rank_config(config).replace(precision="32-true")
    states = tuple(optimizer_state_bytes(
        _local_info(info, [ParamGroup(shape=(x,), count=1, dtype="float32", trainable=True)]),
        one) for x in parts)
    flat_groups = [ParamGroup(shape=(x,), count=1, dtype="float32", trainable=True) for x in parts]
    opt_temp = (0 if layout.zero_optimizer == "deepspeed"
                else _optimizer_step_temporaries(_local_info(info, flat_groups), one, sim.device))
    cpu = sim.device.allocator == "cpu"
    bucket = min(sizes.reduce_bucket_size, trainable) if cpu else sizes.reduce_bucket_size
    offload_opt = layout.offload in ("optimizer", "optimizer+params")
    offload_par = layout.offload == "optimizer+params" and stage == 3
    largest = max((g.numel for g in info.params if g.trainable), default=0)
    p = sum(parts)
    host = 0
    pin = pinned_bytes if not cpu else (lambda b: b)
    if offload_opt:
        # the fp32 partition, its states and fp32 gradients; ZeRO-1/2's bit16 staging
        # buffer and pinned gradient buffer; ZeRO-3's gradient partition buffer
        host = (sum(pin(4 * x) for x in parts) + sum(states) + sum(pin(4 * x) for x in parts)
                + (pin(p * mb) + pin(largest * mb) if stage < 3 else pin(p * mb)))
    if offload_par:
        host += pin(flat[0])
    in_partition = _in_partition(sim.module, layout, rank) if stage < 3 else {}
    return ZeroPlan(
        in_partition=in_partition, touched=cpu,
        stage=stage, mb=mb, flat_bytes=flat, frozen_bytes=frozen * mb if stage < 3 else 0,
        persistent_bytes=persistent, master_bytes=tuple(4 * x for x in parts),
        state_bytes=states, partition=p, bucket=bucket,
        n_buckets=2 if (sizes.overlap_comm and stage < 3) else 1,
        hooks=stage >= 2 or sizes.overlap_comm, opt_temp=opt_temp, offload_opt=offload_opt,
        offload_par=offload_par, largest=largest, host=host,
        persist_threshold=sizes.param_persistence_threshold,
        gathered=dict(marks.params) if marks is not None else {},
        max_reuse=sizes.max_reuse_distance)


def _in_partition(module: torch.nn.Module, layout: Layout, rank: int) -> dict[int, int]:
    """Elements of each trainable parameter (by index) in rank ``rank``'s ZeRO-1/2
    partition: each optimizer group flattened in registration order (the Trainer's
    no-decay group: 1-D parameters, biases and norms) and cut into equal partitions."""
    n = layout.shard_ranks
    params = [p for p in module.parameters() if p.requires_grad]
    one = layout.zero_one_group
    out: dict[int, int] = {}
    for group in ((True,) if one else (True, False)):
        members = [j for j, p in enumerate(params) if one or (p.ndim > 1) == group]
        total = zero_flat_numel(sum(params[j].numel() for j in members), n)
        lo, hi = rank * total // n, (rank + 1) * total // n
        off = 0
        for j in members:
            k = params[j].numel()
            inside = max(0, min(hi, off + k) - max(lo, off))
            if inside:
                out[j] = inside
            off += k
    return out


class _Stream:
    """Builds the transformed event list (new ids above the recorded ones)."""

    def __init__(self, first_id: int) -> None:
        self.out: list[AllocEvent] = []
        self._next = first_id

    def alloc(self, size: int, phase: str, category: str) -> int:
        from autofit.memory.allocator import AllocEvent

        i = self._next
        self._next += 1
        if size > 0:
            self.out.append(AllocEvent("alloc", i, int(size), phase, category))
        return i

    def free(self, i: int, phase: str, category: str) -> None:
        from autofit.memory.allocator import AllocEvent

        self.out.append(AllocEvent("free", i, 0, phase, category))


def zero_events(events: tuple[AllocEvent, ...], marks: tuple[tuple[str, int], ...],
                plan: ZeroPlan, *, weights_bytes: int, param_bytes: int,
                grad_params: dict[int, int]) -> list[AllocEvent]:
    """The single-rank ``events`` transformed into one ZeRO rank's (module docstring):
    ``deepspeed.initialize``'s buffers, then the step replayed with the rank's gradient
    buckets, partitions, gathered parameters (ZeRO-3) and optimizer step.

    Args:
        events, marks: the single-rank simulation's stream and its marks.
        plan: the rank's ZeRO state.
        weights_bytes, param_bytes: bytes of every recorded weight / of the parameters
            among them (the rest are buffers, kept).
        grad_params: a gradient's event id -> its parameter (``SimulationResult``).
    """
    rank = _ZeroRank(plan, events, grad_params)
    rank.initialize(weights_bytes, param_bytes)
    at: dict[int, list[str]] = {}
    for label, i in marks:
        at.setdefault(i, []).append(label)
    rank.step(events, at)
    return rank.st.out


class _ZeroRank:
    """One ZeRO rank's allocations as its step runs: the stream being written (``st``) and
    the gradient buckets, partitions and gathered parameters alive in it."""

    def __init__(self, plan: ZeroPlan, events: tuple[AllocEvent, ...],
                 grad_params: dict[int, int]) -> None:
        self.plan = plan
        self.st = _Stream(max((e.id for e in events), default=0) + 1)
        self.grad_params = dict(grad_params)
        self.sizes = {e.id: e.size for e in events if e.kind == "alloc"}
        self.ipg: list[int] = []
        self.in_part: int | None = None
        self.averaged: int | None = None
        self.fill = 0  # elements in the open bucket
        self.waiting: list[int] = []  # gradients not yet in a bucket (ZeRO-1 without hooks)
        self.large: list[int] = []  # gradients larger than the bucket, awaiting their reduction
        self.pending: list[int] = []  # parameters whose gradients sit in the open bucket
        self.touched = [0] * plan.n_buckets  # elements of each bucket written (a CPU target)
        self.index = 0  # the bucket being filled
        self.in_part_pieces: list[int] = []
        self.gathered: dict[int, int] = {}  # parameter index -> alloc id (ZeRO-3)

    def initialize(self, weights_bytes: int, param_bytes: int) -> None:
        """``deepspeed.initialize``: the flat partitions, the fp32 copy, the states and the
        gradient buffers it allocates before the first step."""
        st, plan = self.st, self.plan
        for b in (() if plan.offload_par else plan.flat_bytes):  # offload_param: on the host
            st.alloc(b, "", Component.WEIGHTS)
        st.alloc(plan.frozen_bytes + plan.persistent_bytes
                 + max(weights_bytes - param_bytes, 0), "", Component.WEIGHTS)
        if not plan.offload_opt:
            for b in plan.master_bytes:
                st.alloc(b, "", Component.WEIGHTS)
            for b in plan.state_bytes:
                st.alloc(b, "", Component.OPTIMIZER_STATES)
        if plan.stage == 3:
            if not plan.touched:  # a CPU counts the bucket's pages as gradients are written
                st.alloc(plan.bucket * plan.mb, "", Component.GRADIENTS)  # IPG bucket
            if not plan.offload_opt:  # grad_partitions_flat_buffer
                st.alloc(plan.partition * plan.mb, "", Component.GRADIENTS)
        elif plan.offload_opt:  # temp_grad_buffer_for_gpu_offload
            st.alloc(plan.largest * plan.mb, "", Component.GRADIENTS)

    def step(self, events: tuple[AllocEvent, ...], at: dict[int, list[str]]) -> None:
        """The recorded step replayed: the rank's weights, states and optimizer step replace
        the recorded ones, gradients go through the buckets, marks (``at``: event index ->
        labels) open and close the phases and, at ZeRO-3, the modules' gathers."""
        st, plan = self.st, self.plan
        dropped: set[int] = set()
        step = -1
        phase = ""
        keep = _kept_modules(plan, at)
        in_backward = False
        for k, e in enumerate(events):
            for label in at.get(k, ()):
                if label.startswith(("step", "end")):
                    if in_backward:
                        self.epilogue(phase)
                        for g in list(self.gathered):  # what no backward hook released (a
                            # module without input grads)
                            st.free(self.gathered.pop(g), phase, Component.WEIGHTS)
                        in_backward = False
                    if label.endswith("optimizer"):
                        self.optimizer_step("optimizer")
                    if "/micro" in label:
                        step = int(label[4:label.index("/")])
                elif plan.stage == 3 and ":" in label:
                    kind, m = label.split(":")
                    mod = int(m)
                    if kind in ("fwd-pre", "bwd-pre"):
                        self.gather(mod, e.phase)
                    elif kind == "fwd-post" and (step == 0 or mod not in keep):
                        # the first step: no trace to keep them by; later, what is not used
                        # again within max_reuse_distance elements of traced modules
                        self.release(mod, e.phase)
                    elif kind == "bwd-post":
                        self.release(mod, e.phase)
            phase = e.phase
            if e.phase == "backward":
                in_backward = True
            if e.kind == "free":
                if e.id not in dropped:
                    st.out.append(e)
                continue
            if (e.category in (Component.WEIGHTS, Component.OPTIMIZER_STATES)
                    or e.phase == "optimizer"):
                dropped.add(e.id)  # replaced by the rank's ZeRO state and step
                continue
            st.out.append(e)
            if e.category == Component.GRADIENTS:
                dropped.add(e.id)  # its recorded free (zero_grad) is replaced
                if plan.hooks:
                    self.take_grad(e.id, e.size, e.phase)
                else:
                    self.waiting.append(e.id)

    def reduce(self, phase: str) -> None:
        """The open bucket reduced: its large gradients freed, its partition's gradients
        copied into ``grads_in_partition``."""
        for g in self.large:
            self.st.free(g, phase, Component.GRADIENTS)
        self.large.clear()
        for j in self.pending:  # the reduced partition's gradients: into grads_in_partition
            self.copy_in(j, phase)
        self.pending.clear()
        self.fill = 0

    def copy_in(self, j: int, phase: str) -> None:
        """``copy_grads_in_partition``: one buffer at the first (a CPU counts its pages as
        they are written: a piece per parameter)."""
        plan = self.plan
        k = plan.in_partition.get(j, 0)
        if plan.stage == 3 or plan.offload_opt or not k:
            return
        if plan.touched:
            self.in_part_pieces.append(self.st.alloc(k * plan.mb, phase, Component.GRADIENTS))
        elif self.in_part is None:
            self.in_part = self.st.alloc(plan.partition * plan.mb, phase, Component.GRADIENTS)

    def touch(self, upto: int, phase: str) -> None:
        """A CPU: the current bucket's pages written up to ``upto`` elements."""
        if upto > self.touched[self.index]:
            self.ipg.append(self.st.alloc((upto - self.touched[self.index]) * self.plan.mb,
                                          phase, Component.GRADIENTS))
            self.touched[self.index] = upto

    def take_grad(self, gid: int, size: int, phase: str) -> None:
        """A gradient made by autograd: into the open bucket (reduced first when full), or
        kept on its own until its reduction when larger than a bucket."""
        plan = self.plan
        numel = size // plan.mb
        if plan.stage < 3 and not self.ipg and not plan.touched:
            self.ipg.extend(self.st.alloc(plan.bucket * plan.mb, phase, Component.GRADIENTS)
                            for _ in range(plan.n_buckets))
        if self.fill + numel > plan.bucket and self.fill > 0:
            self.reduce(phase)
            self.index = (self.index + 1) % plan.n_buckets  # overlap_comm: the other buffer
        self.pending.append(self.grad_params.get(gid, -1))
        if numel > plan.bucket:
            self.large.append(gid)  # reduced on its own, kept until then
        else:
            if plan.touched:
                self.touch(self.fill + numel, phase)
            # copied into the bucket: .grad is a view now
            self.st.free(gid, phase, Component.GRADIENTS)
        self.fill += numel

    def epilogue(self, phase: str) -> None:
        """The end of backward: the waiting gradients bucketed and reduced, the partition
        flattened (``averaged_gradients``), the buckets and ``grads_in_partition``
        released."""
        plan, st = self.plan, self.st
        for g in self.waiting:
            self.take_grad(g, self.sizes[g], phase)
        self.waiting.clear()
        self.reduce(phase)
        if plan.stage < 3 and not plan.offload_opt and self.averaged is None:
            self.averaged = st.alloc(plan.partition * plan.mb, phase, Component.GRADIENTS)
        if plan.stage < 3:  # the buckets are released (ZeRO-3 keeps its one)
            for b in self.ipg:
                st.free(b, phase, Component.GRADIENTS)
            self.ipg.clear()
            self.touched[:] = [0] * plan.n_buckets
        if self.in_part is not None:
            st.free(self.in_part, phase, Component.GRADIENTS)
            self.in_part = None
        for b in self.in_part_pieces:
            st.free(b, phase, Component.GRADIENTS)
        self.in_part_pieces.clear()

    def optimizer_step(self, phase: str) -> None:
        """The step over the flat partition: flattened, upcast to fp32, the optimizer's
        temporaries (none here with the optimizer offloaded: it runs on the host)."""
        plan, st = self.plan, self.st
        if plan.offload_opt:
            return  # the step runs on the host
        flat = st.alloc(plan.partition * plan.mb, phase, Component.TEMPORARIES)  # flatten
        if self.averaged is not None:
            st.free(self.averaged, phase, Component.GRADIENTS)
            self.averaged = None
        fp32 = flat
        if plan.mb != 4:
            fp32 = st.alloc(plan.partition * 4, phase, Component.TEMPORARIES)  # .to(fp32)
            st.free(flat, phase, Component.TEMPORARIES)
        if plan.opt_temp:
            t = st.alloc(plan.opt_temp, phase, Component.TEMPORARIES)
            st.free(t, phase, Component.TEMPORARIES)
        st.free(fp32, phase, Component.TEMPORARIES)

    def gather(self, module: int, phase: str) -> None:
        """ZeRO-3: a module's parameters all-gathered (those above the persistence
        threshold and not gathered yet)."""
        for idx, numel in self.plan.gathered.get(module, ()):
            if idx not in self.gathered and numel > self.plan.persist_threshold:
                self.gathered[idx] = self.st.alloc(numel * self.plan.mb, phase,
                                                   Component.WEIGHTS)

    def release(self, module: int, phase: str) -> None:
        """ZeRO-3: a module's gathered parameters released."""
        for idx, _ in self.plan.gathered.get(module, ()):
            g = self.gathered.pop(idx, None)
            if g is not None:
                self.st.free(g, phase, Component.WEIGHTS)


def simulate_transformed(sim: Simulator, config: TrainConfig, seq_len: int, layout: Layout,
                         why: str = "") -> SimulationResult:
    """Every rank of ``config`` from the single-rank step (module docstring): ZeRO, or
    DDP / FSDP2 where tracing is not possible (``why``)."""
    from autofit.memory.allocator import replay as replay_events

    t0 = time.perf_counter()
    act = activation_config(config, layout)
    if layout.family != "zero":
        return _not_traced(sim, config, seq_len, layout, why or "FSDP2 CPU offload")
    marks = ModuleMarks(act) if layout.zero_stage == 3 else None
    base = sim._run(act, seq_len, trace=marks) if marks is not None else sim.run(act, seq_len=seq_len)
    weights = sum(e.size for e in base.events if e.kind == "alloc" and e.category == Component.WEIGHTS
                  and e.phase == "")
    mb = 2 if config.precision_spec.half else 4
    params = sum(p.numel() for p in sim.module.parameters()) * mb
    n = layout.world_size
    # ranks differ only in which parameters their ZeRO-1/2 partition holds; at most 16
    # are transformed (the others take the nearest one's result)
    todo = range(n) if n <= 16 else [*range(8), *range(n - 8, n)]
    per: dict[int, tuple[Any, Any, Any]] = {}
    for r in todo if layout.zero_stage < 3 else [0]:
        plan = zero_plan(sim, config, layout, marks, r % layout.shard_ranks)
        events = tuple(zero_events(base.events, base.marks, plan, weights_bytes=weights,
                                   param_bytes=params, grad_params=base.grad_params))
        replay = replay_events(events, "cuda" if sim.device.allocator == "cuda" else "cpu")
        est = sim._estimate(config, seq_len, replay, base.estimate.num_params,
                            base.estimate.trainable_params,
                            [f"target allocator: {sim.device.allocator}",
                             f"ZeRO-{plan.stage}: the single-rank step transformed (DeepSpeed "
                             "cannot run on fake tensors): partition "
                             f"{plan.partition:,} elements, IPG bucket {plan.bucket:,}"])
        per[r] = (dataclasses.replace(est, host_bytes=plan.host), events, replay)

    def nearest(r: int) -> int:
        return min(per, key=lambda k: abs(k - r))

    ests = [per[nearest(r)][0] for r in range(n)]
    combined = combine_ranks(ests, layout, sim.device, method="simulate")
    _, events, replay = per[nearest(combined.peak_rank)]
    return dataclasses.replace(base, estimate=combined, events=events, replay=replay,
                               wall_s=time.perf_counter() - t0)


def _not_traced(sim: Simulator, config: TrainConfig, seq_len: int, layout: Layout,
                why: str) -> SimulationResult:
    """DDP / FSDP2 that cannot be traced here: the analytic per-rank estimate (said so)."""
    from autofit.memory.ranks._per_rank import estimate_ranks_analytic
    from autofit.probe.model import describe

    info = describe(sim.module, task=sim.task, name=sim.model_name)
    est = estimate_ranks_analytic(info, config, seq_len, sim.device, layout)
    est = dataclasses.replace(est, notes=(*est.notes, f"not traced ({why}): the analytic "
                                          "per-rank rules of autofit.memory.ranks"))
    base = sim.run(single_rank_config(config), seq_len=seq_len)
    return dataclasses.replace(base, estimate=est)
