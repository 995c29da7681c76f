"""Trials: real micro-steps of the exact training step, on the real device.

``measure`` runs a few steps of what ``transformers.Trainer`` would run for a
``TrainConfig`` (see ``autofit.trial.step``) on the worst-case batch and reports
the peak memory and the speed, or the out-of-memory error it met. The user's model
and the RNGs are left exactly as they were.

    >>> from autofit.config import TrainConfig
    >>> from autofit.trial import measure
    >>> r = measure("tiny-llama", TrainConfig(micro_batch_size=2), seq_len=64,
    ...             device="cpu:2GiB")                        # doctest: +SKIP
    >>> r.oom, r.batch_shape                                 # doctest: +SKIP
    (False, (2, 64))

Devices and what is measured:

- ``cpu:<size>`` (a capped CPU): the trial runs in a fresh child process whose
  address space is capped (``RLIMIT_AS``) at its own baseline + (cap - the resident
  tensors), so the cap bounds the weights, buffers and batch plus everything the
  steps allocate, and exceeding it is a real allocation failure. The peak is the
  child's peak resident memory above its baseline (``VmHWM`` after a reset) plus
  those resident tensors: ``peak_allocated_bytes == peak_reserved_bytes ==
  device_total_bytes`` = weights + buffers + batch + the steps' peak (gradients,
  optimizer state, activations, temporaries, allocator slack). The interpreter and
  libraries (the baseline) are not counted, as a GPU's capacity does not count the
  host process.
- ``cpu``: the same measurement in this process (less exact: this process's
  allocator is not tuned for measuring).
- ``cuda`` (and other ``torch.accelerator`` devices): ``max_memory_allocated`` /
  ``max_memory_reserved`` over the measured steps (peak counters reset after the
  warm-up steps), ``device_total_bytes`` = ``mem_get_info`` total - free after them
  (every process on the device, CUDA context included).

Isolation (``isolation=``):

- ``"auto"`` (default): a capped CPU runs in a subprocess (the cap must be set on a
  fresh process); so does every trial on a device where an in-process trial did not
  give its memory back; everything else runs in this process (fast: no start-up,
  no model transfer). ``TrialResult.isolation_reason`` says which and why.
- ``"subprocess"``: a fresh process (fresh allocator, no fragmentation carried over).
  The model travels by ``torch.save`` (pickle) through a temporary file, or by
  reference (a name or path is rebuilt in the child); the result comes back as JSON.
  On a CPU the process is forked from the trial server (``autofit.trial.server``),
  started by the first such trial, which has imported torch and transformers once
  and allocated no tensor: a trial starts in a fraction of a second, not the
  seconds of a new interpreter's imports. Should the server fail, trials start a
  new interpreter each (one warning says so).
- ``"in-process"``: this process; on a capped CPU the address-space limit is set
  on this process for the duration of the steps and lifted afterwards.

The model untouched: a subprocess trial works on its own copy. In this process
the trial runs on the user's module *in place* when it already sits on the device
in the dtype it trains in (so the device holds one set of weights, as in the real
run: right for a big model that only just fits), with a host-memory snapshot of
every parameter and buffer, the flags, module attributes (training mode,
checkpointing, hooks) and config fields, restored in a ``finally``; otherwise
(``*-true`` casts, another device) on a copy made tensor by tensor on the device.
The torch / CUDA / numpy / ``random`` generators are restored either way, and so
is accelerate's state that building ``TrainingArguments`` touches. See
``autofit.trial.state``.

Out of memory: ``is_oom`` (``autofit.trial.oom``) decides. The message is kept, the
exception dropped outside the ``except`` block, everything the trial made freed,
and memory checked back at the baseline (``recovered``); when it is not, a
``RuntimeWarning`` says so and later ``auto`` trials on that device run in a
subprocess.

Timeouts: ``timeout_s`` is a wall-clock limit for the whole trial. A subprocess is
killed when it is exceeded; in this process no new step starts after it (a step
already running is not interrupted). Either way ``measure`` returns a result with
``timed_out=True`` and ``error="timeout after <timeout_s>s"``; it does not raise.

Killed trial processes: a child ended by a signal from outside (SIGKILL, what the
host's out-of-memory killer sends; SIGTERM, SIGINT, SIGHUP) says nothing about the
trial's memory. It is run once more in a fresh process; killed again, the result
has ``oom=False``, ``killed_by`` (the signal's name) and an ``error`` naming the
signal. A real out-of-memory is one the child reports itself (it catches the
allocation failure), or a child that aborts with ``std::bad_alloc`` on its stderr.

Nothing outlives the caller: the child and its work dir (with ``payload.pt``, the
pickled copy of the model) go on every exit path, the child dies with a parent
killed by any signal, and leftovers are swept at the next start
(``autofit.trial.process``).

Known limitations:
    NB: a capped-CPU child runs single-threaded (steady memory numbers), so its
    step times are those of one core.
    NB: a quantized base given as a module (8-/4-bit bitsandbytes) is not moved or cast
    by a trial; give it already on the device. One given by reference
    (``load_in_4bit`` / ``load_in_8bit`` / ``quantization_config``) is built quantized
    directly on the device (``autofit.trial.model``) and trains in its compute dtype.
    NB: a model on an accelerator that must be cast (``*-true``) is copied beside
    the original; the original's bytes are subtracted from the reported peaks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError, InvalidConfigError, UnknownDeviceError
from autofit.trial import process
from autofit.trial.oom import is_oom
from autofit.trial.process import describe_signal
from autofit.trial.result import TrialResult

if TYPE_CHECKING:

    import torch
    from peft import PeftConfig
    from transformers import BitsAndBytesConfig, PreTrainedTokenizerBase

    from autofit.config import Batch, Collator, ModelSource, ModelSpec, Progress
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import LoraSpec
    from autofit.trial.loop import RawTrial
    from autofit.trial.step import RunSpec, StepPlan

__all__ = ["measure", "ISOLATIONS", "DEFAULT_TIMEOUT_S", "MEASURE_STEPS"]

ISOLATIONS = ("auto", "in-process", "subprocess")
DEFAULT_TIMEOUT_S = 600.0
# Timed steps per trial: the step time is their median, so one slow step (page faults, a
# neighbour on a shared CPU: single CPU steps vary by +-10% here) does not decide between
# close candidates. 3 costs one step more than 2 (warm-up 1 + 3 timed: ~+1/3 of a trial's
# stepping; starting the process and building the model are unchanged).
MEASURE_STEPS = 3


def _kill_grace_s(timeout_s: float) -> float:
    """How long a child past its deadline gets to write its (partial) result."""
    return min(5.0, 0.5 + 0.1 * timeout_s)


@functools.lru_cache(maxsize=1)
def _failed_recovery() -> dict[str, str]:
    """Devices where an in-process trial of this process did not give its memory back:
    device -> reason (later trials there run in a subprocess)."""
    return {}


# ---------------------------------------------------------------- inputs


def _check_counts(warmup_steps: int, measure_steps: int, timeout_s: float | None) -> None:
    problems = []
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        problems.append(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    if isinstance(measure_steps, bool) or not isinstance(measure_steps, int) or measure_steps < 1:
        problems.append(f"measure_steps must be an integer >= 1, got {measure_steps!r}")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        problems.append(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if problems:
        raise BadInputError("; ".join(problems))


# ---------------------------------------------------------------- running


def _torch_device(dev: DeviceInfo) -> torch.device:
    import torch

    if dev.kind == "cpu":
        return torch.device("cpu")
    return torch.device(dev.kind, dev.index if dev.index is not None else 0)


def _accel_empty_cache(tdev: torch.device) -> None:
    if tdev.type == "cpu":
        return
    from autofit.trial.loop import _accel

    with contextlib.suppress(RuntimeError, AttributeError):
        _accel(tdev.type).empty_cache()


def _run_in_process(
    model: ModelSource | ModelSpec,
    batch: Batch,
    plan: StepPlan,
    tdev: torch.device,
    *,
    cap: int | None,
    warmup_steps: int,
    measure_steps: int,
    deadline: float | None,
    run: RunSpec | None = None,
) -> RawTrial:
    from autofit.probe.peft import upcast_adapters
    from autofit.trial.loop import run_steps
    from autofit.trial.model import ModelRef, is_quantized_model, materialize
    from autofit.trial.state import ModelSnapshot, RngSnapshot, needs_copy, working_copy
    from autofit.trial.step import storage_bytes

    true_dtype = plan.param_dtype if plan.precision.endswith("-true") else None
    rng = RngSnapshot(tdev)
    snapshot = None
    work = None
    try:
        excluded = 0
        if isinstance(model, ModelRef):
            work = materialize(model, tdev)
            if true_dtype is not None and not is_quantized_model(work):
                work.to(dtype=true_dtype)
                upcast_adapters(work)  # as peft keeps them on a 16-bit base
        elif needs_copy(model, tdev, true_dtype):
            work = working_copy(model, tdev, true_dtype)
            if true_dtype is not None:
                upcast_adapters(work)
            if tdev.type != "cpu":
                same = [
                    t for t in list(model.parameters()) + list(model.buffers()) if t.device == tdev
                ]
                excluded = storage_bytes(same)
        else:
            snapshot = ModelSnapshot(model)
            work = model
        return run_steps(
            work,
            batch,
            plan,
            tdev,
            warmup_steps=warmup_steps,
            measure_steps=measure_steps,
            cap_bytes=cap,
            excluded_bytes=excluded,
            deadline=deadline,
            run=run,
        )
    finally:
        if snapshot is not None:
            snapshot.restore()
        rng.restore()
        work = None
        snapshot = None
        gc.collect(1)  # the trial's objects are freed by reference counting; cycles are young
        _accel_empty_cache(tdev)


def _child_env() -> dict[str, str]:
    return process.child_env()


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {describe_signal(-code)}"
    return f"exit status {code}"


def _killed_message(signal_name: str, *, retried: bool) -> str:
    """The error of a child ended by a signal from outside: not an out-of-memory result."""
    what = describe_signal(int(signal.Signals[signal_name]))
    msg = (
        f"the trial process was killed by {what} — by the host's out-of-memory killer "
        "or another process; this is not an out-of-memory result of the configuration"
    )
    if retried:
        msg += (
            ", and a fresh process was killed the same way: free host memory "
            "(or stop what kills it) and run again"
        )
    return msg


class _Unpicklable(Exception):
    """The model cannot be sent to a child process."""


def _run_subprocess(
    model: ModelSource | ModelSpec,
    batch: Batch,
    plan: StepPlan,
    tdev: torch.device,
    *,
    cap: int | None,
    warmup_steps: int,
    measure_steps: int,
    timeout_s: float | None,
    run: RunSpec | None = None,
) -> RawTrial:
    """The trial in a fresh child (``autofit.trial.process``), retried once if killed.

    A child killed from outside (``process.OUTSIDE_SIGNALS``: the host's OOM killer,
    a user) is run again once in a fresh process; killed again, the result says so
    (``killed_by``, never ``oom``).
    """
    import torch

    from autofit.trial import server

    deadline = None if timeout_s is None else time.time() + float(timeout_s)
    fork = tdev.type == "cpu" and server.enabled()  # accelerators: fresh children only
    if fork:
        server.prepare(_child_env())  # it imports while the payload is written
    with process.workdir() as work:
        payload = {
            "model": model,
            "batch": {k: v.detach().cpu() for k, v in batch.items()},
            "plan": plan,
            "device": str(tdev),
            "cap_bytes": cap,
            "warmup_steps": warmup_steps,
            "measure_steps": measure_steps,
            "deadline_wall": deadline,
            "run": run,
        }
        try:
            torch.save(payload, work / "payload.pt")
        except Exception as e:  # noqa: BLE001 - pickle raises many types
            raise _Unpicklable(
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from None
        del payload
        raw = _run_child(work, deadline, timeout_s, fork=fork)
        first = raw.killed_by
        if first is None or (deadline is not None and time.time() >= deadline):
            return raw
        raw = _run_child(work, deadline, timeout_s, fork=fork)  # once more, in a fresh process
        if raw.killed_by is not None:
            raw.error = _killed_message(raw.killed_by, retried=True)
        else:
            raw.notes.append(
                f"the first trial process was killed by {describe_signal(signal.Signals[first])} "
                "— by the host's out-of-memory killer or another process; a fresh one ran the trial"
            )
        return raw


def _run_child(
    work: Path, deadline: float | None, timeout_s: float | None, *, fork: bool = False
) -> RawTrial:
    """One child process over the payload in ``work``; its ``RawTrial``.

    ``fork``: forked by the trial server (``autofit.trial.server``) when it can;
    otherwise, and again when the server dies under the trial, a fresh
    ``python -m autofit.trial.child``.
    """
    from autofit.trial import server
    from autofit.trial.loop import RawTrial

    for stale in ("result.json", "child.log"):  # a killed attempt's leftovers
        (work / stale).unlink(missing_ok=True)
    log = open(work / "child.log", "wb")  # noqa: SIM115 - closed below
    proc = None
    lost = False
    try:
        env = _child_env()
        until = None  # wall clock: the deadline and the child's grace to write its result
        if deadline is not None and timeout_s is not None:
            until = deadline + _kill_grace_s(timeout_s)
        try:
            if fork:
                proc = server.start_child(work, env=env, until=until)
            if proc is None:
                proc = process.start(
                    [sys.executable, "-m", "autofit.trial.child", str(work), str(os.getpid())],
                    env=env,
                    log=log,
                )
            proc.wait(timeout=None if until is None else max(0.0, until - time.time()))
        except subprocess.TimeoutExpired:
            return RawTrial(timed_out=True, error=f"timeout after {timeout_s:g}s")
        except server.Lost:
            lost = True  # warned once; the child is killed below
    finally:
        if proc is not None:
            process.stop(proc)  # every exit path: timeout, Ctrl-C, SIGTERM (cli)
        log.close()
    result = work / "result.json"
    if lost and not result.is_file():
        return _run_child(work, deadline, timeout_s)  # a fresh process, as without the server
    if result.is_file():
        with open(result) as f:
            data = json.load(f)
        return RawTrial(**data)
    signal_name = process.killed_by(proc.returncode)
    if signal_name is not None:  # sent from outside: says nothing about memory
        return RawTrial(oom=False, error=_killed_message(signal_name, retried=False),
                        killed_by=signal_name)
    tail = (work / "child.log").read_bytes()[-4000:].decode("utf-8", "replace").strip()
    last = tail.splitlines()[-1] if tail else ""
    # a child that dies of its own (SIGABRT, SIGSEGV, an exit status) without a
    # result: bad_alloc/abort under the cap is an out-of-memory; the rest a failure
    return RawTrial(
        oom=is_oom(RuntimeError(tail)),
        error=f"trial process died ({_describe_exit(proc.returncode)}): {last}"[:500],
    )


# ---------------------------------------------------------------- the API


def measure(
    model: ModelSource,
    config: TrainConfig,
    dataset_or_batch: object = None,
    *,
    device: str | DeviceInfo = "cpu:4GiB",
    seq_len: int | None = None,
    task: str | None = None,
    isolation: str = "auto",
    warmup_steps: int = 1,
    measure_steps: int = MEASURE_STEPS,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    tokenizer: PreTrainedTokenizerBase | None = None,
    collator: Collator | None = None,
    attn_implementation: str | None = None,
    lora: LoraSpec | dict[str, object] | None = None,
    peft_config: PeftConfig | None = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    quantization_config: BitsAndBytesConfig | dict[str, object] | None = None,
    run: RunSpec | None = None,
    progress: Progress | None = None,
    block_size: int | None = None,
    deepspeed_config: str | os.PathLike[str] | dict[str, object] | None = None,
    accelerate_config: str | os.PathLike[str] | dict[str, object] | None = None,
    trainer: str | None = None,
) -> TrialResult:
    """Run ``warmup_steps`` + ``measure_steps`` real training steps and measure them.

    Args:
        model: an ``nn.Module`` / ``PreTrainedModel`` / ``PeftModel`` (never modified),
            or a bundled name, hub id, model directory or config.json path (built
            with random weights directly on the device).
        config: the ``TrainConfig`` to try (micro batch, precision, checkpointing,
            optimizer, ...).
        dataset_or_batch: a dataset (its worst-case batch is used, see
            ``autofit.probe.data.worst_case_batch``), a dict batch (rows repeated or
            cut to ``micro_batch_size``), or None with ``seq_len`` (random tokens).
        device: ``"cpu:4GiB"`` (capped CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        seq_len: tokens per sample (random batch) or truncation length (dataset);
            defaults to ``config.seq_len``.
        task: ``causal-lm`` | ``masked-lm`` | ``seq2seq`` | ``seq-cls`` | ``token-cls`` (default:
            the model's).
        isolation: ``"auto"`` | ``"in-process"`` | ``"subprocess"`` (module docstring).
        warmup_steps: unmeasured steps first (the optimizer state appears).
        measure_steps: timed steps whose peak is reported; the step time is their
            median (``MEASURE_STEPS``, 3: one slow step does not decide).
        timeout_s: wall-clock limit; see the module docstring (no exception).
        tokenizer: for a dataset with a text column.
        collator: replaces the default pad-to-longest collation.
        attn_implementation: ``eager`` | ``sdpa`` for a model given by reference.
        lora: a ``LoraSpec`` (or dict) to put on a model given by reference.
        peft_config: any PEFT method instead (``autofit.probe.peft.peft_config``).
        load_in_4bit, load_in_8bit, quantization_config: a quantized base for a model
            given by reference (``autofit.probe.quant``), built directly on the device.
        block_size: pack the dataset into blocks of this many tokens first, as the
            transformers examples' ``group_texts`` (``autofit.probe.packing``).
        run: a ``autofit.trial.step.RunSpec``: a short run around the measured steps
            (the run's other lengths before them, whose peak counts; an evaluation
            step after them, measured apart: ``eval_device_total_bytes``, ``eval_oom``).
        deepspeed_config, accelerate_config: the user's launch recipe (a path or a dict;
            ``autofit.knobs.recipe``): its strategy, offload, precision, ranks and, for
            ZeRO, its own DeepSpeed config (sizes, optimizer) are what the ranks run.
        trainer: the trainer whose step runs: ``"plain"``, ``"autofit"`` (the only one with
            ``chunked_loss``) or ``"trl"`` (TRL's loss); default: the one ``config``
            implies (``autofit.knobs.trainer``).

    Returns:
        A ``TrialResult``; an out-of-memory step gives ``oom=True`` (not an exception);
        a trial process killed from outside twice gives ``killed_by`` and ``oom=False``.

    Raises:
        UnknownDeviceError: unknown device, or a catalog card that is not present.
        EmptyDatasetError: the dataset has no samples.
        BadInputError: any other input that cannot be trained on (empty batch, ...).

    Example:
        >>> from autofit.config import TrainConfig
        >>> r = measure("tiny-gpt2", TrainConfig(micro_batch_size=1), seq_len=32,
        ...             device="cpu", measure_steps=1)          # doctest: +SKIP
        >>> r.fits, r.peak_allocated_bytes > 0                  # doctest: +SKIP
        (True, True)
    """
    dataset_or_batch, config, user_ds, recipe_line = _checked_request(
        config, dataset_or_batch, isolation=isolation, warmup_steps=warmup_steps,
        measure_steps=measure_steps, timeout_s=timeout_s, block_size=block_size,
        tokenizer=tokenizer, deepspeed_config=deepspeed_config,
        accelerate_config=accelerate_config, trainer=trainer)
    dev = _present_device(device, config)
    ref, module, task_name = _trial_model(
        model, config, dev, task=task, attn_implementation=attn_implementation, lora=lora,
        peft_config=peft_config, load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit,
        quantization_config=quantization_config)
    from autofit.trial.batch import trial_batch

    batch = trial_batch(dataset_or_batch, config, module, task_name, seq_len=seq_len,
                         tokenizer=tokenizer, collator=collator, block_size=block_size)
    from autofit.trial.step import plan_step

    plan = plan_step(module, config, use_cpu=dev.kind == "cpu")
    tdev = _torch_device(dev)
    source = ref if ref is not None else model
    if config.world_size > 1:
        return _measure_ranks(source, module, batch, plan, config,
                              dev, tdev, isolation=isolation, warmup_steps=warmup_steps,
                              measure_steps=measure_steps, timeout_s=timeout_s, run=run,
                              progress=progress, deepspeed=user_ds, notes=recipe_line)
    raw, mode, reason = _run_one_process(source, batch, plan, dev, tdev, isolation=isolation,
                                         warmup_steps=warmup_steps,
                                         measure_steps=measure_steps, timeout_s=timeout_s,
                                         run=run)
    return _one_process_result(raw, config, dev, batch, plan, mode, reason, timeout_s,
                               recipe_line)


def _checked_request(config: TrainConfig, dataset_or_batch: object, *, isolation: str,
                     warmup_steps: int, measure_steps: int, timeout_s: float | None,
                     block_size: int | None, tokenizer: PreTrainedTokenizerBase | None,
                     deepspeed_config: str | os.PathLike[str] | dict[str, object] | None,
                     accelerate_config: str | os.PathLike[str] | dict[str, object] | None,
                     trainer: str | None,
                     ) -> tuple[Any, TrainConfig, dict[str, Any] | None, tuple[str, ...]]:
    """Step 1 of ``measure``: the request checked (config, isolation, counts), a dataset
    packed into ``block_size`` blocks, the user's recipe applied and the trainer's levers
    kept: ``(data, config, the user's DeepSpeed config, the recipe's line)``."""
    if not isinstance(config, TrainConfig):
        raise InvalidConfigError(f"config must be a TrainConfig, got {type(config).__name__}")
    from autofit.config import one_process_strategy

    one_process_strategy(config.strategy, config.world_size)  # nothing to shard: say so
    if isolation not in ISOLATIONS:
        raise BadInputError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    _check_counts(warmup_steps, measure_steps, timeout_s)
    if block_size is not None:
        from autofit.probe.packing import pack_dataset

        if dataset_or_batch is None or isinstance(dataset_or_batch, dict):
            raise BadInputError("block_size packs a dataset: give one (not a batch or seq_len)")
        dataset_or_batch = pack_dataset(dataset_or_batch, block_size,
                                        tokenizer=tokenizer).samples
    user_ds, recipe_line = None, ()
    if deepspeed_config is not None or accelerate_config is not None:
        from autofit.knobs.recipe import read_recipe

        recipe = read_recipe(deepspeed=deepspeed_config, accelerate=accelerate_config)
        config = recipe.apply(config)
        user_ds, recipe_line = recipe.deepspeed, (recipe.describe(),)
    from autofit.knobs.trainer import for_trainer

    config, _ = for_trainer(config, trainer)  # a lever the trainer does not run: bad input
    return dataset_or_batch, config, user_ds, recipe_line


def _present_device(device: str | DeviceInfo, config: TrainConfig) -> DeviceInfo:
    """Step 2 of ``measure``: the device, present here, able to run every knob's value."""
    from autofit.knobs import KNOBS
    from autofit.probe.device import resolve_device

    dev = resolve_device(device)
    if not dev.present:
        raise UnknownDeviceError(
            f"{dev.name} is not present on this machine: a trial needs the real device "
            "(plan for it with `autofit estimate --device ...` instead)"
        )
    for k in KNOBS:  # what the device and the installed libraries allow
        k.check(dev, getattr(config, k.name))
    return dev


def _trial_model(model: ModelSource, config: TrainConfig, dev: DeviceInfo, *, task: str | None,
                 attn_implementation: str | None, lora: object, peft_config: PeftConfig | None,
                 load_in_4bit: bool, load_in_8bit: bool,
                 quantization_config: BitsAndBytesConfig | dict[str, object] | None
                 ) -> tuple[ModelSpec | None, torch.nn.Module, str]:
    """Step 3 of ``measure``: the model to train, ``(its ModelSpec when given by reference,
    the module (on the meta device when by reference), its task)``, checked: the chunked
    loss applies, a quantized base's precision, some parameter trains."""
    import torch

    from autofit.probe.model import build_model
    from autofit.trial.model import build_meta, model_spec

    asked = model_spec(model, task=task, attn_implementation=attn_implementation, lora=lora,
                       peft_config=peft_config, load_in_4bit=load_in_4bit,
                       load_in_8bit=load_in_8bit, quantization_config=quantization_config,
                       device=dev)
    quant = asked.quant
    if isinstance(model, torch.nn.Module):
        module, task_name = build_model(model, task=task, lora=asked.lora,  # checks, never modifies
                                        quantization_config=quant)
        ref = None
        if attn_implementation is not None:
            raise BadInputError(
                "attn_implementation applies to a model given by name; "
                "for a module, build it with the implementation you want"
            )
    else:
        ref = dataclasses.replace(
            asked, ref=os.fspath(model) if isinstance(model, os.PathLike) else str(model))
        module, task_name = build_meta(ref)  # meta device: cheap; validates the reference
        ref = dataclasses.replace(ref, task=task_name)
    from autofit.knobs.registry import check_model

    check_model(config, module, task_name)  # a lever the model cannot run: one line
    from autofit.probe.quant import check_precision, spec_of_module

    spec = quant if quant is not None else spec_of_module(module)
    if spec is not None:  # a bitsandbytes base is never cast: a *-true must be its dtype
        from autofit.probe.model import describe

        check_precision(spec, describe(module, task=task_name).dtype, config.precision)
    if not any(p.requires_grad for p in module.parameters()):
        from autofit.errors import NoTrainableParametersError

        raise NoTrainableParametersError("the model has no trainable parameter (requires_grad)")
    return ref, module, task_name


def _run_one_process(source: ModelSource | ModelSpec, batch: Batch, plan: StepPlan, dev: DeviceInfo,
                     tdev: torch.device, *, isolation: str, warmup_steps: int,
                     measure_steps: int, timeout_s: float | None, run: RunSpec | None,
                     ) -> tuple[RawTrial, str, str]:
    """Step 5 of ``measure`` on one rank: the steps run in a subprocess or in this process
    (``_choose_isolation``; ``auto`` falls back to this process when the model cannot be
    sent or loaded there): ``(raw measurement, isolation, its reason)``."""
    cap = dev.capacity_bytes if dev.capped else None
    mode, reason = _choose_isolation(isolation, dev, plan)
    raw = None
    if mode == "subprocess":
        try:
            raw = _run_subprocess(
                source,
                batch,
                plan,
                tdev,
                cap=cap,
                warmup_steps=warmup_steps,
                measure_steps=measure_steps,
                timeout_s=timeout_s,
                run=run,
            )
        except _Unpicklable as e:
            if (why := _isolated(plan)) is not None:  # no process but its own will do
                raise BadInputError(
                    f"cannot send the model to a trial process ({e}), and {why}: pass the "
                    "model by name or path") from None
            if isolation != "auto":
                raise BadInputError(
                    f"cannot send the model to a trial process ({e}); pass isolation='in-process'"
                ) from None
            mode = "in-process"
            reason = f"the model cannot be pickled ({e}); ran in this process" + (
                " under a temporary address-space limit" if cap else ""
            )
        else:
            if (
                isolation == "auto"
                and raw.error is not None
                and raw.error.startswith("loading the model")
                and not raw.oom
            ):
                reason = (
                    f"the trial process could not load the model ({raw.error}); ran in this process"
                )
                mode, raw = "in-process", None
    if raw is None:
        raw = _run_in_process(
            source,
            batch,
            plan,
            tdev,
            cap=cap,
            warmup_steps=warmup_steps,
            measure_steps=measure_steps,
            deadline=None if timeout_s is None else time.monotonic() + float(timeout_s),
            run=run,
        )
    return raw, mode, reason


def _one_process_result(raw: RawTrial, config: TrainConfig, dev: DeviceInfo,
                        batch: Batch, plan: StepPlan, mode: str, reason: str,
                        timeout_s: float | None, recipe_line: tuple[str, ...]) -> TrialResult:
    """Step 6 of ``measure`` on one rank: the ``TrialResult``; an in-process trial whose
    memory did not return to its baseline sends later trials on that device to a
    subprocess (with a warning)."""
    notes = [*recipe_line, *raw.notes]
    if mode == "in-process" and raw.recovered is False:
        msg = (
            f"memory did not return to its baseline after a trial on {dev.name} "
            f"({raw.leaked_bytes} bytes left); later trials there run in a subprocess"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        notes.append(msg)
        _failed_recovery()[dev.name] = msg
    error = raw.error
    if raw.timed_out:
        error = f"timeout after {timeout_s:g}s"
    b, t = (int(s) for s in batch["input_ids"].shape)
    micro = plan.micro_batches_per_step
    return _trial_result(
        raw, config, dev, b, t, micro, error=error, isolation=mode, isolation_reason=reason,
        capacity_bytes=dev.capacity_bytes,
        recovered=raw.recovered if mode == "in-process" else None,
        leaked_bytes=raw.leaked_bytes if mode == "in-process" else None,
        notes=tuple(notes))


def _measure_ranks(model: ModelSource | ModelSpec, module: torch.nn.Module, batch: Batch,
                   plan: StepPlan, config: TrainConfig, dev: DeviceInfo, tdev: torch.device, *,
                   isolation: str, warmup_steps: int, measure_steps: int, timeout_s: float | None,
                   run: RunSpec | None, progress: Progress | None,
                   deepspeed: dict[str, object] | None = None, notes: tuple[str, ...] = ()
                   ) -> TrialResult:
    """``measure`` on ``config.world_size`` ranks (``autofit.trial.ranks``; ``deepspeed``:
    the user's DeepSpeed config instead of autofit's)."""
    from autofit.trial.ranks import check_ranks, rank_spec, run_ranks

    if isolation == "in-process":
        raise BadInputError(f"{config.world_size} ranks run as {config.world_size} processes: "
                            "use isolation='auto' or 'subprocess'")
    check_ranks(config, dev)
    if config.chunked_loss:
        from autofit.knobs.chunked_loss import SEVERAL_RANKS

        raise BadInputError(f"chunked loss: {SEVERAL_RANKS}; measure without --chunked-loss")
    spec = rank_spec(config, module, dev, timeout_s, deepspeed=deepspeed)
    done = run_ranks(model, batch, plan, spec, tdev, warmup_steps=warmup_steps,
                     measure_steps=measure_steps, timeout_s=timeout_s, run=run,
                     progress=progress)
    raw = done.raw
    b, t = (int(s) for s in batch["input_ids"].shape)
    micro = plan.micro_batches_per_step
    caps = [c for c in spec.caps if c is not None]
    capacity = min(caps) if caps else dev.capacity_bytes
    shape = (f"{config.nnodes} nodes x {config.nproc_per_node} processes" if config.nnodes > 1
             else "one node")
    reason = (f"{config.world_size} ranks ({shape}, {config.strategy}"
              + (f", offload {config.offload}" if config.offload != "none" else "")
              + f"): torchrun started one process per rank, each on its own {dev.name}")
    return _trial_result(
        raw, config, dev, b, t, micro, error=raw.error, isolation="subprocess",
        isolation_reason=reason, capacity_bytes=capacity, notes=(*notes, *raw.notes),
        per_rank=done.per_rank)


def _trial_result(raw: RawTrial, config: TrainConfig, dev: DeviceInfo, b: int, t: int, micro: int,
                  **fields: object) -> TrialResult:
    """A ``TrialResult`` of a trial's raw measurement (one process or the peaking rank):
    what every trial reports, and ``fields`` (isolation, capacity, error, notes, ...)."""
    from autofit.trial.loop import run_step_s

    step = raw.step_time_s
    accum = max(1, config.grad_accum_steps)
    # tokens per second of the run: its accumulation amortises the optimizer step
    run_step = run_step_s(step, raw.optimizer_time_s, micro, accum) if step else None
    return TrialResult(
        oom=bool(raw.oom),
        peak_allocated_bytes=raw.peak_allocated_bytes,
        peak_reserved_bytes=raw.peak_reserved_bytes,
        device_total_bytes=raw.device_total_bytes,
        step_time_s=step,
        optimizer_share=(raw.optimizer_time_s / run_step
                         if run_step and raw.optimizer_time_s is not None else None),
        tokens_per_s=(accum * b * t / run_step) if run_step else None,
        samples_per_s=(accum * b / run_step) if run_step else None,
        config=config.replace(seq_len=t).to_dict(),
        device=dev.name,
        batch_shape=(b, t),
        steps=len(raw.step_times_s),
        warmup_steps=raw.warmup_done,
        micro_batches_per_step=micro,
        resident_bytes=raw.resident_bytes,
        timed_out=raw.timed_out,
        killed_by=raw.killed_by,
        run_steps=raw.run_steps,
        eval_device_total_bytes=raw.eval_device_total_bytes,
        eval_oom=raw.eval_oom,
        eval_error=raw.eval_error,
        compile_s=raw.compile_s,
        over_budget=bool(getattr(raw, "over_budget", False)),
        outpaced=bool(getattr(raw, "outpaced", False)),
        phase_s=dict(getattr(raw, "phase_s", None) or {}),
        setup_bytes=getattr(raw, "setup_bytes", None),
        **fields,
    )


def warm_up(dev: DeviceInfo, isolation: str = "auto") -> None:
    """Start the trial server now when ``dev``'s trials will fork from it (a present CPU,
    one rank, trials in a subprocess): its imports (seconds) then overlap the caller's
    work before the first trial instead of delaying it. Nothing otherwise; never raises."""
    if (dev.kind != "cpu" or not dev.present or dev.nproc_per_node * dev.nnodes > 1
            or _choose_isolation(isolation, dev)[0] != "subprocess"):
        return
    from autofit.trial import server

    server.prepare(_child_env())


def _isolated(plan: StepPlan | None) -> str | None:
    """Why ``plan``'s knob values need a process of their own (a knob's ``prepare`` that
    cannot be undone), or None."""
    from autofit.knobs.registry import isolates

    if plan is None or plan.config is None or not (knobs := isolates(plan.config)):
        return None
    return (f"{', '.join(knobs)}: what the trainer does to the model for them changes "
            "transformers' code for the whole process and cannot be undone")


def _choose_isolation(isolation: str, dev: DeviceInfo, plan: StepPlan | None = None
                      ) -> tuple[str, str]:
    if (why := _isolated(plan)) is not None:
        if isolation == "in-process":
            raise BadInputError(f"a trial in this process cannot run: {why}; use "
                                "isolation='auto' or 'subprocess'")
        return "subprocess", why
    if isolation == "in-process":
        return "in-process", "asked for (isolation='in-process')" + (
            f"; the {dev.name} cap is set on this process during the steps" if dev.capped else ""
        )
    if isolation == "subprocess":
        return "subprocess", "asked for (isolation='subprocess')"
    if dev.capped:
        return "subprocess", (
            f"{dev.name} is a capped CPU: the cap is an address-space limit on a fresh process"
        )
    failed = _failed_recovery()
    if dev.name in failed:
        return (
            "subprocess",
            f"an earlier in-process trial failed to recover: {failed[dev.name]}",
        )
    return "in-process", (
        f"{dev.name} is not capped: in-process is fastest, and memory is checked back at "
        "its baseline after each trial"
    )
