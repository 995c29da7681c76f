"""Launch configs of a tuned run on several ranks (issue 14, item 3): the tuned file keeps
its TrainingArguments fields, a DeepSpeed JSON and an accelerate config go beside it, and
each loads with the library that reads it (``HfArgumentParser``, accelerate's
``load_config_from_file``, transformers' ``HfTrainerDeepSpeedConfig``). The command line
and ``autofit check`` read the ranks back. One slow test tunes on 2 CPU processes and
trains with the real launchers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autofit.cli import main
from autofit.config import TrainConfig
from autofit.emit import read_config, training_arguments_dict
from autofit.emit.launch import accelerate_config, launch_commands, launch_files
from autofit.knobs.base import installed
from autofit.memory.breakdown import MemoryEstimate
from autofit.result import FitResult

REPO = Path(__file__).resolve().parents[2]


def _load_accelerate(path: Path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    loaded = load_config_from_file(str(path))
    assert isinstance(loaded, ClusterConfig)
    again = ClusterConfig.from_yaml_file(str(path))
    assert again.distributed_type == loaded.distributed_type
    return loaded


def _estimate() -> MemoryEstimate:
    return MemoryEstimate(peak_allocated_bytes=1, peak_reserved_bytes=1, device_total_bytes=1,
                          capacity_bytes=2, breakdown={"weights": 1}, method="analytic",
                          device="cpu:1GiB", fits=True, peak_phase="backward")


def _save(tmp_path: Path, config: TrainConfig, name: str = "tuned.yaml") -> Path:
    kwargs = training_arguments_dict(config, use_cpu=True, output_dir=str(tmp_path / "out"))
    result = FitResult(config=config, estimate=_estimate(), trials=(), reasons=("why",),
                       confirmed=False, device="cpu:1GiB", training_arguments_kwargs=kwargs,
                       meta={"model": "tiny-llama", "task": "causal-lm", "seq_len": 64,
                             "device": "cpu:1GiB"})
    return result.save(tmp_path / name)


@pytest.mark.parametrize("strategy, offload, kind", [
    ("ddp", "none", "MULTI_GPU"),  # accelerate's multi-process launcher (MULTI_CPU: one process)
    ("fsdp", "none", "FSDP"),
    ("fsdp-shard-grad-op", "optimizer+params", "FSDP"),
    ("zero3", "optimizer+params", "DEEPSPEED"),
])
def test_accelerate_config_loads_with_accelerate(tmp_path, strategy, offload, kind):
    config = TrainConfig(nproc_per_node=4, strategy=strategy, offload=offload,
                         precision="bf16-mixed")
    args = training_arguments_dict(config, use_cpu=False)
    _, files, meta = launch_files(tmp_path / "tuned.yaml", config, args)
    for path, text in files.items():
        path.write_text(text)
    acc = _load_accelerate(tmp_path / "tuned-accelerate.yaml")
    assert acc.distributed_type.value == kind
    assert acc.num_processes == 4 and acc.num_machines == 1 and not acc.use_cpu
    if kind == "FSDP":
        assert acc.mixed_precision == "bf16"
        assert acc.fsdp_config == {
            "fsdp_version": 2, "fsdp_reshard_after_forward": strategy == "fsdp",
            "fsdp_offload_params": offload != "none",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT"}
    if kind == "DEEPSPEED":  # the precision is the DeepSpeed file's ("auto")
        assert acc.deepspeed_config == {
            "deepspeed_config_file": str(tmp_path / "tuned-deepspeed.json"),
            "zero3_init_flag": True}
        assert acc.mixed_precision is None
    assert meta["launch"]["commands"][0] == (
        f"accelerate launch --config_file {tmp_path / 'tuned-accelerate.yaml'} train.py")


def test_hybrid_sharding_carries_the_parallelism_config(tmp_path):
    config = TrainConfig(nproc_per_node=8, nnodes=2, strategy="hsdp")
    path = tmp_path / "acc.yaml"
    _, files, _ = launch_files(tmp_path / "tuned.yaml", config, training_arguments_dict(config))
    path.write_text(files[tmp_path / "tuned-accelerate.yaml"])
    acc = _load_accelerate(path)
    assert acc.distributed_type.value == "FSDP"
    assert acc.num_processes == 16 and acc.num_machines == 2
    assert acc.parallelism_config == {"parallelism_config_dp_replicate_size": 2,
                                      "parallelism_config_dp_shard_size": 8}
    cmds = launch_commands("tuned.yaml", config)
    assert cmds[1] == ("torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK "
                       "--master-addr $MAIN_ADDR --master-port 29500 train.py")


def test_one_rank_writes_nothing_beside():
    config = TrainConfig()
    args = training_arguments_dict(config)
    assert launch_files("tuned.yaml", config, args) == (args, {}, {})
    assert accelerate_config(TrainConfig(nproc_per_node=2))["num_processes"] == 2


def test_fsdp_tuned_file_loads_with_hf_argument_parser(tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    path = _save(tmp_path, TrainConfig(micro_batch_size=4, nproc_per_node=2, strategy="fsdp"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "tuned-accelerate.yaml", "tuned.yaml"]
    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(path))
    assert args.fsdp and args.fsdp_config["version"] == 2
    assert args.fsdp_config["reshard_after_forward"] is True
    fields, meta = read_config(path)
    assert meta["config"]["nproc_per_node"] == 2 and meta["config"]["strategy"] == "fsdp"
    assert meta["launch"]["accelerate_config"] == str(tmp_path / "tuned-accelerate.yaml")


@pytest.mark.skipif(not installed("deepspeed"), reason="TrainingArguments(deepspeed=) needs it")
def test_deepspeed_json_beside_keeps_auto_values_transformers_fills(tmp_path):
    from transformers import HfArgumentParser, TrainingArguments
    from transformers.integrations.deepspeed import (
        HfTrainerDeepSpeedConfig,
        unset_hf_deepspeed_config,
    )

    config = TrainConfig(micro_batch_size=3, grad_accum_steps=2, nproc_per_node=2,
                         strategy="zero2", offload="optimizer")
    path = _save(tmp_path, config)
    fields, meta = read_config(path)
    ds_path = tmp_path / "tuned-deepspeed.json"
    assert fields["deepspeed"] == str(ds_path) == meta["launch"]["deepspeed_config"]
    ds = json.loads(ds_path.read_text())
    assert ds["train_micro_batch_size_per_gpu"] == "auto"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(path))
    hf = HfTrainerDeepSpeedConfig(str(ds_path))
    try:
        hf.trainer_config_process(args)
        assert hf.config["train_micro_batch_size_per_gpu"] == 3
        assert hf.config["gradient_accumulation_steps"] == 2
        assert hf.config["gradient_clipping"] == 1.0
    finally:
        del hf
        unset_hf_deepspeed_config()
    _load_accelerate(tmp_path / "tuned-accelerate.yaml")


# ---------------------------------------------------------------- the command line


def test_offload_with_ddp_is_exit_2(capsys):
    code = main(["measure", "tiny-gpt2", "--batch-size", "1", "--seq-len", "16", "--device",
                 "cpu:1GiB", "--nproc-per-node", "2", "--strategy", "ddp", "--offload",
                 "optimizer"])
    err = capsys.readouterr().err
    assert code == 2
    assert "offloading (optimizer) needs a sharded strategy" in err
    assert len(err.strip().splitlines()) == 1


def test_tune_offload_with_ddp_is_exit_2(capsys, tmp_path):
    code = main(["tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", "cpu:1GiB",
                 "--nproc-per-node", "2", "--strategy", "ddp", "--offload", "optimizer",
                 "--no-cache", "-o", str(tmp_path / "t.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "needs a sharded strategy" in err
    assert not (tmp_path / "t.yaml").exists()


def test_chunked_loss_on_several_ranks_is_exit_2(capsys, tmp_path):
    code = main(["tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", "cpu:1GiB",
                 "--nproc-per-node", "2", "--chunked-loss", "--no-cache",
                 "-o", str(tmp_path / "t.yaml")])
    assert code == 2 and "chunked loss: one rank only" in capsys.readouterr().err


def test_check_reads_the_ranks_the_tuned_file_records(tmp_path, capsys):
    config = TrainConfig(micro_batch_size=2, nproc_per_node=2, strategy="fsdp", seq_len=64)
    path = _save(tmp_path, config)
    code = main(["check", str(path), "--no-trial", "--no-cache", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0, d
    assert d["config"]["nproc_per_node"] == 2 and d["config"]["strategy"] == "fsdp"
    assert any("2 ranks (fsdp)" in r for r in d["reasons"])
    code = main(["check", str(path), "--no-trial", "--no-cache", "--json", "--nnodes", "2"])
    assert json.loads(capsys.readouterr().out)["config"]["world_size"] == 4


def test_check_reads_the_launch_file_that_will_be_used(tmp_path, capsys):
    # issue 23: metadata edited to nproc_per_node 1000 was trusted, and an edited
    # <name>-accelerate.yaml never read: accelerate launches what the launch file says
    import re

    config = TrainConfig(micro_batch_size=2, nproc_per_node=2, strategy="fsdp", seq_len=64)
    path = _save(tmp_path, config)
    text = path.read_text()
    path.write_text(re.sub(r'"(nproc_per_node|world_size)":\s*2', r'"\1": 1000', text))
    side = tmp_path / "tuned-accelerate.yaml"
    code = main(["check", str(path), "--no-trial", "--no-cache", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["config"]["world_size"] == 2, d
    assert any("launch file beside it (2 x 1 nodes)" in r for r in d["reasons"])
    side.write_text(side.read_text().replace("num_processes: 2", "num_processes: 4"))
    main(["check", str(path), "--no-trial", "--no-cache", "--json"])
    assert json.loads(capsys.readouterr().out)["config"]["world_size"] == 4
    side.write_text(side.read_text().replace("num_processes: 4", "num_processes: many"))
    code = main(["check", str(path), "--no-trial", "--no-cache", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "num_processes must be a positive whole number" in err
    # without a launch file, the metadata's 1000 ranks per node are more than a node runs
    side.unlink()
    code = main(["check", str(path), "--no-trial", "--no-cache", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "1000 ranks per node" in err and "--nproc-per-node" in err
    assert len(err.strip().splitlines()) == 1
    code = main(["check", str(path), "--no-trial", "--no-cache", "--json",
                 "--nproc-per-node", "2"])
    assert code == 0 and json.loads(capsys.readouterr().out)["config"]["world_size"] == 2


def test_autofit_sets_the_device_s_ranks():
    from autofit import autofit

    data = [{"input_ids": list(range(1, 33))}] * 8
    r = autofit("tiny-llama", data, device="A100-80GB", nproc_per_node=4, nnodes=2,
                strategy=["fsdp"], target_batch_size=32)
    assert (r.config.nproc_per_node, r.config.nnodes, r.config.world_size) == (4, 2, 8)
    assert r.config.strategy == "fsdp" and r.config.effective_batch_size == 32
    assert r.training_arguments_kwargs["fsdp"] is True
    from autofit.errors import BadInputError

    with pytest.raises(BadInputError, match="world_size 3 is not nproc_per_node x nnodes"):
        autofit("tiny-llama", data, device="A100-80GB", nproc_per_node=2, world_size=3)


# ---------------------------------------------------------------- end to end


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", AUTOFIT_CACHE_DIR=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-3000:]}"
    return r.stdout + r.stderr


@pytest.mark.slow
def test_tune_on_two_ranks_then_train_with_the_real_launchers(tmp_path):
    """The issue's "done when": a 2-process CPU tune confirms its choice on both ranks and
    writes the tuned file + accelerate config; `accelerate launch` trains with them (on a CPU
    accelerate's FSDP falls back to DDP), and a torchrun FSDP2 step of the tuned file shards
    the model across the two ranks."""
    env = _env(tmp_path)
    model = str(REPO / "examples" / "tiny-model")
    _run([sys.executable, "-m", "autofit", "tune", model, "--dataset", "tiny-samples",
          "--device", "cpu:1GiB", "--nproc-per-node", "2", "--strategy", "fsdp",
          "--precision", "32-true", "--optim", "adamw_torch", "--no-gradient-checkpointing",
          "--max-micro-batch", "4", "--max-trials", "2", "-o", "tuned.yaml"],
         tmp_path, env, 1200)
    fields, meta = read_config(tmp_path / "tuned.yaml")
    assert meta["confirmed"] and meta["config"]["world_size"] == 2
    chosen = [t for t in meta["trials"] if t["micro_batch"] == fields[
        "per_device_train_batch_size"] and not t["oom"] and t["error"] is None]
    assert chosen and [r["rank"] for r in chosen[-1]["per_rank"]] == [0, 1]
    assert all(r["device_total_bytes"] for r in chosen[-1]["per_rank"])
    assert any(r.startswith("confirmed on every rank (2 processes)") for r in meta["reasons"])
    assert fields["fsdp"] is True and fields["use_cpu"] is True
    assert (tmp_path / "tuned-accelerate.yaml").is_file()
    _load_accelerate(tmp_path / "tuned-accelerate.yaml")
    out = _run(["accelerate", "launch", "--config_file", "tuned-accelerate.yaml",
                str(REPO / "examples" / "train.py"), "tuned.yaml"], tmp_path, env, 600)
    assert out.count("trained 2 steps") == 2  # one line per rank
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(REPO / "examples" / "fsdp_step.py"), "tuned.yaml"],
               tmp_path, env, 600)
    for rank in (0, 1):
        assert f"rank {rank}/2: FSDP2 step done" in out and "(50%)" in out


def test_a_regional_compile_writes_its_launch_file_even_on_one_rank(tmp_path, capsys,
                                                                   monkeypatch):
    """No TrainingArguments field carries a regional compile: a tuned file that chose one gets
    an accelerate config beside it (one process) whose ``dynamo_config`` accelerate loads, and
    the commands that run it; ``autofit check`` reads it back (checked as regional), and
    without the launch file the same fields are a whole compile."""
    from autofit.emit.launch import launch_settings
    from autofit.knobs.compile import REGIONAL_ENV

    monkeypatch.delenv(REGIONAL_ENV, raising=False)
    config = TrainConfig(micro_batch_size=8, precision="bf16-mixed", torch_compile=True,
                         torch_compile_regional=True, seq_len=64)
    cfg = accelerate_config(config)
    assert cfg["distributed_type"] == "NO" and cfg["num_processes"] == 1
    assert cfg["dynamo_config"]["dynamo_use_regional_compilation"] is True
    cmds = launch_commands("tuned.yaml", config)
    assert cmds == ["accelerate launch --config_file tuned-accelerate.yaml train.py",
                    f"{REGIONAL_ENV}=true python train.py"]
    path = _save(tmp_path, config)
    side = tmp_path / "tuned-accelerate.yaml"
    loaded = _load_accelerate(side)
    assert loaded.dynamo_config["dynamo_use_regional_compilation"] is True
    assert loaded.dynamo_config["dynamo_backend"] == "INDUCTOR"
    assert launch_settings(path) == {"nproc_per_node": 1, "nnodes": 1, "regional": 1}
    peaks = []
    for _ in range(2):
        code = main(["check", str(path), "--no-trial", "--no-cache", "--json",
                     "--seq-len", "512"])
        d = json.loads(capsys.readouterr().out)
        assert code in (0, 3), d  # fits, or does not: a verdict either way
        peaks.append((d["config"]["torch_compile_regional"],
                      d["estimate"]["peak_allocated_bytes"]))
        side.unlink(missing_ok=True)
    assert peaks[0][0] is True and peaks[1][0] is False
    assert peaks[0][1] > peaks[1][1]  # the eager loss a whole compile fuses
    # a whole compile on one rank writes nothing beside, as before
    whole = config.replace(torch_compile_regional=False)
    args = training_arguments_dict(whole)
    assert launch_files("tuned.yaml", whole, args) == (args, {}, {})


def test_an_fsdp_plan_checkpoints_through_fsdp_s_own_activation_checkpointing(tmp_path):
    """An FSDP plan that checkpoints writes it as FSDP's own activation checkpointing (the
    tuned file's ``fsdp_config`` and the accelerate config's ``fsdp_activation_checkpointing``)
    with the training argument off: the Trainer refuses both at once, and transformers prefers
    FSDP's under FSDP. TrainingArguments carries it to accelerate's plugin; read back, the
    plan checkpoints. With activation offloading (transformers offloads only through the
    training argument) the training argument stays."""
    from transformers import HfArgumentParser, TrainingArguments

    from autofit.emit.training_args import config_from_arguments

    config = TrainConfig(micro_batch_size=2, nproc_per_node=2, strategy="fsdp",
                         gradient_checkpointing=True, seq_len=64)
    path = _save(tmp_path, config)
    fields, _ = read_config(path)
    assert fields["fsdp_config"]["activation_checkpointing"] is True
    assert fields["activation_checkpointing"] is False
    assert "activation_checkpointing_kwargs" not in fields
    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(path))
    assert args.fsdp_plugin_args["activation_checkpointing"] is True
    assert not args.activation_checkpointing
    back = config_from_arguments(fields)
    assert back.gradient_checkpointing and back.strategy == "fsdp"
    loaded = _load_accelerate(tmp_path / "tuned-accelerate.yaml")
    assert loaded.fsdp_config["fsdp_activation_checkpointing"] is True
    # off: neither says it
    off = training_arguments_dict(config.replace(gradient_checkpointing=False))
    assert "activation_checkpointing" not in off["fsdp_config"] and not off[
        "activation_checkpointing"]
    assert "fsdp_activation_checkpointing" not in accelerate_config(
        config.replace(gradient_checkpointing=False))["fsdp_config"]
    offloaded = training_arguments_dict(config.replace(activation_offloading=True))
    assert offloaded["activation_checkpointing"] is True
    assert "activation_checkpointing" not in offloaded["fsdp_config"]
