"""The simulate method: the real training step on fake tensors, its allocations replayed.

`Simulator` / `simulate` (``_simulator``) run the step; its helpers, each private to
this package:

- ``_model``: the FakeTensor clone of the user's model, prepared for training;
- ``_recorder``: every storage allocated and freed at the dispatch level;
- ``_step``: the Trainer's step (forward with labels, backward, clip, optimizer step);
- ``_cuda``: CUDA's semantics where the CPU kernels differ; ``_bnb``: bitsandbytes;
- ``_ranks``, ``_dist``, ``_zero``: several ranks (a traced wrapper under a fake process
  group, or the single-rank step transformed for ZeRO).

    >>> from autofit.memory.simulate import Simulator, simulate
"""

from autofit.memory.simulate._ranks import simulate_ranks
from autofit.memory.simulate._simulator import PeakLine, SimulationResult, Simulator, simulate

__all__ = ["simulate", "Simulator", "SimulationResult", "PeakLine", "simulate_ranks"]
