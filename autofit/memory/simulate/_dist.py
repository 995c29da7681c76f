"""Several ranks simulated: the real FSDP2 / DDP wrappers traced on fake tensors, per rank.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``: collectives
that move no data) lets ``fully_shard`` and ``DistributedDataParallel`` run in this one
process as rank ``r`` of ``N`` on FakeTensors, as torch's own ``FSDPMemTracker`` tests
run them. The wrapper is applied to the fake clone while the recorder is active, so
the sharded parameters, the all-gather and reduce-scatter buffers (FSDP2) and the
gradient buckets (DDP) are recorded as the real step allocates them, and replayed
through the target's allocator model like any other step (``simulate``).

The process group exists only while one rank is traced and is destroyed afterwards
(``fake_world``); a process that already has one (``torch.distributed.is_initialized``)
is left alone: its ranks are then simulated by the single-rank step with the rules of
``autofit.memory.ranks`` applied to it (``simulate._zero.transform``, which ZeRO always
uses, as DeepSpeed cannot run on fake tensors).

Only ranks that hold different shards are traced: FSDP2's ranks differ only by the
length of their unpadded chunks (``fsdp_local_numel``), so ranks with the same chunks
share one trace; DDP's ranks are alike.

Known limitations:
    * NB: DDP on fake tensors needs three stand-ins: its start-up checks and broadcast
      (``_verify_param_shape_across_processes``, ``_sync_module_states``) read values
      and are skipped (they allocate nothing that lasts); the all-reduce of a bucket is
      a comm hook that divides the bucket in place and completes at once (the default
      hook's ``div_`` + in-place all-reduce); the bucket rebuild after the first step
      (same buckets in gradient-ready order, the old freed first) is skipped.
    * NB: FSDP2's all-gather and reduce-scatter run in place on fake tensors; their
      buffers are torch's own (``foreach_all_gather``, ``foreach_reduce``), recorded
      as allocated, with no extra staging a backend might add.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import TrainConfig
from autofit.memory.breakdown import Component
from autofit.memory.ranks._layout import Layout, activation_config, fsdp_local_numel

if TYPE_CHECKING:  # pragma: no cover
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.memory.simulate._recorder import StorageRecorder

__all__ = ["ProcessGroupExists", "RankTrace", "fake_world", "rank_classes", "wrap_fsdp",
           "wrap_ddp", "device_mesh"]


class ProcessGroupExists(RuntimeError):
    """This process already has a default process group (the fake one cannot be made)."""


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """A fake default process group of ``world_size`` ranks as rank ``rank``, destroyed on
    exit; ``ProcessGroupExists`` if the process already has one (it is never touched)."""
    import torch.distributed as dist

    if not dist.is_available():  # pragma: no cover - torch built without distributed
        raise ProcessGroupExists("torch.distributed is not available")
    if dist.is_initialized():
        raise ProcessGroupExists("a process group is already initialized in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _sharding_propagation_unrecorded(rec: StorageRecorder) -> Iterator[None]:
    """DTensor computes an op's output metadata on fake tensors of the *global* shape
    (``ShardingPropagator._propagate_tensor_meta_non_cached``); nothing of it exists on
    the device, so the recorder pauses while it runs."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: object, *args: object, **kwargs: object) -> Any:
        rec.paused += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            rec.paused -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def _no_split_classes(model: torch.nn.Module) -> tuple[type, ...]:
    """The block classes accelerate's transformer auto-wrap policy wraps: the model's
    ``_no_split_modules`` names, found among its modules."""
    from autofit.memory.simulate._model import unwrap

    names = set(getattr(unwrap(model), "_no_split_modules", None) or ())
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """accelerate's ``_find_final_norm``: the last ``*Norm*`` child of the base model."""
    from autofit.memory.simulate._model import unwrap

    base_model = unwrap(model)
    prefix = getattr(base_model, "base_model_prefix", "")
    base = getattr(base_model, prefix, None) if prefix else base_model
    if not isinstance(base, torch.nn.Module):
        return None
    norm = None
    for _, m in base.named_children():
        if "Norm" in type(m).__name__:
            norm = m
    return norm


def device_mesh(layout: Layout) -> Any:
    """FSDP2's mesh on the fake world (made outside the fake mode: it reads its ranks):
    1-D over all ranks, or (replicate over nodes, shard within a node) for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.strategy == "hsdp":
        return init_device_mesh("cpu", (layout.nnodes, layout.nproc_per_node),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (layout.world_size,))


def wrap_fsdp(model: torch.nn.Module, layout: Layout, config: TrainConfig,
              mesh: object) -> torch.nn.Module:
    """``fully_shard`` the clone as the recipe does (on the fake world, inside the fake
    mode): a unit per block, then (Trainer: accelerate 1.15 ``fsdp2_prepare_model``)
    the untied input embedding, the tail [final norm, output head] kept after forward and
    the root with torch's root default; (torch recipe) the root with the blocks' setting.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

    spec = config.precision_spec
    if spec.autocast:
        low = getattr(torch, spec.compute_dtype)
        reduce = torch.float32 if layout.fsdp_recipe == "torch" else low
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce,
                                  **({} if layout.fsdp_recipe == "torch" else {"output_dtype": low}))
    else:
        mp = MixedPrecisionPolicy()
    raf = layout.reshard_after_forward
    kw: dict[str, Any] = {"mesh": mesh, "mp_policy": mp}
    if layout.offload != "none":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    blocks = _no_split_classes(model)
    for m in list(model.modules())[::-1]:  # bottom up, as accelerate walks them
        inner = getattr(m, "_checkpoint_wrapped_module", m)
        if m is not model and blocks and isinstance(inner, blocks) and not isinstance(m, FSDPModule):
            fully_shard(m, reshard_after_forward=raf, **kw)
    if layout.fsdp_recipe == "accelerate":
        get_in = getattr(model, "get_input_embeddings", lambda: None)
        get_out = getattr(model, "get_output_embeddings", lambda: None)
        inp, out = get_in(), get_out()
        tied = (inp is not None and out is not None
                and getattr(inp, "weight", None) is getattr(out, "weight", 0))
        if not tied and inp is not None and not isinstance(inp, FSDPModule):
            fully_shard(inp, reshard_after_forward=raf, **kw)
        norm = _final_norm(model)
        tail = [x for x in ((norm, inp, out) if tied else (norm, out))
                if x is not None and not isinstance(x, FSDPModule)]
        if tail:
            fully_shard(tail, reshard_after_forward=False, **kw)
        fully_shard(model, **kw)  # root: reshard_after_forward=None (kept after forward)
    else:
        fully_shard(model, reshard_after_forward=raf, **kw)
    return model


def wrap_ddp(model: torch.nn.Module, layout: Layout, world_size: int) -> torch.nn.Module:
    """``DistributedDataParallel`` around the clone (inside the fake mode), with the
    stand-ins of the module docstring."""
    import torch.nn.parallel.distributed as ddp_mod
    from torch.nn.parallel import DistributedDataParallel

    kwargs: dict[str, Any] = {"gradient_as_bucket_view": layout.gradient_as_bucket_view}
    if layout.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = layout.bucket_cap_mb
    saved = ddp_mod._verify_param_shape_across_processes, ddp_mod._sync_module_states
    ddp_mod._verify_param_shape_across_processes = lambda *a, **k: None
    ddp_mod._sync_module_states = lambda *a, **k: None
    try:
        wrapped = DistributedDataParallel(model, **kwargs)
    finally:
        ddp_mod._verify_param_shape_across_processes, ddp_mod._sync_module_states = saved

    def allreduce_in_place(state: object, bucket: torch.distributed.GradBucket
                           ) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer().div_(world_size))
        return fut

    import torch.distributed as dist

    # DDP checks the hook's annotations as objects (this module's are strings)
    allreduce_in_place.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                          "return": torch.futures.Future[torch.Tensor]}
    wrapped.register_comm_hook(None, allreduce_in_place)
    wrapped.reducer = _NoRebuild(wrapped.reducer)
    return wrapped


class _NoRebuild:
    """The Reducer, whose bucket rebuild (it reads values to agree on bucket order) is off."""

    def __init__(self, reducer: object) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def rank_classes(module: torch.nn.Module, layout: Layout) -> dict[int, list[int]]:
    """Ranks that hold the same shards, as {representative: [ranks]} (FSDP2: the lengths
    of every parameter's unpadded chunk; DDP: all alike)."""
    n = layout.world_size
    if layout.family != "fsdp":
        return {0: list(range(n))}
    shapes = [tuple(p.shape) for p in module.parameters()]
    k = layout.shard_ranks
    out: dict[tuple[int, ...], list[int]] = {}
    for r in range(n):
        key = tuple(fsdp_local_numel(s, k, r % k) for s in shapes)
        out.setdefault(key, []).append(r)
    return {ranks[0]: ranks for ranks in out.values()}


@dataclass
class RankTrace:
    """What ``Simulator._run`` needs to trace rank ``rank`` of ``layout``."""

    layout: Layout
    rank: int
    config: TrainConfig

    @property
    def step_config(self) -> TrainConfig:
        """The config ``run_steps`` runs: autocast as the recipe runs it."""
        return activation_config(self.config, self.layout)

    def wrap(self, model: torch.nn.Module, rec: StorageRecorder, fake_mode: FakeTensorMode) -> torch.nn.Module:
        """The wrapped clone; the wrapper's allocations recorded (DDP's buckets as
        gradients)."""
        if self.layout.family == "ddp":
            rec.phase = ""
            with fake_mode, rec:
                wrapped = wrap_ddp(model, self.layout, self.layout.world_size)
            rec.mark_live(Component.GRADIENTS, phase="")  # the buckets
            return wrapped
        mesh = device_mesh(self.layout)
        with fake_mode, rec:
            return wrap_fsdp(model, self.layout, self.config, mesh)

    @contextlib.contextmanager
    def running(self, rec: StorageRecorder) -> Iterator[None]:
        """While the step runs: DTensor's metadata propagation unrecorded."""
        if self.layout.family != "fsdp":
            yield
            return
        with _sharding_propagation_unrecorded(rec):
            yield
