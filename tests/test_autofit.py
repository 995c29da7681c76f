"""autofit() end to end on the capped CPU device (real trials in capped subprocesses)."""

import random

import pytest

import autofit.trial as trial_mod
from autofit import TrainConfig, measure
from autofit.api import autofit
from autofit.errors import BadInputError, DoesNotFitError, UnsupportedPrecisionError

CAP = "cpu:160MiB"
FIXED = dict(precision=["32-true"], optimizer=["adamw_torch"], gradient_checkpointing=False)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def data():
    rng = random.Random(0)
    rows = [{"input_ids": [rng.randrange(1, 512) for _ in range(rng.randint(8, 40))]}
            for _ in range(48)]
    rows[5]["input_ids"] = [rng.randrange(1, 512) for _ in range(128)]  # the worst case
    return rows


@pytest.fixture()
def count_trials(monkeypatch):
    calls = []
    real = trial_mod.measure

    def counting(*a, **k):
        calls.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(trial_mod, "measure", counting)
    return calls


def test_choice_fits_next_does_not_and_batch_is_kept(tiny_llama, data, count_trials):
    r = autofit(tiny_llama, data, device=CAP, target_batch_size=32, margin=0.0, **FIXED)
    c = r.config
    assert r.confirmed and c.effective_batch_size == 32
    assert c.micro_batch_size * c.grad_accum_steps == 32
    assert r.estimate.seq_len == 128  # the longest sample, not the average
    chosen = [t for t in r.trials if t.config["micro_batch_size"] == c.micro_batch_size]
    assert chosen and chosen[-1].fits
    # the next allowed micro batch (a divisor of 32) does not fit the cap
    nxt = 2 * c.micro_batch_size
    if nxt <= 32:
        from autofit.probe.data import worst_case_batch

        batch = worst_case_batch(data, nxt, task="causal-lm")
        over = measure(tiny_llama, c.replace(micro_batch_size=nxt, grad_accum_steps=32 // nxt),
                       batch, device=CAP)
        assert over.oom or over.device_total_bytes > r.estimate.capacity_bytes
    assert r.ooms <= 1 and len(count_trials) <= 4
    assert any("effective batch kept" in x for x in r.reasons)


def test_training_arguments_and_save(tiny_llama, data, tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    r = autofit(tiny_llama, data, device=CAP, target_batch_size=16, **FIXED)
    args = r.training_arguments
    assert args.per_device_train_batch_size == r.config.micro_batch_size
    assert args.gradient_accumulation_steps == r.config.grad_accum_steps
    (loaded,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(r.save(tmp_path / "t.yaml")))
    assert loaded.per_device_train_batch_size == r.config.micro_batch_size
    (loaded,) = HfArgumentParser(TrainingArguments).parse_json_file(str(r.save(tmp_path / "t.json")))
    assert loaded.gradient_accumulation_steps == r.config.grad_accum_steps


def test_user_training_args_only_tuned_fields_change(tiny_llama, data, tmp_path):
    from transformers import TrainingArguments

    user = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=4, learning_rate=3e-4, use_cpu=True,
                             report_to=[], seed=7)
    r = autofit(tiny_llama, data, device=CAP, training_args=user, **FIXED)
    a = r.training_arguments
    assert r.config.effective_batch_size == 16  # the user's 4 x 4
    assert a.learning_rate == 3e-4 and a.seed == 7 and a.output_dir == str(tmp_path / "o")


def test_cache_answers_second_run_without_trials(tiny_llama, data, monkeypatch):
    first = autofit(tiny_llama, data, device=CAP, target_batch_size=16, **FIXED)
    assert not first.from_cache and first.trials

    def no_trial(*a, **k):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(trial_mod, "measure", no_trial)
    second = autofit(tiny_llama, data, device=CAP, target_batch_size=16, **FIXED)
    assert second.from_cache and second.config == first.config
    assert len(second.trials) == len(first.trials)
    # another constraint is another question: not answered from the cache
    with pytest.raises(AssertionError, match="cache should have answered"):
        autofit(tiny_llama, data, device=CAP, target_batch_size=8, **FIXED)


def test_resume_after_a_killed_run(tiny_llama, data, monkeypatch):
    real = trial_mod.measure
    seen = []

    def dies_after_first(*a, **k):
        if seen:
            raise KeyboardInterrupt  # the run is killed during its second trial
        seen.append(a[1])
        return real(*a, **k)

    # two combinations whose steps differ (checkpointing): both are tried (two optimizers
    # at one micro batch would not be: the second differs only in a cheap optimizer step)
    space = dict(precision=["32-true"], optimizer=["adamw_torch"],
                 gradient_checkpointing=[False, True])
    monkeypatch.setattr(trial_mod, "measure", dies_after_first)
    with pytest.raises(KeyboardInterrupt):
        autofit(tiny_llama, data, device=CAP, target_batch_size=16, **space)
    assert len(seen) == 1
    rerun = []

    def counting(*a, **k):
        rerun.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(trial_mod, "measure", counting)
    r = autofit(tiny_llama, data, device=CAP, target_batch_size=16, **space)
    assert seen[0] not in rerun  # the finished trial was not run again
    assert len(r.trials) == len(rerun) + 1


def test_constraints_respected(tiny_llama, data):
    # (bf16 on a CPU: the run's ~20 other lengths each leave oneDNN's kernels of every
    # matmul shape, ~10 MiB apiece here: it needs ~330 MiB where 32-true fits 160)
    r = autofit(tiny_llama, data, device="cpu:512MiB", target_batch_size=8,
                precision=["bf16-mixed"], optimizer=["sgd"], gradient_checkpointing=True,
                max_micro_batch=2, cache=False)
    c = r.config
    assert (c.precision, c.optimizer, c.gradient_checkpointing) == ("bf16-mixed", "sgd", True)
    assert c.micro_batch_size <= 2 and c.effective_batch_size == 8
    assert all(t.config["precision"] == "bf16-mixed" for t in r.trials)
    assert any("oneDNN's 16-bit kernels for the run's" in x for x in r.reasons), r.reasons
    assert r.estimate.run_device_total_bytes > r.estimate.device_total_bytes + (50 << 20)


def test_nothing_fits_says_what_would(data):
    with pytest.raises(DoesNotFitError) as e:
        autofit("meta-llama/Llama-3.1-8B", data, device="T4", precision=["16-mixed"],
                optimizer=["adamw_torch"])
    msg = str(e.value)
    assert "no configuration fits" in msg and "QLoRA" in msg and "\n" not in msg
    assert e.value.exit_code == 3


def test_planning_for_a_card_not_present(data):
    r = autofit("meta-llama/Llama-3.2-1B", data, device="H100-80GB", target_batch_size=64)
    assert not r.confirmed and r.trials == ()
    assert r.config.effective_batch_size == 64 and r.config.precision == "bf16-mixed"
    assert any("not present" in x for x in r.reasons)
    if not __import__("torch").cuda.is_available():
        with pytest.raises(BadInputError, match="parse_yaml_file"):
            _ = r.training_arguments  # bf16 cannot be built on a CPU-only machine
    assert r.training_arguments_kwargs["bf16"] is True


def test_bad_input(tiny_llama, data):
    with pytest.raises(BadInputError, match="unknown option"):
        autofit(tiny_llama, data, device=CAP, batch=3)
    with pytest.raises(UnsupportedPrecisionError):
        autofit("tiny-llama", data, device="T4", precision=["bf16-mixed"])
    from autofit.errors import EmptyDatasetError

    with pytest.raises(EmptyDatasetError):
        autofit(tiny_llama, [], device=CAP)
    with pytest.raises(BadInputError):
        autofit(tiny_llama, data, device=CAP, target_batch_size=0)


def test_time_budget_returns_best_so_far(tiny_llama, data):
    r = autofit(tiny_llama, data, device=CAP, target_batch_size=16, time_budget_s=0.001,
                cache=False, **FIXED)
    # the budget is spent before the first trial: the choice rests on the estimate
    assert not r.confirmed and r.trials == () and any("budget" in x for x in r.reasons)
    assert isinstance(r.config, TrainConfig)


def test_planning_by_simulation_for_a_card_not_present():
    # tiny-llama at 2048 tokens on a T4 (fp16, grouped-query attention: SDPA's math
    # kernel): the plan is bracketed by simulated steps, exact for the simulated step.
    from autofit import estimate

    rows = [{"input_ids": list(range(1, 2049))}] + [{"input_ids": list(range(1, 65))}] * 15
    fixed = dict(precision=["16-mixed"], optimizer=["adamw_torch"], gradient_checkpointing=False)
    r = autofit("tiny-llama", rows, device="T4", method="simulate", **fixed)
    assert not r.confirmed and r.trials == () and r.estimate.method == "simulate"
    assert any("simulating their training step" in x for x in r.reasons)
    # the margin from the run: its replay in the Trainer's order + a 3% safety, with why
    margin = r.meta["margin"]
    assert 0.03 <= margin < 0.5
    assert any(x.startswith(f"margin {100 * margin:.1f}%") and "replayed in the Trainer's order"
               in x and "+ 3% safety" in x for x in r.reasons)
    budget = (1 - margin) * r.estimate.capacity_bytes
    b = r.config.micro_batch_size
    assert r.estimate.device_total_bytes <= budget
    cfg = TrainConfig(micro_batch_size=b + 1, precision="16-mixed", optimizer="adamw_torch")
    nxt = estimate("tiny-llama", cfg, seq_len=2048, device="T4", method="simulate")
    assert nxt.device_total_bytes > budget  # the next size does not fit: the exact limit


def test_simulated_estimate_on_a_present_device(tiny_llama, data, count_trials):
    # method="simulate" on the capped CPU: the simulated step is the estimate the trials
    # start from; the choice is still confirmed by trials and fits the cap.
    r = autofit(tiny_llama, data, device=CAP, target_batch_size=32, margin=0.0,
                method="simulate", cache=False, **FIXED)
    assert r.confirmed and r.config.effective_batch_size == 32
    assert any("estimates: the simulated step" in x for x in r.reasons)
    chosen = [t for t in r.trials if t.config["micro_batch_size"] == r.config.micro_batch_size]
    assert chosen and chosen[-1].fits and r.ooms <= 1 and len(count_trials) <= 3


def test_a_model_only_the_simulation_estimates_is_tuned_on_a_present_cpu():
    """RWKV is no transformer the closed form recognises: with method='simulate' its
    result quotes the simulated step (it was the closed form's refusal, "use
    method='simulate'", after the search), the same from the cache, and its checkpointed
    combinations, whose CPU recurrence the simulation refuses, are left out with that
    refusal as their reason; its evaluation, which no closed form estimates, runs at the
    training micro batch."""
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "rwkv", hidden_size=32, attention_hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, vocab_size=128, context_length=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    rng = random.Random(0)
    rows = [{"input_ids": [rng.randrange(128) for _ in range(32)]} for _ in range(16)]
    kw = dict(device="cpu:1GiB", method="simulate", target_batch_size=4,
              precision=["bf16-mixed"], optimizer=["adamw_torch"])
    r = autofit(model, rows, **kw)
    assert r.confirmed and not r.config.gradient_checkpointing
    assert r.estimate.notes and r.estimate.notes[0].startswith("target allocator")
    refused = [c for c in r.candidates if c["status"] == "infeasible"]
    assert refused and all("per-position recurrence" in c["reason"] for c in refused)
    # its evaluation step has no closed form: evaluated at the training micro batch (not
    # the Trainer's default 8), measured by the trial
    assert r.eval_micro_batch == r.config.micro_batch_size
    assert r.training_arguments.per_device_eval_batch_size == r.config.micro_batch_size
    assert any(line.startswith(f"eval micro batch {r.config.micro_batch_size}: the training "
                               "micro batch") for line in r.reasons)
    again = autofit(model, rows, **kw)
    assert again.from_cache
    assert again.estimate.device_total_bytes == r.estimate.device_total_bytes


@pytest.mark.slow  # 31 s (the fast suite's ten minutes)
def test_nothing_fits_for_a_lora_model_suggests_its_base_in_bf16_or_4_bits():
    # LoRA on an 8B model with its frozen base in fp32 (the Trainer's default) does not fit
    # a 40 GB card at 4096 tokens (simulated: ~42 GB); a bf16 base or a 4-bit base would,
    # and the error says so. (At 2048 tokens it fits: the simulated stream runs in 34.6 GB.)
    rows = [{"input_ids": list(range(1, 4097))}] * 8
    with pytest.raises(DoesNotFitError) as e:
        autofit("meta-llama/Llama-3.1-8B", rows, device="A100-40GB", lora={"r": 16})
    msg = str(e.value)
    assert "precision=['bf16-true']" in msg and "load_in_4bit=True" in msg
    assert "--precision" not in msg and "--load-in-4bit" not in msg  # Python names keywords
    r = autofit("meta-llama/Llama-3.1-8B", rows, device="A100-40GB", lora={"r": 16},
                precision=["bf16-true"])
    assert r.config.precision == "bf16-true" and not r.confirmed


def test_a_4_bit_base_by_name_is_planned_for_a_card(data):
    r = autofit("tiny-llama", data, device="A100-40GB", lora={"r": 8}, load_in_4bit=True)
    assert not r.confirmed and r.estimate.config["precision"] == r.config.precision
    assert any("base quantized: 4-bit nf4" in x for x in r.reasons)
    assert r.meta["quantization"]["load_in_4bit"] is True


@pytest.mark.slow
def test_an_8_bit_base_by_name_is_tuned_with_trials(data):
    """Trials build the 8-bit base on the device (a capped CPU here)."""
    r = autofit("tiny-llama", data, device="cpu:1GiB", lora={"r": 8}, load_in_8bit=True,
                target_batch_size=4, max_trials=3, cache=False)
    assert r.confirmed and r.meta["quantization"]["load_in_8bit"] is True
    assert all(t.error is None for t in r.trials)


def test_a_16_bit_quantized_base_is_searched_in_precisions_it_runs(data):
    """An fp16 base on a bf16 card: bf16 autocast cannot mix with it, so only 32-true (no
    autocast) is searched, and the reasons say why."""
    r = autofit("tiny-llama", data, device="A100-80GB", lora={"r": 8},
                quantization_config={"load_in_4bit": True, "bnb_4bit_compute_dtype": "float16"})
    assert r.config.precision == "32-true"
    assert {c["precision"] for c in r.candidates} == {"32-true"}
    assert any("precision: 32-true searched (the base is quantized in float16" in x
               for x in r.reasons)
