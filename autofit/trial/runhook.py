"""The hook ``autofit run`` injects into the user's training processes (``sitecustomize``).

``autofit.preflight.run`` copies this file as ``sitecustomize.py`` into a temporary
folder put first on ``PYTHONPATH``, so every Python process of the command runs it
at start-up: the script, and every rank torchrun or ``accelerate launch`` starts
(children inherit the environment). It measures the process from the inside and,
at exit, writes one JSON record ``<AUTOFIT_RUN_DIR>/<pid>.json``:

- CPU: the high-water mark of resident memory above a *baseline* taken when the
  first ``torch.nn.Module`` is constructed, the moment the model starts being built
  (``peak = VmHWM - baseline RSS``, VmHWM reset at the baseline by writing ``5`` to
  ``/proc/self/clear_refs``). This is the figure autofit's trials measure and its
  whole-run prediction counts (weights, gradients, optimizer states, activations,
  temporaries, overhead), not the interpreter and the libraries imported before.
  With ``AUTOFIT_RUN_CAP`` (bytes, ``--device cpu:CAP``) the address space is capped
  at that same moment as a trial caps it (``RLIMIT_AS`` = VmSize + CAP:
  ``autofit.trial.procmem.cap_address_space``; nothing of the model is resident yet,
  so nothing is subtracted), and an allocation past it fails with torch's
  "DefaultCPUAllocator: can't allocate memory", as on a real device that is full.
- CUDA (when the process used it): ``torch.cuda.max_memory_allocated`` /
  ``max_memory_reserved`` of every device it touched, over the whole process.

Why the first ``nn.Module`` built outside an ``import``: every model (plain
torch, transformers' ``from_config`` / ``from_pretrained``, PEFT, TRL) runs
``nn.Module.__init__`` before its first parameter is allocated. Libraries do
build modules while they are imported (``transformers.activations`` makes a
``GELUActivation`` at import): those are skipped, since a baseline taken there
would count the rest of the imports (~200 MiB of RSS and more address space for
the ``Trainer``'s modules, which then ate a ``cpu:1GiB`` cap before the first
step). The hook wraps ``nn.Module.__init__`` once torch is imported (an import
hook on ``torch``, so a script that never imports torch only pays one finder on
``sys.meta_path``), takes the baseline on the first call made outside an import
and puts the original back. A ``Parameter`` hook would come too late: ``nn.Linear``
allocates its weight with ``torch.empty`` before wrapping it.

With ``AUTOFIT_RUN_GUARD`` (``autofit run --guard``) it also wraps
``transformers.Trainer.train`` once ``transformers.trainer`` is imported, so that each
Trainer is ``autofit.guard``-ed when it starts training (autofit's own folder is then
on ``PYTHONPATH``; ``AUTOFIT_GUARD_RECORD`` says where the rescues go).

The file is self-contained (standard library only): it runs inside the user's
interpreter, which need not have autofit installed, and must not import autofit
(nor torch) itself, except for ``--guard``, when a Trainer starts training. It chains to the ``sitecustomize`` it shadows, and never
raises: a failure of the hook is a note in the record, not a broken run.

Known limitations:
    NB: what the process does between the first ``nn.Module`` and the first step
    and a trial does before its baseline (lazy imports of the Trainer's modules,
    the first step's one-time autograd and kernel set-up, the pages of library
    code touched first) is counted here and not in a trial's peaks. The set-up
    step's part a CPU trial measures apart (``TrialResult.setup_bytes``, 20 MiB for
    tiny-gpt2) and the tuned whole-run figure adds it; the Trainer's own (its
    objects, the data loader: a few MiB for tiny-gpt2) is not counted.
    NB: a module the script builds before the model (e.g. a loss ``nn.Module``
    constructed first) takes the baseline earlier; what the script allocates and
    imports between the two is counted too. A model built by a module's body
    while it is imported is not seen (the baseline waits for a later module).
    NB: a process that ends with ``os._exit`` or a signal writes no exit record;
    its baseline record (written when the baseline is taken) says so.
    NB: ``/proc`` and ``RLIMIT_AS`` are Linux-only; elsewhere no CPU peak is recorded.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import importlib.abc
import importlib.util
import json
import os
import resource
import sys
import time

RECORD_DIR_ENV = "AUTOFIT_RUN_DIR"  # where each process writes <pid>.json
CAP_ENV = "AUTOFIT_RUN_CAP"  # bytes of address space above the baseline (cpu:CAP)
HOOK_DIR_ENV = "AUTOFIT_RUN_HOOK_DIR"  # the folder holding this file as sitecustomize.py
GUARD_ENV = "AUTOFIT_RUN_GUARD"  # "1": guard every Trainer (autofit run --guard)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm() -> tuple[int, int] | None:
    """(VmSize, VmRSS) bytes of this process."""
    try:
        with open("/proc/self/statm") as f:
            size, resident = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(size) * _PAGE, int(resident) * _PAGE


def _status(field: str) -> int | None:
    """A ``/proc/self/status`` size, bytes: ``VmHWM`` (the resident high-water mark since
    start or the last reset), ``VmPeak`` (the largest address space since start)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _write(record: dict[str, object]) -> None:
    folder = os.environ.get(RECORD_DIR_ENV)
    if not folder or os.getpid() != record["pid"]:  # a forked child inherits the hook
        return
    path = os.path.join(folder, f"{record['pid']}.json")
    tmp = path + ".tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)


def _baseline(record: dict[str, object]) -> None:
    """The model is about to be built: baseline RSS, cap the address space, reset VmHWM."""
    gc.collect()
    _malloc_trim()
    now = _statm()
    if now is None:
        record["notes"].append("no /proc/self/statm: CPU memory not measured (Linux only)")
        return
    size, rss = now
    record.update(baseline_rss_bytes=rss, baseline_vm_size_bytes=size, baseline_time=time.time())
    cap = os.environ.get(CAP_ENV)
    if cap:
        try:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            limit = size + int(cap)
            if hard != resource.RLIM_INFINITY and limit > hard:
                limit = hard
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            record["address_space_limit_bytes"] = limit
        except (OSError, ValueError) as e:
            record["notes"].append(f"could not cap the address space: {e}")
    if not _reset_hwm():
        record["notes"].append("cannot reset VmHWM (/proc/self/clear_refs): the peak "
                               "includes what the process held before the model")
        record["hwm_reset"] = False
    else:
        record["hwm_reset"] = True
    _write(record)  # a process that dies without atexit still says it got this far


def _importing() -> bool:
    """Whether the caller runs inside an ``import`` (a module body executing)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _patch_torch(torch, record: dict[str, object]) -> None:
    module_cls = torch.nn.Module
    original = module_cls.__dict__["__init__"]

    def __init__(self, *args, **kwargs):
        if not _importing():
            module_cls.__init__ = original  # once: the first model's construction
            try:
                _baseline(record)
            except Exception as e:  # noqa: BLE001 - the hook never breaks the run
                record["notes"].append(f"baseline failed: {type(e).__name__}: {e}")
        original(self, *args, **kwargs)

    module_cls.__init__ = __init__


class _Watch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of module ``name`` so that ``patch(module)``
    runs once the module is executed (then steps aside).

    NB: libraries probe for torch with ``importlib.util.find_spec("torch")`` without
    importing it (``datasets``, ``evaluate``, ``accelerate`` do): that call reaches this
    finder too, so the finder stays until the module really executes (it stepped aside at
    the first look before, and a run that imported ``datasets`` first measured nothing)."""

    def __init__(self, name: str, patch, record: dict[str, object]) -> None:
        self.name, self.patch, self.done = name, patch, False
        self.record = record

    def find_spec(self, name, path=None, target=None):
        if name != self.name or self.done:
            return None
        at = sys.meta_path.index(self) if self in sys.meta_path else 0
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # the real finders, without this one (no recursion)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if not self.done:
                sys.meta_path.insert(at, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            if self.done:
                return
            self.done = True
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
            try:
                self.patch(module, self.record)
            except Exception as e:  # noqa: BLE001
                self.record["notes"].append(f"could not hook {name}: {type(e).__name__}: {e}")

        spec.loader.exec_module = exec_and_patch
        return spec


def _patch_trainer(module, record: dict[str, object]) -> None:
    """``autofit run --guard``: every ``Trainer`` is guarded when it starts training
    (``autofit.guard``; autofit's folder is on ``PYTHONPATH`` for that)."""
    trainer_cls = module.Trainer
    original = trainer_cls.train

    def train(self, *args, **kwargs):
        if getattr(self, "autofit_guard", None) is None:
            from autofit.trial.guard import guard

            guard(self)  # wraps this instance's train, which comes back here, guarded
            record["guarded"] = True
            return self.train(*args, **kwargs)
        return original(self, *args, **kwargs)

    trainer_cls.train = train


def _cuda_peaks() -> list[dict]:
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return []
    out = []
    for i in range(cuda.device_count()):
        reserved = int(cuda.max_memory_reserved(i))
        if reserved:
            out.append({"index": i, "peak_allocated_bytes": int(cuda.max_memory_allocated(i)),
                        "peak_reserved_bytes": reserved})
    return out


def _at_exit(record: dict[str, object]) -> None:
    try:
        hwm, vm_peak = _status("VmHWM"), _status("VmPeak")
        if hwm is not None and "baseline_rss_bytes" in record:
            record["hwm_bytes"] = hwm
            record["peak_bytes"] = max(0, hwm - record["baseline_rss_bytes"])
        if vm_peak is not None and "baseline_vm_size_bytes" in record:
            # what RLIMIT_AS counts (NB: VmPeak cannot be reset: a larger address space
            # before the baseline would show here; imports only grow it, in practice)
            record["address_space_bytes"] = max(0, vm_peak - record["baseline_vm_size_bytes"])
        record["cuda"] = _cuda_peaks()
        error = getattr(sys, "last_value", None)  # an uncaught exception ended the script
        if error is not None:
            text = str(error).strip().splitlines()
            head = text[0] if text else ""
            # torch prefixes allocator errors with "[enforce fail at alloc_cpu.cpp:127] err == 0. "
            if head.startswith("[enforce fail") and "] " in head:
                head = head.split("] ", 1)[1].removeprefix("err == 0. ")
            record["error"] = f"{type(error).__name__}: {head}"[:500]
        record["exited"] = True
    except Exception as e:  # noqa: BLE001
        record["notes"].append(f"exit record failed: {type(e).__name__}: {e}")
    _write(record)


def _chain() -> None:
    """Run the ``sitecustomize`` this file shadows (the next one on sys.path), if any."""
    here = os.environ.get(HOOK_DIR_ENV)
    if not here:
        return
    saved = list(sys.path)
    own = sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        spec = importlib.util.find_spec("sitecustomize")
        if spec is not None:
            importlib.import_module("sitecustomize")
    except Exception as e:  # noqa: BLE001 - as Python's site does: report, go on
        print(f"Error in sitecustomize (chained by autofit run): {type(e).__name__}: {e}",
              file=sys.stderr)
    finally:
        sys.path[:] = saved
        if own is not None:
            sys.modules["sitecustomize"] = own


def _install() -> None:
    if not os.environ.get(RECORD_DIR_ENV):
        return
    # this process's record, written to <pid>.json (baseline, peaks, notes)
    record: dict[str, object] = {"pid": os.getpid(), "argv": list(sys.argv), "notes": []}
    record["rank"] = os.environ.get("RANK")
    record["local_rank"] = os.environ.get("LOCAL_RANK")
    if "torch" in sys.modules:
        _patch_torch(sys.modules["torch"], record)
    else:
        sys.meta_path.insert(0, _Watch("torch", _patch_torch, record))
    if os.environ.get(GUARD_ENV):
        sys.meta_path.insert(0, _Watch("transformers.trainer", _patch_trainer, record))
    atexit.register(_at_exit, record)


if __name__ == "sitecustomize":  # imported by autofit itself (for its names): nothing runs
    with contextlib.suppress(Exception):  # never break the user's interpreter
        _install()
    _chain()
