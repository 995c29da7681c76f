"""Reports: FitResult.report() and `autofit report` write a real PNG and a self-contained HTML."""

from __future__ import annotations

import json
import re
import struct

import pytest

from autofit import TrainConfig, estimate
from autofit.cli import main

GiB = 1 << 30
DEVICE = "cpu:4GiB"


def _trial(micro, total=None, tps=None, *, oom=False, precision="32-true"):
    from autofit.trial import TrialResult

    return TrialResult(
        oom=oom, peak_allocated_bytes=total, peak_reserved_bytes=total, device_total_bytes=total,
        step_time_s=None if oom else 1.0, tokens_per_s=tps, samples_per_s=None,
        error="DefaultCPUAllocator: can't allocate memory" if oom else None,
        config=TrainConfig(micro_batch_size=micro, grad_accum_steps=16 // micro,
                           precision=precision, seq_len=128).to_dict(),
        device=DEVICE, batch_shape=(micro, 128), isolation="subprocess", isolation_reason="",
        steps=0 if oom else 2, capacity_bytes=4 * GiB)


def _row(precision, micro, est, measured=None, pred=None, meas=None, status="estimated"):
    return {"precision": precision, "gradient_checkpointing": False, "optimizer": "adamw_torch",
            "micro_batch": micro, "status": status, "estimate_bytes": est,
            "measured_bytes": measured, "predicted_tokens_per_s": pred,
            "measured_tokens_per_s": meas, "calibration": None, "failed_micro_batch": None,
            "reason": ""}


@pytest.fixture()
def result():
    from autofit.emit import training_arguments_dict
    from autofit.result import FitResult

    config = TrainConfig(micro_batch_size=4, grad_accum_steps=4, seq_len=128)
    est = estimate("tiny-llama", config, seq_len=128, device=DEVICE)
    kwargs = training_arguments_dict(config, use_cpu=True) | {"per_device_eval_batch_size": 16}
    trials = (_trial(8, oom=True), _trial(4, int(3.1 * GiB), 900.0),
              _trial(8, int(3.3 * GiB), 1400.0, precision="bf16-mixed"),
              _trial(16, oom=True, precision="bf16-mixed"))
    rows = (_row("32-true", 4, int(3.0 * GiB), int(3.1 * GiB), 1000.0, 900.0, "confirmed"),
            _row("bf16-mixed", 8, int(3.2 * GiB), int(3.3 * GiB), 1500.0, 1400.0, "confirmed"))
    return FitResult(config=config, estimate=est, trials=trials,
                     reasons=("chosen: fastest measured", "margin: 10% <kept> & free"),
                     confirmed=True, device=DEVICE, candidates=rows,
                     training_arguments_kwargs=kwargs,
                     meta={"model": "tiny-llama", "task": "causal-lm", "seq_len": 128,
                           "device": DEVICE, "margin": 0.1},
                     eval_micro_batch=16)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height, len(data)


def _check_files(png, page):
    w, h, n = _png_size(png)
    assert w >= 1000 and h >= 400 and n > 20_000
    from PIL import Image

    with Image.open(png) as im:
        im.verify()
    text = page.read_text()
    srcs = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", text)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)  # no external asset
    assert "<script" not in text
    for needle in ("Memory breakdown", "optimizer_states", "Candidates", "Trials on the device",
                   "OUT OF MEMORY", "per_device_eval_batch_size", "Reasons"):
        assert needle in text, needle
    return text


def test_fit_result_report_writes_png_and_html_beside_the_config(tmp_path, result):
    png, page = result.report(tmp_path / "tuned.yaml")
    assert png == tmp_path / "tuned.png" and page == tmp_path / "tuned.html"
    text = _check_files(png, page)
    assert "margin: 10% &lt;kept&gt; &amp; free" in text  # escaped


def test_report_default_path(tmp_path, result, monkeypatch):
    monkeypatch.chdir(tmp_path)
    png, page = result.report()
    assert png.name == "autofit-report.png" and page.name == "autofit-report.html"
    assert png.is_file() and page.is_file()


def test_cli_report_from_a_saved_file(tmp_path, result, capsys):
    path = result.save(tmp_path / "tuned.yaml")
    code = main(["report", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    for word in ("optimizer_states", "device total", "B/param", "wrote"):
        assert word in out
    _check_files(tmp_path / "tuned.png", tmp_path / "tuned.html")
    code = main(["report", str(path), "-o", str(tmp_path / "sub" / "other.yaml")])
    assert code == 0 and (tmp_path / "sub" / "other.png").is_file()


def test_saved_file_stays_pure_training_arguments(tmp_path, result):
    from transformers import HfArgumentParser, TrainingArguments

    from autofit.emit import read_config

    path = result.save(tmp_path / "tuned.yaml")
    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(path))
    assert args.per_device_train_batch_size == 4 and args.per_device_eval_batch_size == 16
    fields, meta = read_config(path)
    assert len(meta["candidates"]) == 2 and len(meta["trials"]) == 4
    assert meta["trials"][0]["oom"] is True and meta["eval_micro_batch"] == 16
    assert meta["estimate"]["peak_phase"] and "headroom_bytes" not in meta["estimate"]


def test_report_from_an_older_file_draws_the_breakdown(tmp_path, capsys):
    meta = {"model": "tiny-llama", "seq_len": 64, "device": "cpu:2GiB", "margin": 0.1,
            "config": TrainConfig(micro_batch_size=8).to_dict(),
            "estimate": {"peak_allocated_bytes": 841031680, "peak_reserved_bytes": 841031680,
                         "device_total_bytes": 841031680, "capacity_bytes": 2 * GiB,
                         "breakdown": {"weights": 177489920, "gradients": 177489920,
                                       "optimizer_states": 354979840, "activations": 0,
                                       "temporaries": 131072000, "overhead": 0},
                         "method": "analytic"}}
    path = tmp_path / "old.yaml"
    path.write_text("# autofit: " + json.dumps(meta) + "\nper_device_train_batch_size: 8\n")
    assert main(["report", str(path)]) == 0
    w, h, n = _png_size(tmp_path / "old.png")
    assert w >= 1000 and n > 10_000
    assert "temporaries" in capsys.readouterr().out


def test_report_needs_autofit_metadata(tmp_path, capsys):
    path = tmp_path / "plain.yaml"
    path.write_text("per_device_train_batch_size: 8\n")
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no autofit metadata" in err and len(err.strip().splitlines()) == 1


def test_candidates_table_fits_80_columns_with_reasons_as_notes(result):
    from dataclasses import replace

    from rich.console import Console

    from autofit.report import candidates_renderable

    rejected = _row("bf16-mixed", None, None, status="rejected") | {
        "optimizer": "adamw_torch_fused", "failed_micro_batch": 2,
        "reason": "micro batch 2 did not fit in a trial; micro batch 1 is estimated at 3.9 GiB "
                  "(calibrated by the trials) > budget 3.6 GiB"}
    r = replace(result, candidates=(*result.candidates, rejected))
    console = Console(width=80, record=True, color_system=None)
    console.print(candidates_renderable(r))
    lines = console.export_text().splitlines()
    assert all(len(x) <= 80 for x in lines)
    assert not any("…" in x for x in lines), "\n".join(lines)  # nothing cut
    i = next(i for i, x in enumerate(lines) if "rejected" in x)
    assert "2✗" in lines[i] and "[1]" in lines[i] + lines[i + 1]  # the verdict may fold
    assert any(x.startswith("[1] micro batch 2 did not fit") for x in lines)
