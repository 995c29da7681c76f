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
    from autofit.memory.analytic import estimate_analytic
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


def test_dry_run_writes_every_result(tmp_path):
    names = f"{gpu_check.MATRIX[0].name},{gpu_check.MATRIX[3].name}"  # llama (1B -> micro), gpt2
    code = gpu_check.main(["--dry-run", "--names", names, "--no-oom-check", "--out",
                           str(tmp_path)])
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
    assert "Skipped:" in (tmp_path / "gpu_check.md").read_text()


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
