"""The trainer is part of the question (issue 21, items 1, 2, 6, 7): the chunked loss is searched
only for autofit.ChunkedLossTrainer, the tuned file records its trainer, check judges the
file's fields as the declared trainer runs them, secrets are never written, and the callback
says its verdict."""

from __future__ import annotations

import json

import pytest

from autofit.cli import main
from autofit.errors import BadInputError
from autofit.stages import TuneOptions

# tiny-gpt2 at micro batch 16 x 128 tokens: ~1.6 GiB with the full logits, ~0.6 GiB chunked
FIELDS = {"output_dir": "out", "per_device_train_batch_size": 16,
          "gradient_accumulation_steps": 1, "use_cpu": True}


def _meta(**extra):
    from autofit import TrainConfig

    config = TrainConfig(micro_batch_size=16, chunked_loss=True, seq_len=128).to_dict()
    return {"model": "tiny-gpt2", "task": "causal-lm", "seq_len": 128, "device": "cpu:1GiB",
            "reasons": [], "confirmed": True, "config": config, **extra}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _wide_llama(tmp_path):
    """A causal LM whose logits dominate (vocab 64000, hidden 64): the chunked loss lets a
    larger micro batch fit."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=64000, max_position_embeddings=512)
    path = tmp_path / "config.json"
    cfg.to_json_file(path)
    return str(path)


def test_plain_never_picks_the_chunked_loss_autofit_does(tmp_path, monkeypatch):
    """Where the chunked loss wins (its loop made free, so a larger micro batch is faster), the
    default plain trainer's search leaves it out and says how to get it; trainer='autofit'
    picks it; the result records the trainer."""
    from autofit import autofit
    from autofit.knobs.chunked_loss import CHUNKED_LOSS

    monkeypatch.setattr(CHUNKED_LOSS, "step_seconds", lambda ctx: 0.0)
    model = _wide_llama(tmp_path)
    data = [{"input_ids": list(range(1, 513))}] * 256
    fixed = dict(device="T4", cache=False, margin=0.1, precision="32-true", gradient_checkpointing=False,
                 optimizer="adamw_torch")
    plain = autofit(model, data, **fixed)
    assert not plain.config.chunked_loss and plain.meta["trainer"] == "plain"
    assert any(r.startswith("no chunked loss:") and "trainer='autofit'" in r
               for r in plain.reasons)
    assert "use_liger_kernel" not in plain.training_arguments_kwargs
    chunked = autofit(model, data, trainer="autofit", **fixed)
    assert chunked.config.chunked_loss and chunked.meta["trainer"] == "autofit"
    assert chunked.config.micro_batch_size > plain.config.micro_batch_size
    implied = autofit(model, data, chunked_loss=True, **fixed)  # --chunked-loss alone
    assert implied.meta["trainer"] == "autofit"
    assert any("implied by chunked_loss=True" in r for r in implied.reasons)
    with pytest.raises(BadInputError, match="trainer='autofit'"):
        autofit(model, data, trainer="plain", chunked_loss=True, **fixed)
    with pytest.raises(BadInputError, match="unknown trainer"):
        autofit(model, data, trainer="hf", **fixed)


def test_tuned_file_says_which_trainer_it_is_for(tmp_path):
    from autofit.emit import read_config, write_config

    for trainer, line in (("plain", "# for a plain transformers.Trainer"),
                          ("autofit", "# train with autofit.ChunkedLossTrainer")):
        p = write_config(tmp_path / f"{trainer}.yaml", FIELDS, _meta(trainer=trainer))
        assert p.read_text().splitlines()[0].startswith(line)
        assert read_config(p)[1]["trainer"] == trainer
    with pytest.raises(BadInputError, match="trainer should be"):
        bad = tmp_path / "bad.yaml"
        bad.write_text('# autofit: {"model": "m", "trainer": "hf"}\nper_device_train_batch_size: 2\n')
        read_config(bad)


def test_estimate_and_measure_take_the_trainer(capsys, tmp_path):
    code, _, err = run(capsys, "tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device",
                       "cpu:1GiB", "--chunked-loss", "--trainer", "plain", "-o",
                       tmp_path / "t.yaml")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--trainer autofit" in err
    code, out, err = run(capsys, "estimate", "tiny-gpt2", "--batch-size", "2", "--seq-len", "32",
                         "--chunked-loss", "--trainer", "plain", "--json")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "autofit.ChunkedLossTrainer" in err and "--trainer autofit" in err
    code, out, err = run(capsys, "measure", "tiny-gpt2", "--batch-size", "2", "--seq-len", "32",
                         "--chunked-loss", "--trainer", "trl", "--device", "cpu")
    assert code == 2 and "--trainer autofit" in err
    code, out, _ = run(capsys, "estimate", "tiny-gpt2", "--batch-size", "2", "--seq-len", "32",
                       "--chunked-loss", "--json")  # alone: implies the autofit trainer
    assert code == 0
    from autofit import TrainConfig, estimate

    est = estimate("tiny-gpt2", TrainConfig(micro_batch_size=8), seq_len=256, device="cpu",
                   trainer="trl")  # SFTTrainer's loss: no full logits either
    full = estimate("tiny-gpt2", TrainConfig(micro_batch_size=8), seq_len=256, device="cpu")
    assert est.device_total_bytes != full.device_total_bytes  # TRL's loss, not the full logits


def test_check_judges_the_fields_with_the_declared_trainer(tmp_path, capsys):
    """A file tuned for autofit's trainer: fits as autofit (the file's), exit 3 as plain with
    one line naming the trainer it needs and the plain Trainer's need; a file that records no
    trainer is checked as plain (the metadata grants no lever)."""
    from autofit.emit import write_config

    tuned = write_config(tmp_path / "tuned.yaml", FIELDS, _meta(trainer="autofit"))
    common = ("--no-trial", "--no-cache", "--device", "cpu:1GiB")
    code, out, _ = run(capsys, "check", tuned, *common)
    assert code == 0, out
    assert "trainer autofit" in out
    code, out, _ = run(capsys, "check", tuned, "--trainer", "plain", *common, "--json")
    assert code == 3, out
    line = json.loads(out)["problems"][0]
    assert line.startswith("fits only with autofit.ChunkedLossTrainer; a plain Trainer needs ~1.")
    assert "GiB (> 1.00 GiB on cpu:1GiB)" in line
    old = write_config(tmp_path / "old.yaml", FIELDS, _meta())  # no trainer recorded
    code, out, _ = run(capsys, "check", old, *common, "--json")
    assert code == 3 and "fits only with autofit.ChunkedLossTrainer" in out
    code, out, _ = run(capsys, "report", tuned, "--trainer", "plain", "--device", "cpu:1GiB",
                       "-o", tmp_path / "r.html")
    assert code == 3 and "fits only with autofit.ChunkedLossTrainer" in out
    code, out, _ = run(capsys, "report", tuned, "-o", tmp_path / "r.html")
    assert code == 0


def test_preflight_reads_the_trainer_class():
    from autofit.knobs.trainer import trainer_of
    from autofit.preflight import preflight

    class Trainer:
        pass

    class SFTTrainer(Trainer):
        pass

    class Mine(SFTTrainer):
        pass

    import autofit

    assert trainer_of(Trainer()) == "plain"
    assert trainer_of(Mine()) == "trl"
    chunked = autofit.ChunkedLossTrainer.__new__(autofit.ChunkedLossTrainer)
    assert trainer_of(chunked) == "autofit"
    args = {"per_device_train_batch_size": 2}
    r = preflight(args, model="tiny-gpt2", seq_len=32, device="A100-80GB", trainer="autofit",
                  cache=False)
    assert r.config.chunked_loss
    r = preflight(args, model="tiny-gpt2", seq_len=32, device="A100-80GB", trainer="trl",
                  cache=False)
    assert r.config.loss_impl == "trl" and not r.config.chunked_loss
    assert not preflight(args, model="tiny-gpt2", seq_len=32, device="A100-80GB",
                         cache=False).config.chunked_loss

    class Fake(autofit.ChunkedLossTrainer):
        def __init__(self):
            self.args, self.model, self.train_dataset = args, "tiny-gpt2", None

    with pytest.raises(BadInputError, match="drop trainer="):
        preflight(Fake(), seq_len=32, device="A100-80GB", trainer="plain", cache=False)
    assert preflight(Fake(), seq_len=32, device="A100-80GB", cache=False).config.chunked_loss


def test_secrets_are_dropped_and_a_masked_value_refused(tmp_path, capsys):
    from transformers import TrainingArguments

    from autofit.api import _space
    from autofit.emit import read_config
    from autofit.probe.device import resolve_device
    from autofit.probe.model import build_model

    module, task = build_model("tiny-gpt2")
    probed = type("P", (), {"device": resolve_device("cpu"), "module": module, "task": task,
                            "data": type("D", (), {"num_samples": 8})()})()
    reasons: list[str] = []
    user = TrainingArguments(output_dir=str(tmp_path), hub_token="hf_secret", use_cpu=True)
    base = _space(probed, None, TuneOptions(training_args=user), reasons).base_args
    assert not any(k.endswith("_token") for k in base)
    assert "hub_token dropped: set it in the environment (HF_TOKEN) or your script, never in " \
           "the tuned file" in reasons
    reasons.clear()
    base = _space(probed, None, TuneOptions(training_args=TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True)), reasons).base_args
    assert "hub_token" not in base and not any("dropped" in r for r in reasons)  # None: silent
    masked = tmp_path / "masked.yaml"
    masked.write_text("per_device_train_batch_size: 2\nhub_token: <HUB_TOKEN>\n")
    with pytest.raises(BadInputError, match="hub_token: <HUB_TOKEN> is a masked placeholder"):
        read_config(masked)
    code, _, err = run(capsys, "check", masked, "--model", "tiny-gpt2", "--seq-len", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "masked placeholder" in err


def test_sft_tokens_are_not_secrets(tmp_path):
    from trl import SFTConfig

    from autofit.api import _space
    from autofit.probe.device import resolve_device
    from autofit.probe.model import build_model

    module, task = build_model("tiny-gpt2")
    probed = type("P", (), {"device": resolve_device("cpu"), "module": module, "task": task,
                            "data": type("D", (), {"num_samples": 8})()})()
    user = SFTConfig(output_dir=str(tmp_path), eos_token="<|end|>", use_cpu=True)
    space = _space(probed, None, TuneOptions(training_args=user), [])
    assert space.base_args["eos_token"] == "<|end|>" and "hub_token" not in space.base_args
    assert space.trainer == "trl"


def test_callback_prints_its_verdict(capsys, tmp_path):
    from transformers import TrainingArguments

    import autofit
    from autofit.probe.model import build_model

    model, _ = build_model("tiny-gpt2")
    cb = autofit.AutofitCallback(device="A100-80GB", cache=False, seq_len=32)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             use_cpu=True, report_to=[])
    cb.on_train_begin(args, None, None, model=model)
    err = capsys.readouterr().err
    assert err.startswith("autofit: fits on A100-80GB: estimated ")
    assert "(micro batch 2 x 1)" in err and len(err.strip().splitlines()) == 1
