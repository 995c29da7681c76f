"""A handful of the zoo's families (``benchmarks/zoo.py``), each guarding a path of the
memory model, against the peaks the independent harness measured for them (committed in
``benchmarks/results/zoo.json``): the analytic estimate never more than 3% below, at most
10% above (the zoo's targets for the analytic method).

- ``afmoe``: a mixture-of-experts model in fp32 (transformers' ``grouped_mm`` experts,
  whose meta kernel takes bf16 only: the estimate was an internal error);
- ``bert`` with LoRA on every linear layer (fitted BERT rows: 4.9% under);
- ``opt``, ``gptj`` (GPT-2's fitted coefficients: 14.9% and 7.8% over);
- ``gemma2`` (eager, soft-capped attention; llama's fitted coefficients: 22.8% under).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
ROWS = ["zoo-afmoe-causal-lm-s-fp32", "zoo-bert-causal-lm-s-lora", "zoo-opt-causal-lm-s-fp32",
        "zoo-gptj-causal-lm-s-fp32", "zoo-gemma2-causal-lm-s-lora"]


def _rows() -> dict[str, dict]:
    return json.loads((BENCH / "results" / "zoo.json").read_text())["rows"]


@pytest.mark.parametrize("name", ROWS)
def test_a_zoo_family_is_estimated_within_its_measurement(name, tmp_path, monkeypatch):
    row = _rows()[name]
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("accuracy", None)
    from accuracy import _estimate

    est, _ = _estimate(row["spec"], "analytic", tmp_path)
    err = (est.peak_allocated_bytes - row["measured"]) / row["measured"]
    assert -0.03 <= err <= 0.10, f"{name}: analytic {100 * err:+.1f}% of the measured peak"
