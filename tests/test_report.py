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


def test_report_of_a_plain_file_without_a_model_says_what_to_give(tmp_path, capsys):
    path = tmp_path / "plain.yaml"
    path.write_text("per_device_train_batch_size: 8\n")
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert "give --model" in err and len(err.strip().splitlines()) == 1
    assert main(["report", str(path), "--model", "tiny-llama"]) == 2  # and a length
    assert "--seq-len" in capsys.readouterr().err


@pytest.mark.parametrize("chunked", [False, True])  # True: a chunk column is shown too
def test_candidates_table_fits_80_columns_with_reasons_as_notes(result, chunked):
    from dataclasses import replace

    from rich.console import Console

    from autofit.report import candidates_renderable

    rejected = _row("bf16-mixed", None, None, status="rejected") | {
        "optimizer": "adamw_torch_fused", "failed_micro_batch": 2, "chunked_loss": chunked,
        "reason": "micro batch 2 did not fit in a trial; micro batch 1 is estimated at 3.9 GiB "
                  "(calibrated by the trials) > budget 3.6 GiB"}
    r = replace(result, candidates=(*result.candidates, rejected))
    console = Console(width=80, record=True, color_system=None)
    console.print(candidates_renderable(r))
    lines = console.export_text().splitlines()
    assert all(len(x) <= 80 for x in lines)
    assert not any("…" in x for x in lines), "\n".join(lines)  # nothing cut
    i = next(i for i, x in enumerate(lines) if "rejected" in x)
    assert "2✗" in lines[i] + lines[i + 1] and "[1]" in lines[i] + lines[i + 1]  # may fold
    assert any(x.startswith("[1] micro batch 2 did not fit") for x in lines)
    assert any(x.split()[:1] == ["precision"] and ("loss" in x) == chunked for x in lines)
    assert any("chnk" in x for x in lines) == chunked


def test_candidates_table_shows_the_estimate_before_calibration(result):
    # a confirmed row reads "estimated 3.00 GiB, x1.03, measured 3.10 GiB", not "3.10 / 3.10"
    from dataclasses import replace

    from rich.console import Console

    from autofit.report import candidates_renderable

    rows = tuple(r | {"calibration": r["measured_bytes"] / r["estimate_bytes"]}
                 for r in result.candidates)
    console = Console(width=120, record=True, color_system=None)
    console.print(candidates_renderable(replace(result, candidates=rows)))
    text = console.export_text()
    line = next(x for x in text.splitlines() if "CHOSEN" in x)
    assert "3.00 GiB" in line and "×1.03" in line and "3.10 GiB" in line
    assert "cal." in text


def test_chart_keeps_one_style_per_combination_and_the_legend_off_the_bars(result):
    # twelve combinations: twelve distinct (colour, marker) pairs, the same in both panels;
    # no legend covers a bar or its label in the breakdown panel
    from dataclasses import replace

    from autofit.report.files import _figure, combo_styles, report_data_from_result

    keys = [(p, c, o) for p in ("32-true", "bf16-mixed", "16-mixed") for c in (False, True)
            for o in ("adamw_torch", "adamw_torch_fused")]
    styles = combo_styles(keys)
    assert len(keys) == 12 and len(set(styles.values())) == 12
    rows = tuple(_row(p, 2, GiB, pred=100.0) | {"gradient_checkpointing": c, "optimizer": o}
                 for p, c, o in keys)
    fig = _figure(report_data_from_result(replace(result, candidates=rows)))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legends = [ax.get_legend(), *fig.legends]
    boxes = [a.get_window_extent(renderer) for a in (*ax.patches, *ax.texts)]
    assert boxes
    for leg in legends:
        lb = leg.get_window_extent(renderer)
        assert not any(lb.overlaps(b) for b in boxes), "a legend covers the bars"
    for panel in fig.axes[1:3]:  # the combination legend is outside both candidate panels
        for leg in fig.legends:
            assert not leg.get_window_extent(renderer).overlaps(panel.get_window_extent(renderer))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(set(labels)) == len(labels) and len(labels) >= 12


def test_report_of_a_plain_training_arguments_file(tmp_path, capsys):
    # a TrainingArguments file autofit did not write: --model/--seq-len/--device say what it
    # trains (as for `autofit check`); the breakdown is that configuration's estimate
    path = tmp_path / "train_args.yaml"
    path.write_text("output_dir: out\nper_device_train_batch_size: 4\n"
                    "gradient_accumulation_steps: 2\nactivation_checkpointing: true\n")
    assert main(["report", str(path)]) == 2
    assert "give --model" in capsys.readouterr().err
    assert main(["report", str(path), "--model", "tiny-llama", "--seq-len", "128",
                 "--device", "cpu:2GiB"]) == 0
    out = capsys.readouterr().out
    want = estimate("tiny-llama", TrainConfig(micro_batch_size=4, grad_accum_steps=2,
                                              gradient_checkpointing=True, seq_len=128),
                    seq_len=128, device="cpu:2GiB")
    from autofit.probe.device import format_bytes

    assert format_bytes(want.device_total_bytes) in out and "checkpointing" in out
    w, h, n = _png_size(tmp_path / "train_args.png")
    assert w >= 1000 and n > 10_000
    page = (tmp_path / "train_args.html").read_text()
    assert "no trial" in page and "Memory breakdown" in page


def test_saved_checkpointing_file_loads_without_a_deprecation_warning(tmp_path, result):
    # transformers 5.x renamed gradient_checkpointing to activation_checkpointing; the old
    # name (and a user's to_dict(), which holds both) must not reach the file
    import warnings
    from dataclasses import replace

    from transformers import HfArgumentParser, TrainingArguments

    from autofit.emit import training_arguments_dict

    config = result.config.replace(gradient_checkpointing=True)
    user = TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True,
                             learning_rate=3e-4).to_dict()
    kwargs = training_arguments_dict(config, base=user, use_cpu=True)
    r = replace(result, config=config, training_arguments_kwargs=kwargs)
    path = r.save(tmp_path / "tuned.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(path))
    assert args.gradient_checkpointing is True and args.learning_rate == 3e-4
    text = path.read_text()
    if "activation_checkpointing" in TrainingArguments.__dataclass_fields__:
        assert "\ngradient_checkpointing" not in text and "activation_checkpointing: true" in text
