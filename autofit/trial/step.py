"""The training step a trial runs: the one ``transformers.Trainer`` would run.

``plan_step`` (in the parent process, it imports ``transformers.Trainer``) turns a
``TrainConfig`` into a picklable ``StepPlan``: the optimizer class and kwargs from
``Trainer.get_optimizer_cls_and_kwargs`` and the Trainer's decay / no-decay
parameter names. ``Stepper`` runs it (in this process or in a trial child, which
then needs neither ``Trainer`` nor ``TrainingArguments``):

    model.train(); activation checkpointing (use_reentrant=False; offload=True with
    activation offloading); config.use_cache=False
    for each micro batch:  autocast(forward with labels) -> loss / grad_accum -> backward
                           (chunked loss: the backbone, then autofit.causal_lm_chunked_loss)
                           (torch_compile: forward through torch.compile(model, backend="inductor"))
    [GradScaler.unscale_] -> clip_grad_norm_(1.0) -> optimizer.step() -> zero_grad(None)

One trial step runs ``min(grad_accum_steps, 2)`` micro batches before the optimizer
step: with accumulation the gradients stay allocated through the next forward,
and two micro batches are enough to see that peak.

With ``torch_compile`` the step calls what the Trainer's accelerate calls last,
``torch.compile(model, backend="inductor")`` (``compile_model``): a wrapper around the
model (the model itself is not changed; its parameters, names and optimizer groups
are the model's). The trial compiles in its set-up steps, before the baseline
(``autofit.trial.loop``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from autofit.config import TrainConfig
from autofit.errors import MissingDependencyError, require
from autofit.knobs import registry

if TYPE_CHECKING:
    from collections.abc import Iterable

    from transformers.utils import ModelOutput

    from autofit.config import Batch

__all__ = [
    "StepPlan",
    "plan_step",
    "prepare_model",
    "build_optimizer",
    "Stepper",
    "setup_batch",
    "move_batch",
    "storage_bytes",
    "free_grads",
    "compile_model",
]

MAX_GRAD_NORM = 1.0  # TrainingArguments.max_grad_norm's default


@dataclass
class StepPlan:
    """Everything the step needs besides the model and the batch (picklable)."""

    precision: str
    gradient_checkpointing: bool
    grad_accum_steps: int
    optimizer_cls: type
    optimizer_kwargs: dict[str, Any]
    decay_names: list[str] | None  # None: every trainable parameter decays
    weight_decay: float = 0.0
    bnb_embedding_override: bool = False  # Trainer: 8-bit bnb keeps embeddings in 32 bits
    max_grad_norm: float = MAX_GRAD_NORM
    optimizer_name: str = ""
    # the loss a knob's value makes the trainer compute (``registry.step_loss``: the chunked
    # loss's, no full logits); None: the model's own
    loss_fn: Callable[..., torch.Tensor] | None = None
    activation_offloading: bool = False  # checkpointing with offload=True (CUDA)
    torch_compile: bool = False  # forward through torch.compile(model, backend="inductor")
    loss_impl: str = "model"  # "trl": TRL's fused LM head, as SFTTrainer computes it
    notes: list[str] = field(default_factory=list)
    # the configuration, for the knobs' ``prepare`` (what the Trainer does to the model for
    # their values: liger's kernels applied)
    config: TrainConfig | None = None

    @property
    def micro_batches_per_step(self) -> int:
        return min(self.grad_accum_steps, 2)

    @property
    def param_dtype(self) -> torch.dtype:
        from autofit.config import PRECISIONS

        return getattr(torch, PRECISIONS[self.precision].param_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        from autofit.config import PRECISIONS

        return getattr(torch, PRECISIONS[self.precision].compute_dtype)


def _restore_environ(before: dict[str, str]) -> None:
    for k in set(os.environ) - set(before):
        del os.environ[k]
    for k, v in before.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


@contextlib.contextmanager
def _accelerate_state_kept() -> Iterator[None]:
    """Undo what building a ``TrainingArguments`` does to the process.

    Its ``__post_init__`` initialises accelerate's ``PartialState`` singleton (and
    resets an ``AcceleratorState`` the user configured) and may call
    ``torch.cuda.set_device``: the shared state dicts are put back in place (same
    objects: accelerate's singletons share them) and the current device restored.
    """
    try:
        from accelerate.state import AcceleratorState, PartialState
    except ImportError:  # pragma: no cover - transformers' Trainer needs accelerate
        yield
        return
    saved = [
        (cls._shared_state, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState)
    ]
    cuda = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        for shared, copy_ in saved:
            shared.clear()
            shared.update(copy_)
        if cuda is not None:
            torch.cuda.set_device(cuda)


def plan_step(model: torch.nn.Module, config: TrainConfig, *, use_cpu: bool) -> StepPlan:
    """Resolve the Trainer's optimizer for ``config`` (``model`` may live on meta)."""
    spec = config.optimizer_spec
    if config.loss_impl == "trl":
        require("trl", "a trial of SFTTrainer's loss (loss_impl='trl')")
    if spec.bnb:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise MissingDependencyError(
                f"optimizer {config.optimizer!r} needs bitsandbytes: pip install 'autofit[bnb]'"
            ) from None
    from transformers import Trainer, TrainingArguments

    before = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="autofit-args-") as tmp, _accelerate_state_kept():
        try:
            args = TrainingArguments(
                output_dir=tmp,
                optim=config.optimizer,
                optim_args=config.optim_args,
                use_cpu=use_cpu,
                report_to=[],
            )
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        finally:
            _restore_environ(before)  # TrainingArguments may export ACCELERATE_* variables
    try:
        decay = list(Trainer.get_decay_parameter_names(None, model))  # uses no `self`
    except Exception:  # noqa: BLE001 - a later transformers may need `self`; fall back
        from transformers.trainer_pt_utils import get_parameter_names

        decay = list(
            get_parameter_names(
                model,
                [torch.nn.LayerNorm],
                [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"],
            )
        )
    return StepPlan(
        precision=config.precision,
        gradient_checkpointing=config.gradient_checkpointing,
        grad_accum_steps=config.grad_accum_steps,
        optimizer_cls=cls,
        optimizer_kwargs=dict(kwargs),
        decay_names=decay,
        weight_decay=float(args.weight_decay),
        bnb_embedding_override="bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8,
        max_grad_norm=float(args.max_grad_norm),
        optimizer_name=config.optimizer,
        loss_fn=registry.trial_loss(config, "cpu" if use_cpu else "cuda"),
        activation_offloading=config.activation_offloading,
        torch_compile=config.torch_compile,
        loss_impl=config.loss_impl,
        config=config,
    )


def _config_objects(model: torch.nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "to_dict"):
            seen.setdefault(id(c), c)
    return list(seen.values())


def prepare_model(model: torch.nn.Module, plan: StepPlan) -> None:
    """What the Trainer does to the model before training (mutates ``model``): training mode,
    no KV cache, checkpointing as asked, and each knob's ``prepare`` (liger's kernels)."""
    model.train()
    if plan.config is not None:
        registry.prepare(plan.config, model)
    for c in _config_objects(model):
        if hasattr(c, "use_cache"):
            c.use_cache = False  # Trainer: model.config.use_cache = args.use_cache (False)
    if plan.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
            # offload: the checkpointed inputs in pinned host memory, as the Trainer does
            # with activation_checkpointing_kwargs={"offload": True}
            extra = {"offload": True} if plan.activation_offloading else {}
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **extra)
        elif hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            plan.notes.append(f"{type(model).__name__} has no gradient checkpointing; ran without")
    else:
        on = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x
        if on is None:
            on = getattr(model, "is_gradient_checkpointing", False)
        if on:
            if hasattr(model, "activation_checkpointing_disable"):
                model.activation_checkpointing_disable()
            else:
                model.gradient_checkpointing_disable()


def build_optimizer(model: torch.nn.Module, plan: StepPlan) -> torch.optim.Optimizer:
    """The Trainer's optimizer: decay / no-decay groups of the trainable parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if plan.decay_names is None:
        groups = [{"params": [p for _, p in named], "weight_decay": plan.weight_decay}]
    else:
        decay = set(plan.decay_names)
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": plan.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
    optimizer = plan.optimizer_cls(groups, **plan.optimizer_kwargs)
    if plan.bnb_embedding_override:
        import bitsandbytes

        manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


@dataclass(frozen=True)
class RunSpec:
    """What a trial replays of the run besides the worst-case steps (all optional).

    Attributes:
        lengths: padded lengths of micro batches in the run's order, each one optimizer
            step on the worst-case rows cut to that length, run after the first timed step
            and before the others (what a caching allocator fragments on: at least one
            full-length step runs after them).
        eval_batch_size: ``per_device_eval_batch_size``: one evaluation step after the
            timed steps, with the optimizer states alive (as inside ``Trainer.train``).
        eval_length: tokens per sample of the evaluation batch (default: the batch's).
        stop_above_bytes: the search's budget: once the peak measured after the warm-up
            (the replay's and the timed steps', which only grow) passes it, no further step
            runs (``RawTrial.over_budget``): the configuration does not fit with the
            margin whatever the rest would measure.
        replay_s: a bound on the replay's time: no replayed length starts after the replay
            has run this many seconds (slow steps replay fewer lengths; the longest step,
            the timed ones, always runs).
        decisive_spread: the timed steps stop after two that agree within this fraction:
            a third cannot move their median out of the two (``loop.run_steps``).
        outpaced_below_tokens_per_s: the search's fastest confirmed speed divided by
            ``autofit.search.engine.OUTPACED``: a trial whose first timed step (run before
            the replay) is slower than this stops there (``RawTrial.outpaced``): it cannot
            be chosen, so its whole run is not worth replaying.
        replay_within: the replay runs only when the first timed step's peak is within
            this fraction of ``stop_above_bytes`` (``peak * (1 + replay_within) >=
            budget``): further under it, what the run's short batches leave fragmented
            (a few percent of a step on a CPU's heap) cannot change the verdict. None:
            always (a caching allocator's run is modelled apart).
    """

    lengths: tuple[int, ...] = ()
    eval_batch_size: int | None = None
    eval_length: int | None = None
    stop_above_bytes: int | None = None
    replay_s: float | None = None
    decisive_spread: float | None = None
    outpaced_below_tokens_per_s: float | None = None
    replay_within: float | None = None


def cut_batch(batch: dict[str, torch.Tensor], length: int,
              rows: int | None = None) -> dict[str, torch.Tensor]:
    """``batch`` cut to ``length`` tokens, and to ``rows`` rows (repeated when more)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            if rows is not None:
                reps = -(-rows // v.shape[0])
                v = v.repeat(reps, *([1] * (v.dim() - 1)))[:rows] if reps > 1 else v[:rows]
            if v.dim() >= 2:
                v = v[:, :length]
            out[k] = v.contiguous()
        else:
            out[k] = v
    return out


def setup_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One sample at the batch's full length: the set-up step run before the baseline.

    Full length, not a few tokens: the first step of a real size maps memory the
    process keeps for good (measured on a capped CPU: an 8 MiB anonymous mapping, 1 MiB
    of it resident, made by the first step past a few thousand tokens of a small
    Llama), which a run pays once before its peak and a trial must not count against
    the cap. With a set-up step of 8 tokens it fell in the warm-up and cost a capped
    trial 8 MiB of address space: ``benchmarks/soak.py``'s llama-vocab at micro batch
    9 failed its trial (3 runs of 4) while the whole-epoch soak survived at 121 of
    128 MiB; with this set-up step the trial measures 121.3-121.8 MiB and fits.
    """
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            out[k] = v[:1].contiguous()
        else:
            out[k] = v
    return out


def move_batch(batch: Batch, device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def storage_bytes(*tensor_sets: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages among tensors (tied weights count once)."""
    seen: dict[tuple[str, int], int] = {}
    for tensors in tensor_sets:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                s = t.untyped_storage()
                key = (str(t.device), s.data_ptr())
                seen[key] = max(seen.get(key, 0), s.nbytes())
            except (RuntimeError, NotImplementedError):
                seen[(str(t.device), id(t))] = t.numel() * t.element_size()
    return sum(seen.values())


def free_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _loss_of(out: ModelOutput | torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "the model returned no loss: the batch needs labels the model's forward accepts"
        )
    return loss


def _forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                  loss_fn: Callable[..., torch.Tensor] | None = None,
                  loss_impl: str = "model") -> torch.Tensor:
    """The loss of one micro batch: the model's own (forward with labels), a knob's
    (``loss_fn``: the chunked loss ``ChunkedLossTrainer.compute_loss`` runs), or TRL's
    (``SFTTrainer.compute_loss``: the fused LM head added to the trial's own copy for the
    call)."""
    if loss_impl == "trl":
        from autofit.knobs.trl_loss import trl_sft_loss

        return trl_sft_loss(model, batch)
    if loss_fn is not None:
        return loss_fn(model, batch)
    out = model(**batch)
    loss = _loss_of(out)
    # the Trainer's compute_loss returns the loss only: the outputs (logits,
    # (B, T, V)) are freed before backward, so they must not live on here
    del out
    return loss


COMPILE_BACKEND = "inductor"  # TrainingArguments' default torch_compile_backend (CPU, CUDA)


def compile_model(model: torch.nn.Module, mode: str | None = None,
                  regional: bool = False) -> torch.nn.Module:
    """What the Trainer's accelerate does last to the prepared model for
    ``torch_compile=True``: ``torch.compile(model, **TorchDynamoPlugin.to_kwargs())``, i.e.
    ``backend="inductor"``, ``mode`` (``TrainingArguments.torch_compile_mode``; None: the
    default), ``dynamic=None`` (a second shape recompiles with symbolic ones); with
    ``regional`` (``use_regional_compilation``) accelerate's own ``compile_regions`` with the
    same arguments: each repeated block compiled apart, the rest of the forward eager. The
    result wraps ``model`` (``_orig_mod``; the blocks' copies share its parameters);
    ``model`` is not changed."""
    if regional:
        from accelerate.utils import compile_regions

        return compile_regions(model, backend=COMPILE_BACKEND, mode=mode)
    return torch.compile(model, backend=COMPILE_BACKEND, mode=mode)


class Stepper:
    """Runs the Trainer's training step on ``model`` (already prepared and placed).

    ``forward``: the module the micro batches go through (``compile_model(model)`` when
    the plan compiles; default ``model``); the optimizer and the gradients are
    ``model``'s."""

    def __init__(self, model: torch.nn.Module, plan: StepPlan, device: torch.device,
                 forward: torch.nn.Module | None = None) -> None:
        self.model = model
        self.forward = forward if forward is not None else model
        self.plan = plan
        self.device = device
        self.optimizer = build_optimizer(model, plan)
        spec_autocast = plan.precision.endswith("-mixed")
        self._autocast = spec_autocast
        self.scaler = torch.amp.GradScaler(device.type) if plan.precision == "16-mixed" else None
        self.skipped_steps = 0
        # the last step's optimizer step, in seconds (the run amortises it over its
        # accumulation, the trial's step over min(accumulation, 2)); ``sync`` waits for the
        # device before each clock reading (None: a CPU)
        self.optimizer_s = 0.0
        self.sync: Any = None

    def _autocast_ctx(self) -> Any:
        if not self._autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.plan.compute_dtype)

    def step(self, batch: dict[str, torch.Tensor]) -> bool:
        """One optimizer step over ``micro_batches_per_step`` micro batches.

        Returns False when the GradScaler skipped the optimizer step (inf/nan grads).
        """
        for _ in range(self.plan.micro_batches_per_step):
            with self._autocast_ctx():
                loss = _forward_loss(self.forward, batch, self.plan.loss_fn,
                                     self.plan.loss_impl)
            loss = loss / self.plan.grad_accum_steps
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
            del loss
        if self.sync is not None:
            self.sync()
        t0 = time.perf_counter()
        stepped = optimizer_step(self.model, self.optimizer, self.scaler, self.plan.max_grad_norm)
        if self.sync is not None:
            self.sync()
        self.optimizer_s = time.perf_counter() - t0
        if not stepped:
            self.skipped_steps += 1
        return stepped

    def evaluate(self, batch: dict[str, torch.Tensor]) -> None:
        """One evaluation step as ``Trainer.prediction_step`` runs it inside training: eval
        mode, no gradients, the same autocast, forward with labels; the loss and logits
        are dropped (no ``compute_metrics``: the Trainer keeps only the loss)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self._autocast_ctx():
                loss = _forward_loss(self.forward, batch, self.plan.loss_fn,
                                     self.plan.loss_impl).detach()
            del loss
        finally:
            self.model.train(was_training)

    def close(self) -> None:
        """Drop the optimizer, its state and every gradient."""
        if self.optimizer is not None:
            self.optimizer.state.clear()
            self.optimizer.param_groups.clear()
        self.optimizer = None
        self.scaler = None
        self.forward = None
        free_grads(self.model)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: torch.amp.GradScaler | None, max_grad_norm: float) -> bool:
    """The Trainer's optimizer step after the accumulated backwards: unscale (fp16), clip
    the gradients to ``max_grad_norm``, step (through the scaler, which skips a step with
    inf/nan gradients), zero the gradients; whether the optimizer stepped."""
    params = [p for p in model.parameters() if p.grad is not None]
    if scaler is not None:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    stepped = True
    if scaler is not None:
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        stepped = scaler.get_scale() >= scale
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stepped
