"""The training step of one rank among several: the model wrapped as the Trainer wraps it.

A trial with ``world_size > 1`` (``autofit.trial.ranks``) runs this in every rank process
that ``torchrun`` starts. ``RankSpec`` (built in the parent, picklable) says how the
ranks hold the model; ``join`` sets up the process group; ``wrap`` returns a stepper
with the interface of ``autofit.trial.step.Stepper`` (``step``, ``evaluate``, ``close``)
around the wrapped model:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with the Trainer's
  ``find_unused_parameters`` (``not model.is_activation_checkpointing`` for a
  ``PreTrainedModel``); micro batches before the last of a step under ``no_sync``.
- ``fsdp`` / ``fsdp-shard-grad-op`` / ``hsdp``: FSDP2 ``fully_shard`` as accelerate's
  ``fsdp2_prepare_model`` applies it (each ``_no_split_modules`` layer, the input
  embedding, the tail [final norm, output embedding] unit, then the root), called with
  accelerate's own ``FullyShardedDataParallelPlugin`` (``fsdp_version=2``,
  ``TRANSFORMER_BASED_WRAP``, ``reshard_after_forward``, ``CPUOffloadPolicy`` for
  offload, the mixed-precision policy of the precision): the Trainer's accelerate falls
  back to DDP on a CPU, so a CPU trial calls that function itself; hybrid sharding
  on a ``(nnodes, nproc_per_node)`` mesh. Micro batches before the last of a step run
  with ``set_requires_gradient_sync(False)`` (accelerate's ``no_sync`` for FSDP2).
- ``zero1`` / ``zero2`` / ``zero3``: ``deepspeed.initialize`` with the DeepSpeed config
  the tuned file carries, its ``"auto"`` values filled in as transformers fills them
  (``HfTrainerDeepSpeedConfig``, in the parent) and the Trainer's optimizer as the
  client optimizer (``zero_allow_untested_optimizer``, as transformers sets it).

Ranks agree after every step (``Ranks.agree``): each puts in a code (0 went on, 1 out of
memory, 2 failed otherwise), the codes are all-reduced with MAX over a gloo group of
their own, and every rank stops at the same step when any code is not 0.

Known limitations:
    NB: ``nnodes > 1`` runs all ``nproc_per_node * nnodes`` ranks on this machine (the
    memory of a rank does not depend on where its peers are; the speed does).
    NB: ZeRO's set-up allocates its flat buffers and optimizer partitions when the
    engine is built, so they are resident before the measured steps (as in a run), not
    allocated during them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from autofit.trial.step import (
    StepPlan,
    _forward_loss,
    build_optimizer,
    free_grads,
    optimizer_step,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RankSpec", "Ranks", "join", "wrap", "OK", "OOM", "FAILED", "FSDP_STRATEGIES",
           "ZERO_STAGES"]

OK, OOM, FAILED = 0, 1, 2  # what a rank puts into the agreement after a step
FSDP_STRATEGIES = {"fsdp": True, "fsdp-shard-grad-op": False, "hsdp": True}
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


@dataclass(frozen=True)
class RankSpec:
    """How the ranks of a trial hold the model (built in the parent; picklable).

    Attributes:
        nproc_per_node, nnodes: the run's shape (``world_size`` = their product).
        strategy, offload: ``TrainConfig.strategy`` / ``.offload``.
        find_unused_parameters: DDP's, as the Trainer sets it.
        deepspeed: the DeepSpeed config with every ``"auto"`` filled (ZeRO only).
        caps: each rank's CPU cap in bytes (None: not capped), by global rank.
        timeout_s: how long a collective may wait for a peer before it fails.
    """

    nproc_per_node: int
    nnodes: int = 1
    strategy: str = "ddp"
    offload: str = "none"
    find_unused_parameters: bool = True
    deepspeed: dict[str, Any] | None = None
    caps: tuple[int | None, ...] = ()
    timeout_s: float = 1800.0
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class Ranks:
    """This process's place among the ranks, and the agreement after each step."""

    def __init__(self, spec: RankSpec, device: torch.device) -> None:
        import torch.distributed as dist

        self.spec = spec
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # the agreement travels on a gloo group of its own: on the CPU whatever the
        # training's backend, and never queued behind the training's collectives
        self.flags = dist.new_group(backend="gloo")

    def agree(self, code: int, wait_s: float | None = None) -> int:
        """The largest code any rank put in (MAX all-reduce); ``FAILED`` when a peer is
        gone or does not answer within ``wait_s``."""
        import torch.distributed as dist

        flag = torch.tensor([int(code)], dtype=torch.int32)
        try:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.flags, async_op=True)
            if wait_s is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=max(1.0, wait_s)))
        except Exception:  # noqa: BLE001 - a peer that died or hangs: stop
            return FAILED
        return int(flag.item())


def join(spec: RankSpec, device: torch.device) -> Ranks:
    """Join the process group ``torchrun`` set up (env://): gloo on the CPU, NCCL on CUDA."""
    import torch.distributed as dist

    backend = "gloo" if device.type == "cpu" else dist.get_default_backend_for_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(seconds=max(60.0, spec.timeout_s)))
    _preload(spec, backend, device)
    return Ranks(spec, device)


def _preload(spec: RankSpec, backend: str, device: torch.device) -> None:
    """Import (and set up) the wrapper's libraries now, before the rank measures its bare
    process: their code and one-time mappings (DeepSpeed's communication op, tens of MiB)
    are the process's, not the rank's training memory."""
    if spec.strategy in ZERO_STAGES:
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    elif spec.strategy in FSDP_STRATEGIES:
        import accelerate.utils.fsdp_utils  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
    else:
        import torch.nn.parallel  # noqa: F401


def _autocast(plan: StepPlan, device: torch.device) -> Any:
    if not plan.precision.endswith("-mixed"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=plan.compute_dtype)


class _Phases:
    """``on_phase(name)`` is called as a step goes through forward, backward, optimizer step."""

    on_phase: Any = None

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)


class _TorchStepper(_Phases):
    """DDP and FSDP2: the Trainer's step through a wrapper, with a torch optimizer."""

    def __init__(self, model: torch.nn.Module, wrapped: torch.nn.Module, plan: StepPlan,
                 device: torch.device,
                 no_sync: Callable[[], contextlib.AbstractContextManager[None]],
                 scaler: torch.amp.GradScaler | None = None) -> None:
        self.model = model  # the module whose parameters train (FSDP2: the same object)
        self.wrapped = wrapped
        self.plan = plan
        self.device = device
        self.no_sync = no_sync  # () -> context manager skipping gradient sync
        self.optimizer = build_optimizer(model, plan)
        self.scaler = scaler
        self.skipped_steps = 0

    def step(self, batch: dict[str, torch.Tensor]) -> bool:
        n = self.plan.micro_batches_per_step
        for i in range(n):
            ctx = self.no_sync() if i < n - 1 else contextlib.nullcontext()
            with ctx:
                self._phase("forward")
                with _autocast(self.plan, self.device):
                    loss = _forward_loss(self.wrapped, batch, self.plan.loss_fn)
                loss = loss / self.plan.grad_accum_steps
                self._phase("backward")
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
                del loss
        self._phase("optimizer step")
        stepped = optimizer_step(self.model, self.optimizer, self.scaler, self.plan.max_grad_norm)
        if not stepped:
            self.skipped_steps += 1
        self._phase("")
        return stepped

    def evaluate(self, batch: dict[str, torch.Tensor]) -> None:
        was = self.model.training
        self.wrapped.eval()
        try:
            with torch.no_grad(), _autocast(self.plan, self.device):
                loss = _forward_loss(self.wrapped, batch, self.plan.loss_fn).detach()
            del loss
        finally:
            self.wrapped.train(was)

    def close(self) -> None:
        """Drop the optimizer's state and every gradient (the wrapper stays)."""
        if self.optimizer is not None:
            self.optimizer.state.clear()
            self.optimizer.param_groups.clear()
        self.optimizer = None
        free_grads(self.model)

    def reopen(self) -> None:
        """A fresh optimizer after ``close`` (no state yet: it appears at the first step)."""
        self.optimizer = build_optimizer(self.model, self.plan)


def _ddp(model: torch.nn.Module, plan: StepPlan, spec: RankSpec,
         device: torch.device) -> _TorchStepper:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids,
                                  find_unused_parameters=spec.find_unused_parameters)
    scaler = torch.amp.GradScaler(device.type) if plan.precision == "16-mixed" else None
    return _TorchStepper(model, ddp, plan, device, ddp.no_sync, scaler)


class _Accelerator:
    """What accelerate's ``fsdp2_prepare_model`` reads of an ``Accelerator``."""

    def __init__(self, plugin: FullyShardedDataParallelPlugin, mesh: DeviceMesh | None,
                 device: torch.device, precision: str, main: bool) -> None:
        from types import SimpleNamespace

        self.state = SimpleNamespace(fsdp_plugin=plugin)
        self.torch_device_mesh = mesh
        self.parallelism_config = SimpleNamespace(fsdp_dim_names=("dp_replicate", "dp_shard"))
        self.device = device
        self.mixed_precision = {"bf16-mixed": "bf16", "16-mixed": "fp16"}.get(precision, "no")
        self.is_main_process = main


def _fsdp(model: torch.nn.Module, plan: StepPlan, spec: RankSpec, device: torch.device,
          rank: int) -> _TorchStepper:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    offload = CPUOffloadPolicy() if spec.offload != "none" else None
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=FSDP_STRATEGIES[spec.strategy],
        cpu_offload=offload, auto_wrap_policy="transformer_based_wrap",
        state_dict_type="SHARDED_STATE_DICT")
    mixed = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(plan.precision)
    if mixed is not None:
        plugin.set_mixed_precision(mixed, override=True)
    mesh = None
    if spec.strategy == "hsdp":
        mesh = init_device_mesh(device.type, (spec.nnodes, spec.nproc_per_node),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    wrapped = fsdp2_prepare_model(_Accelerator(plugin, mesh, device, plan.precision, rank == 0),
                                  model)
    scaler = None
    if plan.precision == "16-mixed":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type)

    @contextlib.contextmanager
    def no_sync() -> Any:
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)

    return _TorchStepper(wrapped, wrapped, plan, device, no_sync, scaler)


class _ZeroStepper(_Phases):
    """DeepSpeed ZeRO: the engine runs forward, backward and the optimizer step."""

    def __init__(self, model: torch.nn.Module, plan: StepPlan, spec: RankSpec,
                 device: torch.device) -> None:
        import deepspeed

        self.plan = plan
        self.device = device
        self.skipped_steps = 0
        config = dict(spec.deepspeed or {})
        # a config with its own optimizer block: DeepSpeed builds it (not the Trainer's)
        optimizer = None if "optimizer" in config else build_optimizer(model, plan)
        # the trial's step is micro_batches_per_step micro batches: DeepSpeed's boundary
        # (its optimizer step) must fall at its end
        config["gradient_accumulation_steps"] = plan.micro_batches_per_step
        micro = int(config.get("train_micro_batch_size_per_gpu", 1))
        config["train_batch_size"] = micro * plan.micro_batches_per_step * spec.world_size
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False)
        self.model = self.engine.module

    def step(self, batch: dict[str, torch.Tensor]) -> bool:
        for _ in range(self.plan.micro_batches_per_step):
            self._phase("forward")
            loss = _forward_loss(self.engine, batch, self.plan.loss_fn)
            self._phase("backward")
            self.engine.backward(loss)
            del loss
            self._phase("optimizer step")
            self.engine.step()
        self._phase("")
        overflow = bool(getattr(self.engine.optimizer, "overflow", False))
        if overflow:
            self.skipped_steps += 1
        return not overflow

    def evaluate(self, batch: dict[str, torch.Tensor]) -> None:
        self.engine.eval()
        try:
            with torch.no_grad():
                loss = _forward_loss(self.engine, batch, self.plan.loss_fn).detach()
            del loss
        finally:
            self.engine.train()

    def close(self) -> None:
        """Nothing to drop: ZeRO's buffers and optimizer partitions live with the engine."""

    def reopen(self) -> None:
        pass


def wrap(model: torch.nn.Module, plan: StepPlan, spec: RankSpec, device: torch.device,
         rank: int) -> Any:
    """The stepper of ``spec.strategy`` around ``model`` (prepared, on ``device``)."""
    if spec.strategy in ZERO_STAGES:
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return _ZeroStepper(model, plan, spec, device)
    if spec.strategy in FSDP_STRATEGIES:
        return _fsdp(model, plan, spec, device, rank)
    return _ddp(model, plan, spec, device)
