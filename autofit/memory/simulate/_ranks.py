"""The simulate method for several ranks: every rank's estimate, and the one that peaks.

FSDP2, HSDP and DDP are traced (``simulate._dist``: the real wrapper on fake tensors under a
fake process group, one trace per class of ranks that hold the same shards); DeepSpeed
ZeRO, FSDP2 with CPU offload (fake CPU tensors cannot tell the host from the device) and
any strategy in a process that already has a process group are simulated by
transforming the single-rank step (``simulate._zero``).
"""

from __future__ import annotations

import time
from typing import Any

from autofit.config import TrainConfig
from autofit.memory.ranks._layout import Layout
from autofit.memory.ranks._per_rank import FSDP_MIXED_NOTE, combine_ranks

# ``Simulator`` and ``SimulationResult`` (autofit.memory.simulate, which calls this module)
# are written ``Any`` here: importing them, even for types, would make an import cycle.
Simulator = SimulationResult = Any

__all__ = ["simulate_ranks"]


def simulate_ranks(sim: Simulator, config: TrainConfig, seq_len: int,
                   layout: Layout | None = None) -> SimulationResult:
    """Simulate every rank of ``config`` (``world_size > 1``) with ``sim``'s model and
    target; the result's estimate has ``per_rank`` and the peaking rank's figures, its
    events and replay are the peaking rank's."""
    from autofit.memory.simulate._dist import (
        ProcessGroupExists,
        RankTrace,
        fake_world,
        rank_classes,
    )
    from autofit.memory.simulate._step import optimizer_cls_and_kwargs
    from autofit.memory.simulate._zero import simulate_transformed

    layout = layout or Layout.of(config)
    if layout.family == "zero" or (layout.family == "fsdp" and layout.offload != "none"):
        return simulate_transformed(sim, config, seq_len, layout)
    t0 = time.perf_counter()
    # resolved before the fake world exists (TrainingArguments reads the environment)
    optimizer_cls_and_kwargs(config.optimizer, config.optim_args)
    classes = rank_classes(sim.module, layout)
    results: dict[int, Any] = {}
    try:
        for rep in classes:
            with fake_world(rep, layout.world_size):
                results[rep] = sim._run(config, seq_len, trace=RankTrace(layout, rep, config))
    except ProcessGroupExists:
        return simulate_transformed(sim, config, seq_len, layout,
                                    why="this process already has a process group")
    except (ValueError, RuntimeError, NotImplementedError) as e:  # the wrapper refused
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return simulate_transformed(sim, config, seq_len, layout,
                                    why=f"the wrapper failed on the fake clone: {first[:160]}")
    of_rank = {r: rep for rep, ranks in classes.items() for r in ranks}
    ests = [results[of_rank[r]].estimate for r in range(layout.world_size)]
    combined = combine_ranks(ests, layout, sim.device, method="simulate")
    top = results[of_rank[combined.peak_rank]]
    note = (f"traced {'FSDP2' if layout.family == 'fsdp' else 'DDP'} on a fake process group: "
            f"{len(classes)} rank trace(s) for {layout.world_size} ranks")
    notes = (*combined.notes, note)
    if layout.family == "fsdp" and config.precision_spec.autocast:
        notes = (*notes, FSDP_MIXED_NOTE)
    import dataclasses

    return dataclasses.replace(
        top, estimate=dataclasses.replace(combined, notes=notes),
        wall_s=time.perf_counter() - t0, num_ops=sum(r.num_ops for r in results.values()))
