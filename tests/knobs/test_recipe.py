"""The user's launch recipe (autofit.knobs.recipe): DeepSpeed configs, FSDP fields and
accelerate configs are what is estimated, checked and tuned. Nothing here needs DeepSpeed:
every estimate is for an absent card (H100-80GB)."""

import json

import pytest
import yaml

from autofit import TrainConfig, estimate
from autofit.cli import main
from autofit.errors import BadInputError
from autofit.knobs.recipe import read_recipe
from autofit.knobs.strategy import deepspeed_config

CARD = "H100-80GB"
TWO = TrainConfig(micro_batch_size=2, nproc_per_node=2, precision="bf16-mixed")


def _est(config=TWO, **kw):
    return estimate("tiny-llama", config, seq_len=128, device=CARD, **kw)


@pytest.mark.parametrize("stage,offload", [(1, "none"), (2, "none"), (3, "none"),
                                           (2, "optimizer"), (3, "optimizer+params")])
def test_autofits_own_deepspeed_config_estimates_as_the_strategy(stage, offload):
    """The config autofit emits for a strategy, given back as the user's, is that strategy."""
    ds = deepspeed_config(stage, offload)
    a = _est(TWO.replace(strategy=f"zero{stage}", offload=offload))
    b = _est(deepspeed_config=ds)
    assert (b.device_total_bytes, b.host_bytes) == (a.device_total_bytes, a.host_bytes)
    assert b.config["strategy"] == f"zero{stage}" and b.config["offload"] == offload


def test_a_user_config_estimates_as_the_equivalent_sharding():
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8,
                                "stage3_param_persistence_threshold": 1e4},
          "bf16": {"enabled": True}}
    sharding = {"zero_sizes": "deepspeed",
                "zero_overrides": (("reduce_bucket_size", int(5e8)),
                                   ("param_persistence_threshold", 10000))}
    a = _est(TWO.replace(strategy="zero3"), sharding=sharding)
    b = _est(TrainConfig(micro_batch_size=2, nproc_per_node=2), deepspeed_config=ds)
    assert b.device_total_bytes == a.device_total_bytes
    assert b.config["precision"] == "bf16-mixed"  # bf16.enabled true fixes it
    assert any(n.startswith("recipe: ZeRO-3 from the inline deepspeed config "
                            "(reduce_bucket_size 5e8, stage3_param_persistence_threshold 1e4")
               for n in b.notes)


def test_a_larger_bucket_costs_more():
    small = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e6}}
    large = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2e8}}
    assert _est(deepspeed_config=large).device_total_bytes > _est(
        deepspeed_config=small).device_total_bytes


def test_a_higher_persistence_threshold_keeps_more_parameters_whole():
    # reuse distance 0: a gathered parameter is released after use unless it persists
    def zero(threshold):
        return {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0,
                                      "stage3_param_persistence_threshold": threshold}}
    a, b = _est(deepspeed_config=zero(0)), _est(deepspeed_config=zero(1e7))
    assert b.breakdown["weights"] > a.breakdown["weights"]
    assert b.device_total_bytes > a.device_total_bytes


def test_a_longer_reuse_distance_keeps_more_gathered():
    def zero(distance):
        return {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": distance}}
    assert _est(deepspeed_config=zero(1e9)).device_total_bytes > _est(
        deepspeed_config=zero(0)).device_total_bytes


def test_deepspeeds_own_optimizer_sets_the_states():
    zero = {"stage": 2}
    adam = _est(deepspeed_config={"zero_optimization": zero, "optimizer": {"type": "AdamW"}})
    sgd = _est(deepspeed_config={"zero_optimization": zero, "optimizer": {"type": "SGD"}})
    mom = _est(deepspeed_config={"zero_optimization": zero,
                                 "optimizer": {"type": "SGD", "params": {"momentum": 0.9}}})
    s = [e.breakdown["optimizer_states"] for e in (sgd, mom, adam)]
    assert s[0] == 0 < s[1] < s[2] and s[2] == 2 * s[1]
    assert adam.config["optimizer"] == "adamw_torch" and sgd.config["optimizer"] == "sgd"
    # DeepSpeed's Adam updates in place: no step temporaries, unlike the Trainer's AdamW
    trainer = _est(deepspeed_config={"zero_optimization": zero})
    assert adam.device_total_bytes <= trainer.device_total_bytes


def test_accelerate_config_gives_the_ranks(tmp_path):
    acc = tmp_path / "acc.yaml"
    acc.write_text(yaml.safe_dump({
        "distributed_type": "FSDP", "num_processes": 2, "num_machines": 1,
        "mixed_precision": "bf16",
        "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False,
                        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}))
    est = _est(TrainConfig(micro_batch_size=2), accelerate_config=str(acc))
    assert len(est.per_rank) == 2
    assert est.config["strategy"] == "fsdp-shard-grad-op"
    assert est.config["precision"] == "bf16-mixed"
    same = _est(TWO.replace(strategy="fsdp-shard-grad-op"))
    assert est.device_total_bytes == same.device_total_bytes


def test_accelerate_deepspeed_file_relative_to_the_yaml(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "Adam"}}))
    acc = tmp_path / "acc.yaml"
    acc.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "num_processes": 4,
                                   "num_machines": 2,
                                   "deepspeed_config": {"deepspeed_config_file": "ds.json"}}))
    r = read_recipe(accelerate=str(acc))
    assert (r.strategy, r.offload, r.nproc_per_node, r.nnodes) == ("zero3", "optimizer", 2, 2)


def test_a_training_args_fsdp_recipe():
    r = read_recipe(fsdp_fields={"fsdp": True, "fsdp_config": {
        "version": 2, "reshard_after_forward": True, "cpu_offload": True,
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}})
    assert (r.strategy, r.offload) == ("fsdp", "optimizer+params")
    assert "wraps LlamaDecoderLayer" in r.describe()


@pytest.mark.parametrize("ds,needle", [
    ({"zero_optimization": {"stage": 4}}, "unknown ZeRO stage 4"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both enabled"),
    ({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}, "needs ZeRO stage 3"),
    ({"optimizer": {"type": "Shampoo"}}, "not modelled"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, "a number or \"auto\""),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "zero_force_ds_cpu_optimizer"),
])
def test_bad_deepspeed_configs(ds, needle):
    with pytest.raises(BadInputError, match=needle):
        read_recipe(deepspeed=ds)


def test_numeric_batch_must_agree():
    with pytest.raises(BadInputError, match="train_micro_batch_size_per_gpu 4 .* 2"):
        _est(deepspeed_config={"train_micro_batch_size_per_gpu": 4,
                               "zero_optimization": {"stage": 2}})


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("content,flag,needle", [
    ("{not json", "--deepspeed-config", "not valid JSON"),
    (None, "--deepspeed-config", "no such file"),
    ('{"zero_optimization": {"stage": 9}}', "--deepspeed-config", "unknown ZeRO stage 9"),
    ('{"bf16": {"enabled": true}, "fp16": {"enabled": true}}', "--deepspeed-config",
     "both enabled"),
    ("distributed_type: XLA\nnum_processes: 2\n", "--accelerate-config",
     "distributed_type XLA is not modelled"),
    ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 1\n",
     "--accelerate-config", "FSDP1"),
])
def test_bad_recipes_exit_2_with_one_line(tmp_path, capsys, content, flag, needle):
    path = tmp_path / ("r.json" if flag == "--deepspeed-config" else "r.yaml")
    if content is not None:
        path.write_text(content)
    code, out, err = run(capsys, "estimate", "tiny-llama", "--batch-size", "2", "--seq-len",
                         "64", "--device", CARD, flag, str(path))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_check_reads_the_files_deepspeed_relative_to_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)  # not the file's folder
    (tmp_path / "ds.json").write_text(json.dumps(
        {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    args = tmp_path / "args.yaml"
    args.write_text(yaml.safe_dump({"per_device_train_batch_size": 2, "bf16": True,
                                    "deepspeed": "ds.json"}))
    code, out, _ = run(capsys, "check", str(args), "--model", "tiny-llama", "--seq-len", "64",
                       "--device", CARD, "--nproc-per-node", "2", "--json")
    d = json.loads(out)
    assert code == 0 and d["estimate"]["config"]["strategy"] == "zero3"
    assert any(r.startswith("recipe: ZeRO-3 from ds.json") for r in d["reasons"])
    # the file says fp32 but the DeepSpeed config bf16: transformers refuses the pair
    args.write_text(yaml.safe_dump({"per_device_train_batch_size": 2, "deepspeed": "ds.json"}))
    code, _, err = run(capsys, "check", str(args), "--model", "tiny-llama", "--seq-len", "64",
                       "--device", CARD, "--nproc-per-node", "2")
    assert code == 2 and "enables bf16" in err


def test_tune_keeps_the_users_recipe(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4},
          "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": "auto",
          "optimizer": {"type": "AdamW"}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = tmp_path / "tuned.yaml"
    code, stdout, _ = run(capsys, "tune", "tiny-llama", "--dataset", "tiny-samples", "--device",
                          CARD, "--nproc-per-node", "2", "--target-batch-size", "16",
                          "--deepspeed-config", str(tmp_path / "ds.json"), "-o", str(out),
                          "--json")
    assert code == 0
    d = json.loads(stdout)
    assert d["config"]["strategy"] == "zero3" and d["config"]["optimizer"] == "adamw_torch"
    assert any(r.startswith("recipe: ZeRO-3 from ds.json") for r in d["reasons"])
    fields = yaml.safe_load(out.read_text())
    written = json.loads((tmp_path / "tuned-deepspeed.json").read_text())
    assert fields["deepspeed"].endswith("tuned-deepspeed.json")
    # the user's config, the numeric batch set to the tuned one, "auto" kept
    assert written["train_micro_batch_size_per_gpu"] == fields["per_device_train_batch_size"]
    assert written["gradient_accumulation_steps"] == "auto"
    assert written["optimizer"] == {"type": "AdamW"}
    assert json.loads((tmp_path / "ds.json").read_text()) == ds  # never changed


@pytest.mark.parametrize("policy,precision", [
    ("bf16", "bf16-mixed"), ({"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}, "bf16-mixed"),
    ({"param_dtype": "float16"}, "16-mixed")])
def test_fsdp_mixed_precision_policy_fixes_the_precision(policy, precision):
    r = read_recipe(fsdp_fields={"fsdp": True, "fsdp_config": {
        "version": 2, "mixed_precision_policy": policy}})
    assert r.precision == precision


def test_an_fsdp_policy_reducing_in_fp32_is_refused():
    with pytest.raises(BadInputError, match="reduce_dtype float32 is not modelled"):
        read_recipe(fsdp_fields={"fsdp": True, "fsdp_config": {"mixed_precision_policy": {
            "param_dtype": "bfloat16", "reduce_dtype": "float32"}}})


def test_tune_keeps_training_args_fsdp_fields(tmp_path):
    from autofit import autofit

    data = [{"input_ids": list(range(1, 33))}] * 8
    fsdp_config = {"version": 2, "reshard_after_forward": False,
                   "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    r = autofit("tiny-llama", data, device=CARD, nproc_per_node=2, cache=False,
                training_args={"per_device_train_batch_size": 2, "fsdp": "full_shard",
                               "fsdp_config": fsdp_config})
    assert r.config.strategy == "fsdp-shard-grad-op"  # the recipe's, not searched
    assert r.training_arguments_kwargs["fsdp_config"] == fsdp_config
    assert any(x.startswith("recipe: FSDP2 (no reshard) from training_args") for x in r.reasons)
    with pytest.raises(BadInputError, match="fixes strategy zero3 but strategy="):
        autofit("tiny-llama", data, device=CARD, nproc_per_node=2, cache=False,
                strategy=["fsdp"], deepspeed_config={"zero_optimization": {"stage": 3}})


def test_tune_takes_the_ranks_from_the_accelerate_config():
    from autofit import autofit

    data = [{"input_ids": list(range(1, 33))}] * 8
    r = autofit("tiny-llama", data, device=CARD, cache=False, target_batch_size=8,
                accelerate_config={"distributed_type": "MULTI_GPU", "num_processes": 2})
    assert (r.config.world_size, r.config.strategy) == (2, "ddp")


def test_preflight_checks_the_arguments_deepspeed_recipe():
    import autofit

    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2e8}}
    args = {"per_device_train_batch_size": 2, "world_size": 2, "deepspeed": ds}
    r = autofit.preflight(args, model="tiny-llama", seq_len=64, device=CARD, cache=False)
    assert r.config.strategy == "zero3"
    assert any(x.startswith("recipe: ZeRO-3 from the training arguments "
                            "(reduce_bucket_size 2e8)") for x in r.reasons)


def test_accelerate_hsdp_across_nodes():
    r = read_recipe(accelerate={
        "distributed_type": "FSDP", "num_processes": 8, "num_machines": 2,
        "fsdp_config": {"fsdp_version": 2},
        "parallelism_config": {"parallelism_config_dp_replicate_size": 2,
                               "parallelism_config_dp_shard_size": 4}})
    assert (r.strategy, r.nproc_per_node, r.nnodes) == ("hsdp", 4, 2)


def test_measure_names_the_recipe():
    from autofit.trial import measure

    r = measure("tiny-gpt2", TrainConfig(micro_batch_size=1), seq_len=16, device="cpu",
                isolation="in-process", measure_steps=1,
                accelerate_config={"distributed_type": "NO"})
    assert r.fits and "recipe: one rank from the accelerate config" in r.notes


@pytest.mark.slow
def test_measure_runs_the_accelerate_configs_ranks(tmp_path):
    """2 FSDP2 ranks on the CPU from an accelerate config (measured here: 324 MB per rank
    for tiny-gpt2 at 1 x 32, 2.5 min on a busy machine)."""
    from autofit.trial import measure

    acc = tmp_path / "acc.yaml"
    acc.write_text(yaml.safe_dump({"distributed_type": "FSDP", "num_processes": 2,
                                   "mixed_precision": "no", "fsdp_config": {"fsdp_version": 2}}))
    r = measure("tiny-gpt2", TrainConfig(micro_batch_size=1), seq_len=32, device="cpu:2GiB",
                accelerate_config=str(acc))
    assert r.fits and len(r.per_rank) == 2 and r.config["strategy"] == "fsdp"


def test_a_sharded_recipe_on_one_rank_says_so():
    est = _est(TrainConfig(micro_batch_size=2), deepspeed_config={"zero_optimization": {"stage": 3}})
    assert any(n.startswith("one rank: ZeRO-3 has nothing to shard") for n in est.notes)


def test_the_simulated_estimate_uses_the_recipes_sizes():
    """The simulator tune and the whole run use (``Simulator(sharding=)``) and estimate's."""
    from autofit.memory.simulate import Simulator
    from autofit.probe.model import build_model

    def zero(bucket):
        return {"zero_optimization": {"stage": 2, "reduce_bucket_size": bucket}}
    config = TrainConfig(micro_batch_size=1, nproc_per_node=2, strategy="zero2")
    module, task = build_model("tiny-llama")
    small, large = (Simulator(module, task=task, device=CARD,
                              sharding=read_recipe(deepspeed=zero(b)).layout_fields)
                    .simulate(config, seq_len=128) for b in (1e5, 2e7))
    assert large.device_total_bytes > small.device_total_bytes
    same = _est(config, deepspeed_config=zero(2e7), method="simulate")
    assert same.device_total_bytes == large.device_total_bytes


def test_tune_training_args_file_with_its_own_deepspeed(tmp_path, capsys, monkeypatch):
    """``tune --training-args``: the file's deepspeed path is read relative to the file."""
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path.parent)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    args = tmp_path / "args.yaml"
    args.write_text(yaml.safe_dump({"per_device_train_batch_size": 2, "deepspeed": "ds.json",
                                    "model_name_or_path": "tiny-llama"}))
    out = tmp_path / "tuned.yaml"
    code, stdout, err = run(capsys, "tune", "--training-args", str(args), "--dataset",
                            "tiny-samples", "--device", CARD, "--nproc-per-node", "2",
                            "-o", str(out), "--json")
    assert code == 0, err
    d = json.loads(stdout)
    assert d["config"]["strategy"] == "zero2"
    assert any(r.startswith("recipe: ZeRO-2 from ds.json") for r in d["reasons"])


def test_an_accelerate_configs_dynamo_settings_fix_compiling_and_its_mode():
    """accelerate's ``dynamo_config`` compiles the model (its TorchDynamoPlugin): INDUCTOR
    fixes ``torch_compile`` and its ``dynamo_mode`` the mode, which the search keeps and the
    estimate refuses on a card where it captures CUDA graphs; NO fixes it off; another
    backend, or an unknown mode, is one line."""
    from autofit import TrainConfig, estimate
    from autofit.errors import BadInputError, UnmodelledStepError
    from autofit.knobs.recipe import read_recipe

    acc = {"distributed_type": "NO", "mixed_precision": "bf16",
           "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "reduce-overhead"}}
    recipe = read_recipe(accelerate=acc)
    assert recipe.search_constraints()["torch_compile"] == [True]
    assert "torch.compile (reduce-overhead)" in recipe.describe()
    config = recipe.apply(TrainConfig(micro_batch_size=2))
    assert config.torch_compile and config.torch_compile_mode == "reduce-overhead"
    with pytest.raises(UnmodelledStepError):
        estimate("tiny-llama", config, seq_len=64, device="A100-80GB")
    off = read_recipe(accelerate={**acc, "dynamo_config": {"dynamo_backend": "NO"}})
    assert off.search_constraints()["torch_compile"] == [False]
    assert not off.apply(TrainConfig()).torch_compile
    for bad in ({"dynamo_backend": "EAGER"}, {"dynamo_backend": "INDUCTOR", "dynamo_mode": "x"}):
        with pytest.raises(BadInputError) as e:
            read_recipe(accelerate={**acc, "dynamo_config": bad})
        assert "\n" not in str(e.value)


def test_an_accelerate_configs_regional_compilation_is_the_recipe():
    """``dynamo_use_regional_compilation: true`` (accelerate config's question "Do you want to
    enable regional compilation?") compiles each block apart: the recipe says so, the config
    it fixes carries it, and the estimate is above a whole compile's (the loss stays eager);
    a recipe that turns compiling off turns it off too."""
    from autofit import TrainConfig, estimate
    from autofit.knobs.recipe import read_recipe

    acc = {"distributed_type": "NO", "mixed_precision": "bf16",
           "dynamo_config": {"dynamo_backend": "INDUCTOR",
                             "dynamo_use_regional_compilation": True}}
    recipe = read_recipe(accelerate=acc)
    assert recipe.torch_compile_regional is True
    assert "regional torch.compile" in recipe.describe()
    config = recipe.apply(TrainConfig(micro_batch_size=2))
    assert config.torch_compile and config.torch_compile_regional
    whole = read_recipe(accelerate={**acc, "dynamo_config": {"dynamo_backend": "INDUCTOR"}})
    assert whole.torch_compile_regional is False
    peaks = [estimate("tiny-llama", r.apply(TrainConfig(micro_batch_size=8)), seq_len=512,
                      device="cpu").peak_allocated_bytes for r in (whole, recipe)]
    assert peaks[1] > peaks[0]  # at the backward peak: the loss's buffers
    off = read_recipe(accelerate={**acc, "dynamo_config": {"dynamo_backend": "NO"}})
    assert not off.apply(config).torch_compile_regional


def test_fsdp_s_own_activation_checkpointing_is_the_recipe_s():
    """FSDP's activation checkpointing (accelerate's ``fsdp_activation_checkpointing``, a
    training_args ``fsdp_config``'s ``activation_checkpointing``) fixes checkpointing on (the
    step recomputes every block), where it was read as no checkpointing (the search could
    then write the training argument too, which the Trainer refuses beside FSDP's); both on
    in one file is refused in one line."""
    from autofit import TrainConfig
    from autofit.errors import BadInputError
    from autofit.knobs.recipe import read_recipe, recipe_of_fields

    acc = {"distributed_type": "FSDP", "num_processes": 2, "mixed_precision": "bf16",
           "fsdp_config": {"fsdp_version": 2, "fsdp_activation_checkpointing": True}}
    recipe = read_recipe(accelerate=acc)
    assert recipe.gradient_checkpointing is True
    assert recipe.search_constraints()["gradient_checkpointing"] == [True]
    assert "activation checkpointing" in recipe.describe()
    assert recipe.apply(TrainConfig(micro_batch_size=2)).gradient_checkpointing
    plain = read_recipe(accelerate={**acc, "fsdp_config": {"fsdp_version": 2}})
    assert plain.gradient_checkpointing is None
    assert "gradient_checkpointing" not in plain.search_constraints()
    fields = {"per_device_train_batch_size": 8, "fsdp": "full_shard",
              "fsdp_config": {"version": 2, "activation_checkpointing": "true"}}
    assert recipe_of_fields(fields, "train.yaml").gradient_checkpointing is True
    with pytest.raises(BadInputError) as e:
        recipe_of_fields({**fields, "activation_checkpointing": True}, "train.yaml")
    assert "\n" not in str(e.value) and "both on" in str(e.value)


def test_an_accelerate_configs_fp8_is_refused_not_read_as_unsaid():
    """``mixed_precision: fp8`` (TransformerEngine, torchao, MS-AMP: scaled fp8 copies autofit
    does not model) was read as no precision said (searched); now one line, as any value
    accelerate does not have."""
    from autofit.errors import BadInputError
    from autofit.knobs.recipe import read_recipe

    for said in ("fp8", "int4"):
        with pytest.raises(BadInputError) as e:
            read_recipe(accelerate={"distributed_type": "NO", "mixed_precision": said})
        assert "\n" not in str(e.value) and f"mixed_precision {said} is not modelled" in str(
            e.value)
    assert read_recipe(accelerate={"distributed_type": "NO", "mixed_precision": "no"}
                       ).precision == "32-true"
    assert read_recipe(accelerate={"distributed_type": "NO"}).precision is None
