"""The trial child: ``python -m autofit.trial.child WORKDIR [PARENT_PID [OWNER_PID]]``.

Started by ``autofit.trial`` with glibc's allocator set to measure
(``_procmem.CHILD_MALLOC_ENV``). Reads ``WORKDIR/payload.pt`` (a ``torch.save``
of: the pickled module or a ``ModelRef``, the batch, the ``StepPlan``, the device,
the CPU cap, the step counts), runs ``autofit.trial.loop.run_steps`` and writes
``WORKDIR/result.json`` (the ``RawTrial`` fields). Any failure is written there
too; a child that dies without a result is judged by its exit status and stderr.

First of all (before torch is imported, seconds) the child ties its life to the
parent's: should ``PARENT_PID`` die, it removes ``WORKDIR`` (the payload with it)
and exits (``autofit.trial.process.guard_parent``).

A CPU trial's child is usually forked by the trial server (``autofit.trial.server``)
with torch and transformers already imported, and runs ``main`` there: its parent
is then the server and ``OWNER_PID`` the autofit process whose ``WORKDIR`` it is
(kept while that process lives, which reruns the trial in a fresh child).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path


def _write(workdir: Path, data: dict) -> None:
    tmp = workdir / "result.json.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, workdir / "result.json")


def main(argv: list[str]) -> int:
    started = time.monotonic()
    workdir = Path(argv[1])
    from autofit.trial.process import guard_parent

    guard_parent(
        workdir,
        int(argv[2]) if len(argv) > 2 else os.getppid(),
        owner_pid=int(argv[3]) if len(argv) > 3 else None,
    )
    import torch

    torch.set_num_threads(1)
    from autofit.trial.loop import RawTrial, run_steps
    from autofit.trial.model import ModelRef, is_quantized_model, materialize

    try:
        payload = torch.load(workdir / "payload.pt", weights_only=False)
        device = torch.device(payload["device"])
        if device.type != "cpu":
            acc = getattr(torch, "accelerator", None)
            if acc is not None and hasattr(acc, "set_device_index"):
                acc.set_device_index(device)
            else:  # pragma: no cover - torch < 2.6
                getattr(torch, device.type).set_device(device)
        torch.manual_seed(int(payload.get("seed", 0)))
        plan = payload["plan"]
        model = payload["model"]
        if isinstance(model, ModelRef):
            model = materialize(model, device)
        if not is_quantized_model(model):  # a bitsandbytes base stays as it was loaded
            if plan.precision.endswith("-true"):
                from autofit.probe.peft import upcast_adapters

                model.to(dtype=plan.param_dtype)  # the child owns this copy
                upcast_adapters(model)  # as peft keeps them on a 16-bit base
            model.to(device)
        wall = payload.get("deadline_wall")  # the parent's clock: start-up counts too
        deadline = time.monotonic() + (wall - time.time()) if wall else None
        loaded = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, not raised
        from autofit.trial.oom import is_oom

        raw = RawTrial(oom=is_oom(exc), error=f"loading the model: {type(exc).__name__}: {exc}")
        _write(workdir, asdict(raw))
        return 0
    raw = run_steps(
        model,
        payload["batch"],
        plan,
        device,
        warmup_steps=int(payload["warmup_steps"]),
        measure_steps=int(payload["measure_steps"]),
        run=payload.get("run"),
        cap_bytes=payload.get("cap_bytes"),
        deadline=deadline,
    )
    raw.phase_s = {"load": round(loaded - started, 3), **raw.phase_s}
    _write(workdir, asdict(raw))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
