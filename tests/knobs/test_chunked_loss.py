"""The chunked loss knob: the loss itself, its Trainer, its memory rule, its flag and note."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from autofit import TrainConfig, causal_lm_chunked_loss, estimate
from autofit.errors import BadInputError
from autofit.knobs import CHUNKED_LOSS, KNOBS
from autofit.knobs.loss import unsupported_reason

BIG_VOCAB = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=16000,
                 max_position_embeddings=256)


def _llama(**kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **kw))


def _batch(vocab: int, rows: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[0, length // 2:] = -100  # right padding: no loss there
    labels[-1, :3] = -100  # a prompt
    mask = torch.ones_like(ids)
    mask[0, length // 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def test_loss_and_gradients_equal_the_models_own(tiny_llama):
    batch = _batch(512, 3, 24)
    ref = tiny_llama(**batch).loss
    ref.backward()
    ref_grads = _grads(tiny_llama)
    loss = causal_lm_chunked_loss(tiny_llama, batch)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    for a, b in zip(_grads(tiny_llama), ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_accumulation_with_num_items_in_batch_equals_the_models_own(tiny_llama):
    """Two micro batches, each a sum over its tokens divided by the count of both (the
    Trainer's ``num_items_in_batch``): the accumulated gradients are the model's."""
    micro = [_batch(512, 2, 16, seed=1), _batch(512, 2, 16, seed=2)]
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
    for b in micro:
        tiny_llama(**b, num_items_in_batch=torch.tensor(n)).loss.backward()
    ref_grads = _grads(tiny_llama)
    losses = []
    for b in micro:
        loss = causal_lm_chunked_loss(tiny_llama, b, num_items_in_batch=torch.tensor(n))
        loss.backward()
        losses.append(loss.detach())
    ref = [tiny_llama(**b, num_items_in_batch=torch.tensor(n)).loss.detach() for b in micro]
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref))
    for a, b in zip(_grads(tiny_llama), ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_real_trainer_step_with_the_hook(tiny_llama, tmp_path):
    """``autofit.ChunkedLossTrainer.train()`` runs on the CPU without the head's forward
    (no full logits), with the same loss and the same updated weights as ``Trainer``."""
    from transformers import Trainer, TrainingArguments

    import autofit

    rows = [{k: v[i] for k, v in _batch(512, 4, 16, seed=3).items()} for i in range(4)]
    plain, chunked = tiny_llama, copy.deepcopy(tiny_llama)
    heads = []
    chunked.lm_head.register_forward_hook(lambda *a: heads.append(1))

    def train(cls, model, out):
        args = TrainingArguments(output_dir=str(tmp_path / out), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=1, use_cpu=True,
                                 report_to=[], logging_steps=1, save_strategy="no",
                                 optim="sgd", learning_rate=0.1, seed=0,  # linear in grads
                                 dataloader_drop_last=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = cls(model=model, args=args, train_dataset=rows)
            trainer.train()
        return next(h["loss"] for h in trainer.state.log_history if "loss" in h)

    ref = train(Trainer, plain, "plain")
    got = train(autofit.ChunkedLossTrainer, chunked, "chunked")
    assert not heads, "the Trainer hook ran the head's forward (full logits)"
    assert issubclass(autofit.ChunkedLossTrainer, Trainer)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-5)
    for a, b in zip(chunked.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_estimate_drops_about_the_logits():
    """A big vocabulary (16000 x h 64): the saving is the (B, T, V) fp32 logits, their
    log-softmax and gradients (2-3 logits' worth), by both methods, and each method's
    estimate with the chunked loss still holds the model's weights and states."""
    model = _llama(**BIG_VOCAB)
    B, T, V = 4, 128, BIG_VOCAB["vocab_size"]
    logits = B * T * V * 4
    for method in ("analytic", "simulate"):
        off = estimate(model, TrainConfig(micro_batch_size=B), seq_len=T, device="cpu",
                       method=method)
        on = estimate(model, TrainConfig(micro_batch_size=B, chunked_loss=True), seq_len=T,
                      device="cpu", method=method)
        saved = off.peak_allocated_bytes - on.peak_allocated_bytes
        assert 2 * logits <= saved <= 3 * logits, (method, saved / logits)
        assert on.breakdown["weights"] + on.breakdown["optimizer_states"] >= 3 * 4 * V * 64


def test_simulate_matches_a_real_step_with_the_chunked_loss():
    """The simulated step runs the same loss function as the real one: the recorder on
    real tensors and on fake ones sees the same peak (within 2%)."""
    from autofit.memory.simulate._model import fake_clone, prepare_for_training, weight_tensors
    from autofit.memory.simulate._recorder import StorageRecorder
    from autofit.memory.simulate._simulator import _fake_mode
    from autofit.memory.simulate._step import StepTarget, build_optimizer, run_steps

    model = _llama(**BIG_VOCAB)
    config = TrainConfig(micro_batch_size=2, chunked_loss=True)

    def peak(fake: bool) -> int:
        import contextlib

        mode = _fake_mode() if fake else contextlib.nullcontext()
        with mode:
            clone = fake_clone(model, float_dtype=torch.float32) if fake else copy.deepcopy(model)
        prepare_for_training(clone, gradient_checkpointing=False)
        rec = StorageRecorder()
        for t in weight_tensors(clone):
            rec.track(t, "weights")
        target = StepTarget("cpu")
        optimizer = build_optimizer(clone, config, target)
        with mode, rec:
            run_steps(clone, optimizer, config, task="causal-lm", seq_len=128, rec=rec,
                      target=target)
        live = top = 0
        for kind, r, _ in rec.events():
            live += r.size if kind == "alloc" else -r.size
            top = max(top, live)
        return top

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fake, real = peak(True), peak(False)
    # the fake run skips the middle chunks of torch's loop (same buffers, same stream)
    assert abs(fake - real) <= 0.02 * real, (fake, real)


def test_simulate_within_a_few_percent_of_a_measured_trial():
    """A trial in its own process (real tensors, the trial's step, peak RSS) against both
    estimates (the ordinary loss is within ~2.5% here too)."""
    from autofit import measure

    model = _llama(**BIG_VOCAB)
    config = TrainConfig(micro_batch_size=4, chunked_loss=True)
    sim = estimate(model, config, seq_len=128, device="cpu", method="simulate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trial = measure(model, config, seq_len=128, device="cpu", isolation="subprocess")
    assert not trial.oom
    ana = estimate(model, config, seq_len=128, device="cpu", method="analytic")
    for est in (sim, ana):
        err = (est.peak_allocated_bytes - trial.peak_allocated_bytes) / trial.peak_allocated_bytes
        assert abs(err) <= 0.05, (est.method, est.peak_allocated_bytes, trial.peak_allocated_bytes)


def test_cli_flag_lowers_the_estimate(capsys):
    from autofit.cli.main import main

    def peak(*extra: str) -> dict:
        rc = main(["estimate", "tiny-llama", "--batch-size", "8", "--seq-len", "256",
                   "--device", "cpu", "--json", *extra])
        assert rc == 0
        return json.loads(capsys.readouterr().out)

    off, on = peak(), peak("--chunked-loss")
    assert on["config"]["chunked_loss"] is True and off["config"]["chunked_loss"] is False
    logits = 8 * 256 * 32000 * 4  # (B, T, V) fp32 of tiny-llama's 32k vocabulary
    assert off["peak_allocated_bytes"] - on["peak_allocated_bytes"] >= logits


def test_tune_options_restrict_the_knob():
    import argparse

    p = argparse.ArgumentParser()
    CHUNKED_LOSS.add_options(p)
    assert CHUNKED_LOSS.from_options(p.parse_args([])) is None  # searched
    assert CHUNKED_LOSS.from_options(p.parse_args(["--chunked-loss"])) is True
    assert CHUNKED_LOSS.from_options(p.parse_args(["--no-chunked-loss"])) is False
    with pytest.raises(SystemExit):
        p.parse_args(["--chunked-loss", "--no-chunked-loss"])


def test_note_names_the_trainer_hook_and_no_field_on_cpu(monkeypatch):
    import autofit
    from autofit.emit.training_args import training_arguments_dict
    from autofit.knobs import chunked_loss as mod

    note = CHUNKED_LOSS.note(True)
    assert "autofit.ChunkedLossTrainer" in note and CHUNKED_LOSS.note(False) is None
    assert hasattr(autofit, "ChunkedLossTrainer")
    on = TrainConfig(chunked_loss=True)
    assert "use_liger_kernel" not in training_arguments_dict(on, use_cpu=True)
    # liger-kernel importable: its field on a GPU plan, never on a CPU one
    monkeypatch.setattr(mod, "installed", lambda name: name == "liger_kernel")
    assert training_arguments_dict(on)["use_liger_kernel"] is True
    assert "use_liger_kernel" not in training_arguments_dict(on, use_cpu=True)
    assert "use_liger_kernel" not in training_arguments_dict(TrainConfig())


def test_searched_by_default_and_registered():
    assert CHUNKED_LOSS in KNOBS
    values, _ = CHUNKED_LOSS.defaults(None)
    assert values == (False, True) and not any(CHUNKED_LOSS.changes_math(v) for v in values)
    assert CHUNKED_LOSS.saving is True


def test_not_offered_for_sequence_classification():
    from autofit.api import _space
    from autofit.probe.model import build_model
    from autofit.stages import TuneOptions

    module, task = build_model("tiny-llama", task="seq-cls")
    why = unsupported_reason(module, task)
    assert why and "seq-cls" in why
    assert unsupported_reason(build_model("tiny-llama")[0], "causal-lm") is None
    with pytest.raises(BadInputError, match="chunked loss"):
        estimate("tiny-llama", TrainConfig(chunked_loss=True), seq_len=32, device="cpu",
                 task="seq-cls")
    from autofit import measure

    with pytest.raises(BadInputError, match="chunked loss"):
        measure("tiny-llama", TrainConfig(chunked_loss=True), seq_len=32, device="cpu",
                task="seq-cls")

    class Probed:  # what _space reads of the probed model
        device = __import__("autofit.probe.device", fromlist=["x"]).resolve_device("cpu")
        data = type("D", (), {"num_samples": 8})()

    probed = Probed()
    probed.module, probed.task = module, task
    reasons: list[str] = []
    space = _space(probed, None, TuneOptions(), reasons).space
    assert space.values("chunked_loss") == (False,)
    assert any(r.startswith("no chunked loss:") for r in reasons)
    with pytest.raises(BadInputError, match="chunked loss"):
        _space(probed, None, TuneOptions(knobs={"chunked_loss": [False, True]}), [])
    causal = type("P", (), {"device": probed.device, "data": probed.data,
                            "module": build_model("tiny-llama")[0], "task": "causal-lm"})()
    space = _space(causal, None, TuneOptions(trainer="autofit"), []).space
    assert space.values("chunked_loss") == (False, True)
    space = _space(causal, None, TuneOptions(), []).space  # a plain Trainer does not run it: not searched
    assert space.values("chunked_loss") == (False,)


def test_where_liger_carries_it_its_weight_gradient_moment_is_held(monkeypatch):
    """On a CUDA plan with liger-kernel installed, use_liger_kernel carries the chunked loss,
    and liger's fused loss adds each chunk's (V, h) weight gradient through a product and
    its float32 copy (unless addmm accumulates into float32: bf16-mixed on sm >= 8). The
    analytic rule and the simulated step both hold that moment; without liger neither."""
    from autofit.knobs import chunked_loss as cl
    from autofit.memory.simulate._recorder import StorageRecorder
    from autofit.memory.simulate._step import StepTarget
    from autofit.probe.device import resolve_device

    h100 = resolve_device("H100-80GB")
    V, h, tokens = 32000, 256, 1024
    args = dict(accumulating=False, head_trainable=True)
    monkeypatch.setattr(cl, "liger_offered", lambda args: False)
    plain = cl.chunked_loss_bytes(tokens, V, h, 2, h100, **args)
    monkeypatch.setattr(cl, "liger_offered", lambda args: True)
    moment = cl.liger_moment_bytes(tokens, V, h, weight_bytes=2, logit_bytes=2, sm=90)
    assert moment >= 6 * V * h
    grads = tokens * h * 2 + V * h * 2
    assert cl.chunked_loss_bytes(tokens, V, h, 2, h100, **args) == max(grads + moment, plain)
    # bf16-mixed on an H100: addmm into the float32 gradient, nothing more than torch's
    mixed = cl.chunked_loss_bytes(tokens, V, h, 4, h100, autocast=True, **args)
    monkeypatch.setattr(cl, "liger_offered", lambda args: False)
    assert mixed == cl.chunked_loss_bytes(tokens, V, h, 4, h100, autocast=True, **args)
    monkeypatch.setattr(cl, "liger_offered", lambda args: True)
    assert cl.liger_moment_bytes(tokens, V, h, weight_bytes=4, logit_bytes=2, sm=90) == 0
    assert cl.liger_moment_bytes(tokens, V, h, weight_bytes=4, logit_bytes=2, sm=70) > 0

    # the simulated step holds the same moment once per op (a bf16 head on a CUDA target)
    from torch._subclasses.fake_tensor import FakeTensorMode

    def held_in_a_step() -> list[int]:
        rec = StorageRecorder()
        config = TrainConfig(precision="bf16-true", chunked_loss=True)
        CHUNKED_LOSS.recorded(config, rec, StepTarget("cuda", 90))
        with FakeTensorMode(), rec:
            x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(V, h, dtype=torch.bfloat16, requires_grad=True)
            y = torch.randint(0, V, (tokens,))
            torch.nn.functional.linear_cross_entropy(
                x, w, y, options=torch.nn.LinearCrossEntropyOptions())  # as autofit's loss
        return [r.size for kind, r, _ in rec.events() if kind == "alloc" and not r.storage]

    assert held_in_a_step() == [moment]
    monkeypatch.setattr(cl, "liger_offered", lambda args: False)
    assert held_in_a_step() == []
