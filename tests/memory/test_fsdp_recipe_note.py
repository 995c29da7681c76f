"""An FSDP2 estimate in mixed precision says which recipe it is for: accelerate's
MixedPrecisionPolicy (what the Trainer runs), measured within 1% on 2 ranks; a loop with
torch.autocast and no policy holds ~27% more (``benchmarks/results/fsdp_recipes.md``),
which is not modelled, so the note names it. Both methods say it; fp32 has no such note."""

from __future__ import annotations

import pytest

import autofit
from autofit import TrainConfig


@pytest.mark.parametrize("method", ["analytic", "simulate"])
def test_fsdp2_in_mixed_precision_names_its_recipe(method):
    cfg = TrainConfig(micro_batch_size=2, precision="bf16-mixed", strategy="fsdp",
                      nproc_per_node=2)
    est = autofit.estimate("tiny-llama", cfg, seq_len=64, device="cpu", method=method)
    note = [n for n in est.notes if "MixedPrecisionPolicy" in n]
    assert len(note) == 1 and "autocast and no policy" in note[0] and "+27%" in note[0]
    fp32 = autofit.estimate("tiny-llama", cfg.replace(precision="32-true"), seq_len=64,
                            device="cpu", method=method)
    assert not [n for n in fp32.notes if "MixedPrecisionPolicy" in n]
