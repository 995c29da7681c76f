"""The command line: exit codes, JSON keys, one-line errors (run in-process and as a script)."""

import json
import subprocess
import sys

import pytest

from autofit.cli import main

JSON_KEYS = {"peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "breakdown",
             "method", "fits", "capacity_bytes"}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_human_output(capsys):
    code, out, _ = run(capsys, "estimate", "tiny-llama", "--batch-size", "2", "--seq-len", "128",
                       "--device", "cpu")
    assert code == 0
    for word in ("weights", "gradients", "optimizer_states", "activations", "temporaries",
                 "overhead", "B/param", "fits on cpu", "headroom"):
        assert word in out


def test_estimate_json_keys(capsys):
    code, out, _ = run(capsys, "estimate", "tiny-gpt2", "--batch-size", "2", "--seq-len", "64",
                       "--precision", "bf16-mixed", "--device", "A100-80GB", "--json")
    d = json.loads(out)
    assert code == 0 and set(d) >= JSON_KEYS
    assert set(d["breakdown"]) == {"weights", "gradients", "optimizer_states", "activations",
                                   "temporaries", "overhead"}
    assert sum(d["breakdown"].values()) == d["device_total_bytes"]
    assert d["fits"] is True and d["method"] == "analytic"


def test_does_not_fit_exits_3(capsys):
    code, out, _ = run(capsys, "estimate", "meta-llama/Llama-3.1-8B", "--batch-size", "8",
                       "--seq-len", "4096", "--device", "T4", "--precision", "16-mixed", "--json")
    assert code == 3 and json.loads(out)["fits"] is False


def test_lora_and_checkpointing_options(capsys):
    code, out, _ = run(capsys, "estimate", "tiny-llama", "--batch-size", "2", "--seq-len", "128",
                       "--lora-r", "8", "--lora-target-modules", "q_proj", "v_proj",
                       "--gradient-checkpointing", "--optim", "sgd", "--optim-args",
                       "momentum=0.9", "--json", "--device", "cpu")
    d = json.loads(out)
    assert code == 0 and d["trainable_params"] == 4 * (8 * 512 * 2 + 512 * 8 + 256 * 8)
    assert d["config"]["gradient_checkpointing"] is True


@pytest.mark.parametrize("argv,needle", [
    (["estimate", "no-such/model-xyz", "--batch-size", "1", "--seq-len", "8"], "cannot load model"),
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8", "--task", "nope"], "unknown task"),
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8", "--precision", "bf17"], "unknown precision"),
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8", "--optim", "adam"], "unknown optimizer"),
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8", "--device", "H1000"], "unknown device"),
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8", "--device", "T4",
      "--precision", "bf16-mixed"], "does not support bf16"),
    (["estimate", "tiny-llama", "--batch-size", "0", "--seq-len", "8"], "micro_batch_size"),
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "0"], "seq_len"),
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "-4"], "seq_len"),
    (["estimate", "tiny-llama", "--seq-len", "8"], "--batch-size"),
    (["estimate", "tiny-llama", "--batch-size", "x", "--seq-len", "8"], "invalid int"),
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8", "--device", "A100-80GB",
      "--torch-compile-mode", "reduce-overhead"], "captures CUDA graphs"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit) if "--batch-size" not in argv or "x" in argv else _nullcontext():
        code, out, err = run(capsys, *argv)
        assert code == 2
        assert needle in err and err.count("\n") == 1 and "Traceback" not in err


_Q = ["tiny-llama", "--batch-size", "1", "--seq-len", "8", "--device", "cpu"]


@pytest.mark.parametrize("argv,needle", [
    (["estimate", *_Q, "--load-in-4bit", "--load-in-8bit"], "not allowed with argument"),
    (["measure", *_Q, "--load-in-4bit", "--load-in-8bit"], "not allowed with argument"),
    (["tune", "tiny-llama", "--dataset", "tiny-samples", "--load-in-8bit", "--load-in-4bit"],
     "not allowed with argument"),
    (["compare-peft", "tiny-llama", "--seq-len", "8", "--load-in-8bit", "--load-in-4bit"],
     "not allowed with argument"),
    (["estimate", *_Q, "--bnb-4bit-quant-type", "nf4"], "add --load-in-4bit"),
    (["estimate", *_Q, "--load-in-8bit", "--bnb-4bit-use-double-quant"],
     "--bnb-4bit-use-double-quant applies to 4-bit bases"),
    (["measure", *_Q, "--load-in-8bit", "--bnb-4bit-quant-type", "fp4"],
     "--bnb-4bit-quant-type applies to 4-bit bases"),
    (["compare-peft", "tiny-llama", "--seq-len", "8", "--bnb-4bit-use-double-quant"],
     "add --load-in-4bit"),
    (["estimate", *_Q, "--bnb-4bit-quant-type", "int4", "--load-in-4bit"], "invalid choice"),
    (["estimate", *_Q, "--load-in-8bit", "--quantization-config", '{"load_in_4bit": true}'],
     "--load-in-8bit disagrees"),
    (["estimate", *_Q, "--quantization-config", '{"load_in_4bit": true, "bits": 4}'],
     "unknown key(s) bits"),
    (["estimate", *_Q, "--quantization-config", "{nope"], "not valid JSON"),
    (["estimate", *_Q, "--quantization-config", "/no/such.json"], "neither a JSON file"),
    (["estimate", *_Q, "--load-in-4bit", "--bnb-4bit-compute-dtype", "fp32", "--precision",
      "bf16-true"], "cannot be cast"),
])
def test_bad_quantization_options_exit_2_with_one_line(capsys, argv, needle):
    try:
        code, _, err = run(capsys, *argv)
    except SystemExit as e:  # argparse: usage errors
        code, err = e.code, capsys.readouterr().err
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_quantization_options_reach_the_estimate(capsys):
    def weights(*extra):
        code, out, _ = run(capsys, "estimate", *_Q, "--json", *extra)
        assert code == 0, out
        return json.loads(out)["breakdown"]["weights"]

    eight = weights("--load-in-8bit")
    nf4 = weights("--load-in-4bit", "--bnb-4bit-compute-dtype", "fp32")
    dq = weights("--load-in-4bit", "--bnb-4bit-compute-dtype", "fp32",
                 "--bnb-4bit-use-double-quant")
    same = weights("--quantization-config", '{"load_in_4bit": true, "bnb_4bit_quant_type": '
                   '"nf4", "bnb_4bit_compute_dtype": "float32", '
                   '"bnb_4bit_use_double_quant": true}')
    assert nf4 < eight and dq < nf4 and same == dq


@pytest.mark.half
def test_a_tuned_quantized_base_is_checked_with_it(tmp_path, capsys, monkeypatch):
    """The tuned file records how the base was quantized; `autofit check` rebuilds the same
    quantized base (its estimate, its identity)."""
    from autofit import autofit
    from autofit.emit import read_config
    from autofit.preflight.cache import model_identity

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    data = [{"input_ids": [(7 * i + j) % 500 + 1 for j in range(40 + i)]} for i in range(24)]
    result = autofit("tiny-llama", data, device="A100-80GB", target_batch_size=8,
                     lora={"r": 8}, load_in_4bit=True)
    path = result.save(tmp_path / "tuned.yaml")
    _, meta = read_config(path)
    assert meta["quantization"]["bnb_4bit_quant_type"] == "nf4"
    assert meta["model_id"] == model_identity("tiny-llama", meta["adapter"],
                                              meta["quantization"])
    assert meta["model_id"] != model_identity("tiny-llama", meta["adapter"])
    code, out, _ = run(capsys, "check", str(path), "--device", "A100-80GB", "--no-cache",
                       "--json")
    d = json.loads(out)
    assert code == 0 and d["fits"] is True
    assert d["estimate"]["breakdown"]["weights"] == result.estimate.breakdown["weights"]
    # an edited record is refused in one line
    text = path.read_text().replace('"load_in_4bit":true', '"load_in_4bit":false')
    path.write_text(text)
    code, _, err = run(capsys, "check", str(path), "--device", "A100-80GB", "--no-cache")
    assert code == 2 and "quantization" in err and err.count("\n") == 1


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_no_trainable_parameters_message(tmp_path, capsys):
    # LoRA targeting a module that does not exist leaves nothing trainable -> peft raises;
    # the user sees one line, not a traceback
    code, _, err = run(capsys, "estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8",
                       "--lora-target-modules", "nonexistent_proj")
    assert code == 2 and "not found" in err and err.count("\n") == 1


def test_8bit_optimizer_without_bitsandbytes(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    code, _, err = run(capsys, "estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8",
                       "--optim", "adamw_bnb_8bit")
    assert code == 2 and "pip install 'autofit[bnb]'" in err


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "autofit", "estimate", "tiny-bert", "--batch-size",
                        "2", "--seq-len", "64", "--device", "cpu", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout)) >= JSON_KEYS
    r = subprocess.run([sys.executable, "-m", "autofit", "estimate", "tiny-bert", "--batch-size",
                        "2", "--seq-len", "64", "--device", "nope"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_tune_plans_for_a_card_and_writes_a_loadable_file(tmp_path, capsys, monkeypatch):
    from transformers import HfArgumentParser, TrainingArguments

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "tuned.yaml"
    code, stdout, _ = run(capsys, "tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device",
                          "A100-80GB", "--target-batch-size", "32", "-o", str(out))
    assert code == 0 and out.is_file()
    assert "UNCONFIRMED" in stdout and "candidates" in stdout
    text = out.read_text()
    assert "bf16: true" in text and "# autofit: " in text
    # bf16 cannot be built here without a GPU: load the fields on the target instead
    import yaml

    fields = yaml.safe_load(text)
    assert fields["per_device_train_batch_size"] * fields["gradient_accumulation_steps"] == 32
    fields.pop("bf16")
    fields["use_cpu"] = True
    (tmp_path / "cpu.yaml").write_text(yaml.safe_dump(fields))
    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(tmp_path / "cpu.yaml"))
    assert args.per_device_train_batch_size == fields["per_device_train_batch_size"]


def test_tune_plans_lora_for_a_card(tmp_path, capsys, monkeypatch):
    # full fine-tuning of a 1B model does not fit a T4 and says what would; the QLoRA it
    # suggests is then planned with the same command plus the two flags
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["tune", "meta-llama/Llama-3.2-1B", "--dataset", "tiny-samples", "--device", "T4",
            "--json", "-o", str(tmp_path / "tuned.yaml"), "--margin", "0.1"]
    # (a 10% margin: with the default 3% safety an 8-bit-optimizer plan just fits)
    code, _, err = run(capsys, *argv)
    assert code == 3 and "--lora-r 16 --load-in-4bit" in err
    code, stdout, _ = run(capsys, *argv, "--lora-r", "16", "--load-in-4bit")
    d = json.loads(stdout)
    assert code == 0 and not d["confirmed"] and d["trials"] == []
    assert d["estimate"]["fits"] and d["estimate"]["trainable_params"] < 2e7


def test_tune_on_capped_cpu_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "tuned.json"
    code, stdout, _ = run(capsys, "tune", "tiny-llama", "--dataset", "tiny-samples", "--device",
                          "cpu:1GiB", "--target-batch-size", "8", "--max-seq-len", "64",
                          "--precision", "32-true", "--optim", "sgd",
                          "--no-gradient-checkpointing", "--no-chunked-loss", "--json", "-o",
                          str(out))
    d = json.loads(stdout)
    assert code == 0 and d["confirmed"] and d["trials"] and out.is_file()
    cfg = d["config"]
    assert cfg["micro_batch_size"] * cfg["grad_accum_steps"] == 8 and cfg["optimizer"] == "sgd"
    assert cfg["chunked_loss"] is False and {t["config"]["chunked_loss"] for t in d["trials"]} == {False}
    assert json.loads(out.read_text())["per_device_train_batch_size"] == cfg["micro_batch_size"]


@pytest.mark.parametrize("argv,code,needle", [
    (["tune", "meta-llama/Llama-3.1-8B", "--dataset", "tiny-samples", "--device", "T4",
      "--optim", "adamw_torch", "-o", "x.yaml"], 3, "would fit"),
    (["tune", "tiny-gpt2", "--dataset", "no-such-data", "-o", "x.yaml"], 2, "not found"),
    (["tune", "tiny-gpt2", "--dataset", "tiny-samples", "-o", "x.txt"], 2, ".yaml or .json"),
    (["tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", "T4", "--precision",
      "bf16-mixed", "-o", "x.yaml"], 2, "bf16"),
    (["tune", "meta-llama/Llama-3.1-8B", "--dataset", "tiny-samples", "--device", "T4",
      "--lora-r", "16", "--max-seq-len", "2048", "-o", "x.yaml"], 3, "--load-in-4bit"),
    (["tune", "tiny-llama", "--dataset", "tiny-samples", "--device", "cpu:1GiB", "--lora-r", "8",
      "--load-in-8bit", "--bnb-4bit-quant-type", "nf4", "-o", "x.yaml"], 2,
     "--bnb-4bit-quant-type applies to 4-bit bases"),
])
def test_tune_errors(tmp_path, capsys, monkeypatch, argv, code, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    got, _, err = run(capsys, *argv)
    assert got == code and needle in err and err.count("\n") == 1


def test_measure_exits_4_for_a_trial_that_failed_otherwise(capsys):
    # a timeout is neither "fits" (0) nor "out of memory" (3) nor bad input (2) nor a bug (1)
    code = main(["measure", "tiny-llama", "--batch-size", "1", "--seq-len", "16", "--device",
                 "cpu", "--isolation", "in-process", "--timeout", "0.001", "--json"])
    out = capsys.readouterr().out
    import json as _json

    r = _json.loads(out)
    assert code == 4 and r["timed_out"] and not r["oom"] and "timeout" in r["error"]


def test_measure_exits_4_for_a_trial_that_crashed(capsys, monkeypatch):
    # a step that raises something other than out-of-memory (a model that does not run)
    # is exit 4 with the error, neither 3 (out of memory) nor 1 (a bug in autofit)
    from autofit.trial import loop

    def crash(self, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (16x64 and 32x64)")

    monkeypatch.setattr(loop.Stepper, "step", crash)
    code = main(["measure", "tiny-llama", "--batch-size", "1", "--seq-len", "16", "--device",
                 "cpu", "--isolation", "in-process", "--json"])
    import json as _json

    r = _json.loads(capsys.readouterr().out)
    assert code == 4 and not r["oom"] and not r["timed_out"] and "shapes cannot be multiplied" in r["error"]
    code = main(["measure", "tiny-llama", "--batch-size", "1", "--seq-len", "16", "--device",
                 "cpu", "--isolation", "in-process"])
    out = capsys.readouterr().out
    assert code == 4 and "trial failed" in out and "shapes cannot be multiplied" in out


def test_a_compile_mode_reaches_the_estimate(capsys):
    """``--torch-compile-mode`` implies ``--torch-compile`` and goes into the estimated
    configuration; on a CPU a CUDA-graph mode is estimated (no CUDA graphs there)."""
    for mode in ("max-autotune-no-cudagraphs", "reduce-overhead"):
        code, out, err = run(capsys, "estimate", "tiny-llama", "--batch-size", "1", "--seq-len",
                             "8", "--device", "cpu", "--torch-compile-mode", mode, "--json")
        assert code == 0, err
        config = json.loads(out)["config"]
        assert config["torch_compile"] is True and config["torch_compile_mode"] == mode
