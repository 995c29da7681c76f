"""benchmarks/gpu_check.py: its matrix, and its whole pipeline on the CPU (dry run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
GiB = 1 << 30


def _load():
    spec = importlib.util.spec_from_file_location("_bench_gpu_check", BENCH / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def test_matrix_has_the_required_coverage():
    m = gpu_check.MATRIX
    assert len(m) >= 12
    assert len({s.name for s in m}) == len(m)
    assert {"tiny-llama", "tiny-gpt2", "meta-llama/Llama-3.2-1B"} <= {s.model for s in m}
    assert {"32-true", "bf16-mixed", "bf16-true"} <= {s.precision for s in m}
    assert {True, False} == {s.gradient_checkpointing for s in m}
    assert {"adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit"} <= {s.optimizer for s in m}
    assert any(s.lora for s in m if s.model == "meta-llama/Llama-3.2-1B")
    assert all(s.lora is None for s in m if "gpt2" in s.model)
    assert all(512 <= s.seq <= 2048 for s in m)
    assert all(s.seq <= 1024 for s in m if "gpt2" in s.model)  # GPT-2's n_positions
    # every 1B precision is measured without the optional packages too
    plain_1b = [s for s in m if s.model.endswith("1B") and not s.needs()]
    assert {"32-true", "bf16-mixed", "bf16-true"} <= {s.precision for s in plain_1b}
    # a run cut short by the time guard has covered each model and precision early
    first = m[:6]
    assert {s.model for s in first} == {s.model for s in m}
    assert {s.precision for s in first} >= {"32-true", "bf16-mixed", "bf16-true"}


def test_matrix_peaks_are_between_1_and_60_gib_on_the_h200():
    from autofit import TrainConfig
    from autofit.memory.ranks import estimate_analytic
    from autofit.probe.device import resolve_device
    from autofit.probe.model import LoraSpec, build_model, describe

    h200 = resolve_device("H200")
    infos = {}  # one meta build per (model, LoRA)
    for s in gpu_check.MATRIX:
        key = (s.model, bool(s.lora))
        if key not in infos:
            module, task = build_model(s.model, lora=LoraSpec(**s.lora) if s.lora else None)
            infos[key] = describe(module, task=task, name=s.model)
        cfg = TrainConfig(micro_batch_size=s.batch, precision=s.precision,
                          gradient_checkpointing=s.gradient_checkpointing, optimizer=s.optimizer)
        est = estimate_analytic(infos[key], cfg, s.seq, h200)
        assert 1 * GiB <= est.device_total_bytes <= 60 * GiB, (s.name, est.device_total_bytes)


@pytest.mark.slow
def test_dry_run_writes_every_result(tmp_path):
    names = f"{gpu_check.MATRIX[0].name},{gpu_check.MATRIX[3].name}"  # llama (1B -> micro), gpt2
    code = gpu_check.main(["--dry-run", "--names", names, "--no-oom-check", "--no-soak",
                           "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    assert data["finished"] and data["mode"].startswith("dry-run")
    env = data["environment"]
    assert env["versions"]["torch"] and env["versions"]["transformers"]
    assert env["device_info"]["kind"] == "cpu"
    assert [r["model"] for r in data["rows"]] == ["micro-llama", "micro-gpt2"]
    for r in data["rows"]:
        assert (r["batch"], r["seq"]) == (gpu_check.DRY_BATCH, gpu_check.DRY_SEQ)
        m = r["measured"]
        assert m.get("error") is None, m
        assert m["peak_allocated_bytes"] > m["weights_bytes"] > 0
        assert m["loss_finite"] and len(m["step_times_s"]) == 2
        assert set(m["segments"]) == {"step1", "forward", "backward", "optimizer"}
        for method in ("simulate", "analytic"):
            e = r[method]
            assert e["peak_allocated_bytes"] > 0 and e["device_total_bytes"] > 0
            assert abs(e["allocated_err"]) < 1.0  # a sane ratio, not an accuracy claim
            assert {"reserved_err", "total_err", "peak_phase"} <= set(e)
    assert {"simulate_allocated", "analytic_total"} <= set(data["summary"])
    assert data["rows"][0]["name"] in md and "| config |" in md


def test_time_guard_and_missing_packages_skip_with_a_note(tmp_path, monkeypatch):
    bnb = next(s for s in gpu_check.MATRIX if "bitsandbytes" in s.needs())
    plain = gpu_check.MATRIX[1]
    monkeypatch.setattr(gpu_check, "_missing", lambda spec: spec.needs()[:1])
    code = gpu_check.main(["--dry-run", "--names", f"{bnb.name},{plain.name}", "--guard-s", "0",
                           "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    reasons = {s["name"].split("-dry-")[0]: s["reason"] for s in data["skipped"]}
    assert "bitsandbytes not installed" in reasons[bnb.name.rsplit("-b", 1)[0]]
    assert reasons[plain.name.rsplit("-b", 1)[0]].startswith("time guard")
    assert data["rows"][0]["measured"]["error"] == "skipped: time guard"
    assert data["rows"][0]["simulate"]["error"] == "skipped: time guard"
    assert data["oom_check"]["error"].startswith("skipped: time guard")
    assert len(data["soak"]) == len(gpu_check.gpu_soak.SOAKS)
    for r in data["soak"]:
        assert r["measured"]["error"] == "skipped: time guard"
        assert r["predicted"]["error"] == "skipped: time guard"
        assert reasons[r["name"].split("-dry-")[0]].startswith("time guard")
    assert "Skipped:" in (tmp_path / "gpu_check.md").read_text()


def test_soaks_are_one_epoch_of_max_steps_and_several_gib_on_the_h200():
    from autofit import TrainConfig
    from autofit.memory.ranks import estimate_analytic
    from autofit.probe.device import resolve_device
    from autofit.probe.model import build_model, describe
    from autofit.probe.run import run_order

    soak = gpu_check.gpu_soak
    h200 = resolve_device("H200")
    assert len({s.name for s in soak.SOAKS}) == len(soak.SOAKS) >= 2
    assert {1, 4} <= {s.accumulation for s in soak.SOAKS}
    assert {"tiny-llama", "tiny-gpt2"} <= {s.model for s in soak.SOAKS}
    for s in soak.SOAKS:
        lengths = soak.sample_lengths(s.samples, s.seq, s.data_seed)
        assert max(lengths) == s.seq and min(lengths) >= 2  # the longest batch is seq tokens
        kw = dict(micro_batch_size=s.batch, grad_accum_steps=s.accumulation, seed=soak.SOAK_SEED)
        # the Trainer's max_steps run is one epoch: estimate(epochs=1) replays the same order
        by_steps = run_order(lengths, max_steps=s.steps, **kw)
        by_epoch = run_order(lengths, epochs=1.0, **kw)
        assert by_steps == by_epoch and len(by_epoch.steps) == s.steps
        assert s.eval_steps < s.steps and s.save_steps <= s.steps
        module, task = build_model(s.model)
        cfg = TrainConfig(micro_batch_size=s.batch, grad_accum_steps=s.accumulation,
                          precision=s.precision, optimizer=s.optimizer)
        est = estimate_analytic(describe(module, task=task, name=s.model), cfg, s.seq, h200)
        assert 2 * GiB <= est.device_total_bytes <= 60 * GiB, (s.name, est.device_total_bytes)


def test_soak_growth_is_attributed_to_steps_evals_and_saves():
    steps = [{"max_reserved": v} for v in (10, 12, 12, 15, 15)]
    events = [{"kind": "eval", "step": 2, "max_reserved": 13},
              {"kind": "save", "step": 4, "max_reserved": 15},
              {"kind": "eval", "step": 5, "max_reserved": 16}]
    g = gpu_check.gpu_soak.growth(4, steps, events)
    assert g["growth_by_kind"] == {"step": 6 + 2 + 2, "eval": 1 + 1, "save": 0}
    assert g["converged_step"] == 4 and g["last_growth"] == "eval 5"


def test_dry_soak_measures_a_trainer_run_in_the_order_autofit_replays(tmp_path):
    """The soak child in this process (one Trainer run of a micro model, ~10 s); the
    prediction itself (fake-tensor simulations, ~1 min here) is the slow test's."""
    import dataclasses

    import torch

    from autofit.probe.run import run_order

    soak = gpu_check.gpu_soak
    spec = soak.dry_soak(soak.SOAKS[1], gpu_check.dry_models_dir(tmp_path))  # accumulation 4
    assert (spec.batch, spec.seq, spec.steps, spec.accumulation) == (2, 64, 8, 4)
    threads = torch.get_num_threads()
    try:
        m = soak.run_soak_child(dataclasses.asdict(spec), "cpu",
                                gpu_check._read_config(spec.model))
    finally:
        torch.set_num_threads(threads)
    assert m["error"] is None, m
    assert m["steps_done"] == spec.steps and len(m["by_step"]["max_reserved"]) == spec.steps
    assert m["order_sizes"] == [spec.batch] * (spec.steps * spec.accumulation)
    assert [(e["kind"], e["step"]) for e in m["events"]] == [("eval", 4), ("eval", 8),
                                                              ("save", 8)]
    assert m["checkpoints"] == ["checkpoint-8"] and m["loss_finite"]
    assert m["empty_cache_calls_during_run"] == 0
    longest = max(m["order_lengths"])
    assert m["alone_lengths"] == [longest] * (2 * spec.accumulation)
    assert m["run_peak_reserved_bytes"] > 0 and m["step_peak_reserved_bytes"] is not None
    assert m["over_the_run_bytes"] == m["run_peak_reserved_bytes"] - m["step_peak_reserved_bytes"]
    assert 1 <= m["converged_step"] <= spec.steps

    # the order estimate(dataset=..., epochs=1, seed=42) replays is the one the Trainer fed
    lengths = [len(s["input_ids"]) for s in soak.soak_samples(spec)]
    order = run_order(lengths, micro_batch_size=spec.batch, grad_accum_steps=spec.accumulation,
                      epochs=1.0, seed=soak.SOAK_SEED)
    assert list(order.lengths) == m["order_lengths"] and len(order.steps) == spec.steps
    predicted = {"order_lengths": list(order.lengths), "steps": len(order.steps),
                 "run_peak_reserved_bytes": 2 * m["run_peak_reserved_bytes"],
                 "peak_reserved_bytes": m["step_peak_reserved_bytes"] or 1,
                 "over_the_run_bytes": 0}
    row = {**soak.soak_row(spec), "measured": m, "predicted": predicted}
    soak.compare(row)
    assert row["compare"]["order_matches"] and row["compare"]["steps_match"]
    assert row["compare"]["run_peak_reserved_err"] == pytest.approx(1.0)
    md = "\n".join(soak.markdown([row], cuda=False))
    assert spec.name in md and "| same |" in md and "+100.0%" in md


@pytest.mark.slow  # 3-8 min on a busy 2-core machine: the whole dry run of the soak (three
# Trainer children, three prediction children)
def test_dry_run_soak_writes_its_rows(tmp_path):
    code = gpu_check.main(["--dry-run", "--soak-only", "--budget-s", "1500", "--guard-s",
                           "1400", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["finished"] and data["rows"] == [] and data["oom_check"] is None
    assert len(data["soak"]) == len(gpu_check.gpu_soak.SOAKS)
    for r in data["soak"]:
        m, p, c = r["measured"], r["predicted"], r["compare"]
        assert m.get("error") is None, m
        assert "error" not in p, p
        assert m["steps_done"] == p["steps"] == r["steps"]
        assert c["order_matches"] and c["run_peak_reserved_err"] is not None
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## Whole-run soak" in md and data["soak"][0]["name"] in md


@pytest.mark.slow  # ~20 s: a child, four trials and one more child
def test_oom_check_runs_on_a_capped_cpu():
    r = gpu_check._run_json_child(["--oom-child", "--device", "cpu", "--oom-method", "analytic"],
                                  "cpu", 120.0)
    assert r.get("error") is None, r
    checks = r["checks"]
    assert checks["oom_reported"] and checks["recovered_reported"]
    assert checks["allocated_back_at_baseline"] and checks["fit_after_oom"]
    assert r["passed"] and not r["peak_check_required"]
    roles = [t["role"] for t in r["trials"]]
    assert roles[0] == "warm" and "over" in roles and roles[-2:] == ["fit", "fresh"]
    assert r["measured_boundary"]["oom"] == r["measured_boundary"]["fits"] + 1


@pytest.mark.gpu
def test_one_config_on_the_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = gpu_check.MATRIX[1]  # tiny-llama, 32-true
    res = gpu_check._run_json_child(["--child", json.dumps(gpu_check.asdict(spec)), "--device",
                                     "cuda"], "cuda", 300.0)
    assert res.get("error") is None, res
    assert res["peak_reserved_bytes"] >= res["peak_allocated_bytes"] > res["weights_bytes"]
    assert res["device_used_bytes"] > res["peak_reserved_bytes"]


@pytest.mark.gpu
def test_oom_boundary_and_recovery_on_the_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    r = gpu_check._run_json_child(["--oom-child", "--device", "cuda"], "cuda", 300.0)
    assert r.get("error") is None, r
    assert r["passed"] and r["peak_check_required"], r["checks"]
