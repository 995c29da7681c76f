"""The torch.compile knob: its fields, its search, its memory rule and its trial."""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch

from autofit import TrainConfig, estimate
from autofit.emit.training_args import training_arguments_dict
from autofit.knobs import KNOBS, TORCH_COMPILE, restrict
from autofit.probe.device import resolve_device

CPU = resolve_device("cpu")


def test_values_emit_and_read_round_trip():
    assert TORCH_COMPILE in KNOBS and TORCH_COMPILE.values == (False, True)
    args: dict = {}
    TORCH_COMPILE.emit(TrainConfig(torch_compile=True), args)
    assert args == {"torch_compile": True} and TORCH_COMPILE.read(args) is True
    # off: a backend or mode left in the user's arguments would turn it back on
    args = {"torch_compile": True, "torch_compile_mode": "max-autotune", "seed": 3}
    TORCH_COMPILE.emit(TrainConfig(), args)
    assert args == {"seed": 3} and TORCH_COMPILE.read(args) is False
    assert TORCH_COMPILE.read({"torch_compile_backend": "inductor"}) is True
    assert set(TORCH_COMPILE.fields) <= __import__(
        "autofit.knobs.base", fromlist=["x"]).training_arguments_fields()
    assert TORCH_COMPILE.flag(True) == "--torch-compile"
    assert "compiles" in TORCH_COMPILE.note(True) and TORCH_COMPILE.note(False) is None
    with pytest.raises(ValueError, match="torch_compile must be True or False"):
        TrainConfig(torch_compile="yes")


def test_hf_argument_parser_loads_the_emitted_fields():
    from transformers import HfArgumentParser, TrainingArguments

    d = training_arguments_dict(TrainConfig(micro_batch_size=2, torch_compile=True),
                                use_cpu=True)
    assert d["torch_compile"] is True
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(d)
    assert args.torch_compile is True and args.torch_compile_backend == "inductor"
    from autofit.preflight.trainer import config_of

    assert config_of(d).torch_compile is True  # `autofit check` reads it back
    assert config_of(args).torch_compile is True


def test_searched_only_when_asked():
    from autofit.api import _space
    from autofit.stages import TuneOptions

    reasons: list[str] = []
    assert restrict(TORCH_COMPILE, CPU, None, reasons) == (False,)
    assert restrict(TORCH_COMPILE, CPU, [False, True], reasons) == (False, True)
    assert restrict(TORCH_COMPILE, CPU, True, reasons) == (True,)
    assert not any(TORCH_COMPILE.changes_math(v) for v in TORCH_COMPILE.values)
    assert TORCH_COMPILE.saving is None and TORCH_COMPILE.suggest(CPU) == (True,)
    p = argparse.ArgumentParser()
    TORCH_COMPILE.add_options(p)
    assert TORCH_COMPILE.from_options(p.parse_args([])) is None  # the default: eager only
    assert TORCH_COMPILE.from_options(p.parse_args(["--torch-compile"])) == [False, True]
    assert TORCH_COMPILE.from_options(p.parse_args(["--no-torch-compile"])) is False

    from autofit.probe.model import build_model

    class Probed:  # what _space reads of the probed model
        device = CPU
        data = type("D", (), {"num_samples": 8})()

    probed = Probed()
    probed.module, probed.task = build_model("tiny-llama")
    space = _space(probed, None, TuneOptions(), []).space
    assert space.values("torch_compile") == (False,)
    space = _space(probed, None, TuneOptions(knobs={"torch_compile": [False, True]}), []).space
    assert space.values("torch_compile") == (False, True)


def test_missing_compiler_is_named(monkeypatch):
    from autofit.errors import MissingDependencyError
    from autofit.knobs import compile as mod

    monkeypatch.setattr(mod.shutil, "which", lambda name: None)
    with pytest.raises(MissingDependencyError, match="C\\+\\+ compiler"):
        TORCH_COMPILE.check(CPU, True)
    TORCH_COMPILE.check(CPU, False)
    TORCH_COMPILE.check(resolve_device("H100-80GB"), True)  # a plan: nothing to check here


def _llama(**kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)
    cfg.update(kw)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **cfg))


def test_memory_rule_direction_and_size():
    """The rule's saving for a llama block (the MLP's product and the key/value heads' net
    2 kv, less the materialised causal mask), taken off the eager estimate by both methods;
    nothing with the chunked loss (its backbone runs uncompiled), one block with
    checkpointing."""
    from autofit.memory.analytic import compile_saving_bytes
    from autofit.probe.model import describe

    model = _llama(intermediate_size=512)
    B, T, L, kv, i = 4, 64, 2, 32, 512
    info = describe(model, task="causal-lm")
    on = TrainConfig(micro_batch_size=B, torch_compile=True)
    per_block = (2 * kv + i) * 4  # fp32 elements -> bytes, per token
    expected = B * T * (L * per_block) - B * T * T * 4
    assert compile_saving_bytes(info, on, T) == expected > 0
    assert compile_saving_bytes(info, on.replace(gradient_checkpointing=True), T) == (
        B * T * per_block - B * T * T * 4)
    assert compile_saving_bytes(info, on.replace(chunked_loss=True), T) == 0
    bf16 = on.replace(precision="bf16-mixed")  # 16-bit activations; the loss's buffers
    assert compile_saving_bytes(info, bf16, T) == (
        B * T * (L * per_block // 2) - B * T * T * 2 + int(1.75 * B * T * 512 * 4))
    for method in ("analytic", "simulate"):
        eager = estimate(model, on.replace(torch_compile=False), seq_len=T, device="cpu",
                         method=method)
        compiled = estimate(model, on, seq_len=T, device="cpu", method=method)
        saved = eager.peak_allocated_bytes - compiled.peak_allocated_bytes
        assert saved == expected, (method, saved, expected)
        assert compiled.config["torch_compile"] is True
    # a long sequence on a narrow model: the (B, 1, T, T) mask costs more than it saves
    assert compile_saving_bytes(info, on, 2048) < 0


def test_memory_rule_for_gpt2_counts_the_dropout_masks():
    from autofit.memory.analytic import compile_saving_bytes
    from autofit.probe.model import probe_model

    info = probe_model("tiny-gpt2")
    b = info.blocks[0]
    assert b.num_dropouts == 2 and b.attention_dropout > 0 and info.embedding_dropout > 0
    T = 32
    per_token = b.count * (3 * b.intermediate_size * 4 + 3 * (2 * b.hidden_size + b.num_heads * T))
    per_token += 3 * info.hidden_size  # the embeddings' dropout mask
    per_token += info.vocab_size * 4  # one fp32 (B, T, V) buffer fewer at the loss backward
    assert compile_saving_bytes(info, TrainConfig(torch_compile=True), T) == T * per_token


def _gpt2(activation: str, vocab: int = 512, meta: bool = True):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=vocab,
                               n_positions=128, activation_function=activation)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(cfg)


def _gpt2_info(activation: str):
    from autofit.probe.model import describe

    return describe(_gpt2(activation), task="causal-lm")


def test_memory_rule_follows_the_mlp_activation():
    """What the compiled step stops keeping in the MLP is the activation's
    (benchmarks/results/compile_saved.md): gelu_new's Python ops three (B, T, i) tensors,
    torch's one-op tanh GELU none (the gelu_new rule put GPT-2 with it 11% under,
    gpt2t-b4s256-bf16t-compile), relu a bool mask more; an unmeasured one no saving and that
    mask (the safe side)."""
    from autofit.knobs.compile import compiled_saving_parts

    T, cfg = 32, TrainConfig(torch_compile=True)

    def blocks(act: str) -> int:
        return compiled_saving_parts(_gpt2_info(act), cfg, T, family="gpt2", element=4)[0]

    b = _gpt2_info("gelu_new").blocks[0]
    masks = 3 * (b.num_dropouts * b.hidden_size + b.num_heads * T)  # fp32 noise -> bool
    i = b.intermediate_size
    assert blocks("gelu_new") == T * b.count * (3 * i * 4 + masks)
    assert blocks("gelu_pytorch_tanh") == blocks("gelu") == T * b.count * masks
    assert blocks("relu") == T * b.count * (masks - i)
    assert blocks("mish") == blocks("relu")


def test_memory_rule_loss_coefficient_is_the_measured_model_types():
    """The loss's fused buffers were measured on each family's own model type; another of
    its block structure gets the least any family saves (OPT with GPT-2's 2.2 in bf16-true:
    11.7% under; with 1.65 +0.8%), and Gemma 2's soft-capped logits their measured 0.9
    more (26% over without)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from autofit.knobs.compile import compiled_saving_parts
    from autofit.probe.model import describe

    def loss_part(model_type: str, family: str, precision: str, **kw) -> float:
        cfg = AutoConfig.for_model(model_type, vocab_size=1000, **kw)
        with torch.device("meta"):
            info = describe(AutoModelForCausalLM.from_config(cfg), task="causal-lm")
        config = TrainConfig(torch_compile=True, precision=precision)
        rest = compiled_saving_parts(info, config, 8, family=family, element=2, cuda=True)[1]
        mask = 8 * 8 * {"llama": 1, "gpt2": 0}[family] * 2  # the causal mask llama's keeps
        return (rest + mask) / (8 * 1000 * 4)  # in fp32 (B, T, V) buffers

    small = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2)
    assert loss_part("llama", "llama", "bf16-true", **small) == pytest.approx(1.65)
    assert loss_part("gpt2", "gpt2", "bf16-true", n_layer=1, n_embd=64,
                     n_head=4) == pytest.approx(2.2)
    assert loss_part("gpt2", "gpt2", "bf16-mixed", n_layer=1, n_embd=64,
                     n_head=4) == pytest.approx(2.05)
    assert loss_part("opt", "gpt2", "bf16-true", num_hidden_layers=1, hidden_size=64,
                     ffn_dim=128, num_attention_heads=4,
                     word_embed_proj_dim=64) == pytest.approx(1.65)
    assert loss_part("qwen2", "llama", "bf16-mixed", **small) == pytest.approx(1.75)
    assert loss_part("gemma2", "llama", "bf16-true", head_dim=16,
                     **small) == pytest.approx(1.65 + 0.9)
    assert loss_part("gemma2", "llama", "32-true", head_dim=16, **small) == pytest.approx(0.0)


def test_memory_rule_blocks_only_of_the_model_types_measured_to_save_them():
    """The blocks' rule stands for the model types whose compiled blocks saved at least
    what it takes off (results/compile_saved_zoo.md); StableLM's saved half of it (+1024
    B a block and token over), so its blocks are estimated as eager, a bool mask more."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from autofit.knobs.compile import _BLOCKS_CHECKED, compiled_saving_parts
    from autofit.probe.model import describe

    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    config, T = TrainConfig(torch_compile=True, precision="bf16-true"), 16

    def blocks(model_type: str) -> tuple[int, object]:
        with torch.device("meta"):
            info = describe(AutoModelForCausalLM.from_config(
                AutoConfig.for_model(model_type, **small)), task="causal-lm")
        return compiled_saving_parts(info, config, T, family="llama", element=2,
                                     cuda=True)[0], info

    assert "mistral" in _BLOCKS_CHECKED and "stablelm" not in _BLOCKS_CHECKED
    saved, info = blocks("mistral")
    assert saved == T * 2 * (2 * 32 + 128) * 2 > 0  # 2 kv + i elements, bf16, 2 blocks
    saved, info = blocks("stablelm")
    assert saved == -T * 2 * 128  # nothing recomputed; an unmeasured bool mask more


def test_memory_rule_on_a_cuda_target_takes_off_no_dropout_mask():
    """CUDA's eager dropout (native_dropout) keeps a bool mask as the compiled step does, and
    its fused SDPA kernels drop out inside: on a CUDA target the rule's CPU masks are not
    taken off (with them, and the gelu_new rule on a tanh GELU, GPT-2 at 32 x 1024 tokens
    on an A100 was estimated at 6.3 GiB, its activations below zero)."""
    from autofit.memory.analytic import compile_saving_bytes
    from autofit.probe.model import describe

    model = _gpt2("gelu_pytorch_tanh", vocab=2048, meta=False)
    info = describe(model, task="causal-lm")
    on = TrainConfig(micro_batch_size=4, torch_compile=True, precision="bf16-true")
    B, T, a100 = 4, 128, resolve_device("A100-80GB")
    gpu = compile_saving_bytes(info, on, T, a100)
    # only the loss's fused buffers remain (2.2 fp32 (B, T, V) with 16-bit weights)
    assert gpu == int(2.2 * B * T * info.vocab_size * 4)
    assert compile_saving_bytes(info, on, T, CPU) > gpu
    assert compile_saving_bytes(info, on, T) == compile_saving_bytes(info, on, T, CPU)
    # both estimators take the CUDA rule's saving off the eager step
    for method in ("analytic", "simulate"):
        eager = estimate(model, on.replace(torch_compile=False), seq_len=T, device=a100,
                         method=method)
        compiled = estimate(model, on, seq_len=T, device=a100, method=method)
        assert eager.peak_allocated_bytes - compiled.peak_allocated_bytes == gpu, method


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values()) + sum(counters["frames"].values())


@pytest.mark.slow  # compiles a tiny llama's step (fwd + bwd, then eval): ~30-60 s on CPU
def test_trial_compiles_before_the_baseline_and_leaves_the_model_alone(monkeypatch):
    """A ``torch_compile`` trial on the CPU: every compilation happens in the set-up steps,
    before the baseline and outside the timed steps (``compile_s``, a note); the user's
    model is not compiled, wrapped or changed."""
    from autofit import measure
    from autofit.trial import loop
    from autofit.trial.step import RunSpec

    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = {id(m): set(vars(m)) for m in model.modules()}
    after_setup: list[int] = []
    real = loop._compile_steps

    def spy(*a, **kw):
        real(*a, **kw)
        after_setup.append(_compiled_graphs())

    monkeypatch.setattr(loop, "_compile_steps", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trial = measure(model, TrainConfig(micro_batch_size=2, torch_compile=True), seq_len=16,
                        device="cpu", isolation="in-process", measure_steps=2, timeout_s=None,
                        run=RunSpec(lengths=(12,), eval_batch_size=1))
    assert trial.fits and trial.steps == 2 and trial.config["torch_compile"] is True
    assert trial.compile_s is not None and any("torch.compile" in n for n in trial.notes)
    assert after_setup and after_setup[0] > 0
    assert _compiled_graphs() == after_setup[0], "a measured step compiled"
    assert trial.run_steps == 1 and trial.eval_device_total_bytes is not None
    # the user's module: same class, attributes, values, mode; no compiled call set on it
    assert "forward" not in vars(model) and getattr(model, "_compiled_call_impl", None) is None
    assert {id(m): set(vars(m)) for m in model.modules()} == attrs
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow  # a real Trainer step with torch_compile=True compiles (~30-60 s on CPU)
def test_a_real_trainer_step_with_the_emitted_fields(tmp_path):
    from transformers import HfArgumentParser, Trainer, TrainingArguments

    d = training_arguments_dict(TrainConfig(micro_batch_size=2, torch_compile=True),
                                base={"output_dir": str(tmp_path), "max_steps": 1,
                                      "report_to": [], "save_strategy": "no",
                                      "logging_steps": 1},
                                use_cpu=True)
    (args,) = HfArgumentParser(TrainingArguments).parse_dict(d)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids.clone()}
            for ids in torch.randint(0, 512, (4, 16), generator=g)]
    model = _llama()
    start = _compiled_graphs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
    assert trainer.args.torch_compile is True
    assert any("loss" in h for h in trainer.state.log_history)
    assert _compiled_graphs() > start  # the step ran compiled


def test_the_users_compile_mode_is_estimated_written_and_read_back():
    """A mode the user states (``torch_compile_mode``, a TrainingArguments field) goes
    into the estimate, the tuned file and back; a mode that captures CUDA graphs is
    refused on a card in one line (their private pool is not modelled: an estimate would
    be low), estimated on a CPU (no CUDA graphs there); a mode without compiling, or an
    unknown one, is an InvalidConfigError."""
    from autofit.emit.training_args import config_from_arguments
    from autofit.errors import InvalidConfigError, UnmodelledStepError

    cfg = TrainConfig(micro_batch_size=2, precision="bf16-mixed", torch_compile=True,
                      torch_compile_mode="reduce-overhead")
    for method in ("analytic", "simulate"):
        with pytest.raises(UnmodelledStepError) as e:
            estimate("tiny-llama", cfg, seq_len=64, device="A100-80GB", method=method)
        assert "\n" not in str(e.value) and "max-autotune-no-cudagraphs" in str(e.value)
    on_cpu = estimate("tiny-llama", cfg, seq_len=64, device="cpu")
    default = estimate("tiny-llama", cfg.replace(torch_compile_mode=None), seq_len=64,
                       device="cpu")
    assert on_cpu.peak_allocated_bytes == default.peak_allocated_bytes > 0
    safe = cfg.replace(torch_compile_mode="max-autotune-no-cudagraphs")
    assert estimate("tiny-llama", safe, seq_len=64, device="A100-80GB").peak_allocated_bytes > 0
    args = training_arguments_dict(safe)
    assert args["torch_compile"] is True
    assert args["torch_compile_mode"] == "max-autotune-no-cudagraphs"
    assert config_from_arguments(args).torch_compile_mode == "max-autotune-no-cudagraphs"
    # a mode alone turns compiling on, as TrainingArguments does
    assert config_from_arguments({"torch_compile_mode": "max-autotune"}).torch_compile
    for bad in (dict(torch_compile_mode="reduce-overhead"),
                dict(torch_compile=True, torch_compile_mode="fastest")):
        with pytest.raises(InvalidConfigError):
            TrainConfig(**bad)


def test_the_search_gives_the_compiled_candidates_the_users_mode():
    """The space's compile mode (the user's training_args) is every compiled candidate's;
    on a card, CUDA graphs' modes leave those candidates out with the refusal as reason."""
    from autofit.search import Engine, SearchSpace

    def est(c):
        from autofit.knobs.compile import check_compile_mode

        check_compile_mode(c, resolve_device("A100-80GB"))
        assert c.torch_compile_mode == ("reduce-overhead" if c.torch_compile else None)
        return (1 << 30) + (1 << 20) * c.micro_batch_size

    space = SearchSpace({"torch_compile": (False, True)}, (1, 2, 4),
                        compile_mode="reduce-overhead")
    out = Engine(space, 8 << 30, estimate=est, speed=lambda c: 2.0 if c.torch_compile else 1.0,
                 trial=None, seq_len=64).run()
    assert out.config is not None and not out.config.torch_compile
    refused = [c for c in out.candidates if c.choice["torch_compile"]]
    assert refused and all("CUDA graphs" in c.reason for c in refused)


def test_a_regional_compile_keeps_the_eager_loss(monkeypatch):
    """accelerate's regional compilation (``compile_regions``: the blocks compiled apart, the
    head and the loss eager) saves the blocks' part of the rule and none of the loss's: on a
    large vocabulary it needs more than a whole compile and less than eager, by both methods.
    It needs ``torch_compile``; the environment ``accelerate launch`` sets turns it on for a
    compiled file's fields, as the Trainer's TorchDynamoPlugin reads it."""
    from autofit.emit.training_args import config_from_arguments
    from autofit.errors import InvalidConfigError
    from autofit.knobs.compile import REGIONAL_ENV
    from autofit.memory.analytic import compile_saving_bytes
    from autofit.probe.model import describe

    model = _llama(intermediate_size=512, vocab_size=8192)
    info = describe(model, task="causal-lm")
    B, T = 4, 64
    whole = TrainConfig(micro_batch_size=B, precision="bf16-true", torch_compile=True)
    regional = whole.replace(torch_compile_regional=True)
    blocks_only = compile_saving_bytes(info, regional, T)
    assert 0 < blocks_only < compile_saving_bytes(info, whole, T)
    for method in ("analytic", "simulate"):
        peaks = [estimate(model, c, seq_len=T, device="cpu", method=method).peak_allocated_bytes
                 for c in (whole.replace(torch_compile=False), regional, whole)]
        assert peaks[0] > peaks[1] > peaks[2], (method, peaks)
        # the loss's fp32 (B, T, V) buffers a whole compile fuses, at least one
        assert peaks[1] - peaks[2] > B * T * 8192 * 4, (method, peaks)
    with pytest.raises(InvalidConfigError) as e:
        TrainConfig(torch_compile_regional=True)
    assert "needs torch_compile=True" in str(e.value)
    fields = {"per_device_train_batch_size": 2, "torch_compile": True}
    monkeypatch.delenv(REGIONAL_ENV, raising=False)
    assert not config_from_arguments(fields).torch_compile_regional
    monkeypatch.setenv(REGIONAL_ENV, "True")  # what accelerate launch writes
    assert config_from_arguments(fields).torch_compile_regional
    assert not config_from_arguments({"per_device_train_batch_size": 2}).torch_compile_regional


def test_a_regional_trial_compiles_the_blocks_apart_and_leaves_the_model_alone():
    """The trial's module for a regional compile is accelerate's own ``compile_regions``: each
    decoder block is a compiled wrapper sharing the model's parameters, the rest eager; the
    user's model keeps its modules (nothing compiled on it)."""
    from autofit.trial.step import compile_model

    model = _llama()
    layers = list(model.model.layers)
    stepped = compile_model(model, None, regional=True)
    assert stepped is not model
    assert all(type(b).__name__ == "OptimizedModule" for b in stepped.model.layers)
    assert list(model.model.layers) == layers
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model.model.layers)
    assert {id(p) for p in stepped.parameters()} == {id(p) for p in model.parameters()}


@pytest.mark.slow  # compiles a tiny llama's blocks (fwd + bwd): ~20-40 s on CPU
def test_a_regional_trial_measures_the_compiled_blocks_and_leaves_the_model_alone():
    """A regional trial (accelerate's ``compile_regions``) compiles in its set-up steps,
    measures compiled steps, and leaves the user's model as it was (no compiled call on any
    of its blocks, the same values)."""
    from autofit import measure
    from autofit.trial.step import RunSpec

    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = {id(m): set(vars(m)) for m in model.modules()}
    start = _compiled_graphs()
    config = TrainConfig(micro_batch_size=2, torch_compile=True, torch_compile_regional=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trial = measure(model, config, seq_len=16, device="cpu", isolation="in-process",
                        measure_steps=2, timeout_s=None, run=RunSpec(lengths=(12,)))
    assert trial.fits and trial.steps == 2
    assert trial.config["torch_compile_regional"] is True and trial.compile_s is not None
    assert _compiled_graphs() > start
    assert {id(m): set(vars(m)) for m in model.modules()} == attrs
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_compiled_trl_step_is_not_taken_below_its_eager_one():
    """TRL's fused LM head (``loss_impl="trl"``) makes no full logits, so the loss part of
    the rule (fp32 (B, T, V) buffers fused) has nothing to take off, and its step compiled
    whole was measured above the eager one (half an fp32 tile more): not below its eager
    estimate, by both methods (the whole-model rule took 14% off:
    ``llama-b4s256-bf16m-trl-compile``). Compiled by regions the fused head runs eagerly
    and the blocks save what they save with the model's own loss
    (``llama-b4s256-bf16m-trl-compile-regional``: +0.2%)."""
    from autofit.memory.analytic import compile_saving_bytes
    from autofit.probe.model import describe

    model = _llama(vocab_size=4096)
    info = describe(model, task="causal-lm")
    trl = TrainConfig(micro_batch_size=4, precision="bf16-mixed", loss_impl="trl",
                      torch_compile=True)
    tile = 4 * 64 * 4096 * 4  # one fp32 (rows, vocab) tile at 4 x 64 tokens
    assert compile_saving_bytes(info, trl, 64) <= -tile // 2
    assert compile_saving_bytes(info, trl.replace(loss_impl="model"), 64) > 0
    regional = trl.replace(torch_compile_regional=True)
    assert compile_saving_bytes(info, regional, 64) == compile_saving_bytes(
        info, regional.replace(loss_impl="model"), 64) > 0
    for method in ("analytic", "simulate"):
        eager = estimate(model, trl.replace(torch_compile=False), seq_len=64, device="cpu",
                         method=method).peak_allocated_bytes
        whole = estimate(model, trl, seq_len=64, device="cpu", method=method)
        assert whole.peak_allocated_bytes >= eager, method
        by_regions = estimate(model, regional, seq_len=64, device="cpu", method=method)
        assert by_regions.peak_allocated_bytes < eager, method


def test_a_tune_inside_accelerate_launch_s_regional_environment_compiles_by_regions(
        monkeypatch, tmp_path):
    """Under ``accelerate launch --dynamo_use_regional_compilation`` (its environment) the
    compiled candidates are regional, said in a reason, and the tuned file gets the launch
    file that carries it."""
    from autofit.api import autofit
    from autofit.knobs.compile import REGIONAL_ENV

    monkeypatch.setenv(REGIONAL_ENV, "true")
    rows = [{"input_ids": list(range(1, 65))} for _ in range(16)]
    r = autofit("tiny-llama", rows, device="A100-80GB", torch_compile=[True],
                precision=["bf16-mixed"], optimizer=["adamw_torch"],
                gradient_checkpointing=False, max_micro_batch=4)
    assert r.config.torch_compile and r.config.torch_compile_regional
    assert any(x.startswith("regional torch.compile: ") and REGIONAL_ENV in x
               for x in r.reasons)
    r.save(tmp_path / "tuned.yaml")
    side = (tmp_path / "tuned-accelerate.yaml").read_text()
    assert "dynamo_use_regional_compilation: true" in side
    monkeypatch.delenv(REGIONAL_ENV)
    plain = autofit("tiny-llama", rows, device="A100-80GB", torch_compile=[True],
                    precision=["bf16-mixed"], optimizer=["adamw_torch"],
                    gradient_checkpointing=False, max_micro_batch=4)
    assert plain.config.torch_compile and not plain.config.torch_compile_regional


def test_a_training_args_file_that_compiles_has_compiling_searched_not_dropped():
    """``torch_compile: true`` in the user's training_args (the knob alone searches without
    compiling only) is searched with and without, said in a reason line: it was turned off
    unseen in the tuned file. Without it, or with ``torch_compile=`` given, as before."""
    from autofit.api import autofit

    rows = [{"input_ids": list(range(1, 65))} for _ in range(16)]
    kw = dict(device="A100-80GB", precision=["bf16-mixed"], optimizer=["adamw_torch"],
              gradient_checkpointing=False, max_micro_batch=4)
    base = {"output_dir": "out", "per_device_train_batch_size": 4, "torch_compile": True}
    r = autofit("tiny-llama", rows, training_args=base, **kw)
    assert {c["torch_compile"] for c in r.candidates} == {False, True}
    assert any(x.startswith("torch.compile: your training_args compile") for x in r.reasons)
    plain = autofit("tiny-llama", rows, training_args={**base, "torch_compile": False}, **kw)
    assert {c["torch_compile"] for c in plain.candidates} == {False}
    told = autofit("tiny-llama", rows, training_args=base, torch_compile=False, **kw)
    assert {c["torch_compile"] for c in told.candidates} == {False}
