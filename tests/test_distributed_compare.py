"""benchmarks/distributed_compare.py: a measured spec becomes the config and launch recipe
that was measured, and offload rows compare device + host bytes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "distributed_compare.py"
_SPEC = importlib.util.spec_from_file_location("_autofit_distributed_compare", _PATH)
dc = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(dc)

SPEC = {"batch": 2, "seq": 256, "precision": "bf16-mixed", "gradient_checkpointing": False,
        "optimizer": "adamw_torch", "nproc": 2, "strategy": "fsdp", "offload": "none",
        "reshard_after_forward": False, "gradient_as_bucket_view": True, "bucket_cap_mb": 25}


def test_a_measured_spec_is_its_config_and_recipe():
    c = dc.config_of(SPEC)
    assert (c.strategy, c.world_size, c.precision) == ("fsdp-shard-grad-op", 2, "bf16-mixed")
    s = dc.sharding_of(SPEC, "measured")
    assert s["fsdp_recipe"] == "torch" and s["zero_optimizer"] == "deepspeed"
    assert s["gradient_as_bucket_view"] is True and s["zero_sizes"] == "auto"
    assert dc.sharding_of({**SPEC, "ds_buckets": "deepspeed-default"}, "measured")[
        "zero_sizes"] == "deepspeed"
    assert dc.sharding_of(SPEC, "trainer") is None


def test_offload_rows_compare_device_plus_host():
    rank = {"peak_allocated_bytes": 100, "host_bytes": 30}
    assert dc.compared(rank, "none") == 100
    assert dc.compared(rank, "optimizer") == 130
