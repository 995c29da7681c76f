"""Simulate the real training step on fake tensors and replay its allocations.

`simulate` runs the step that ``transformers.Trainer`` runs — forward with labels,
``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``,
``zero_grad(set_to_none=True)`` — twice, on a FakeTensor clone of the model (shapes,
dtypes and storages, no data, no memory), records every storage allocated and freed
at the dispatch level, and replays that stream through a model of the target
device's allocator (`autofit.memory.allocator`). The user's module is never touched.

    >>> from autofit import TrainConfig
    >>> from autofit.probe.model import build_model
    >>> from autofit.probe.device import resolve_device
    >>> from autofit.memory.simulate import Simulator, simulate
    >>> module, task = build_model("tiny-llama")
    >>> est = simulate(module, TrainConfig(micro_batch_size=2), seq_len=128,
    ...                device=resolve_device("A100-80GB"), task=task)
    >>> est.method, est.peak_phase in ("forward", "backward", "optimizer")
    ('simulate', True)
    >>> sim = Simulator(module, task=task, device=resolve_device("cpu"))
    >>> line = sim.peak_line(TrainConfig(micro_batch_size=1), seq_len=128)
    >>> abs(line.check_error) < 0.01
    True

How it works:

- The model is cloned with ``copy.deepcopy`` and a memo that maps each parameter,
  buffer and tensor attribute to a FakeTensor (``simulate._model``). Precision follows
  Lightning's names: ``32-true``; ``bf16-mixed`` / ``16-mixed`` keep fp32 weights and
  run forward + loss under autocast (``16-mixed`` with GradScaler semantics);
  ``bf16-true`` / ``16-true`` cast the weights (``model.to(dtype)``).
- Gradient checkpointing is enabled on the clone exactly as the Trainer does
  (``activation_checkpointing_enable``, non-reentrant, ``use_cache=False``); with
  activation offloading (a CUDA target) with ``offload=True``, torch's ``save_on_cpu``
  given its device semantics (``simulate._step.offloaded_to_host``): what it packs is host
  memory (``host_bytes``, power-of-two pinned blocks), what it unpacks a device copy.
- The optimizer is the class and kwargs ``Trainer.get_optimizer_cls_and_kwargs``
  gives for the ``optim`` name, over the Trainer's two parameter groups, with the
  target's ``foreach`` default. bitsandbytes optimizers run as they are (their ops
  have fake implementations); on a CPU target their CPU update kernels run as torch
  ops so that their temporaries are seen.
- Frees are seen through weak references to storages (``simulate._recorder``); a storage
  is categorised after the step (weights, gradients, optimizer_states, activations,
  temporaries).
- For a CUDA target, ``simulate._cuda`` follows CUDA's semantics where the CPU kernels
  that actually run on fake CPU tensors differ: CUDA's autocast op lists, CUDA's SDPA
  backend choice (flash / memory-efficient / math, with their saved logsumexp and
  backward workspaces), fused dropout masks (bool instead of a float noise tensor),
  and the caching allocator model.

`Simulator` holds the model and the target for many configurations: each run makes
a fresh fake clone (0.03 s for a 1B model, 1 s for 70B; a fresh clone leaves no
optimizer state, checkpointing flag or hook behind) and results are memoised per
(config, seq_len). `Simulator.peak_line` fits ``peak = a + b * micro_batch`` from two
batch sizes and checks it on a third; `predict_batch` and `max_micro_batch` use it.

Timings on this 2-core host: a 1.2B Llama at 4 x 1024 simulates (two steps, replay
included) in about 4 s; the bundled tiny models in 0.3-1 s; a 70B plan at batch 1 x
64 in about 15 s within 0.6 GiB of host memory.

Known limitations:

- NB: memory that is not a tensor storage is not seen. On the CPU that is mostly the
  math libraries' caches, created by the first full-size step and kept: MKL's
  buffer cache for fp32 GEMMs and oneDNN's primitive cache and scratch for 16-bit
  matmuls, which differ by instruction set (AVX2: ~2 MiB at 128 tokens, ~14 MiB at
  1024; AVX512: 1.5 MiB + the widest packed fp32 weight from ~400 rows, 8 MiB for
  16-bit). A CPU estimate adds them by the analytic rule (``cpu_library_cache_bytes``);
  without it CPU estimates ran 0.1-3.7 % (typically ~1.3 %) below the measured peak
  RSS of a step, up to 6.6 % on a small model, and the AVX2 rule on an AVX512 machine
  5-7 % below on masked-LM and sequence-classification steps (issue 25).
- NB: workspaces allocated *inside* a kernel are invisible at the dispatch level;
  CUDA's flash-attention backward workspace is added by formula, others (cuBLAS
  workspace: in ``DeviceInfo.overhead_bytes``; efficient-attention accumulators;
  the CPU's per-thread attention buffers) are not.
- NB: the attention mask of a batch without padding is not passed to the model
  (transformers would drop it on real tensors and use SDPA's ``is_causal``, but it
  cannot read a fake mask's values); the mask tensor itself is counted. For the
  same reason transformers' packed-sequence check is answered "not packed", as it
  is on real one-sequence-per-row batches. Padded or packed batches (a 4-D mask, no
  flash attention) are not simulated.
- NB: a CUDA target is simulated on CPU fake tensors (autograd on fake ``cuda``
  tensors aborts a CPU-only build). The CUDA autocast lists are applied on top of
  CPU autocast at the torch-function level: ops reached only through a composite
  decomposition are cast as CPU autocast casts them; fp16 ``softmax(dtype=float)``
  is counted with the input copy that CUDA avoids for fp16 (not for bf16).
- NB: the SDPA backend choice for CUDA follows torch's rules for flash (fp16/bf16,
  no mask, head_dim <= 256 and % 8, sm80+), memory-efficient (no GQA, head_dim
  alignment) and math; cuDNN attention and ``torch.backends.cuda.sdp_kernel``
  settings are not modelled.
- NB: optimizer step counters are scalar tensors (on the host for torch's
  non-fused optimizers on CUDA); they are counted as device memory (bytes).
- NB: paged bitsandbytes states live in unified memory outside the caching
  allocator; they are counted as device optimizer states (what they occupy when
  resident).
- NB: a CPU target is replayed through a glibc model (``MALLOC_MMAP_THRESHOLD_``
  protocol); RSS counts only touched pages, which a never-written ``torch.empty``
  does not have.
- NB: gradient accumulation is simulated with two micro steps (the second, with
  gradients alive, is the worst; later ones repeat it).
- NB: with bitsandbytes 8-bit optimizers the embeddings get 32-bit states, as
  ``Trainer.create_optimizer`` registers them.
- NB: ``torch_compile`` is simulated as the eager step with the rule of
  ``autofit.knobs.compile`` applied to its replay (activations the compiled step
  recomputes are taken off every forward and backward event); the compiled graph is
  not traced.
- NB: quantized bases run bitsandbytes' own layers (``autofit.memory.simulate._bnb``). 4-bit
  (QLoRA) bases with bitsandbytes' ops as they run on CUDA and on the CPU's default
  kernel (``gemm_4bit`` dequantizes the weight to a temporary); an optimized CPU kernel
  (kernels-community) would not. 8-bit (LLM.int8) bases through ``MatMul8bitFp`` on a
  CPU target and ``MatMul8bitLt`` (with its CUDA kernels' allocations) on a CUDA one;
  LLM.int8's data-dependent outlier columns are assumed absent.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError
from autofit.knobs.registry import patched
from autofit.memory.breakdown import COMPONENTS, Component, MemoryEstimate
from autofit.probe.device import sm_version

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterator

    import torch

    from autofit.memory.allocator import AllocEvent, ReplayResult
    from autofit.memory.simulate._cuda import CudaSemantics
    from autofit.memory.simulate._recorder import Record, StorageRecorder
    from autofit.probe.device import DeviceInfo

__all__ = ["simulate", "Simulator", "SimulationResult", "PeakLine"]

_CATEGORIES = COMPONENTS[:-1]  # everything but "overhead"

@dataclass(frozen=True)
class SimulationResult:
    """One simulated configuration: the estimate plus what produced it."""

    estimate: MemoryEstimate
    events: tuple[AllocEvent, ...]
    replay: ReplayResult
    wall_s: float
    num_ops: int
    # (label, index into events) where each micro step / optimizer step begins:
    # "step0/micro0", ..., "step1/optimizer", "end"
    marks: tuple[tuple[str, int], ...] = ()
    # a gradient's event id -> its parameter's index among the trainable ones
    grad_params: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PeakLine:
    """``peak_allocated = intercept + slope * micro_batch`` for one configuration.

    Fitted through two simulated batch sizes and checked on a third. Reserved memory
    is not linear (allocator rounding and caching make it a staircase), so the device
    total is predicted as the allocated line plus the largest reserved-above-allocated
    margin seen in the three simulations, plus the device overhead.

    Attributes:
        intercept_bytes: allocated bytes at batch 0 (weights, states, ...).
        slope_bytes: allocated bytes per sample of micro batch.
        reserve_margin_bytes: max (reserved - allocated) over the simulations.
        overhead_bytes: the device's context + workspace.
        batches: the micro batch sizes simulated (fit, fit, check).
        check_error: (predicted - simulated) / simulated allocated peak at the check.
        peak_phases: the phase of each simulated peak.
    """

    intercept_bytes: float
    slope_bytes: float
    reserve_margin_bytes: int
    overhead_bytes: int
    batches: tuple[int, int, int]
    check_error: float
    peak_phases: tuple[str, ...] = field(default=())

    def allocated(self, batch: int) -> int:
        """Predicted peak allocated bytes at micro batch ``batch``."""
        return int(round(self.intercept_bytes + self.slope_bytes * batch))

    def total(self, batch: int) -> int:
        """Predicted device total bytes (reserved + overhead) at micro batch ``batch``."""
        return self.allocated(batch) + self.reserve_margin_bytes + self.overhead_bytes


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


class Simulator:
    """Simulates many training configurations of one model on one target device.

    Args:
        module: a model built on the meta device (``probe.model.build_model``) or a
            real module; it is only read.
        task: ``"causal-lm"``, ``"masked-lm"``, ``"seq2seq"``, ``"seq-cls"`` or ``"token-cls"``.
        device: the target device: a DeviceInfo or a name (``"cpu"``, ``"H100-80GB"``).
        model_name: shown in the estimates.
        sharding: how several ranks run beyond a config (``ranks.Layout`` fields, a
            user's recipe: ``autofit.knobs.recipe``); None: what the Trainer runs.

    Example:
        >>> from autofit.probe.model import build_model
        >>> from autofit.probe.device import resolve_device
        >>> module, task = build_model("tiny-gpt2")
        >>> sim = Simulator(module, task=task, device=resolve_device("cpu"))
        >>> est = sim.simulate(TrainConfig(micro_batch_size=2), seq_len=64)
        >>> est.breakdown["weights"] > 0
        True
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        task: str,
        device: DeviceInfo | str,
        model_name: str = "",
        sharding: dict[str, object] | None = None,
    ) -> None:
        import torch

        from autofit.probe.device import resolve_device

        if not isinstance(module, torch.nn.Module):
            raise BadInputError(
                f"simulate needs an nn.Module (use probe.model.build_model), got {type(module).__name__}"
            )
        self.module = module
        self.task = task
        self.device = resolve_device(device)
        self.model_name = model_name or type(module).__name__
        self.sharding = dict(sharding or {})
        self._cache: dict[tuple[TrainConfig, int], SimulationResult] = {}

    # ------------------------------------------------------------------ core
    def _seq(self, config: TrainConfig, seq_len: int | None) -> int:
        s = seq_len if seq_len is not None else config.seq_len
        if s is None or s <= 0:
            raise BadInputError("give seq_len (or TrainConfig.seq_len) to simulate a step")
        return int(s)

    def run(self, config: TrainConfig, *, seq_len: int | None = None) -> SimulationResult:
        """Simulate ``config`` (memoised) and return the estimate with its event stream."""
        from autofit.knobs.compile import check_compile_mode

        check_compile_mode(config, self.device)  # CUDA graphs' pool: refused
        s = self._seq(config, seq_len)
        key = (config, s)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if config.world_size > 1:
            from autofit.memory.ranks._layout import Layout
            from autofit.memory.simulate._ranks import simulate_ranks

            layout = Layout.of(config, **self.sharding) if self.sharding else None
            result = simulate_ranks(self, config, s, layout)
        else:
            try:
                result = self._run(config, s)
            except RuntimeError as e:  # xLSTM's step trains with checkpointing only
                from autofit.errors import inplace_autograd_error

                refused = inplace_autograd_error(e, self.model_name, config)
                if refused is None:
                    raise
                raise refused from None
        self._cache[key] = result
        return result

    def simulate(self, config: TrainConfig, *, seq_len: int | None = None) -> MemoryEstimate:
        """The MemoryEstimate of one configuration (see `simulate`)."""
        return self.run(config, seq_len=seq_len).estimate

    def events(self, config: TrainConfig, *, seq_len: int | None = None) -> list[AllocEvent]:
        """The allocation stream of two steps of ``config``."""
        return list(self.run(config, seq_len=seq_len).events)

    def _run(self, config: TrainConfig, seq_len: int, trace: object = None) -> SimulationResult:
        """One simulation; ``trace`` (``simulate._dist.RankTrace``): one rank of several, its
        wrapper applied to the clone and its step config run."""
        import torch

        from autofit.memory.simulate._bnb import bnb_target
        from autofit.memory.simulate._model import fake_clone, prepare_for_training, weight_tensors
        from autofit.memory.simulate._recorder import StorageRecorder
        from autofit.memory.simulate._step import (
            StepTarget,
            build_optimizer,
            host_peak_bytes,
            offloaded_to_host,
            run_steps,
            track_built_states,
        )

        t0 = time.perf_counter()
        target = StepTarget(self.device.allocator, sm_version(self.device)
                            if self.device.allocator == "cuda" else None)
        spec = config.precision_spec
        float_dtype = getattr(torch, spec.param_dtype)
        fake_mode = _fake_mode()
        rec = StorageRecorder()
        with warnings.catch_warnings(), _quiet():
            warnings.simplefilter("ignore")
            recompute = None
            if target.kind == "cuda":
                from autofit.memory.simulate._cuda import CudaSemantics

                def recompute() -> CudaSemantics:
                    return CudaSemantics(self.device)

            with fake_mode:
                model = fake_clone(self.module, float_dtype=float_dtype)
                prepare_for_training(
                    model,
                    gradient_checkpointing=config.gradient_checkpointing,
                    recompute_context=recompute,
                    # a CPU target (refused by the knob's check) has nothing to offload
                    activation_offloading=config.activation_offloading and target.kind == "cuda",
                )
            if trace is not None:
                model = trace.wrap(model, rec, fake_mode)
            for t in weight_tensors(model):  # no reference kept: FSDP2 may replace them
                rec.track(t, Component.WEIGHTS)
            num_params, trainable = _count_params(model)
            optimizer = build_optimizer(model, config, target)
            track_built_states(optimizer, rec)
            ctx: Any = contextlib.nullcontext()
            cuda = None
            if target.kind == "cuda":
                cuda = CudaSemantics(self.device)
                ctx = cuda
                rec.workspaces.update(cuda.workspaces())
            else:  # what its kernels copy inside (``_cpu_kernels``)
                rec.on_cpu()
            offload: Any = (offloaded_to_host(rec)
                            if config.activation_offloading and target.kind == "cuda"
                            else contextlib.nullcontext([]))
            running = _running(trace, rec, patched(config, model))
            with fake_mode, rec, ctx, bnb_target(model, rec, target.kind), offload as host, running:
                run_steps(
                    model,
                    optimizer,
                    trace.step_config if trace is not None else config,
                    task=self.task,
                    seq_len=seq_len,
                    rec=rec,
                    target=target,
                )
            num_ops = rec.num_ops
            log = rec.events()
            grad_params = {r.id: r.param for kind, r, _ in log
                           if kind == "alloc" and r.param >= 0}
            log_marks = list(rec.marks)
            host_bytes, host_tensors = host_peak_bytes(log, host)
            del model, optimizer, host
        event_list, marks = _to_events(log, log_marks)
        events = tuple(event_list)
        replay = _replay(events, self.device)
        notes = self._notes(cuda, host_bytes, host_tensors)
        est = self._estimate(config, seq_len, replay, num_params, trainable, notes,
                             half_matmuls=len(rec.half_matmuls), half_step=rec.half_step())
        if host_bytes:
            import dataclasses

            est = dataclasses.replace(est, host_bytes=host_bytes)
        if config.torch_compile:
            est = self._compiled(est, config, seq_len, events)
        return SimulationResult(
            estimate=est,
            events=events,
            replay=replay,
            wall_s=time.perf_counter() - t0,
            num_ops=num_ops,
            marks=tuple(marks),
            grad_params=grad_params,
        )

    def _notes(self, cuda: CudaSemantics | None, host_bytes: int,
               host_tensors: int) -> list[str]:
        """The estimate's notes: the target allocator, the SDPA backends a CUDA step ran,
        and what an offload keeps on the host."""
        notes = [f"target allocator: {self.device.allocator}"]
        if cuda is not None and cuda.backends:
            used = ", ".join(f"{k} x{v}" for k, v in sorted(cuda.backends.items()))
            notes.append(f"CUDA SDPA backends (forward calls): {used}")
        if host_bytes:
            from autofit.memory.analytic._levers import offload_note

            notes.append(offload_note(host_bytes, host_tensors))
        return notes

    def _estimate(
        self,
        config: TrainConfig,
        seq_len: int,
        r: ReplayResult,
        num_params: int,
        trainable: int,
        notes: list[str],
        half_matmuls: int | None = None,
        half_step: tuple[int, bool] | None = None,
    ) -> MemoryEstimate:
        breakdown = {c: int(r.peak_by_category.get(c, 0)) for c in _CATEGORIES}
        # the CPU math libraries' caches: not tensors, so not in the stream (analytic's rule,
        # with the 16-bit matmuls of distinct shapes the step ran); where the rule tells the
        # step's own from what the process keeps once (oneDNN's first 16-bit matmul), the
        # latter is overhead, as a CUDA context is: in the device total, not the step's peak
        lib_cache, once = self._library_cache(config, seq_len, half_matmuls, half_step)
        breakdown[Component.TEMPORARIES] = breakdown.get(Component.TEMPORARIES, 0) + lib_cache
        allocated = int(r.peak_allocated_bytes) + lib_cache
        reserved = int(r.peak_reserved_bytes) + lib_cache
        total = reserved + int(self.device.overhead_bytes) + once
        breakdown[Component.OVERHEAD] = total - allocated
        if self.device.allocator == "cpu":
            # what a CPU step holds is what is resident: the heap's holes between small
            # tensors too (the allocator model's reserved bytes), as a CPU trial measures
            allocated = reserved
        if r.oom:
            notes.append("the allocator model ran out of the device's capacity")
        return MemoryEstimate(
            peak_allocated_bytes=allocated,
            peak_reserved_bytes=reserved,
            device_total_bytes=total,
            capacity_bytes=int(self.device.capacity_bytes),
            fits=total <= self.device.capacity_bytes,
            breakdown=breakdown,
            method="simulate",
            device=self.device.name,
            peak_phase=r.peak_phase or "forward",
            model=self.model_name,
            num_params=num_params,
            trainable_params=trainable,
            seq_len=seq_len,
            config=config.to_dict(),
            notes=tuple(notes),
        )

    def _library_cache(self, config: TrainConfig, seq_len: int,
                       half_matmuls: int | None = None,
                       half_step: tuple[int, bool] | None = None) -> tuple[int, int]:
        """``cpu_library_cache_bytes`` of this model (0 on a CUDA target or a non-transformer)
        and what of it the process keeps once (``cpu_library_once_bytes``, not in the first);
        ``half_matmuls``: the 16-bit matmuls of distinct shapes the simulated step ran,
        ``half_step``: its oneDNN primitives and whether a 16-bit flash attention ran."""
        if self.device.allocator == "cuda":
            return 0, 0
        from autofit.memory.analytic._cpu_cache import (
            cpu_library_cache_bytes,
            cpu_library_once_bytes,
        )
        from autofit.probe.model import describe

        info = describe(self.module, task=self.task, name=self.model_name)
        step = cpu_library_cache_bytes(info, config, seq_len, self.device,
                                       half_matmuls=half_matmuls, half_step=half_step)
        once = cpu_library_once_bytes(info, config, seq_len, self.device, half_step=half_step)
        return step, once

    def _compiled(self, est: MemoryEstimate, config: TrainConfig, seq_len: int,
                  events: tuple[AllocEvent, ...]) -> MemoryEstimate:
        """The eager step's estimate with the rule of ``autofit.knobs.compile`` applied: the
        activations the compiled step does not keep (``compile_saving_bytes``) are taken off
        the live bytes of every forward and backward event, and the step's peak is the
        highest of that curve and the untouched optimizer step's."""
        from autofit.memory.analytic._levers import compile_saving_bytes
        from autofit.probe.model import describe

        info = describe(self.module, task=self.task, name=self.model_name)
        fused = compile_saving_bytes(info, config, seq_len, self.device)
        delta, phase = _compiled_peak_drop(events, fused)
        if not delta:
            return est
        from dataclasses import replace as _replace

        breakdown = dict(est.breakdown)
        left = delta
        for cat in (Component.ACTIVATIONS, Component.TEMPORARIES):  # what the saving comes out of
            take = min(left, breakdown.get(cat, 0)) if left > 0 else left
            breakdown[cat] = breakdown.get(cat, 0) - take
            left -= take
            if not left:
                break
        total = est.device_total_bytes - delta
        what = "less" if delta > 0 else "more"
        note = (f"torch.compile: the eager step simulated, {abs(delta) / 2**20:.1f} MiB {what} "
                "at its peak by the fused-activation rule (autofit.knobs.compile)")
        return _replace(est, peak_phase=phase or est.peak_phase,
                        peak_allocated_bytes=est.peak_allocated_bytes - delta,
                        peak_reserved_bytes=est.peak_reserved_bytes - delta,
                        device_total_bytes=total, fits=total <= est.capacity_bytes,
                        breakdown=breakdown, notes=(*est.notes, note))

    # ------------------------------------------------------------------ batch line
    def peak_line(
        self,
        config: TrainConfig,
        *,
        seq_len: int | None = None,
        batches: tuple[int, int, int] | None = None,
    ) -> PeakLine:
        """Fit ``peak = a + b * micro_batch`` on two batch sizes and check it on a third.

        Args:
            config: the configuration; its ``micro_batch_size`` is the first batch.
            seq_len: sequence length (default ``config.seq_len``).
            batches: (fit, fit, check); default (b, 2b, 4b) with b the config's batch.

        The line holds while the peak stays in the same phase; ``peak_phases`` and
        ``check_error`` tell whether it did.
        """
        b = config.micro_batch_size
        b1, b2, b3 = batches or (b, 2 * b, 4 * b)
        if b1 == b2 or min(b1, b2, b3) <= 0:
            raise BadInputError("peak_line needs two different positive batch sizes to fit a line")
        ests = [
            self.simulate(config.replace(micro_batch_size=x), seq_len=seq_len) for x in (b1, b2, b3)
        ]
        y1, y2, y3 = (e.peak_allocated_bytes for e in ests)
        slope = (y2 - y1) / (b2 - b1)
        intercept = y1 - slope * b1
        return PeakLine(
            intercept_bytes=intercept,
            slope_bytes=slope,
            reserve_margin_bytes=max(e.peak_reserved_bytes - e.peak_allocated_bytes for e in ests),
            # the device's, and what the CPU's libraries keep once (``_estimate``)
            overhead_bytes=int(ests[0].device_total_bytes - ests[0].peak_reserved_bytes),
            batches=(b1, b2, b3),
            check_error=(intercept + slope * b3 - y3) / y3,
            peak_phases=tuple(e.peak_phase for e in ests),
        )

    def predict_batch(self, config: TrainConfig, batch: int, *, seq_len: int | None = None) -> int:
        """Predicted device total bytes at micro batch ``batch``, from the line of ``config``
        (three simulations, memoised; none at ``batch`` itself)."""
        return self.peak_line(config, seq_len=seq_len).total(batch)

    def max_micro_batch(
        self,
        config: TrainConfig,
        budget_bytes: int,
        *,
        seq_len: int | None = None,
        limit: int = 4096,
    ) -> int:
        """Largest micro batch whose simulated device total fits ``budget_bytes`` (0: none).

        The line proposes a batch; simulations confirm it and step to the exact
        boundary (allocator rounding makes the true curve a staircase near the line).
        """
        one = config.replace(micro_batch_size=1)
        if self.simulate(one, seq_len=seq_len).device_total_bytes > budget_bytes:
            return 0
        line = self.peak_line(one, seq_len=seq_len)
        if line.slope_bytes <= 0:  # the peak does not grow yet (e.g. the optimizer step's)
            guess = 2
        else:
            guess = int((budget_bytes - line.total(0)) // line.slope_bytes)
        guess = max(1, min(limit, guess))

        def fits(b: int) -> bool:
            est = self.simulate(config.replace(micro_batch_size=b), seq_len=seq_len)
            return est.device_total_bytes <= budget_bytes

        if fits(guess):
            lo, hi = guess, None
            step = 1
            while hi is None:
                nxt = min(limit, lo + step)
                if nxt == lo:
                    return lo
                if fits(nxt):
                    lo, step = nxt, step * 2
                else:
                    hi = nxt
        else:
            lo, hi = 1, guess
        while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo


@contextlib.contextmanager
def _running(trace: object, rec: StorageRecorder,
             swapped: contextlib.AbstractContextManager[None]) -> Iterator[None]:
    """While the step runs: the trace's recording (when tracing) and the stand-ins a knob
    puts in the model's code (liger's kernels: ``registry.patched``)."""
    running = getattr(trace, "running", None)  # a rank layout's (_dist, _zero), or none
    with (running(rec) if running is not None else contextlib.nullcontext()), swapped:
        yield


@contextlib.contextmanager
def _quiet() -> Any:
    """Silence transformers' logger while simulating (deprecation notes, warnings)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _count_params(model: torch.nn.Module) -> tuple[int, int]:
    num = trainable = 0
    for p in model.parameters():
        qs = getattr(p, "quant_state", None)
        n = math.prod(qs.shape) if qs is not None else p.numel()  # 4-bit: unpacked count
        num += n
        if p.requires_grad:
            trainable += n
    return num, trainable


def _to_events(log: list[tuple[str, Record, str]], marks: list[tuple[str, int]] = ()
               ) -> tuple[list[AllocEvent], list[tuple[str, int]]]:
    """The device's events of a recorded log (host-side storages dropped), and the marks
    moved from log positions to event positions."""
    from autofit.memory.allocator import AllocEvent

    out = []
    at = dict.fromkeys(range(len(log) + 1), 0)
    for i, (kind, rec, phase) in enumerate(log):
        at[i] = len(out)
        if rec.host:
            continue
        cat = rec.category or Component.TEMPORARIES
        if kind == "alloc":
            out.append(AllocEvent("alloc", rec.id, rec.size, rec.phase or phase, cat))
        else:
            out.append(AllocEvent("free", rec.id, rec.size, phase, cat))
    at[len(log)] = len(out)
    return out, [(label, at[i]) for label, i in marks]


def _compiled_peak_drop(events: tuple[AllocEvent, ...], fused: int) -> tuple[int, str]:
    """How much lower the step's peak of live bytes is when every forward and backward
    event has ``fused`` bytes fewer alive (the optimizer step's are unchanged; negative
    when the compiled step keeps more), and the phase of that lower peak. Live bytes are
    the requested sizes."""
    if not fused:
        return 0, ""
    live, sizes = 0, {}
    peak = peak_compiled = None
    phase = ""
    for ev in events:
        if ev.kind == "alloc":
            sizes[ev.id] = ev.size
            live += ev.size
        else:
            live -= sizes.pop(ev.id, 0)
        here = live - fused if ev.phase in ("forward", "backward") else live
        peak = live if peak is None else max(peak, live)
        if peak_compiled is None or here > peak_compiled:
            peak_compiled, phase = here, ev.phase
    if peak is None:
        return 0, ""
    return int(peak - peak_compiled), phase


def _replay(events: tuple[AllocEvent, ...], device: DeviceInfo) -> ReplayResult:
    from autofit.memory.allocator import replay

    kind = "cuda" if device.allocator == "cuda" else "cpu"
    return replay(events, kind)


def simulate(
    module: torch.nn.Module,
    config: TrainConfig,
    *,
    seq_len: int,
    device: DeviceInfo,
    task: str,
    model_name: str = "",
) -> MemoryEstimate:
    """Estimate one configuration by simulating its training step on fake tensors.

    Args:
        module: a meta-built model (``probe.model.build_model``) or a real module;
            never modified.
        config: the training configuration.
        seq_len: tokens per sample.
        device: the target device.
        task: the model's task (labels follow it).
        model_name: shown in the estimate.

    Returns:
        A MemoryEstimate with ``method="simulate"``.

    Example:
        >>> from autofit.probe.model import build_model
        >>> from autofit.probe.device import resolve_device
        >>> m, task = build_model("tiny-bert")
        >>> simulate(m, TrainConfig(), seq_len=32, device=resolve_device("cpu"), task=task).fits
        True
    """
    return Simulator(module, task=task, device=device, model_name=model_name).simulate(
        config, seq_len=seq_len
    )
