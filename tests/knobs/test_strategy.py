"""The strategy and offload knobs: values, defaults by the number of ranks, what each
writes into TrainingArguments (read back by transformers), and what is refused."""

import argparse
import dataclasses

import pytest

from autofit import TrainConfig
from autofit.errors import InvalidConfigError, MissingDependencyError
from autofit.knobs import base, conflict
from autofit.knobs.strategy import OFFLOAD, STRATEGY, deepspeed_config
from autofit.probe.device import resolve_device

H100 = resolve_device("H100-80GB")
EIGHT = dataclasses.replace(H100, nproc_per_node=8)
TWO_NODES = dataclasses.replace(H100, nproc_per_node=8, nnodes=2)


def test_ranks_and_world_size_agree():
    assert TrainConfig(nproc_per_node=4, nnodes=2).world_size == 8
    assert TrainConfig(world_size=4).nproc_per_node == 4  # world_size alone: one node
    assert TrainConfig(nproc_per_node=2, nnodes=1, world_size=2).effective_batch_size == 2
    with pytest.raises(InvalidConfigError, match="nproc_per_node x nnodes"):
        TrainConfig(world_size=3, nproc_per_node=2)
    with pytest.raises(InvalidConfigError, match="positive integer"):
        TrainConfig(nnodes=0)
    assert TrainConfig(strategy="ZeRO-3", offload="cpu", world_size=2).offload == "optimizer+params"
    assert not TrainConfig(strategy="fsdp").sharded  # one rank shards nothing
    assert TrainConfig(strategy="fsdp", nproc_per_node=2).sharded


@pytest.mark.parametrize(("strategy", "offload", "match"), [
    ("ddp", "optimizer", "sharded strategy"),
    ("zero2", "optimizer+params", "needs ZeRO-3"),
    ("fsdp", "optimizer", "together"),
    ("nonsense", "none", "unknown strategy"),
    ("zero3", "disk", "unknown offload"),
])
def test_impossible_combinations_say_what_to_do(strategy, offload, match):
    with pytest.raises(InvalidConfigError, match=match):
        TrainConfig(strategy=strategy, offload=offload, nproc_per_node=2)
    if "unknown" not in match:
        assert conflict({"strategy": strategy, "offload": offload}) is not None


def test_defaults_depend_on_the_ranks(monkeypatch):
    assert STRATEGY.defaults(H100)[0] == ("ddp",)
    values, why = STRATEGY.defaults(EIGHT)
    assert values[0] == "ddp" and {"fsdp", "zero3"} <= set(values) and "hsdp" not in values
    assert "8 ranks" in why
    assert "hsdp" in STRATEGY.defaults(TWO_NODES)[0]
    assert OFFLOAD.defaults(EIGHT)[0] == ("none",)  # slow: only when asked
    assert STRATEGY.suggest(H100) == () and "zero3" in STRATEGY.suggest(EIGHT)
    # a present device without DeepSpeed: ZeRO left out of the search, refused when asked
    here = dataclasses.replace(resolve_device("cpu"), nproc_per_node=2)
    monkeypatch.setattr(base, "installed", lambda package: package != "deepspeed")
    values, why = STRATEGY.defaults(here)
    assert "zero1" not in values and "DeepSpeed is not installed" in why
    with pytest.raises(MissingDependencyError, match="autofit\\[deepspeed\\]"):
        STRATEGY.check(here, "zero2")
    STRATEGY.check(here, "zero2", run=False)  # an estimate runs nothing: no DeepSpeed needed
    STRATEGY.check(EIGHT, "zero2")  # a plan for cards that are not here needs nothing


def test_emitted_fields_are_read_by_transformers():
    from transformers import TrainingArguments

    args: dict = {}
    STRATEGY.emit(TrainConfig(nproc_per_node=2, strategy="fsdp-shard-grad-op",
                              offload="optimizer+params"), args)
    assert args == {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": False,
                                                  "cpu_offload": True}}
    ta = TrainingArguments("/tmp/autofit-test-out", use_cpu=True, **args)
    plugin = ta._process_fsdp_args() if hasattr(ta, "_process_fsdp_args") else None
    assert ta.fsdp_config["reshard_after_forward"] is False
    if isinstance(plugin, dict):  # transformers' kwargs for accelerate's FSDP plugin
        assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is False
        assert plugin["cpu_offload"] is True
    assert STRATEGY.read(args) == "fsdp-shard-grad-op" and OFFLOAD.read(args) == "optimizer+params"
    # one rank, or DDP: nothing sharded, and stale fields of an earlier choice are removed
    STRATEGY.emit(TrainConfig(strategy="ddp", nproc_per_node=2), args)
    assert args == {}


def test_deepspeed_config_by_stage_and_offload():
    z3 = deepspeed_config(3, "optimizer+params")["zero_optimization"]
    assert z3["stage"] == 3 and z3["offload_param"]["device"] == "cpu"
    assert z3["stage3_prefetch_bucket_size"] == "auto"  # transformers sizes it by the model
    z1 = deepspeed_config(1, "none")["zero_optimization"]
    assert "offload_optimizer" not in z1 and "stage3_prefetch_bucket_size" not in z1
    assert OFFLOAD.read({"deepspeed": deepspeed_config(2, "optimizer")}) == "optimizer"
    assert STRATEGY.read({"deepspeed": deepspeed_config(2, "optimizer")}) == "zero2"


def test_cli_options():
    p = argparse.ArgumentParser()
    STRATEGY.add_options(p)
    OFFLOAD.add_options(p)
    a = p.parse_args(["--strategy", "fsdp", "zero-3", "--offload", "optimizer"])
    assert STRATEGY.from_options(a) == ["fsdp", "zero3"] and OFFLOAD.from_options(a) == ["optimizer"]
    with pytest.raises(SystemExit):
        p.parse_args(["--strategy", "tensor-parallel"])
