"""The several-process ground-truth harness (benchmarks/distributed_measure.py) and its
comparison script (benchmarks/distributed_accuracy.py): spec checks, result parsing, the
baseline/peak arithmetic, and one real 2-process DDP measurement (slow)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dm = _load("distributed_measure")
acc = _load("distributed_accuracy")
configs = _load("distributed_configs")

TINY = {  # ~0.37 M params: a 2-process step takes seconds
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 172, "vocab_size": 1024,
}


def _spec(**kw):
    s = configs.spec("t", "ddp")
    s.update(kw)
    return s


def test_configs_are_well_formed():
    cs = configs.CONFIGS
    assert len(cs) >= 16
    assert len({c["name"] for c in cs}) == len(cs)
    for c in cs:
        dm.check_spec(c)
        # measure_cpu's project-wide keys in order, then the six distributed ones
        n = len(dm.mc.SPEC_KEYS)
        assert list(c)[:n] == list(dm.mc.SPEC_KEYS)
        assert list(c)[n:n + len(dm.DIST_KEYS)] == list(dm.DIST_KEYS)
        assert set(list(c)[n + len(dm.DIST_KEYS):]) <= set(dm.DIST_OPTIONAL)
    kinds = {(c["strategy"], c["offload"], c["nproc"]) for c in cs}
    for strategy in dm.STRATEGIES:
        assert any(k[0] == strategy for k in kinds), strategy
    assert ("zero3", "optimizer+params", 2) in kinds and ("zero2", "optimizer", 2) in kinds
    assert any(c["nproc"] == 4 for c in cs)
    assert {c["precision"] for c in cs} == {"32-true", "bf16-mixed"}
    assert any(c["gradient_checkpointing"] for c in cs)
    assert any(not c["reshard_after_forward"] for c in cs)
    assert any(c["gradient_as_bucket_view"] for c in cs)


def test_bad_spec_lists_every_problem():
    bad = _spec(strategy="zero4", offload="everything", nproc=0, precision="fp8")
    del bad["bucket_cap_mb"]
    with pytest.raises(ValueError) as e:
        dm.check_spec(bad)
    msg = str(e.value)
    for part in ("missing keys ['bucket_cap_mb']", "nproc must be an int >= 1",
                 "strategy 'zero4'", "offload 'everything'", "precision 'fp8'"):
        assert part in msg, part


@pytest.mark.parametrize(("kw", "needle"), [
    ({"offload": "optimizer"}, "measured for zero1/2/3 only"),
    ({"strategy": "zero2", "offload": "optimizer+params"}, "needs strategy zero3"),
    ({"strategy": "fsdp", "gradient_as_bucket_view": True}, "applies to ddp only"),
    ({"reshard_after_forward": False}, "applies to fsdp only"),
    ({"strategy": "fsdp", "bucket_cap_mb": 50}, "applies to ddp only"),
    ({"ds_buckets": "trainer-auto"}, "ds_buckets applies to zero1/2/3 only"),
    ({"strategy": "zero1", "ds_buckets": "huge"}, "ds_buckets 'huge'"),
    ({"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj"]}}, "lora is not measured"),
    ({"task": "seq-cls"}, "task must be causal-lm"),
])
def test_spec_refuses_what_is_not_measured(kw, needle):
    with pytest.raises(ValueError, match=needle):
        dm.check_spec(_spec(**kw))


def test_deepspeed_config_is_the_trainers_resolution_of_autofits_emitted_one():
    z3 = dm._ds_config(_spec(strategy="zero3", offload="optimizer+params",
                             precision="bf16-mixed"))
    h = configs.LLAMA["hidden_size"]
    zero = z3["zero_optimization"]
    assert zero["stage"] == 3 and zero["reduce_bucket_size"] == h * h
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * h * h)
    assert zero["stage3_param_persistence_threshold"] == 10 * h
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert z3["bf16"]["enabled"] is True and z3["optimizer"]["type"] == "AdamW"
    z1 = dm._ds_config(_spec(strategy="zero1", ds_buckets="deepspeed-default"))
    assert z1["zero_optimization"] == {"stage": 1} and z1["bf16"]["enabled"] is False


def test_parse_rank_output_finds_the_marked_line_only():
    payload = {"rank": 1, "peak_bytes": 5}
    out = "noise\n" + dm.RESULT_MARK + json.dumps(payload) + "\nmore noise\n"
    assert dm.parse_rank_output(out) == payload
    assert dm.parse_rank_output("Traceback ...\nRuntimeError: boom\n") is None


def _rank(rank: int, peak: int) -> dict:
    return {"rank": rank, "peak_bytes": peak, "phase_peaks": {"forward": peak},
            "param_count": 10, "optimizer_class": "AdamW", "basic_optimizer_class": None,
            "zero_config": None, "torch_version": "t", "transformers_version": "x",
            "deepspeed_version": None, "spec": {}, "local_param_bytes": 1,
            "model_resident_bytes": 2, "steady_rss_after_step_bytes": 3,
            "first_step_peak_bytes": 4}


def test_combine_takes_the_rank_that_peaks():
    spec = _spec(nproc=3)
    r = dm.combine(spec, [_rank(2, 90), _rank(0, 100), _rank(1, 80)], wall_s=1.0)
    assert (r["peak_bytes"], r["peak_rank"]) == (100, 0)
    assert r["rank_spread"] == pytest.approx(0.2)
    assert [x["rank"] for x in r["ranks"]] == [0, 1, 2]
    assert "spec" not in r["ranks"][0] and r["optimizer_class"] == "AdamW"
    with pytest.raises(RuntimeError, match="expected 0..2"):
        dm.combine(spec, [_rank(0, 1), _rank(2, 1)], wall_s=1.0)


class _FakeMemory:
    """A process whose RSS/VmHWM the test drives: ``alloc``/``free`` move RSS."""

    def __init__(self, rss: int) -> None:
        self.rss = self.hwm = rss

    def alloc(self, n: int) -> None:
        self.rss += n
        self.hwm = max(self.hwm, self.rss)

    def free(self, n: int) -> None:
        self.rss -= n

    def reset(self) -> None:
        self.hwm = self.rss


def test_peak_and_phases_are_measured_above_the_baseline(monkeypatch):
    mem = _FakeMemory(rss=1000)
    monkeypatch.setattr(dm.mc, "_rss_bytes", lambda: mem.rss)
    monkeypatch.setattr(dm.mc, "_hwm_bytes", lambda: mem.hwm)
    monkeypatch.setattr(dm.mc, "_reset_hwm", mem.reset)
    baseline = mem.rss
    mem.alloc(50)  # the model's shard, built after the baseline
    steps = []

    def step(mark=None):
        mark = mark or (lambda phase: None)
        first = not steps
        steps.append(1)
        mark("forward")
        mem.alloc(300)  # activations
        mark("backward")
        mem.alloc(40)  # gradients
        mem.free(300)
        mark("optimizer")
        if first:
            mem.alloc(80)  # optimizer states, kept
        mem.alloc(10)  # a temporary of the step
        mem.free(10 + 40)
        mark(None)
        return 1.5

    r = dm.measure_steps(step, baseline)
    assert len(steps) == 3
    # the peak includes the shard (50) and the states (80) that exist before the step
    assert r["peak_bytes"] == 50 + 80 + 300 + 40
    assert r["first_step_peak_bytes"] == 50 + 300 + 40
    assert r["phase_peaks"] == {"forward": 50 + 80 + 300, "backward": 50 + 80 + 300 + 40,
                                "optimizer": 50 + 80 + 40 + 10}
    assert r["steady_rss_after_step_bytes"] == 50 + 80
    assert r["loss"] == 1.5


def test_accuracy_names_errors_and_offload():
    assert acc.autofit_strategy(configs.spec("a", "fsdp", reshard_after_forward=False)) \
        == "fsdp-shard-grad-op"
    assert acc.autofit_strategy(configs.spec("a", "zero3")) == "zero3"
    assert acc.estimate_caveat(configs.spec("a", "ddp", gradient_as_bucket_view=True))
    assert acc.estimate_caveat(configs.spec("a", "ddp")) is None
    assert acc.signed_error(110, 100) == pytest.approx(0.10)

    class Est:
        peak_allocated_bytes, host_bytes = 100, 30

    assert acc.compared_bytes(Est, None, "none") == 100
    assert acc.compared_bytes(Est, None, "optimizer") == 130
    assert acc.compared_bytes(Est, {"peak_allocated_bytes": 7, "host_bytes": 2}, "optimizer") == 9


def _measured(name: str, peaks: list[int], **kw) -> dict:
    spec = configs.spec(name, kw.pop("strategy", "ddp"), nproc=len(peaks), **kw)
    ranks = [{**_rank(i, p), "phase_peaks": {"forward": p, "backward": p - 1,
                                             "optimizer": p - 2}} for i, p in enumerate(peaks)]
    return dm.combine(spec, ranks, wall_s=1.0)


def test_accuracy_without_the_estimator_writes_the_measured_table(tmp_path, monkeypatch, capsys):
    measured = tmp_path / "m.json"
    measured.write_text(json.dumps([_measured("ddp-x", [700 * 2**20, 710 * 2**20]),
                                    _measured("fsdp-y", [400 * 2**20, 401 * 2**20],
                                              strategy="fsdp")]))
    monkeypatch.setattr(acc, "estimator_missing", lambda: "TrainConfig has no strategy yet")
    out = tmp_path / "acc"
    assert acc.main(["--measured", str(measured), "--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "Estimates not available:** TrainConfig has no strategy yet" in md
    assert "| ddp-x | 0.0 | 0.0 | 0.0 | 0.0 | 710.0 |" in md  # what the peak rank holds
    assert "| ddp-x | 2x ddp 32-true | 2x256 | 700.0 / 710.0 |" in md
    assert "| fsdp-y |" in md
    published = acc.load_published()
    assert all(f"| {p['id']} |" in md for p in published)
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["summary"] == {} and data["rows"][0]["measured"] == 710 * 2**20
    assert "skipping estimates" in capsys.readouterr().err


def test_published_rows_are_complete():
    rows = acc.load_published()
    assert 5 <= len(rows) <= 12
    keys = {"id", "model", "model_type", "model_config", "strategy", "offload", "gpu",
            "autofit_device", "nproc_per_node", "nnodes", "micro_batch", "seq_len", "precision",
            "optimizer", "gradient_checkpointing", "reported_value", "reported_unit", "metric",
            "source_url"}
    for r in rows:
        assert keys <= set(r), r["id"]
        assert r["source_url"].startswith("https://")
        assert r["strategy"] in ("ddp", "fsdp", "fsdp-shard-grad-op", "zero1", "zero2", "zero3")
        assert r["gradient_checkpointing"] in ("none", "full", "selective")
    assert len({r["id"] for r in rows}) == len(rows)


@pytest.mark.slow
def test_two_process_ddp_measures_each_rank():
    spec = configs.spec("tiny-ddp2", "ddp")
    spec.update(config=dict(TINY), batch=2, seq=64)
    r = dm.measure(spec, timeout_s=600)
    assert [x["rank"] for x in r["ranks"]] == [0, 1]
    params = r["param_count"]
    for x in r["ranks"]:
        # DDP: the full fp32 model on every rank, measured above a pre-model baseline
        assert x["local_param_bytes"] >= 4 * params
        # (0.899 of it measured on a Xeon, 0.74-0.90 from run to run on an EPYC: parameters
        # below glibc's 64 KiB mmap threshold reuse heap pages the imports left resident; a
        # baseline after the model would read ~0)
        assert x["model_resident_bytes"] >= 0.6 * 4 * params
        # weights + AdamW states (2 x fp32) stay; the peak adds gradients and activations
        assert x["steady_rss_after_step_bytes"] >= 0.9 * 12 * params
        assert x["peak_bytes"] > x["steady_rss_after_step_bytes"]
        assert set(x["phase_peaks"]) == {"forward", "backward", "optimizer"}
    assert r["rank_spread"] < 0.05
    assert r["optimizer_class"] == "AdamW"


def test_published_verdict_brackets_selective_checkpointing():
    g = 2**30
    row = {"reported_value": 80.0, "reported_unit": "GiB"}
    both = {"no_ckpt": {"reserved": 160 * g}, "ckpt": {"reserved": 50 * g}}
    assert acc.published_verdict(row, both) == "within the bracket"
    assert acc.published_verdict({**row, "reported_value": 40.0}, both) == \
        "below the bracket (+25.0%)"
    assert acc.published_verdict(row, {"ckpt": {"reserved": 88 * g}}) == "+10.0%"


def test_a_measured_spec_is_estimated_with_the_recipe_that_ran():
    spec = {"batch": 2, "seq": 256, "precision": "bf16-mixed", "gradient_checkpointing": False,
            "optimizer": "adamw_torch", "nproc": 2, "strategy": "fsdp", "offload": "none",
            "reshard_after_forward": False, "gradient_as_bucket_view": True, "bucket_cap_mb": 25}
    assert acc.autofit_strategy(spec) == "fsdp-shard-grad-op"
    s = acc.sharding_of(spec, "measured")
    assert s["fsdp_recipe"] == "torch" and s["zero_optimizer"] == "deepspeed"
    assert s["gradient_as_bucket_view"] is True and s["zero_sizes"] == "auto"
    assert acc.sharding_of({**spec, "ds_buckets": "deepspeed-default"}, "measured")[
        "zero_sizes"] == "deepspeed"
    assert acc.sharding_of(spec, "trainer") is None
