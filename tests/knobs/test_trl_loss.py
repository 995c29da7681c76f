"""TRL's SFT loss (SFTTrainer's fused LM head) recognised from an SFTConfig: detection and its
fallbacks, the user's model left alone, the estimate against a measured TRL step, the search."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from autofit import TrainConfig, estimate
from autofit.errors import BadInputError, InvalidConfigError
from autofit.knobs.trl_loss import (
    is_sft_config,
    loss_impl_of,
    trl_loss_type,
    trl_sft_loss,
)

trl = pytest.importorskip("trl", reason="TRL's loss needs trl (the dev extra installs it)")

BIG_VOCAB = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=16000,
                 max_position_embeddings=256)


def _llama(**kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **kw))


def _sft(tmp_path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)


def test_detects_sftconfig_and_the_fallbacks(tmp_path):
    from transformers import TrainingArguments

    assert trl_loss_type(_sft(tmp_path)) == "nll"
    assert trl_loss_type(_sft(tmp_path, loss_type="dft")) == "dft"
    assert loss_impl_of(_sft(tmp_path)) == "trl"
    # label smoothing: SFTTrainer's loss needs the full logits
    assert trl_loss_type(_sft(tmp_path, label_smoothing_factor=0.1)) is None
    assert loss_impl_of(_sft(tmp_path, label_smoothing_factor=0.1)) == "model"
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert not is_sft_config(plain) and loss_impl_of(plain) == "model"
    assert loss_impl_of(None) == "model" and loss_impl_of({"loss_type": "nll"}) == "model"

    class SFTConfig:  # duck typing: recognised by its class name, trl not imported
        loss_type = "nll"
        label_smoothing_factor = 0.0

    class Ulysses:
        sp_backend, sp_enabled = "deepspeed", True

    assert loss_impl_of(SFTConfig()) == "trl"
    ulysses = SFTConfig()
    ulysses.parallelism_config = Ulysses()
    assert loss_impl_of(ulysses) == "model"


def test_preflight_reads_the_loss_from_the_arguments_and_the_trainer(tmp_path):
    from autofit.preflight.trainer import config_of, trainer_loss

    config = config_of(_sft(tmp_path, per_device_train_batch_size=2))
    assert config.loss_impl == "trl" and config.micro_batch_size == 2
    assert config_of(_sft(tmp_path, label_smoothing_factor=0.1)).loss_impl == "model"
    assert config_of({"per_device_train_batch_size": 2}).loss_impl == "model"

    class SFTTrainer:
        compute_loss_func = None

    class Custom(SFTTrainer):
        compute_loss_func = staticmethod(lambda *a, **k: None)

    class Trainer:
        pass

    assert trainer_loss(config, SFTTrainer()).loss_impl == "trl"
    assert trainer_loss(config, Custom()).loss_impl == "model"  # full logits for the function
    assert trainer_loss(config, Trainer()).loss_impl == "model"  # not SFTTrainer's loss


def test_config_refuses_trl_with_chunked_loss_and_unknown_impl():
    with pytest.raises(InvalidConfigError, match="loss_impl"):
        TrainConfig(loss_impl="liger")
    with pytest.raises(InvalidConfigError, match="chunked_loss cannot"):
        TrainConfig(loss_impl="trl", chunked_loss=True)


def test_loss_is_the_models_own_and_the_model_is_left_unpatched(tiny_llama):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, 10:] = -100
    batch = {"input_ids": ids, "labels": labels}
    before = tiny_llama.forward
    loss = trl_sft_loss(tiny_llama, batch)
    assert "forward" not in vars(tiny_llama) and tiny_llama.forward == before
    torch.testing.assert_close(loss, tiny_llama(**batch).loss, rtol=1e-5, atol=1e-6)
    loss.backward()  # through TRL's ChunkedLogProbFunction
    assert tiny_llama.lm_head.weight.grad is not None
    out = tiny_llama(**batch)  # the model's own forward still returns logits
    assert out.logits.shape == (2, 16, 512)


def test_estimate_counts_trls_tiles_not_the_logits():
    """A big vocabulary (16000): TRL's buffer is (tokens, 32768) whatever V, and the CPU's
    torch fallback holds ~7 fp32 tiles in backward; both methods agree within 5%, and the
    simulated step never patches the user's model."""
    model = _llama(**BIG_VOCAB)
    config = TrainConfig(micro_batch_size=2, loss_impl="trl")
    ana = estimate(model, config, seq_len=128, device="cpu", method="analytic")
    sim = estimate(model, config, seq_len=128, device="cpu", method="simulate")
    assert "forward" not in vars(model)
    assert abs(ana.peak_allocated_bytes - sim.peak_allocated_bytes) <= 0.05 * sim.peak_allocated_bytes
    plain = estimate(model, TrainConfig(micro_batch_size=2), seq_len=128, device="cpu",
                     method="analytic")
    assert ana.peak_allocated_bytes != plain.peak_allocated_bytes


def test_simulate_within_a_few_percent_of_a_measured_trl_trial():
    """A trial in its own process (real tensors, TRL's fused head on the trial's copy, peak
    RSS) against both estimates."""
    from autofit import measure

    model = _llama(**BIG_VOCAB)
    config = TrainConfig(micro_batch_size=4, loss_impl="trl")
    sim = estimate(model, config, seq_len=128, device="cpu", method="simulate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trial = measure(model, config, seq_len=128, device="cpu", isolation="subprocess")
    assert not trial.oom
    ana = estimate(model, config, seq_len=128, device="cpu", method="analytic")
    for est, tol in ((sim, 0.03), (ana, 0.05)):
        err = (est.peak_allocated_bytes - trial.peak_allocated_bytes) / trial.peak_allocated_bytes
        assert abs(err) <= tol, (est.method, est.peak_allocated_bytes, trial.peak_allocated_bytes)


def test_autofit_with_an_sftconfig_runs_trls_loss_and_emits_an_sftconfig(
        tiny_llama, tmp_path, monkeypatch):
    """The search does not turn autofit's chunked loss on (SFTTrainer computes its own), says
    why, tunes with loss_impl='trl', emits an SFTConfig; SFTTrainer trains with it."""
    from autofit.api import autofit

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    rng = random.Random(0)
    rows = [{"input_ids": [rng.randrange(1, 512) for _ in range(rng.randint(8, 32))]}
            for _ in range(16)]
    user = _sft(tmp_path / "o", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                max_steps=1, save_strategy="no", learning_rate=1e-3, logging_steps=1)
    r = autofit(tiny_llama, rows, device="cpu:160MiB", training_args=user,
                precision=["32-true"], optimizer=["adamw_torch"], gradient_checkpointing=False)
    assert r.config.loss_impl == "trl" and not r.config.chunked_loss
    assert any("TRL's fused LM-head loss (SFTConfig loss_type=nll)" in x for x in r.reasons)
    assert "forward" not in vars(tiny_llama)
    import io

    from rich.console import Console

    from autofit.report.terminal import print_fit

    out = io.StringIO()
    print_fit(r, console=Console(file=out, width=100))
    text = out.getvalue()  # the chosen plan is not labelled with autofit's "full logits"
    assert "· full logits" not in text and ", full logits" not in text
    assert "TRL's fused LM-head loss" in text
    args = r.training_arguments
    assert isinstance(args, trl.SFTConfig) and args.loss_type == "nll"
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8
    with pytest.raises(BadInputError, match="SFTConfig"):
        autofit(tiny_llama, rows, device="cpu:160MiB", training_args=user, chunked_loss=True)

    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, 512)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>", eos_token="t1")  # no hub: the rows are tokenized already
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(model=tiny_llama, args=args, processing_class=tok,
                                 train_dataset=Dataset.from_list(rows))
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(torch.isfinite(torch.tensor(x)) for x in losses)


def test_cuda_target_counts_no_fallback_temporaries():
    """For a GPU TRL's Triton kernels fold the tiles in place (the simulated step replaces
    the torch folds for the run, then restores them); both methods agree within 5%, and
    each is below the CPU's estimate by about the fallback's fp32 tiles."""
    import trl.kernels.chunked_logprob as ck

    folds = (ck._forward_tile, ck._backward_tile, ck._addmm_fp32)
    model = _llama(**BIG_VOCAB)
    B, T, V = 4, 128, BIG_VOCAB["vocab_size"]
    for precision in ("32-true", "bf16-mixed"):
        config = TrainConfig(micro_batch_size=B, precision=precision, loss_impl="trl")
        gpu = {m: estimate(model, config, seq_len=T, device="H100-80GB", method=m)
               for m in ("analytic", "simulate")}
        cpu = estimate(model, config, seq_len=T, device="cpu", method="simulate")
        a, s = (gpu[m].peak_allocated_bytes for m in ("analytic", "simulate"))
        assert abs(a - s) <= 0.05 * s, (precision, a, s)
        assert cpu.peak_allocated_bytes - s >= 5 * B * T * V * 4, precision
    assert (ck._forward_tile, ck._backward_tile, ck._addmm_fp32) == folds


def test_nothing_fits_with_trls_loss_is_a_does_not_fit_error(tiny_llama, tmp_path, monkeypatch):
    """The "nothing fits" suggestions leave autofit's chunked loss out (it cannot be combined
    with TRL's): the answer is the usual error naming what to try, not a config error."""
    from autofit.api import autofit
    from autofit.errors import DoesNotFitError

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    rows = [{"input_ids": list(range(1, 33))}] * 8
    with pytest.raises(DoesNotFitError, match="no configuration fits"):
        autofit(tiny_llama, rows, device="cpu:4MiB", training_args=_sft(tmp_path / "o"),
                precision=["32-true"], optimizer=["adamw_torch"], gradient_checkpointing=False)
