"""The soak benchmark's child on a tiny model: its result fields, and an OOM with its phase.

Each child is a fresh process that imports torch and transformers and runs a warm-up
``Trainer.train()`` before its own (~20-40 s each on a loaded 2-core machine): ``slow``.
The search for the largest surviving micro batch is tested against an oracle (fast).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "benchmarks" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_soak"] = mod  # dataclasses need the module registered
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_soak", None)


def tiny_job(soak, cap_bytes: int, **kw):
    """A 1-layer GPT-2 on 24 samples (max 32 tokens), batch 4: 6 steps, evals, saves."""
    spec = soak.tuners.Spec(
        name="tiny", profile="test",
        config={"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2,
                "vocab_size": 4096, "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0,
                "architectures": ["GPT2LMHeadModel"]},
        task="causal-lm", cap="cpu:1GiB", seq_max=32, samples=24)
    job = {"mode": "soak", "spec": dataclasses.asdict(spec), "config": spec.config,
           "task": spec.task, "seed": 0, "samples": spec.samples, "cap_bytes": cap_bytes,
           "batch": 4, "eval_batch": 4, "min_steps": 4, "eval_every": 2, "save_every": 3,
           "log_every": 2}
    job.update(kw)
    return job


@pytest.mark.slow
def test_child_soak_survives_with_a_curve(soak, tmp_path):
    r = soak.run_child(tiny_job(soak, 1 << 30), tmp_path, "ok")
    assert r["survived"] is True and r["oom"] is False and r["error"] is None
    assert r["steps"] == r["planned_steps"] == 6  # one epoch: 24 samples / 4
    assert r["resident_bytes"] > 0 and r["baseline_bytes"] > 0 and r["cap_bytes"] == 1 << 30
    c = r["curve"]
    assert c["phase"].count("train") == 6
    assert c["phase"].count("eval") == 3 and c["phase"].count("save") == 2  # 2, 4, 6; 3, 6
    rows = list(zip(c["step"], c["phase"], c["seq"], strict=True))
    assert [s for s, ph, _ in rows if ph == "eval"] == [2, 4, 6]
    assert all(t is not None and t > 0 for _, ph, t in rows if ph == "train")
    assert r["peak"] == max(c["peak"]) >= r["resident_bytes"]
    assert r["peak_at"]["phase"] in soak.PHASES
    assert len(r["attempts"]) == 1
    assert r["attempts"][0]["survived"] and r["attempts"][0]["batch"] == 4


@pytest.mark.slow
def test_child_soak_under_a_tiny_cap_dies_with_its_step_and_phase(soak, tmp_path):
    # the logits of 8 x 32 tokens x 4096 are 4 MiB a copy: 6 MiB above the weights is too little
    r = soak.run_child(tiny_job(soak, 6 * MiB, batch=8, samples=24), tmp_path, "oom")
    assert r["survived"] is False
    assert r["oom"] is True, r["error"]
    assert "can't allocate memory" in r["error"] or "MemoryError" in r["error"]
    assert r["died_phase"] in soak.PHASES
    assert r["died_step"] >= 1
    assert r["attempts"][-1]["died_step"] == r["died_step"]


def test_largest_surviving_search_goes_up_then_bisects(soak):
    for limit_true, start in ((10, 8), (8, 8), (30, 8), (5, 8), (1, 8)):
        seen: list[int] = []

        def survives(b, t=limit_true, seen=seen):
            seen.append(b)
            return b <= t

        r = soak.largest_surviving(survives, start, limit=4 * start)
        assert r["largest"] == (limit_true if limit_true >= 1 else None), (limit_true, r)
        assert r["first_death"] == limit_true + 1
        assert len(seen) == len(set(seen))  # no size soaked twice
        assert r["probes"] == seen


def test_largest_surviving_stops_at_the_limit(soak):
    r = soak.largest_surviving(lambda b: True, 4, limit=16)
    assert r["largest"] == 16 and r["first_death"] is None and r["capped_at_limit"]


def test_lengths_skewed_with_three_at_the_max(soak):
    lengths = soak.soak_lengths(2000, 128, seed=0)
    assert lengths.count(128) >= 3 and max(lengths) == 128 and min(lengths) >= 4
    assert sum(x <= 16 for x in lengths) / len(lengths) > 0.9
    assert soak.soak_lengths(2000, 128, seed=0) == lengths  # seeded


def test_death_cause_separates_address_space_from_memory(soak):
    cap = 128 * MiB
    err = ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate "
           f"{15 * MiB} bytes. Error code 12 (Cannot allocate memory)")
    died = {"survived": False, "error": err}
    assert soak.requested_bytes(err) == 15 * MiB
    assert soak.death_cause(dict(died, died_peak=90 * MiB), cap) == "address space"
    assert soak.death_cause(dict(died, died_peak=110 * MiB), cap) == "memory"
    assert soak.death_cause({"survived": True}, cap) is None
    assert soak.death_cause(dict(died, error="killed by SIGABRT", died_peak=1), cap) is None
