"""The Liger kernels knob: a lever added through the knob hooks only (its module, the registry,
its TrainConfig field): the file it writes, where it may run, its memory rule (the stand-ins
of liger's kernels) against liger's published measurements, and the trial's isolation."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from autofit.config import TrainConfig
from autofit.errors import BadInputError, MissingDependencyError
from autofit.knobs import liger as liger_mod
from autofit.knobs.liger import LIGER, emulated
from autofit.knobs.registry import emit_fields, isolates, knob, patch_key
from autofit.probe.device import resolve_device


def _tiny(model_type: str = "llama") -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=300)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_stand_ins_compute_what_the_model_computes(model_type):
    """liger's kernels compute the same functions: the stand-ins' loss and gradients equal the
    model's own (float32), so the simulated step is the model's step."""
    m = _tiny(model_type).train()
    twin = copy.deepcopy(m)
    ids = torch.randint(0, 300, (2, 24))
    m(input_ids=ids, labels=ids).loss.backward()
    with emulated(twin):
        loss = twin(input_ids=ids, labels=ids).loss
        loss.backward()
    assert loss.item() == pytest.approx(m(input_ids=ids, labels=ids).loss.item(), rel=1e-6)
    for (name, a), b in zip(m.named_parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name


def test_the_stand_ins_are_taken_out_again():
    m = _tiny()
    import transformers.models.llama.modeling_llama as modeling

    rope = modeling.apply_rotary_pos_emb
    with emulated(m):
        assert modeling.apply_rotary_pos_emb is not rope
        assert "forward" in vars(m.model.layers[0].mlp)
    assert modeling.apply_rotary_pos_emb is rope
    assert not any("forward" in vars(mod) for mod in m.modules())


def test_the_file_turns_on_exactly_the_kernels_chosen(monkeypatch):
    monkeypatch.setattr("autofit.knobs.chunked_loss.liger_offered", lambda args: True)
    off = dict.fromkeys(liger_mod.FLAGS, False)  # every flag named: liger's default is on
    cases = {(True, False): dict(off, rms_norm=True, swiglu=True, rope=True),
             (False, True): dict(off, fused_linear_cross_entropy=True),
             (True, True): dict(off, rms_norm=True, swiglu=True, rope=True,
                                fused_linear_cross_entropy=True)}
    for (kernels, loss), expected in cases.items():
        args: dict[str, object] = {"liger_kernel_config": {"geglu": True}}  # the user's own
        emit_fields(TrainConfig(liger_kernels=kernels, chunked_loss=loss), args)
        assert args["use_liger_kernel"] is True and args["liger_kernel_config"] == expected
        assert LIGER.read(args) is kernels and knob("chunked_loss").read(args) is loss
    # neither: a user's own use_liger_kernel is turned off, not left to run what was not planned
    args = {"use_liger_kernel": True, "liger_kernel_config": {"layer_norm": True}}
    emit_fields(TrainConfig(), args)
    assert "use_liger_kernel" not in args and "liger_kernel_config" not in args
    # a file that says only use_liger_kernel runs all of liger's defaults: read as both on
    assert LIGER.read({"use_liger_kernel": True}) and knob("chunked_loss").read(
        {"use_liger_kernel": True})


def test_the_written_fields_build_training_arguments():
    from transformers import TrainingArguments

    args: dict[str, object] = {}
    emit_fields(TrainConfig(liger_kernels=True), args)
    ta = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[],
                           use_liger_kernel=args["use_liger_kernel"],
                           liger_kernel_config=args["liger_kernel_config"])
    assert ta.liger_kernel_config["swiglu"] is True


def test_where_it_may_run():
    with pytest.raises(BadInputError, match="Triton GPU kernels"):
        LIGER.check(resolve_device("cpu"), True, run=False)
    LIGER.check(resolve_device("H100-80GB"), True, run=False)  # estimated for a card
    LIGER.check(resolve_device("H100-80GB"), True, run=True)  # a planned card: no trial
    if not liger_mod.installed("liger_kernel"):
        present = dataclasses.replace(resolve_device("H100-80GB"), present=True)
        with pytest.raises(MissingDependencyError, match="autofit\\[liger\\]"):
            LIGER.check(present, True, run=True)
    assert LIGER.defaults(resolve_device("cpu"))[0] == (False,)
    with pytest.raises(BadInputError, match="model type 'gpt2'"):
        from transformers import GPT2Config, GPT2LMHeadModel

        LIGER.check_model(True, GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)),
                          "causal-lm")


def test_its_memory_rule_is_its_own_and_analytic_follows_the_simulation():
    """liger on: the simulated peak drops by what its kernels do not keep; the analytic
    estimate, derived from the same stand-ins, stays within 1% of the simulation."""
    from autofit.api import estimate

    m = _tiny()
    out = {}
    for on in (False, True):
        for method in ("simulate", "analytic"):
            config = TrainConfig(micro_batch_size=4, liger_kernels=on, precision="bf16-mixed")
            est = estimate(m, config, seq_len=256, device="H100-80GB", method=method)
            out[method, on] = est
    sim_off, sim_on = out["simulate", False], out["simulate", True]
    assert sim_on.breakdown["activations"] < 0.9 * sim_off.breakdown["activations"]
    assert sim_on.breakdown["weights"] == sim_off.breakdown["weights"]
    ana = out["analytic", True].peak_allocated_bytes
    assert abs(ana - sim_on.peak_allocated_bytes) / sim_on.peak_allocated_bytes < 0.01
    assert patch_key(TrainConfig(liger_kernels=True)) != patch_key(TrainConfig())


def test_the_stand_ins_against_liger_s_published_measurements():
    """liger-kernel's own measurements (A100-80GB) of transformers' LlamaMLP and its SwiGLU
    MLP: the simulation of each, the SwiGLU one with autofit's stand-in, within 2%."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        import liger_check
    finally:
        sys.path.pop(0)
    rows = liger_check.swiglu_rows(only=(1024,))
    assert {r[1] for r in rows} == {"liger", "huggingface"}
    for _, provider, x, published, simulated in rows:
        assert abs(simulated - published) / published < 0.02, (provider, x)


def test_a_trial_with_liger_runs_in_its_own_process():
    from autofit.trial.runner import _choose_isolation
    from autofit.trial.step import StepPlan

    plan = StepPlan(precision="32-true", gradient_checkpointing=False, grad_accum_steps=1,
                    optimizer_cls=torch.optim.SGD, optimizer_kwargs={}, decay_names=None,
                    config=TrainConfig(liger_kernels=True))
    assert isolates(plan.config) and not isolates(TrainConfig())
    dev = resolve_device("cpu")
    assert _choose_isolation("auto", dev, plan)[0] == "subprocess"
    with pytest.raises(BadInputError, match="cannot run"):
        _choose_isolation("in-process", dev, plan)


def test_a_trial_of_the_chunked_loss_liger_carries_runs_liger_s_loss(monkeypatch):
    """On a card where use_liger_kernel carries the chunked loss, the trial runs what the
    user's Trainer runs: liger applied to the trial's copy with its fused loss (and only
    that), the model's own forward as the loss, in a process of its own; on a CPU, or
    without liger, autofit's chunked loss as before."""
    from autofit.knobs import chunked_loss as cl
    from autofit.knobs.loss import causal_lm_chunked_loss
    from autofit.knobs.registry import prepare, trial_loss

    config = TrainConfig(chunked_loss=True)
    monkeypatch.setattr(cl, "liger_offered", lambda args: False)
    assert trial_loss(config, "cuda") is causal_lm_chunked_loss and not isolates(config)
    monkeypatch.setattr(cl, "liger_offered", lambda args: True)
    assert trial_loss(config, "cuda") is None
    assert trial_loss(config, "cpu") is causal_lm_chunked_loss
    assert isolates(config) == ("chunked loss",)
    applied = []
    monkeypatch.setattr("transformers.integrations.liger.apply_liger_kernel",
                        lambda module, cfg: applied.append(cfg))
    m = _tiny()
    prepare(config, m)
    assert applied == []  # a CPU copy: nothing applied
    monkeypatch.setattr(cl, "_on_cuda", lambda module: True)
    prepare(config, m)
    assert applied == [{"fused_linear_cross_entropy": True, "cross_entropy": False,
                        "rms_norm": False, "swiglu": False, "rope": False}]


def test_use_liger_kernel_on_a_model_liger_leaves_alone_checks_the_full_logits(tmp_path, capsys,
                                                                               monkeypatch):
    """A plain Trainer's ``use_liger_kernel`` on a model liger patches nothing in (GPT-2)
    runs the model's own loss over the full logits: ``autofit check`` estimates that, not
    the chunked loss (at 8 x 512 tokens in bf16 it said 0.6 GiB where the step holds 2.9),
    and says why; on a model liger patches (llama) the fused loss stays."""
    import json

    from autofit.cli import main

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))

    def check(model: str, fields: dict) -> tuple[str, str]:
        path = tmp_path / f"{model}-{len(fields)}.json"
        path.write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": 8,
                                    "bf16": True, **fields}))
        rc = main(["check", str(path), "--model", model, "--device", "H100-80GB",
                   "--seq-len", "512", "--json"])
        out = capsys.readouterr().out
        assert rc == 0, out
        report = json.loads(out)
        return report["estimate"]["device_total_bytes"], " ".join(report["reasons"])

    (liger, why), (plain, _) = (check("tiny-gpt2", f) for f in ({"use_liger_kernel": True}, {}))
    assert liger == plain and "liger patches nothing in tiny-gpt2" in why
    (liger, why), (plain, _) = (check("tiny-llama", f) for f in ({"use_liger_kernel": True}, {}))
    assert liger < plain and "liger patches nothing" not in why
    # the Python pre-flight of the same arguments, as a script calls it before train()
    from autofit import preflight

    args = {"output_dir": "out", "per_device_train_batch_size": 8, "bf16": True}
    liger, plain = (preflight({**args, **f}, model="tiny-gpt2", device="H100-80GB",
                              seq_len=512, cache=False)
                    for f in ({"use_liger_kernel": True}, {}))
    assert liger.estimate.device_total_bytes == plain.estimate.device_total_bytes
    assert any("liger patches nothing" in r for r in liger.reasons)
    # and the report of the file (its picture and page)
    pytest.importorskip("matplotlib")
    totals = []
    for f in ({"use_liger_kernel": True}, {}):
        path = tmp_path / f"report-{len(f)}.json"
        path.write_text(json.dumps({**args, **f}))
        rc = main(["report", str(path), "--model", "tiny-gpt2", "--device", "H100-80GB",
                   "--seq-len", "512", "-o", str(tmp_path / f"report-{len(f)}.html")])
        out = capsys.readouterr().out
        assert rc == 0, out
        totals.append([ln for ln in out.splitlines() if "device total" in ln])
        assert ("liger patches nothing in tiny-gpt2" in " ".join(out.split())) == bool(f)
    assert totals[0] == totals[1] and totals[0]


def test_a_model_liger_is_not_modelled_for_is_estimated_as_it_is(tmp_path, capsys, monkeypatch):
    """Asked for a model autofit does not model liger for, liger is refused in one line; a
    user's file with use_liger_kernel for such a model (GPT-2: liger applies nothing to it)
    is checked as the model is, with the same estimate as without the field."""
    import json

    from autofit.api import estimate
    from autofit.cli import main

    with pytest.raises(BadInputError, match="not model type 'gpt2'"):
        estimate("tiny-gpt2", TrainConfig(liger_kernels=True), seq_len=64, device="H100-80GB")
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    lines = []
    for fields in ({"use_liger_kernel": True}, {}):
        path = tmp_path / f"args{len(fields)}.json"
        path.write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": 2,
                                    "bf16": True, **fields}))
        rc = main(["check", str(path), "--model", "tiny-gpt2", "--device", "H100-80GB",
                   "--seq-len", "64"])
        out = capsys.readouterr().out
        assert rc == 0, out
        lines.append([ln for ln in out.splitlines() if "fits: estimated" in ln])
    assert lines[0] == lines[1] and lines[0]
