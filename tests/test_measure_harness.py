"""The CPU ground-truth harness (benchmarks/measure_cpu.py) is repeatable and sees real memory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


measure_cpu = _load("measure_cpu")

BATCH, SEQ, VOCAB = 4, 128, 8000
TINY = {
    "name": "tiny-llama",
    "model_type": "llama",
    "config": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 172,
        "vocab_size": VOCAB,
    },
    "task": "causal-lm",
    "batch": BATCH,
    "seq": SEQ,
    "precision": "32-true",
    "gradient_checkpointing": False,
    "optimizer": "adamw_torch",
    "optim_args": None,
    "attn_implementation": "sdpa",
    "lora": None,
}


@pytest.mark.slow  # the benchmark harness measured twice (benchmarks/measure_cpu.py)
def test_peak_is_repeatable_and_sees_the_logits():
    a = measure_cpu.measure(TINY)
    b = measure_cpu.measure(TINY)
    assert abs(a["peak_bytes"] - b["peak_bytes"]) <= 0.01 * max(a["peak_bytes"], b["peak_bytes"])
    logits_bytes = BATCH * SEQ * VOCAB * 4  # (B, T, V) fp32 logits, one tensor
    assert a["peak_bytes"] > logits_bytes
    # The two-step peak is the max of the last step's phases or of the step before it.
    assert a["peak_bytes"] >= max(a["phase_peaks"].values())
    assert set(a["phase_peaks"]) == {"forward", "backward", "optimizer"}
    assert a["spec"] == TINY
    assert a["trainable_param_count"] == a["param_count"] > 0
    # fp32 weights: 4 bytes per parameter (plus small buffers such as rotary inv_freq).
    assert 4 * a["param_count"] <= a["weights_bytes"] < 4 * a["param_count"] + 2**20
    # AdamW keeps two fp32 states per parameter after the step.
    assert a["steady_rss_after_step_bytes"] >= 0.9 * 8 * a["param_count"]


def test_bad_spec_lists_every_problem():
    bad = {**TINY, "task": "nope", "precision": "fp8"}
    del bad["lora"]
    with pytest.raises(ValueError, match=r"missing keys \['lora'\].*task 'nope'.*precision"):
        measure_cpu.check_spec(bad)


def test_configs_are_well_formed():
    configs = measure_cpu.load_configs()
    assert len(configs) >= 36
    assert len({c["name"] for c in configs}) == len(configs)
    for c in configs:
        measure_cpu.check_spec(c)
        # the project-wide keys in order, then only optional ones (chunked_loss when on)
        assert list(c)[:len(measure_cpu.SPEC_KEYS)] == list(measure_cpu.SPEC_KEYS)
        assert set(list(c)[len(measure_cpu.SPEC_KEYS):]) <= set(measure_cpu.OPTIONAL_KEYS)


def test_peft_key_is_checked():
    measure_cpu.check_spec({**TINY, "peft": {"peft_type": "IA3"}})
    with pytest.raises(ValueError, match=r"peft must be a dict with peft_type"):
        measure_cpu.check_spec({**TINY, "peft": {"r": 8}})
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj"]}
    with pytest.raises(ValueError, match=r"lora or peft, not both"):
        measure_cpu.check_spec({**TINY, "lora": lora, "peft": {"peft_type": "LORA"}})


def test_quantization_key_is_checked():
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj"]}
    measure_cpu.check_spec({**TINY, "lora": lora, "quantization": {"load_in_8bit": True}})
    measure_cpu.check_spec({**TINY, "lora": lora, "precision": "bf16-true", "quantization": {
        "load_in_4bit": True, "bnb_4bit_compute_dtype": "bfloat16"}})
    for q, why in (({"load_in_4bit": True, "load_in_8bit": True}, "one of load_in_4bit"),
                   ({}, "one of load_in_4bit")):
        with pytest.raises(ValueError, match=why):
            measure_cpu.check_spec({**TINY, "lora": lora, "quantization": q})
    with pytest.raises(ValueError, match="trains through adapters"):
        measure_cpu.check_spec({**TINY, "quantization": {"load_in_8bit": True}})
    with pytest.raises(ValueError, match="casts the model"):
        measure_cpu.check_spec({**TINY, "lora": lora, "precision": "bf16-true",
                                "quantization": {"load_in_8bit": True}})


@pytest.mark.slow
def test_a_quantized_base_is_measured_with_its_states():
    """The harness loads the base back quantized: its weights count the 8-bit row scales,
    and an 8-bit step's peak sits above a 4-bit one's (int8 weights, inputs kept)."""
    lora = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    eight = measure_cpu.measure({**TINY, "lora": lora, "quantization": {"load_in_8bit": True}})
    four = measure_cpu.measure({**TINY, "lora": lora, "quantization": {
        "load_in_4bit": True, "bnb_4bit_compute_dtype": "float32"}})
    c = TINY["config"]
    h, i, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    linear = n * (2 * h * h + 2 * h * (h // 2) + 3 * h * i)  # q, o, k, v (GQA), gate/up/down
    # int8 + a row scale vs packed 4-bit + an absmax per 64: ~0.45 byte per weight more
    assert 0.4 * linear < eight["weights_bytes"] - four["weights_bytes"] < 0.6 * linear
    assert eight["peak_bytes"] > four["peak_bytes"]
