"""benchmarks/published_gpu.py: a row is estimated as its source ran it -- the card's
CUDA context the source measured on its own stack, today's optimizer standing in for one
that no longer exists -- and every such substitution says why."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MiB = 1 << 20


def _load():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("_bench_published_gpu",
                                                  BENCH / "published_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


published = _load()
ROWS = {r["id"]: r for r in json.loads((BENCH / "published_gpu.json").read_text())["rows"]}


def test_every_substitution_in_a_row_is_explained():
    substituted = [r for r in ROWS.values()
                   if r.get("context_mib") is not None or r.get("estimated_optimizer")]
    assert substituted
    for r in substituted:
        assert len(r.get("estimated_as", "")) > 80, r["id"]
        if r.get("estimated_optimizer"):
            assert r["estimated_optimizer"] in r["estimated_as"], r["id"]


def test_a_row_is_estimated_with_the_context_its_source_measured(tmp_path):
    """The V100 page's stack held 1,341 MiB of context where the catalog has today's:
    the device total (what nvidia-smi shows) moves by the difference, the step not at all."""
    from autofit.probe.device import resolve_device

    row = ROWS["hf-bert-large-b1-ga4-gc-fp16"]
    catalog = resolve_device(row["autofit_device"])
    stated = published.device_of(row)
    assert stated.context_bytes == row["context_mib"] * MiB != catalog.context_bytes
    assert stated.capacity_bytes == catalog.capacity_bytes
    with_stack, _, _ = published.estimate_row(row, "analytic", tmp_path)
    plain, _, _ = published.estimate_row({**row, "context_mib": None}, "analytic", tmp_path)
    assert with_stack - plain == (stated.context_bytes - catalog.context_bytes) / MiB
    assert published.setup_of(row).endswith(f"context {row['context_mib']} MiB")
    assert "(as adamw_torch_fused)" in published.setup_of(row)
