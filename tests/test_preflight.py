"""Pre-flight: the `autofit check` CLI (exit codes, JSON, cache), `preflight()` and the callback.

Fits cases run their one trial on the uncapped CPU (in this process: fast);
"does not fit" cases use capped CPUs (``cpu:NMiB``) where the estimate is far over
the cap, so no trial runs; the fix case runs one capped trial (a subprocess).
"""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
import yaml

import autofit
from autofit.cli import main
from autofit.errors import BadInputError

# hidden 64, 2 layers, vocab 512: one step is a few MiB
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "max_position_embeddings": 256}
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512,
             "n_positions": 256}
# vocab 8000: micro batch 8 x 256 needs ~260 MiB, micro batch 2 ~85 MiB
SMALL = {**TINY, "hidden_size": 128, "intermediate_size": 344, "vocab_size": 8000,
         "max_position_embeddings": 512}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))


def _model_dir(tmp_path, cfg, name):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _module(cfg):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    c = dict(cfg)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(c.pop("model_type"), **c))


def _data(n, longest, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, longest, (n,), generator=g).tolist()
    lengths[0] = longest
    return [{"input_ids": torch.randint(1, vocab, (k,), generator=g).tolist()} for k in lengths]


def _collate(features):
    t = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _trainer(model, data, tmp_path, callbacks=(), eval_dataset=None, **kw):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, **kw)
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=eval_dataset,
                   data_collator=_collate, callbacks=list(callbacks))


def _no_trials(monkeypatch):
    import autofit.trial

    def boom(*a, **k):
        raise AssertionError("a trial ran")

    monkeypatch.setattr(autofit.trial, "measure", boom)


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


JSON_KEYS = {"fits", "estimate", "trial", "from_cache", "reasons", "problems"}


# ---------------------------------------------------------------- the CLI


def test_check_tuned_file_fits_then_answers_from_the_cache(tmp_path, capsys, monkeypatch):
    from autofit.api import autofit as tune

    model = _model_dir(tmp_path, TINY, "tiny")
    data = _data(16, 64, 512)
    result = tune(model, data, device="cpu", target_batch_size=4, precision="32-true",
                  optimizer="adamw_torch", gradient_checkpointing=False, max_trials=2)
    path = result.save(tmp_path / "tuned.yaml")
    assert result.confirmed and result.trials
    # the tuning run's trial of exactly this configuration answers: no trial
    _no_trials(monkeypatch)
    code, out, _ = run(capsys, "check", path, "--device", "cpu", "--json")
    d = json.loads(out)
    assert code == 0 and set(d) >= JSON_KEYS
    assert d["fits"] is True and d["from_cache"] is True and d["trial"]["oom"] is False
    assert d["problems"] == [] and d["estimate"]["device_total_bytes"] > 0
    assert any("tuning run" in r for r in d["reasons"])
    # ... and from then on the check cache (no model built: see the JSON index)
    code, out, _ = run(capsys, "check", path, "--device", "cpu", "--json")
    d = json.loads(out)
    assert code == 0 and d["from_cache"] is True and d["trials_run"] == 0
    assert any("check cache" in r for r in d["reasons"])
    assert list((tmp_path / "cache" / "checks").glob("*.json"))
    # the human output: the estimate box and the verdict
    code, out, _ = run(capsys, "check", path, "--device", "cpu")
    assert code == 0 and "activations" in out and "fits on cpu" in out


def test_check_plain_arguments_file_runs_one_trial_then_caches(tmp_path, capsys, monkeypatch):
    import autofit.trial

    model = _model_dir(tmp_path, TINY, "tiny")
    cfg = tmp_path / "train_args.yaml"
    cfg.write_text(yaml.safe_dump({"output_dir": "out", "per_device_train_batch_size": 4,
                                   "gradient_accumulation_steps": 2, "optim": "adamw_torch"}))
    calls = []
    real = autofit.trial.measure
    monkeypatch.setattr(autofit.trial, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    code, out, _ = run(capsys, "check", cfg, "--model", model, "--seq-len", 64, "--device", "cpu",
                       "--json")
    d = json.loads(out)
    assert code == 0 and d["fits"] and not d["from_cache"] and len(calls) == 1
    assert d["trial"]["batch_shape"] == [4, 64]
    assert d["config"]["grad_accum_steps"] == 2
    _no_trials(monkeypatch)
    code, out, _ = run(capsys, "check", cfg, "--model", model, "--seq-len", 64, "--device", "cpu",
                       "--json")
    assert code == 0 and json.loads(out)["from_cache"] is True


def test_check_does_not_fit_exits_3_with_reasons(tmp_path, capsys, monkeypatch):
    _no_trials(monkeypatch)  # ~4x over the cap: beyond the estimator's error, no trial
    model = _model_dir(tmp_path, SMALL, "small")
    cfg = tmp_path / "args.yaml"
    cfg.write_text(yaml.safe_dump({"per_device_train_batch_size": 8, "optim": "adamw_torch"}))
    code, out, _ = run(capsys, "check", cfg, "--model", model, "--seq-len", 256,
                       "--device", "cpu:64MiB", "--json")
    d = json.loads(out)
    assert code == 3 and d["fits"] is False and d["trial"] is None
    assert len(d["problems"]) == 1 and "does not fit by" in d["problems"][0]
    code, out, _ = run(capsys, "check", cfg, "--model", model, "--seq-len", 256,
                       "--device", "cpu:64MiB")
    assert code == 3 and "does NOT fit" in out


def test_check_of_a_compile_mode_with_cuda_graphs_says_why_it_cannot_tell(tmp_path, capsys):
    """A file whose ``torch_compile_mode`` captures CUDA graphs, checked for a card: the
    estimate refuses it (their private pool is not modelled), and the verdict says so
    instead of "no estimate for this model"."""
    cfg = tmp_path / "args.yaml"
    cfg.write_text(yaml.safe_dump({"per_device_train_batch_size": 2, "bf16": True,
                                   "torch_compile_mode": "reduce-overhead"}))
    code, out, _ = run(capsys, "check", cfg, "--model", "tiny-llama", "--seq-len", 64,
                       "--device", "A100-80GB", "--json")
    d = json.loads(out)
    assert code == 3 and d["fits"] is False
    assert len(d["problems"]) == 1 and "captures CUDA graphs" in d["problems"][0]


@pytest.mark.parametrize("argv,needle", [
    (["check", "{tmp}/missing.yaml"], "no such file"),
    (["check", "{tmp}/plain.yaml", "--seq-len", "8"], "give --model"),
    (["check", "{tmp}/plain.yaml", "--model", "tiny-llama"], "--seq-len"),
    (["check", "{tmp}/plain.yaml", "--model", "no-such/model-xyz", "--seq-len", "8",
      "--device", "cpu"], "cannot load model"),
    (["check", "{tmp}/plain.yaml", "--model", "tiny-llama", "--seq-len", "8", "--device",
      "nonsense-gpu"], "unknown device"),
    (["check", "{tmp}/bad.txt"], "unknown config format"),
    (["check"], "required"),
])
def test_check_bad_input_exits_2_with_one_line(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "plain.yaml").write_text("per_device_train_batch_size: 2\n")
    (tmp_path / "bad.txt").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code, out, err = run(capsys, *argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
        out, err = capsys.readouterr()
    assert code == 2, err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- Python: Trainer + callback


def test_callback_lets_a_fitting_run_train(tmp_path):
    cb = autofit.AutofitCallback(device="cpu")
    trainer = _trainer(_module(TINY), _data(8, 64, 512), tmp_path, [cb],
                       per_device_train_batch_size=2, optim="adamw_torch")
    trainer.train()
    assert trainer.state.global_step == 1
    assert cb.report.fits and cb.report.trial is not None and cb.report.trial.fits
    assert cb.report.config.micro_batch_size == 2 and cb.report.seq_len == 64


def test_callback_stops_a_run_that_cannot_fit_listing_every_problem(tmp_path, monkeypatch):
    _no_trials(monkeypatch)
    cb = autofit.AutofitCallback(device="cpu:16MiB")
    # 300-token samples > GPT-2's 256 learned positions; micro batch 16 far over 16 MiB;
    # eval batch 512 too
    trainer = _trainer(_module(TINY_GPT2), _data(8, 300, 512), tmp_path, [cb],
                       eval_dataset=_data(4, 64, 512), per_device_train_batch_size=16,
                       per_device_eval_batch_size=512, eval_strategy="steps", eval_steps=1,
                       optim="adamw_torch")
    with pytest.raises(autofit.PreflightError) as e:
        trainer.train()
    assert trainer.state.global_step == 0
    problems = e.value.problems
    assert len(problems) == 3, problems
    text = str(e.value)
    assert "256 learned positions" in text and "does not fit by" in text and "evaluation" in text
    assert "preflight(trainer, fix=True)" in text
    assert isinstance(e.value, autofit.DoesNotFitError) and e.value.exit_code == 3


def test_fix_from_the_estimate_keeps_the_effective_batch_and_trains(tmp_path, monkeypatch):
    _no_trials(monkeypatch)  # trial=False: the estimate decides (fast; the slow test measures)
    cb = autofit.AutofitCallback(device="cpu:120MiB", trial=False)
    trainer = _trainer(_module(SMALL), _data(16, 256, 8000), tmp_path, [cb],
                       per_device_train_batch_size=8, gradient_accumulation_steps=2,
                       optim="adamw_torch")
    report = autofit.preflight(trainer, fix=True, device="cpu:120MiB", trial=False)
    args = trainer.args
    assert report.fits and report.trial is None and report.requested.effective_batch_size == 16
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16
    assert args.per_device_train_batch_size < 8
    assert report.config.effective_batch_size == 16
    trainer.train()
    assert trainer.state.global_step == 1 and cb.report.fits


@pytest.mark.slow
def test_fix_shrinks_the_micro_batch_keeps_the_effective_batch_and_trains(tmp_path, caplog):
    cb = autofit.AutofitCallback(device="cpu:120MiB")
    trainer = _trainer(_module(SMALL), _data(16, 256, 8000), tmp_path, [cb],
                       per_device_train_batch_size=8, gradient_accumulation_steps=1,
                       optim="adamw_torch")
    with pytest.raises(autofit.PreflightError, match="fix=True"):
        autofit.preflight(trainer, device="cpu:120MiB")
    with caplog.at_level(logging.WARNING, logger="autofit"):
        report = autofit.preflight(trainer, fix=True, device="cpu:120MiB")
    args = trainer.args
    assert report.fits and report.trial is not None and report.trial.fits
    assert report.changes["per_device_train_batch_size"][0] == 8
    assert args.per_device_train_batch_size < 8
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8
    assert trainer._train_batch_size == args.per_device_train_batch_size
    assert "effective batch 8 kept" in caplog.text and "pre-flight changed" in caplog.text
    trainer.train()  # the callback confirms from the cache
    assert trainer.state.global_step == 1
    assert cb.report.fits and cb.report.from_cache and cb.report.trials_run == 0


def test_fix_shrinks_the_eval_batch_only(tmp_path):
    args = {"per_device_train_batch_size": 1, "per_device_eval_batch_size": 4096,
            "eval_strategy": "steps"}
    report = autofit.preflight(args, model=_model_dir(tmp_path, SMALL, "small"),
                               dataset=_data(8, 256, 8000), eval_dataset=_data(4, 256, 8000),
                               fix=True, device="cpu:512MiB", trial=False)
    assert report.fits and set(report.changes) == {"per_device_eval_batch_size"}
    assert args["per_device_train_batch_size"] == 1
    assert 1 <= args["per_device_eval_batch_size"] < 4096
    assert report.eval_estimate is not None


def test_callback_cannot_fix_and_catches_arguments_changed_too_late(tmp_path):
    with pytest.raises(BadInputError, match="before trainer.train"):
        autofit.AutofitCallback(fix=True)
    cb = autofit.AutofitCallback(device="cpu")
    trainer = _trainer(_module(TINY), _data(8, 64, 512), tmp_path, [cb],
                       per_device_train_batch_size=4, optim="adamw_torch")
    trainer.args.per_device_train_batch_size = 2  # the Trainer keeps its own copy (4)
    with pytest.raises(autofit.PreflightError, match="dataloader yields batches of 4"):
        trainer.train()


def test_preflight_needs_a_model_and_data():
    with pytest.raises(BadInputError, match="model="):
        autofit.preflight({"per_device_train_batch_size": 2}, seq_len=8)
    with pytest.raises(BadInputError, match="dataset="):
        autofit.preflight({"per_device_train_batch_size": 2}, model="tiny-llama")
    with pytest.raises(BadInputError, match="Trainer, TrainingArguments"):
        autofit.preflight(42, model="tiny-llama", seq_len=8)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(510)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def test_sft_trainer(tmp_path):
    pytest.importorskip("trl")
    import datasets
    from trl import SFTConfig, SFTTrainer

    cfg = {**TINY, "pad_token_id": 0, "eos_token_id": 1}
    data = datasets.Dataset.from_list(_data(16, 200, 512))
    args = SFTConfig(output_dir=str(tmp_path / "sft"), per_device_train_batch_size=4,
                     max_steps=1, use_cpu=True, report_to=[], save_strategy="no",
                     logging_strategy="no", disable_tqdm=True, max_length=128)
    cb = autofit.AutofitCallback(device="cpu")
    trainer = SFTTrainer(model=_module(cfg), args=args, train_dataset=data,
                         processing_class=_tokenizer(), callbacks=[cb])
    report = autofit.preflight(trainer, device="cpu")
    # SFTConfig's own defaults are what is checked (bf16 autocast, checkpointing), at its
    # max_length
    assert report.fits and report.seq_len == 128 and report.trial.batch_shape == (4, 128)
    assert report.config.precision == ("bf16-mixed" if args.bf16 else "32-true")
    trainer.train()
    assert trainer.state.global_step == 1 and cb.report.from_cache


def test_top_level_exports_stay_light():
    import os
    import subprocess
    from pathlib import Path

    root = str(Path(autofit.__file__).resolve().parent.parent)
    code = ("import sys, autofit; assert autofit.__file__.startswith(sys.argv[1]); "
            "assert callable(autofit.preflight); "
            "assert 'transformers' not in sys.modules and 'torch' not in sys.modules")
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", code, root], check=True, env=env)


def test_a_checks_own_cpu_trial_counts_what_the_run_adds():
    """A check's trial runs the longest batch once; the run also runs its other shapes, and on
    a CPU in 16-bit oneDNN keeps its kernels of each for good, and it counts what the
    first step's set-up leaves resident. The tune's trials count both; a check's own did
    not: TRL's sft.py on a tiny Qwen2 in bf16 was checked at 736 MiB where its tune had
    measured 966 (and the run 880-898)."""
    from autofit.cli.datasets import load_dataset_ref
    from autofit.memory.analytic import cpu_half_run_growth
    from autofit.preflight.check import run_check
    from autofit.probe.data import probe_data
    from autofit.probe.device import format_bytes, resolve_device
    from autofit.probe.model import probe_model
    from autofit.probe.run import RunPlan

    cfg = autofit.TrainConfig(micro_batch_size=4, precision="bf16-mixed")
    data = load_dataset_ref("tiny-samples")
    dev = resolve_device("cpu:4GiB")
    run_args = {"max_steps": 6, "eval_strategy": "steps", "eval_steps": 3}
    plan = RunPlan.of(run_args)
    lengths = probe_data(data).lengths
    shapes = len(plan.order(lengths, cfg, None).distinct()) - 1
    extra = cpu_half_run_growth(probe_model("tiny-gpt2"), cfg, dev, shapes, evaluates=True)
    if not extra:
        pytest.skip("this CPU's 16-bit matmuls keep no kernels per shape (AVX2)")
    r = run_check("tiny-gpt2", cfg, dataset=data, device=dev, run_args=run_args)
    t = r.trial
    assert r.fits and t is not None and t.setup_counted and t.setup_bytes > 0
    assert any(n.startswith(f"+ {format_bytes(extra)} for the run's {shapes} other")
               for n in t.notes), t.notes
    assert any(n.startswith(f"+ {format_bytes(t.setup_bytes)} that the trial's set-up")
               for n in t.notes), t.notes
    # the verdict is that figure, counted once (the set-up is in it)
    assert any(x.startswith(f"fits: measured {format_bytes(t.device_total_bytes)} of")
               for x in r.reasons), r.reasons
    assert r.estimate.run_device_total_bytes == r.estimate.device_total_bytes + extra
    # from the check cache: the same figure, not counted again
    again = run_check("tiny-gpt2", cfg, dataset=data, device=dev, run_args=run_args)
    assert again.from_cache and again.trial.device_total_bytes == t.device_total_bytes
    assert any(x.startswith(f"fits: measured {format_bytes(t.device_total_bytes)} of")
               for x in again.reasons)


def _metrics_trainer(tmp_path, eval_rows, compute_metrics, preprocess=None, **args):
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=160,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=32000)
    model = AutoModelForCausalLM.from_config(cfg)
    rows = [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, 32000, (eval_rows, 128))]
    targs = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                              per_device_eval_batch_size=4, use_cpu=True, report_to=[],
                              eval_strategy="steps", eval_steps=10, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Trainer(model=model, args=targs, train_dataset=rows[:8], eval_dataset=rows,
                       compute_metrics=compute_metrics,
                       preprocess_logits_for_metrics=preprocess)


def test_preflight_counts_the_predictions_compute_metrics_keeps(tmp_path):
    """A Trainer with ``compute_metrics`` keeps every evaluation batch's logits and labels
    until the evaluation ends (benchmarks/eval_predictions.py: 875 MiB more for 500 MiB of logits):
    counted beside the evaluation step (2 copies: 32 x 128 tokens x 32,000 fp32 logits =
    1000 MiB), a problem when it then does not fit, with what to set; without
    ``compute_metrics`` nothing; with ``preprocess_logits_for_metrics`` said, not counted;
    on a card ``fix`` sets ``eval_accumulation_steps`` (to the host every step)."""
    def metrics(p):
        return {}

    kept = 2 * 32 * (128 * 32000 * 4 + 128 * 8)
    r = autofit.preflight(_metrics_trainer(tmp_path, 32, metrics), device="cpu:8GiB",
                          trial=False, raise_on_failure=False)
    (line,) = [x for x in r.reasons if x.startswith("compute_metrics:")]
    assert r.fits and "32 samples" in line and f"~{kept / 2**20:.0f} MiB" in line
    small = autofit.preflight(_metrics_trainer(tmp_path, 32, metrics), device="cpu:1GiB",
                              trial=False, raise_on_failure=False)
    assert not small.fits and any("compute_metrics' predictions" in p and "preprocess_logits"
                                  in p for p in small.problems)
    plain = autofit.preflight(_metrics_trainer(tmp_path, 32, None), device="cpu:1GiB",
                              trial=False, raise_on_failure=False)
    assert plain.fits and not any("compute_metrics" in x for x in plain.reasons)
    argmax = autofit.preflight(
        _metrics_trainer(tmp_path, 32, metrics, preprocess=lambda logits, labels: logits),
        device="cpu:1GiB", trial=False, raise_on_failure=False)
    assert argmax.fits and any("not counted" in x for x in argmax.reasons)
    # a card: 4,000 samples' logits (~122 GiB) do not fit 80 GB; fixed by sending them to
    # the host every step
    trainer = _metrics_trainer(tmp_path, 4000, metrics)
    card = autofit.preflight(trainer, device="A100-80GB", trial=False, fix=True,
                             raise_on_failure=False)
    assert card.changes.get("eval_accumulation_steps") == (None, 1)
    assert trainer.args.eval_accumulation_steps == 1
    assert any(x.startswith("fixed: eval_accumulation_steps 1") for x in card.reasons)
    done = autofit.preflight(trainer, device="A100-80GB", trial=False, raise_on_failure=False)
    assert not any("compute_metrics:" in x for x in done.reasons)
