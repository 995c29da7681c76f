"""The Trainer's training step, run on a fake-tensor clone under the recorder.

One *step* is what ``Trainer`` does between two ``optimizer.step()`` calls:
``grad_accum_steps`` micro steps (forward with labels, ``loss.backward()``), then
``clip_grad_norm_(params, 1.0)``, ``optimizer.step()`` and
``optimizer.zero_grad(set_to_none=True)``. Micro steps after the second behave like
the second (gradients already exist and are accumulated in place), so at most two
are run.

With ``config.chunked_loss`` the loss is ``autofit.causal_lm_chunked_loss`` (the function
the trial and ``ChunkedLossTrainer`` run); torch's chunked ``linear_cross_entropy`` op is
opaque to a dispatch mode (its fake implementation makes the outputs only), so its
real implementation runs instead (the knob's ``recorded`` hook,
``autofit.knobs.chunked_loss``): the recorder sees every chunk's logits and the gradients
it accumulates.

With ``config.loss_impl == "trl"`` the loss is TRL's fused LM head as ``SFTTrainer`` runs
it (``autofit.knobs.trl_loss.trl_sft_loss``: ``add_fused_lm_head`` on the fake clone for
the call), TRL's torch fallback tiles recorded op by op.

With ``config.activation_offloading`` the checkpointed blocks run under transformers' own
offloading (``activation_checkpointing_enable(offload=True)``: torch's ``save_on_cpu``
around each checkpoint), with ``save_on_cpu`` given its CUDA semantics on the fake CPU
tensors (``offloaded_to_host``): a packed tensor is a host copy (left out of the device's
stream, counted in ``host_bytes``), an unpacked one a fresh device copy.

Known limitations:
    NB: the chunk size and accumulation policy torch picks depend on the device type
    (``_AUTO_DEFAULTS``); the simulation runs on fake CPU tensors, so a CUDA target is
    simulated with the CPU's choices.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from autofit.config import TrainConfig
from autofit.errors import BadInputError, MissingDependencyError, UnmodelledStepError, fix
from autofit.knobs.registry import recorded, step_loss
from autofit.memory.breakdown import Component
from autofit.memory.simulate._model import make_batch, unpacked_batches, unwrap
from autofit.memory.simulate._recorder import Record, StorageRecorder
from autofit.probe.model import _layer_lists

__all__ = [
    "StepTarget",
    "optimizer_cls_and_kwargs",
    "build_optimizer",
    "track_built_states",
    "bnb_cpu_kernels",
    "offloaded_to_host",
    "host_peak_bytes",
    "run_steps",
]


@dataclass(frozen=True)
class StepTarget:
    """What differs between the device planned for and this host."""

    kind: str  # "cuda" | "cpu"
    sm: int | None = None  # a CUDA target's compute capability (80: 8.0), which gates kernels

    @property
    def foreach(self) -> bool:
        # torch's optimizers default to foreach (multi-tensor) on CUDA, to the
        # per-parameter loop on the CPU (_default_to_fused_or_foreach).
        return self.kind == "cuda"


@functools.cache
def optimizer_cls_and_kwargs(optim: str, optim_args: str | None) -> tuple[type, dict, float, float]:
    """(class, kwargs, weight_decay, max_grad_norm) exactly as the Trainer resolves ``optim``."""
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(
            output_dir=tmp, optim=optim, optim_args=optim_args, use_cpu=True, report_to=[]
        )
        try:
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
        except ImportError as e:
            raise MissingDependencyError(
                f"optimizer {optim!r} needs a package that is not installed: {e}"
            ) from None
    return cls, dict(kwargs), float(args.weight_decay), float(args.max_grad_norm or 0.0)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The Trainer's two groups: decay / no-decay, trainable parameters only."""
    from transformers import Trainer

    # get_decay_parameter_names does not use `self`.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def _is_bnb(cls: type) -> bool:
    return "bitsandbytes" in getattr(cls, "__module__", "")


def build_optimizer(model: torch.nn.Module, config: TrainConfig, target: StepTarget) -> Any:
    """The Trainer's optimizer over the clone's parameters, with the target's defaults.

    Built outside the fake mode (bitsandbytes computes its quantization maps with
    real tensors at construction); its states appear at the first ``step()``.
    """
    cls, kwargs, wd, _ = optimizer_cls_and_kwargs(config.optimizer, config.optim_args)
    kwargs = dict(kwargs)
    sig = inspect.signature(cls.__init__).parameters
    if "foreach" in sig and not kwargs.get("fused"):
        kwargs["foreach"] = target.foreach  # fake tensors would resolve the default to False
    groups = [g for g in _param_groups(model, wd) if g["params"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = cls(groups, **kwargs)
    if _is_bnb(cls) and kwargs.get("optim_bits") == 8:
        # Trainer.create_optimizer: embeddings are optimized in 32 bits. Registered on a
        # private manager so that bitsandbytes' global singleton is left alone.
        from bitsandbytes.optim import GlobalOptimManager

        mng = GlobalOptimManager.__new__(GlobalOptimManager)
        mng.initialize()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                mng.register_module_override(module, "weight", {"optim_bits": 32})
        opt.mng = mng
    return opt


def bnb_cpu_kernels() -> dict[Any, Any]:
    """bitsandbytes optimizer ops -> their CPU kernels (Python over torch ops).

    On a CPU target these run instead of the ops' fake implementations so that their
    temporaries (dequantized fp32 states, fp32 copies of grads and params) are seen.
    On CUDA the updates are fused kernels that allocate nothing, which is what the
    fake implementations (no outputs) already are.
    """
    import bitsandbytes  # noqa: F401  (registers the ops)
    from bitsandbytes.backends.cpu import ops as cpu_ops

    ops = torch.ops.bitsandbytes
    return {
        ops.optimizer_update_8bit_blockwise.default: cpu_ops._optimizer_update_8bit_blockwise_cpu,
        ops.optimizer_update_32bit.default: cpu_ops._optimizer_update_32bit_cpu,
    }


@contextlib.contextmanager
def offloaded_to_host(rec: StorageRecorder) -> Any:
    """While inside, transformers' ``save_on_cpu`` (its activation offloading) keeps what it
    packs in host memory: the packed copy's record is marked ``host`` (not a device
    allocation) and unpacking makes a fresh device copy, as ``tensor.to("cuda")`` does; on
    fake CPU tensors torch's own hooks would copy within the "device" and unpack to the
    same tensor. Yields the list of host records (``host_peak_bytes`` reads them).

    ``save_on_cpu(pin_memory=True)`` packs every tensor saved under it into a new pinned
    tensor of the same size (a view's size, not its base's), whatever it is; transformers
    enters it around each checkpointed call, where only the checkpoint's positional inputs
    are saved (the recompute's own tensors are held by the checkpoint, not saved).
    """
    from torch.autograd.graph import saved_tensors_hooks
    from transformers import modeling_utils

    if not hasattr(modeling_utils, "save_on_cpu"):
        raise BadInputError("the installed transformers offloads activations by other means "
                            "than torch's save_on_cpu; simulate with activation_offloading=False")
    host: list[Any] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)  # pinned host memory
        packed.copy_(t)
        r = rec.record_of(packed)
        if r is not None:
            r.host = True
            host.append(r)
        return packed

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(packed).copy_(packed)  # back on the device

    class save_on_cpu(saved_tensors_hooks):  # noqa: N801 - stands in for torch's class
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pack, unpack)

    original = modeling_utils.save_on_cpu
    modeling_utils.save_on_cpu = save_on_cpu
    try:
        yield host
    finally:
        modeling_utils.save_on_cpu = original


def host_peak_bytes(log: list[tuple[str, Record, str]], host: list[Record]
                    ) -> tuple[int, int]:
    """The most pinned host memory the offloaded tensors of ``log`` held at once, each
    rounded up to a power of two as torch's host caching allocator does, and how many
    tensors held it."""
    from autofit.memory.allocator._common import pinned_bytes

    ids = {r.id for r in host}
    live = count = peak = at_peak = 0
    for kind, r, _ in log:
        if r.id in ids:
            sign = 1 if kind == "alloc" else -1
            live += sign * pinned_bytes(r.size)
            count += sign
            if live > peak:
                peak, at_peak = live, count
    return peak, at_peak


class _FakeGradScaler:
    """``torch.amp.GradScaler`` on fake tensors (its ``step`` reads a value with ``.item()``).

    Same tensors and in-place ops: a persistent scale and growth tracker, the scaled
    loss, ``inv_scale`` and ``found_inf`` per unscale, grads unscaled in place.
    """

    def __init__(self) -> None:
        self.scale = torch.full((), 2.0**16, dtype=torch.float32)  # (,) fp32
        self.growth_tracker = torch.full((), 0, dtype=torch.int32)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params: list[torch.Tensor]) -> torch.Tensor:
        inv_scale = self.scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32)
        grads = [p.grad for p in params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found_inf, inv_scale)
        return found_inf

    def update(self, found_inf: torch.Tensor) -> None:
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf, 2.0, 0.5, 2000)


def _autocast(config: TrainConfig) -> Any:
    """CPU autocast on the fake CPU tensors (a CUDA target adds CUDA's extra casts in
    ``simulate._cuda.CudaSemantics``)."""
    spec = config.precision_spec
    if not spec.autocast:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=getattr(torch, spec.compute_dtype))


def track_built_states(optimizer: torch.optim.Optimizer, rec: StorageRecorder) -> None:
    """The states an optimizer makes in its constructor (torch's Adagrad: ``sum``, one
    full copy), outside the recorder: held from the start as optimizer states. Untracked, a
    CUDA target's step never counted them (Adagrad on an H100: 20% under)."""
    from torch._subclasses.fake_tensor import is_fake

    phase, rec.phase = rec.phase, "optimizer"
    for state in optimizer.state.values():
        for t in state.values() if isinstance(state, dict) else ():
            if isinstance(t, torch.Tensor) and is_fake(t):
                rec.track(t, Component.OPTIMIZER_STATES)
    rec.phase = phase


def _mark_host_steps(optimizer: torch.optim.Optimizer, rec: StorageRecorder) -> None:
    """torch's non-fused, non-capturable optimizers keep ``state["step"]`` on the host."""
    defaults = getattr(optimizer, "defaults", {})
    if defaults.get("fused") or defaults.get("capturable"):
        return
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            r = rec.record_of(step)
            if r is not None:
                r.host = True


def forward_loss(model: torch.nn.Module, config: TrainConfig, task: str, batch_size: int,
                 seq_len: int, rec: StorageRecorder, target_kind: str = "cpu",
                 ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """One micro batch's forward and loss as the Trainer runs them (inside the fake mode):
    the batch made and tracked as activations, the loss under autocast (the chunked loss
    when asked), the outputs dropped as ``compute_loss`` drops them. Returns (loss, batch,
    the model's keyword arguments); the caller frees the last two when the Trainer would."""
    if target_kind == "cpu":
        check_cpu_experts(model)
    batch = make_batch(unwrap(model), task, batch_size, seq_len)
    for v in batch.values():
        if isinstance(v, torch.Tensor):
            rec.track(v, Component.ACTIVATIONS)  # the batch on the device
    kwargs = {k: batch[k] for k in batch["_model_kwargs"]}
    with _autocast(config), unpacked_batches():
        if config.loss_impl == "trl":  # TRL's fused LM head, on this fake clone only
            from autofit.knobs.trl_loss import trl_sft_loss

            # on a CPU only the pages TRL writes are resident: its (rows, 32768) buffer as
            # wide as the vocabulary (the same tiles and loop for V <= 32768)
            loss = trl_sft_loss(model, kwargs, resident_only=target_kind == "cpu")
        elif (loss_fn := step_loss(config)) is not None:  # a knob's (the chunked loss)
            loss = loss_fn(model, kwargs)
        else:
            out = model(**kwargs)
            loss = getattr(out, "loss", None)
            del out  # the outputs (logits) are dropped, as compute_loss does
    return loss, batch, kwargs


def run_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    *,
    task: str,
    seq_len: int,
    rec: StorageRecorder,
    target: StepTarget,
    steps: int = 2,
) -> None:
    """Run ``steps`` Trainer steps of ``config`` under ``rec`` (inside the fake mode); TRL's
    loss for a CUDA target with its folds as the Triton kernels (``triton_folds``)."""
    folds: Any = contextlib.nullcontext()
    if config.loss_impl == "trl" and target.kind == "cuda":
        from autofit.knobs.trl_loss import triton_folds

        folds = triton_folds()
    with folds:
        _run_steps(model, optimizer, config, task=task, seq_len=seq_len, rec=rec,
                   target=target, steps=steps)


# CPU: the autograd graph's own host memory, beside the tensors it saves -- per node
# (``MulBackward0``: its inputs' metadata, edges) and per saved tensor (the tensor and
# storage objects of a ``SavedVariable``); measured on torch 2.13 / glibc by
# ``benchmarks/autograd_host.py`` (637 B a node, 474 B more with a saved output, of which
# 80 B the data). Negligible for a transformer's few hundred nodes; RWKV's CPU recurrence
# runs a dozen ops per token and layer (7,300 nodes, 5,700 saved tensors at 4 x 128
# tokens: 6.6 MiB, the zoo's rows 3.7-5.5% under without it), held node by node in the
# heap's holes (``_graph_held``). On CUDA it is host memory.
_NODE_HOST_BYTES = 640
_SAVED_HOST_BYTES = 400
# With non-reentrant checkpointing (``benchmarks/autograd_host.py``'s checkpointed chains):
# a saved slot holds the checkpoint's handle instead (630 B, the data freed), and backward
# rebuilds a block's graph beside the step's, each of its saved tensors also entered in
# the recompute's map (870 B a saved tensor): an exp chain's peak 2,757 B an op, not the
# 1,113 B of the plain one. RWKV in bf16 with checkpointing at 4 x 256: 12.8% under
# without it, 11.9% with (the rest: host objects beside its tensors, docs/accuracy.md),
# so such a recurrence is refused on a CPU (``_MEASURED_RECURRENCES``).
_SAVED_CKPT_HOST_BYTES = 630
_RECOMPUTE_SAVED_HOST_BYTES = 870


# A checkpointed block whose graph has more autograd nodes than this (a transformer
# block: tens to a few hundred) is a per-position recurrence run op by op: on a CPU
# target, its host memory under checkpointing (the rebuilt graphs' host objects, the
# heap's holes between its thousands of small tensors) is modelled only for the families
# measured within the targets (``_MEASURED_RECURRENCES``); any other is refused
# (``recurrent_checkpoint_refusal``): RWKV's CPU kernel (30 nodes a position and layer) was
# 4.8% and 11.9% above the simulated step (bf16, 4 x 128 and 4 x 256)
_RECURRENT_BLOCK_NODES = 1000
# model types whose checkpointed CPU recurrence the zoo measured within the targets: Mamba's
# and Falcon-Mamba's slow scan (15 nodes a position and layer, 1,900-3,700 a block at 4 x
# 128 and 4 x 256 in bf16: -0.2..+0.5%)
_MEASURED_RECURRENCES = frozenset({"mamba", "falcon_mamba"})


def recurrent_checkpoint_refusal(block_nodes: int) -> UnmodelledStepError:
    """The one-line refusal of a checkpointed block of ``block_nodes`` autograd nodes on a
    CPU target."""
    return UnmodelledStepError(
        f"simulate cannot estimate a checkpointed per-position recurrence on a CPU "
        f"({block_nodes:,} autograd nodes a block, e.g. RWKV's CPU kernel): its host "
        "memory was up to 12% above the simulated step; train it without gradient "
        f"checkpointing ({fix('--no-gradient-checkpointing', 'gradient_checkpointing=False')})"
        ", or measure it (autofit.measure)")


def check_cpu_experts(model: torch.nn.Module) -> None:
    """Refuse (``UnmodelledStepError``) a mixture of experts whose expert weights are 16-bit
    on a CPU target: each expert's matmul runs at its own token count, which the routing
    changes every step, and oneDNN keeps a primitive and its JIT-compiled kernels for each
    shape, with scratch beyond them, none of it a tensor (Mixtral and GraniteMoE in
    bf16-true, drawn by ``benchmarks/random_sweep.py``: measured 15-22% above both
    estimates, 8-9% with oneDNN's primitive cache off; transformers' grouped_mm and its
    per-expert loop alike). In fp32 and under autocast they are measured within the
    targets."""
    for m in model.modules():
        if not type(m).__name__.endswith("Experts"):
            continue
        half = [p for p in m.parameters(recurse=False)
                if p.dim() == 3 and p.dtype in (torch.bfloat16, torch.float16)]
        if half:
            raise UnmodelledStepError(
                f"a mixture of experts in {str(half[0].dtype)[6:]} on a CPU is not modelled: oneDNN "
                "keeps state for each expert's matmul shape, which the routing changes every "
                "step (a bf16-true Mixtral measured 22% above the estimate); train it in "
                f"32-true or bf16-mixed ({fix('--precision bf16-mixed', 'precision=bf16-mixed')}"
                "), or measure it (autofit.measure)")


def graph_nodes(loss: torch.Tensor) -> list[Any]:
    """Every node of ``loss``'s autograd graph, each once (none without a graph)."""
    seen: dict[Any, None] = {}
    todo = [getattr(loss, "grad_fn", None)]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen[fn] = None
        todo.extend(f for f, _ in fn.next_functions)
    return list(seen)


@functools.cache
def _saved_attributes(node_type: type) -> tuple[str, ...]:
    """The ``_raw_saved_*`` attributes of an autograd node type (its saved variables)."""
    return tuple(n for n in dir(node_type) if n.startswith("_raw_saved_"))


def graph_host_bytes(loss: torch.Tensor, blocks: int = 0) -> int:
    """Host bytes of ``loss``'s autograd graph: its nodes and their saved-variable slots
    (the constants above, calibrated per op, slots used or not: a ``mul`` by a constant
    has two). The slots are counted on the nodes (their ``_raw_saved_*`` attributes;
    reading ``_saved_*`` would unpack them, and recompute a checkpointed block), not by
    ``saved_tensors_hooks``: a hook changes what is kept (Pegasus-X's
    simulated step: 12 MiB more activations under one).

    With ``blocks`` checkpointed blocks: the slots hold the checkpoint's handles, and
    backward holds one block's rebuilt graph (a ``blocks``-th of the step's) beside it."""
    return _host_bytes(*_graph_counts(loss), blocks)


def _graph_counts(loss: torch.Tensor) -> tuple[int, int]:
    """The nodes of ``loss``'s autograd graph and their saved-variable slots."""
    nodes = graph_nodes(loss)
    return len(nodes), sum(_saved_slots(fn) for fn in nodes)


def _saved_slots(fn: torch.autograd.graph.Node) -> int:
    """An autograd node's saved-variable slots, used or not (its ``_raw_saved_*``)."""
    slots = 0
    for name in _saved_attributes(type(fn)):
        value = getattr(fn, name, None)
        slots += len(value) if isinstance(value, list | tuple) else value is not None
    return slots


def _host_bytes(nodes: int, saved: int, blocks: int) -> int:
    """`graph_host_bytes` of a graph of ``nodes`` nodes and ``saved`` slots."""
    if not blocks:
        return _NODE_HOST_BYTES * nodes + _SAVED_HOST_BYTES * saved
    rebuilt = _NODE_HOST_BYTES * nodes + _RECOMPUTE_SAVED_HOST_BYTES * saved
    return _NODE_HOST_BYTES * nodes + _SAVED_CKPT_HOST_BYTES * saved + rebuilt // blocks


def _graph_held(rec: StorageRecorder, loss: torch.Tensor, blocks: int,
                model_type: str = "") -> list[Any]:
    """Record the host memory of ``loss``'s autograd graph as held from the end of the
    forward (``graph_host_bytes``): a block per node, its saved slots with it, as the
    heap holds them -- small chunks that fill the holes the forward's freed tensors left
    (one block beside them put RWKV's small steps 3.6-5.5% over: its 7,300 nodes sit in
    the holes of its thousands of 4 KiB tensors; now within 1.7%) -- or, with ``blocks``
    checkpointed blocks, one block of the handles and a block's rebuilt graph (a
    per-position recurrence there, of a ``model_type`` not measured within the targets, is
    refused: ``recurrent_checkpoint_refusal``)."""
    if blocks:
        nodes, saved = _graph_counts(loss)
        if nodes // blocks > _RECURRENT_BLOCK_NODES and model_type not in _MEASURED_RECURRENCES:
            raise recurrent_checkpoint_refusal(nodes // blocks)
        return [rec.hold(_host_bytes(nodes, saved, blocks), Component.ACTIVATIONS)]
    return [rec.hold(_host_bytes(1, _saved_slots(fn), 0), Component.ACTIVATIONS)
            for fn in graph_nodes(loss)]


def _run_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, *, task: str,
               seq_len: int, rec: StorageRecorder, target: StepTarget, steps: int) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    _, _, _, max_grad_norm = optimizer_cls_and_kwargs(config.optimizer, config.optim_args)
    if _is_bnb(type(optimizer)) and target.kind == "cpu":
        rec.decompositions.update(bnb_cpu_kernels())
    recorded(config, rec, target)  # what a knob's value runs differently (its kernels)
    micro_steps = min(config.grad_accum_steps, 2)
    # checkpointing: backward rebuilds each block's graph while the step's is still held
    # (its host bytes: the step's graph over its blocks; RWKV's 3,650-node blocks)
    blocks = (sum(len(m) for _, m in _layer_lists(unwrap(model)))
              if config.gradient_checkpointing and target.kind == "cpu" else 0)
    model_type = str(getattr(getattr(unwrap(model), "config", None), "model_type", ""))
    scaler = None
    if config.precision_spec.grad_scaler:
        rec.phase = "optimizer"  # created once, kept for the whole run
        scaler = _FakeGradScaler()
        rec.keepalive.append(scaler)  # the Trainer's scaler outlives the steps
    for step in range(steps):
        for micro in range(micro_steps):
            rec.mark(f"step{step}/micro{micro}")
            rec.micro += 1
            rec.phase = "forward"
            loss, batch, kwargs = forward_loss(model, config, task, config.micro_batch_size,
                                               seq_len, rec, target.kind)
            if not isinstance(loss, torch.Tensor):
                raise BadInputError(
                    f"{type(model).__name__}(input_ids=..., labels=...) returned no loss; "
                    "simulate needs a model that computes its loss from labels "
                    "(a transformers model for the task)"
                )
            del batch, kwargs
            if config.grad_accum_steps > 1:
                loss = loss / config.grad_accum_steps
            rec.mark_live(Component.ACTIVATIONS, phase="forward", micro=rec.micro)
            graph = (_graph_held(rec, loss, blocks, model_type) if target.kind == "cpu"
                     else [])
            rec.phase = "backward"
            root = scaler.scale_loss(loss) if scaler is not None else loss
            with rec.eager_accumulation(graph_nodes(root)):
                root.backward()
            del loss, root
            for held in graph:
                rec.release(held)
            for j, p in enumerate(params):
                if p.grad is not None:
                    r = rec.record_of(p.grad)
                    if r is not None:
                        r.category = Component.GRADIENTS
                        r.param = j
        rec.mark(f"step{step}/optimizer")
        rec.phase = "optimizer"
        found_inf = scaler.unscale_(params) if scaler is not None else None
        if max_grad_norm > 0:
            # Trainer -> accelerate -> clip_grad_norm_; foreach on real CUDA and CPU tensors.
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer.step()
        if scaler is not None:
            scaler.update(found_inf)
            del found_inf
        optimizer.zero_grad(set_to_none=True)
        rec.mark_live(Component.OPTIMIZER_STATES, phase="optimizer")
        if target.kind == "cuda":
            _mark_host_steps(optimizer, rec)
    rec.mark("end")
    rec.phase = ""
