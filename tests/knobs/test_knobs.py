"""The knobs: what each declares, and the generic parts built on the registry."""

import argparse
import warnings

import pytest

from autofit import TrainConfig
from autofit.errors import MissingDependencyError, UnsupportedPrecisionError
from autofit.knobs import CHECKPOINTING, KNOBS, OPTIMIZER, PRECISION, base, knob, owned_fields
from autofit.knobs.strategy import STRATEGY
from autofit.probe.device import resolve_device

A100, T4 = resolve_device("A100-80GB"), resolve_device("T4")


_WITH = {"activation_offloading": {"gradient_checkpointing": True},
         "strategy": {"nproc_per_node": 2}, "offload": {"nproc_per_node": 2, "strategy": "zero3"}}


def test_every_knob_is_a_trainconfig_field_with_declared_values():
    fields = set(TrainConfig.__dataclass_fields__)
    for k in KNOBS:
        assert k.name in fields, k.name
        assert k.values and all(k.normalize(v) == v for v in k.values)
        defaults, _ = k.defaults(A100)
        assert defaults and set(defaults) <= set(k.values)
        assert not any(k.changes_math(v) for v in defaults), f"{k.name} searches math changes"
        for v in k.values:  # every value reads, and round-trips through TrainingArguments
            assert k.describe(v) and k.short(v) and k.flag(v).startswith("--")
            args: dict = {}
            # activation offloading goes with checkpointing (it offloads what that keeps), a
            # strategy with several ranks, host offload with ZeRO-3
            config = TrainConfig(**{k.name: v}, **_WITH.get(k.name, {}))
            k.emit(config, args)
            assert set(args) <= set(k.fields), (k.name, set(args) - set(k.fields))
            if k.name == "activation_offloading":
                CHECKPOINTING.emit(config, args)
                k.emit(config, args)
            if k.name == "offload":  # written into the strategy's DeepSpeed config
                STRATEGY.emit(config, args)
            if k.name == "chunked_loss" and v and not args:
                # no TrainingArguments field without liger-kernel: the note names the hook
                assert "autofit.ChunkedLossTrainer" in k.note(v)
            elif k.name == "strategy" and v == "hsdp":
                # hybrid replication is accelerate's parallelism_config (the accelerate
                # config file); TrainingArguments hold FSDP2 itself
                assert k.read(args) == "fsdp"
            elif k.name != "precision" or not k.changes_math(v):  # *-true is not a field
                assert k.read(args) == v, (k.name, v, args)


def test_bf16_on_a_card_without_it():
    with pytest.raises(UnsupportedPrecisionError, match="16-mixed"):
        PRECISION.check(T4, "bf16-mixed")
    PRECISION.check(T4, "16-mixed")
    PRECISION.check(A100, "bf16-true")
    assert PRECISION.defaults(T4)[0] == ("16-mixed", "32-true")
    assert PRECISION.changes_math("bf16-true") and not PRECISION.changes_math("bf16-mixed")
    assert "torch_dtype=torch.bfloat16" in PRECISION.note("bf16-true")
    assert PRECISION.note("bf16-mixed") is None


def test_a_bitsandbytes_optimizer_without_bitsandbytes(monkeypatch):
    monkeypatch.setattr(base, "installed", lambda package: package != "bitsandbytes")
    with pytest.raises(MissingDependencyError, match="bitsandbytes"):
        OPTIMIZER.check(A100, "adamw_bnb_8bit")
    OPTIMIZER.check(A100, "adamw_torch")
    assert "adamw_bnb_8bit" not in OPTIMIZER.defaults(A100)[0]
    assert OPTIMIZER.suggest(A100) == ()
    monkeypatch.setattr(base, "installed", lambda package: True)
    assert "adamw_bnb_8bit" in OPTIMIZER.defaults(A100)[0]


def test_optimizer_math_and_calibration():
    assert not OPTIMIZER.changes_math("adamw_torch_fused")
    assert OPTIMIZER.changes_math("sgd") and OPTIMIZER.changes_math("adafactor")
    assert OPTIMIZER.calibrates_apart and not PRECISION.calibrates_apart
    args = {"optim_args": "old"}
    OPTIMIZER.emit(TrainConfig(optimizer="sgd", optim_args="momentum=0.9"), args)
    assert args == {"optim": "sgd", "optim_args": "momentum=0.9"}
    OPTIMIZER.emit(TrainConfig(), args)
    assert "optim_args" not in args


def test_checkpointing_uses_the_installed_transformers_field_names():
    fields = base.training_arguments_fields()
    new = "activation_checkpointing" in fields  # transformers 5.x renamed it
    args = {"gradient_checkpointing": False, "gradient_checkpointing_kwargs": None,
            "activation_checkpointing": False}  # what TrainingArguments.to_dict() holds in 5.x
    CHECKPOINTING.emit(TrainConfig(gradient_checkpointing=True), args)
    name = "activation_checkpointing" if new else "gradient_checkpointing"
    assert args == {name: True, f"{name}_kwargs": {"use_reentrant": False}}
    assert CHECKPOINTING.read(args) is True
    from transformers import TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated name warns
        ta = TrainingArguments(output_dir="unused", use_cpu=True, **args)
    assert getattr(ta, name) is True
    CHECKPOINTING.emit(TrainConfig(gradient_checkpointing=False), args)
    assert args == {name: False}
    assert CHECKPOINTING.read({"gradient_checkpointing": True}) is True  # an old file reads


def test_cli_options_come_from_the_knobs():
    p = argparse.ArgumentParser()
    for k in KNOBS:
        k.add_options(p)
    a = p.parse_args(["--precision", "bf16-mixed", "32-true", "--no-gradient-checkpointing",
                      "--optim", "sgd", "--chunked-loss", "--activation-offloading",
                      "--torch-compile", "--strategy", "zero3", "--offload", "optimizer",
                      "--liger-kernels"])
    assert [k.from_options(a) for k in KNOBS] == [["bf16-mixed", "32-true"], False, ["sgd"], True,
                                                  True, True, [False, True], ["zero3"],
                                                  ["optimizer"]]
    a = p.parse_args([])
    assert [k.from_options(a) for k in KNOBS] == [None] * len(KNOBS)


def test_registry():
    assert knob("optimizer") is OPTIMIZER
    assert {"bf16", "fp16", "optim", "optim_args", "activation_checkpointing"} <= set(owned_fields())
    from autofit.errors import BadInputError

    with pytest.raises(BadInputError, match="unknown knob"):
        knob("nope")


def test_one_configurations_options_come_from_the_knobs():
    # `autofit estimate` / `measure`: one value per knob, defaults = TrainConfig's
    from autofit.cli.options import add_config_options, train_config

    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    add_config_options(p)
    a = p.parse_args(["--batch-size", "2", "--seq-len", "64", "--precision", "bf16-mixed",
                      "--gradient-checkpointing", "--optim", "sgd", "--optim-args",
                      "momentum=0.9", "--torch-compile"])
    assert train_config(a) == TrainConfig(micro_batch_size=2, seq_len=64, precision="bf16-mixed",
                                          gradient_checkpointing=True, optimizer="sgd",
                                          optim_args="momentum=0.9", torch_compile=True)
    assert train_config(p.parse_args(["--batch-size", "1"])) == TrainConfig()


def test_checkpointing_every_n_layers_is_refused_where_it_would_be_estimated(tmp_path, capsys):
    """transformers 5's ``activation_checkpointing_kwargs={"every_n_layers": n}`` checkpoints
    every n-th layer only (the rest keep their activations): a file that runs it is refused in
    one line where it would be estimated as every layer checkpointed (``autofit check``, the
    callback's ``config_of``), where it was read as plain checkpointing, low; a tune says it
    and writes every layer checkpointed; 1 is the usual behaviour."""
    import json

    from autofit.api import autofit
    from autofit.cli import main
    from autofit.emit import write_config
    from autofit.errors import UnmodelledStepError
    from autofit.preflight.trainer import config_of

    fields = {"per_device_train_batch_size": 2, "activation_checkpointing": True,
              "activation_checkpointing_kwargs": {"every_n_layers": 2}}
    with pytest.raises(UnmodelledStepError) as e:
        config_of(fields)
    assert "\n" not in str(e.value) and "every_n_layers 2" in str(e.value)
    assert config_of({**fields, "activation_checkpointing_kwargs": {"every_n_layers": 1}}
                     ).gradient_checkpointing
    path = tmp_path / "train.yaml"
    write_config(path, fields, {})
    code = main(["check", str(path), "--model", "tiny-llama", "--seq-len", "64", "--device",
                 "cpu:2GiB", "--no-trial", "--no-cache", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "every_n_layers 2" in err and len(err.strip().splitlines()) == 1
    rows = [{"input_ids": list(range(1, 33))} for _ in range(8)]
    r = autofit("tiny-llama", rows, device="A100-80GB", training_args=dict(fields),
                gradient_checkpointing=True, precision=["bf16-mixed"],
                optimizer=["adamw_torch"], max_micro_batch=2)
    assert any("every_n_layers 2: not modelled" in x for x in r.reasons)
    kw = r.training_arguments_kwargs.get("activation_checkpointing_kwargs")
    assert r.config.gradient_checkpointing and "every_n_layers" not in json.dumps(kw)


def test_checkpointing_narrowed_off_for_a_model_that_refuses_it():
    """ALBERT (like CTRL, XLM, MPNet, ...) says ``supports_gradient_checkpointing = False``:
    the Trainer raises at start, so a tune never searches it (a reason says why), asking
    for it is one line, and the estimate refuses it as the simulation does."""
    from transformers import AlbertConfig, AlbertForMaskedLM, LlamaConfig, LlamaForCausalLM

    from autofit.errors import BadInputError
    from autofit.knobs.base import Scope

    albert = AlbertForMaskedLM(AlbertConfig(hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=64,
                                            embedding_size=16, vocab_size=64))
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=64,
                                         vocab_size=64))
    for asked in (None, [True, False], False):
        reasons: list[str] = []
        scope = Scope(albert, "masked-lm", A100, "plain", "model", None, reasons)
        if asked == [True, False]:
            with pytest.raises(BadInputError, match="AlbertForMaskedLM does not support it"):
                CHECKPOINTING.narrow(asked, scope)
            continue
        assert CHECKPOINTING.narrow(asked, scope) is False
        assert reasons == ["no gradient checkpointing: AlbertForMaskedLM does not support it "
                           "(transformers refuses it at start)"]
        llama_scope = Scope(llama, "causal-lm", A100, "plain", "model", None, reasons)
        assert CHECKPOINTING.narrow(asked, llama_scope) == asked  # as asked, no reason added
        assert len(reasons) == 1
    with pytest.raises(BadInputError, match="drop"):
        CHECKPOINTING.check_model(True, albert, "masked-lm")
    CHECKPOINTING.check_model(False, albert, "masked-lm")
    CHECKPOINTING.check_model(True, llama, "causal-lm")
