"""The tuner benchmark's pieces against a fake device: exact sequences of sizes tried.

No trial runs here: ``fits(b)`` is an oracle and an OOM is a fake exception with
the message torch's CPU allocator raises under a cap. The transformers test and the
second Lightning one are ``slow`` (importing ``transformers.trainer_utils`` imports
peft, ~4 s here; each Lightning tuner run ~3 s): ``pytest -m slow``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_OOM = ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8192000 bytes. "
           "Error code 12 (Cannot allocate memory)")


@pytest.fixture(scope="module")
def tuners():
    spec = importlib.util.spec_from_file_location("bench_tuners", ROOT / "benchmarks" / "tuners.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_tuners"] = mod  # dataclasses need the module registered
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("bench_tuners", None)


def fake_device(tuners, limit: int, error: str = f"warm-up step: RuntimeError: {CPU_OOM}"):
    """``attempt(size, accum)`` of a device where sizes up to ``limit`` fit."""

    def attempt(size: int, accum: int = 1):
        ok = size <= limit
        return tuners.Attempt(size=size, accum=accum, fits=ok, oom=not ok,
                              error=None if ok else error, wall_s=0.0, peak_bytes=None,
                              steps=3 if ok else 0)

    return attempt


def accelerate_predicate():
    from accelerate.utils.memory import should_reduce_batch_size

    return should_reduce_batch_size


@pytest.mark.slow  # the peers' real finders, minutes of probing: the benchmark's own run
def test_accelerate_real_function_shrinks_by_0_9(tuners):
    log = tuners.Log()
    try_size = tuners.oom_raiser(fake_device(tuners, 10), accelerate_predicate(), log)
    assert tuners.run_accelerate(try_size) == 9
    assert log.sizes == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22,
                         19, 17, 15, 13, 11, 9]
    assert (log.ooms, log.recognised, log.wrapped) == (21, 21, 0)


def test_accelerate_halving_when_asked(tuners):
    log = tuners.Log()
    size = {"b": 128}

    def halve() -> int:
        size["b"] //= 2
        return size["b"]

    try_size = tuners.oom_raiser(fake_device(tuners, 10), accelerate_predicate(), log)
    assert tuners.run_accelerate(try_size, reduce_batch_size_fn=halve) == 8
    assert log.sizes == [128, 64, 32, 16, 8]


@pytest.mark.slow
def test_transformers_auto_find_batch_size_starts_at_per_device_batch(tuners):
    log = tuners.Log()
    try_size = tuners.oom_raiser(fake_device(tuners, 10), accelerate_predicate(), log)
    assert tuners.run_transformers(try_size, 48) == (10, 1)
    assert log.sizes == [48, 43, 38, 34, 30, 27, 24, 21, 18, 16, 14, 12, 10]
    assert all(a.accum == 1 for a in log.attempts)  # accumulation is never raised


@pytest.mark.slow
def test_lightning_real_binsearch(tuners, tmp_path):
    from lightning.pytorch.utilities.memory import is_oom_error

    log = tuners.Log()
    try_size = tuners.oom_raiser(fake_device(tuners, 10), is_oom_error, log)
    # double from 2 until 16 fails, bisect 8..16, then Lightning's 5% margin: int(10 * 0.95)
    assert tuners.run_lightning(try_size, 160, str(tmp_path)) == 9
    assert log.sizes == [2, 4, 8, 16, 12, 10, 11]
    assert (log.ooms, log.recognised, log.wrapped) == (3, 3, 0)


@pytest.mark.slow
def test_lightning_stops_at_the_dataset_length(tuners, tmp_path):
    from lightning.pytorch.utilities.memory import is_oom_error

    log = tuners.Log()
    try_size = tuners.oom_raiser(fake_device(tuners, 1000), is_oom_error, log)
    assert tuners.run_lightning(try_size, 20, str(tmp_path)) == 30  # int(32 * 0.95)
    assert log.sizes == [2, 4, 8, 16, 32]


def test_unrecognised_oom_is_wrapped(tuners):
    import torch

    log = tuners.Log()
    crashed = "trial process died (killed by SIGABRT): terminate called after std::bad_alloc"
    try_size = tuners.oom_raiser(fake_device(tuners, 10, crashed), accelerate_predicate(), log)
    with pytest.raises(torch.OutOfMemoryError, match="DefaultCPUAllocator"):
        try_size(11)
    assert (log.recognised, log.wrapped) == (0, 1)
    assert tuners.run_accelerate(try_size, start=12) == 10  # 12 fails, int(12 * 0.9) fits
    assert (log.sizes, log.wrapped) == ([11, 12, 10], 2)


def test_other_failures_are_not_retried(tuners):
    log = tuners.Log()

    def attempt(size: int, accum: int = 1):
        return tuners.Attempt(size, accum, False, False, "timeout after 600s", 0.0, None, 0)

    with pytest.raises(RuntimeError, match="timeout"):
        tuners.run_accelerate(tuners.oom_raiser(attempt, accelerate_predicate(), log))
    assert log.sizes == [128]


def test_rebuild_exception(tuners):
    import torch

    e = tuners.rebuild_exception(f"measured step: RuntimeError: {CPU_OOM}")
    assert type(e) is RuntimeError and e.args == (CPU_OOM,)
    assert type(tuners.rebuild_exception("warm-up step: OutOfMemoryError: x")) is (
        torch.OutOfMemoryError)
    assert type(tuners.rebuild_exception("warm-up step: MemoryError: x")) is MemoryError
    odd = "the weights, buffers and batch alone (5 bytes) exceed the cap (4 bytes)"
    assert tuners.rebuild_exception(odd).args == (odd,)


def test_first_failure_tries_every_size(tuners):
    tried = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= 7

    assert tuners.first_failure(fits) == 8
    assert tried == [1, 2, 3, 4, 5, 6, 7, 8]
    tried.clear()
    assert tuners.first_failure(fits, start=6) == 8
    assert tried == [6, 7, 8]


def test_true_max_both_steps(tuners):
    calls = []

    def attempt(size: int, accum: int = 1):
        calls.append((size, accum))
        ok = size <= (5 if accum > 1 else 7)  # held gradients cost two samples
        a = tuners.Attempt(size, accum, ok, not ok, None if ok else "x", 0.0, None, 0)
        return a, size == 7  # as if a tuner had measured 7 already

    t = tuners.true_max(attempt, 48)
    assert (t["accumulated"], t["plain"], t["allowed_accumulated"]) == (5, 7, 4)
    assert calls == [(1, 48), (2, 24), (3, 16), (4, 12), (5, 9), (6, 8),
                     (5, 1), (6, 1), (7, 1), (8, 1)]
    assert t["consistent"] and t["reused_plain"] == [7] and t["reused_accumulated"] == []


def test_device_reuses_a_measurement_of_the_same_step(tuners, tmp_path):
    dev = tuners.Device(tuners.SPECS[0], tmp_path, [])
    dev.record(tuners.Attempt(8, 6, True, False, None, None, 1, 3))
    a, reused = dev.cached(8, 3)  # any accumulation >= 2 runs the same two micro batches
    assert reused and a.accum == 6
    dev.attempt = lambda size, accum: tuners.Attempt(size, accum, True, False, None, 1.0, 1, 3)
    assert dev.cached(8, 1)[1] is False  # a plain step is another measurement


def test_dataset_is_skewed_and_seeded(tuners):
    spec = tuners.SPECS[0]
    data = tuners.make_dataset(spec)
    lengths = sorted(len(s["input_ids"]) for s in data)
    assert len(data) == spec.samples and lengths[-1] == spec.seq_max
    assert lengths[len(lengths) // 2] <= 64 and sum(x == spec.seq_max for x in lengths) >= 3
    assert data == tuners.make_dataset(spec)
    bert = next(s for s in tuners.SPECS if s.task == "seq-cls")
    assert {"input_ids", "label"} <= set(tuners.make_dataset(bert)[0])


def test_true_max_within_the_margin(tuners):
    # peak = 10 + 10 * size bytes (plain), +5 with accumulation; budget 75: accumulated 6
    # (65 + 5 = 70; 7 -> 85), plain 6 (70; 7 -> 80); cap: accumulated 8, plain 8
    def attempt(size: int, accum: int = 1):
        peak = 10 + 10 * size + (5 if accum > 1 else 0)
        ok = peak <= 95
        return tuners.Attempt(size, accum, ok, not ok, None if ok else "x", 0.0,
                              peak if ok else None, 3), False

    t = tuners.true_max(attempt, 48, budget=75)
    assert (t["accumulated"], t["plain"]) == (8, 8)
    assert (t["within_margin_accumulated"], t["within_margin_plain"]) == (6, 6)


def _row(tuners, name, micro, accum, *, margin=None, target=48, wall=10.0, fits=True):
    r = {"tuner": name, "attempts": 1, "ooms": 0, "steps": 3, "wall_s": wall, "micro": micro,
         "accum": accum, "effective": micro * accum, "kept": micro * accum == 48,
         "trials": [{"size": micro, "oom": False}], "margin": margin, "target": target}
    r["full_run"] = {"size": micro, "accum": accum, "fits": fits, "error": None,
                     "peak_bytes": 900 << 20}
    return r


def test_report_compares_each_run_with_what_it_may_choose(tuners):
    log = tuners.Log()
    peer = tuners.peer_row("accelerate find_executable_batch_size", log, 100.0, 9, 1, 48)
    truth = {"accumulated": 9, "plain": 10, "within_margin_accumulated": 8,
             "within_margin_plain": 9, "allowed_accumulated": 8, "consistent": True,
             "reused_accumulated": [], "reused_plain": [], "attempts_accumulated": [],
             "attempts_plain": [], "wall_s": 1.0, "budget_bytes": 1}
    rows = [_row(tuners, "autofit", 8, 6), _row(tuners, "autofit margin=0", 8, 6, margin=0.0),
            _row(tuners, "autofit, no target", 9, 1, target=None),
            _row(tuners, "autofit, no target, margin=0", 9, 1, margin=0.0, target=None,
                 fits=False), peer]
    for r in rows:
        r["true_max"] = 10
    model = {"spec": {"name": "m", "target": 48, "cap": "cpu:1GiB", "profile": "p",
                      "config": {"architectures": ["X"]}},
             "params": 1e6, "cap_bytes": 1 << 30, "truth": truth, "rows": rows,
             "lengths": {"n": 1, "median": 1, "p90": 1, "max": 1, "at_max": 1}}
    model["summary"] = tuners.summarise(model)
    by = {r["tuner"]: r for r in model["summary"]["rows"]}
    assert by["autofit"]["reference"] == 8  # largest divisor of 48 within the margin
    assert by["autofit margin=0"]["reference"] == 8  # largest divisor of 48 that fits (9)
    assert by["autofit, no target"]["reference"] == 9  # plain, within the margin
    assert by["autofit, no target, margin=0"]["reference"] == 10
    assert by["autofit, no target, margin=0"]["choice_vs_reference"] == 0.9
    assert by["autofit"]["wall_vs_fastest_peer"] == 0.1
    md = tuners.markdown({"command": "c", "date": "d", "machine": "x", "versions": "v",
                          "wall_s": 60.0, "recognition_probe": {}, "models": [model]})
    assert "- m, autofit: choice ≥ 95% of the largest it may choose: **met**" in md
    assert ("- m, autofit, no target, margin=0: choice ≥ 95% of the largest it may choose: "
            "**not met**") in md
    assert "full run without OOM: **not met**" in md
