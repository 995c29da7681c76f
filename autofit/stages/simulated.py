"""A device that is not here: its trials and its estimates from the simulated step on fake
tensors (``autofit.memory.simulate``), for ``autofit(method="simulate")``.

    >>> SimulatedTrial(False, 1 << 30, None, None, 1000.0).oom
    False
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.knobs import choice_of, describe_choice
from autofit.probe.device import DeviceInfo

if TYPE_CHECKING:
    import torch

    from autofit.probe.model import ModelInfo

__all__ = ["SimulatedTrial", "simulated_trials", "simulated_estimate"]


@dataclass(frozen=True)
class SimulatedTrial:
    """What the engine reads from a trial, produced by simulating the step instead."""

    oom: bool
    device_total_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    tokens_per_s: float | None
    error: str | None = None


def simulated_trials(module: torch.nn.Module, task: str, info: ModelInfo, dev: DeviceInfo,
                     seq_len: int, speed: Callable[[TrainConfig], float],
                     sharding: dict[str, object] | None = None) -> Callable[[TrainConfig], Any]:
    """A trial function for a device that is not here: the simulated step on fake tensors.

    The engine brackets the limit with it exactly as with real trials (a few
    simulations for the best combinations, not one per micro batch); throughput
    is the model's prediction, since nothing runs on the target.
    """
    from autofit.memory.simulate import Simulator

    sim = Simulator(module, task=task, device=dev, model_name=info.name, sharding=sharding)

    def trial(config: TrainConfig) -> SimulatedTrial:
        est = sim.simulate(config, seq_len=seq_len)
        total = est.device_total_bytes
        if total > dev.capacity_bytes:
            return SimulatedTrial(True, None, None, None, None,
                                   f"simulated out of memory: {total} bytes > capacity")
        return SimulatedTrial(False, total, est.peak_allocated_bytes, est.peak_reserved_bytes,
                               speed(config))

    trial.simulator = sim  # type: ignore[attr-defined]
    return trial


def simulated_estimate(module: torch.nn.Module, task: str, info: ModelInfo, dev: DeviceInfo,
                       seq_len: int, progress: Callable[[str], None] | None = None,
                       sharding: dict[str, object] | None = None) -> Callable[[TrainConfig], int]:
    """``config -> device total bytes`` from the simulated step's peak line per combination."""
    from autofit.memory.simulate import Simulator

    sim = Simulator(module, task=task, device=dev, model_name=info.name, sharding=sharding)
    lines: dict[TrainConfig, Any] = {}

    def estimate_total(config: TrainConfig) -> int:
        base = config.replace(micro_batch_size=1, grad_accum_steps=min(config.grad_accum_steps, 2))
        if base not in lines:
            if progress is not None:
                progress(f"simulating {describe_choice(choice_of(base))} "
                         "at micro batches 1, 2 and 4")
            lines[base] = sim.peak_line(base, seq_len=seq_len, batches=(1, 2, 4))
        return lines[base].total(config.micro_batch_size)

    return estimate_total
