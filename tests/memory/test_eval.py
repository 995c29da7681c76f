"""The evaluation-step estimate: its parts, the eval batch tuner, and a real measurement.

tiny llama (conftest): hidden 64, intermediate 160, 2 layers, 4 heads, 2 KV heads
(head_dim 16), vocab 512, untied head, P = 151872 parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autofit import TrainConfig
from autofit.errors import BadInputError, DoesNotFitError
from autofit.memory.analytic import estimate_analytic, weights_bytes
from autofit.memory.eval import estimate_eval, kv_cache_bytes, tune_eval_batch
from autofit.probe.device import resolve_device
from autofit.probe.model import probe_model

P = 151872
CPU = resolve_device("cpu:8GiB")
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def info(tiny_llama):
    return probe_model(tiny_llama)


def test_no_gradients_no_optimizer_states_weights_as_in_training(info):
    est = estimate_eval(info, 4, 64, CPU)
    b = est.breakdown
    assert b["gradients"] == 0 and b["optimizer_states"] == 0
    assert b["weights"] == weights_bytes(info, TrainConfig()) == 4 * P + info.buffer_bytes
    assert sum(b.values()) == est.device_total_bytes and est.method == "analytic-eval"
    # bf16 autocast caches a 16-bit copy of every matmul weight for the forward
    linear = 2 * (4096 + 2048 + 2048 + 4096 + 3 * 10240) + 512 * 64
    assert estimate_eval(info, 4, 64, CPU, precision="bf16-mixed").breakdown["weights"] == (
        4 * P + info.buffer_bytes + 2 * linear)


def test_kv_cache_formula(info):
    # 2 (K, V) x 2 layers x B x T x 2 kv heads x 16 head_dim x 4 bytes
    assert kv_cache_bytes(info, 3, 10, 4) == 2 * 2 * 3 * 10 * 2 * 16 * 4


def test_logits_and_loss_dominate_a_large_vocabulary_forward(info):
    n, v = 8 * 256, 512
    fp32 = estimate_eval(info, 8, 256, CPU)
    # logits + fp32 log_softmax, at least
    assert fp32.peak_allocated_bytes - fp32.breakdown["weights"] >= n * v * 8
    # 16-bit logits: + their fp32 upcast in the loss, - half of the logits themselves
    bf16 = estimate_eval(info, 8, 256, CPU, precision="bf16-true")
    assert bf16.breakdown["temporaries"] - fp32.breakdown["temporaries"] == pytest.approx(
        n * v * 2, rel=0.01)
    kept = estimate_eval(info, 8, 256, CPU, kept_logit_batches=3)
    assert kept.peak_allocated_bytes - fp32.peak_allocated_bytes == 3 * n * v * 4


def test_generation_adds_the_kv_cache_and_eager_adds_the_scores(info, tiny_llama_config):
    import torch
    from transformers import AutoModelForCausalLM

    base = estimate_eval(info, 8, 64, CPU, with_loss=False)
    gen = estimate_eval(info, 8, 64, CPU, with_loss=False, generate_max_new_tokens=4096)
    assert gen.peak_allocated_bytes - base.peak_allocated_bytes >= kv_cache_bytes(info, 8, 4096, 4)
    beams = estimate_eval(info, 8, 64, CPU, with_loss=False, generate_max_new_tokens=4096,
                          num_beams=4)
    assert beams.peak_allocated_bytes > 3 * (gen.peak_allocated_bytes - base.peak_allocated_bytes)
    with torch.device("meta"):
        eager, sdpa = (probe_model(AutoModelForCausalLM.from_config(
            tiny_llama_config, attn_implementation=a)) for a in ("eager", "sdpa"))
    assert eager.attn_implementation == "eager"
    e, s = (estimate_eval(m, 2, 2048, CPU) for m in (eager, sdpa))
    # two (B, H, T, T) fp32 tensors and the fp32 (B, 1, T, T) mask, less the working set
    # of the block they replace
    scores = 2 * 2048**2 * (4 * 8 + 4)
    assert 0.5 * scores < e.peak_allocated_bytes - s.peak_allocated_bytes <= scores


def test_bad_input(info):
    with pytest.raises(BadInputError, match="micro_batch_size"):
        estimate_eval(info, 0, 64, CPU)
    with pytest.raises(BadInputError, match="generate_max_new_tokens"):
        estimate_eval(info, 1, 64, CPU, generate_max_new_tokens=-1)
    cls = probe_model("tiny-bert", task="seq-cls")
    with pytest.raises(BadInputError, match="causal-lm or seq2seq"):
        estimate_eval(cls, 1, 64, CPU, generate_max_new_tokens=8)
    with pytest.raises(BadInputError, match="margin"):
        tune_eval_batch(info, 64, CPU, margin=1.5)


def test_tune_eval_batch_is_the_largest_that_fits(info):
    dev = resolve_device("cpu:64MiB")
    b = tune_eval_batch(info, 256, dev, 0.10, max_micro_batch=4096)
    budget = int(dev.capacity_bytes * 0.9)
    assert estimate_eval(info, b, 256, dev).device_total_bytes <= budget
    assert estimate_eval(info, b + 1, 256, dev).device_total_bytes > budget
    assert tune_eval_batch(info, 256, dev, 0.5, max_micro_batch=4096) < b
    assert tune_eval_batch(info, 256, dev, 0.1, max_micro_batch=3) == 3
    gen = tune_eval_batch(info, 256, dev, 0.1, max_micro_batch=4096, generate_max_new_tokens=2048)
    assert gen < b
    with pytest.raises(DoesNotFitError, match="no eval batch fits"):
        tune_eval_batch("tiny-llama", 2048, "cpu:64MiB")


def test_eval_batch_is_larger_than_the_train_batch(info):
    dev = resolve_device("cpu:64MiB")
    train = max(b for b in range(1, 257) if estimate_analytic(
        info, TrainConfig(micro_batch_size=b), 256, dev).device_total_bytes <= 0.9 * dev.capacity_bytes)
    assert tune_eval_batch(info, 256, dev, 0.1, max_micro_batch=4096) > 2 * train


def test_autofit_writes_the_eval_batch():
    from autofit.api import autofit

    data = [{"input_ids": list(range(1, 129))}] * 16
    r = autofit("tiny-llama", data, device="A100-80GB", target_batch_size=16)
    assert r.eval_micro_batch is not None and r.eval_micro_batch >= r.config.micro_batch_size
    assert r.training_arguments_kwargs["per_device_eval_batch_size"] == r.eval_micro_batch
    assert any(x.startswith("eval micro batch") and "states alive" in x for x in r.reasons)
    # tuned inside the run: the chosen optimizer's states count against the budget
    from autofit.memory.eval import estimate_eval
    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model

    inside = estimate_eval(probe_model("tiny-llama"), r.eval_micro_batch, 128,
                           resolve_device("A100-80GB"), training=r.config)
    assert inside.breakdown["optimizer_states"] > 0


# ---------------------------------------------------------------- against a measurement


def _compare(spec):
    sys.path.insert(0, str(BENCH))
    try:
        import measure_eval
    finally:
        sys.path.remove(str(BENCH))
    return measure_eval.compare([spec])[0]


LLAMA = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4000,
         "max_position_embeddings": 1024}


def test_estimate_matches_a_measured_eval_step():
    row = _compare({"name": "llama-b8s256", "model_type": "llama", "config": LLAMA,
                    "task": "causal-lm", "batch": 8, "seq": 256, "precision": "32-true"})
    # tensors only: the steady peak (without the ~10 MiB of one-time CPU caches)
    assert abs(row["steady_error"]) < 0.05, row
    assert abs(row["error"]) < 0.20, row


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    {"precision": "bf16-mixed"},
    {"attn_implementation": "eager", "batch": 4},
    {"generate_max_new_tokens": 256, "batch": 4, "seq": 64},
    {"config": {**LLAMA, "vocab_size": 256, "num_hidden_layers": 4}, "seq": 512},
])
def test_estimate_matches_measured_eval_variants(extra):
    spec = {"name": "x", "model_type": "llama", "config": LLAMA, "task": "causal-lm",
            "batch": 8, "seq": 256, "precision": "32-true", **extra}
    row = _compare(spec)
    assert abs(row["steady_error"]) < 0.08, row


def test_evaluation_inside_a_training_run_keeps_the_optimizer_states():
    # Trainer evaluates every eval_steps between training steps: the optimizer's states are
    # alive then (gradients are not), so an eval batch tuned without them does not fit.
    from autofit.config import TrainConfig
    from autofit.memory.analytic import optimizer_state_bytes
    from autofit.memory.eval import estimate_eval, tune_eval_batch
    from autofit.probe.device import resolve_device
    from autofit.probe.model import probe_model

    info = probe_model("tiny-llama")
    dev = resolve_device("cpu")
    alone = estimate_eval(info, 8, 256, dev, precision="bf16-mixed")
    run = TrainConfig(precision="bf16-mixed", optimizer="adamw_torch")
    inside = estimate_eval(info, 8, 256, dev, training=run)
    states = optimizer_state_bytes(info, run)
    assert states > 0 and inside.breakdown["optimizer_states"] == states
    assert inside.breakdown["gradients"] == 0
    assert inside.peak_allocated_bytes == alone.peak_allocated_bytes + states
    assert any("states stay alive" in n for n in inside.notes)
    # the training precision applies: bf16-true weights are half the fp32 ones
    half = estimate_eval(info, 8, 256, dev, training=TrainConfig(precision="bf16-true"))
    assert half.breakdown["weights"] < alone.breakdown["weights"]
    # on a device where the states matter, the tuned eval batch is smaller
    cap = f"cpu:{(alone.peak_allocated_bytes + states // 2) // 2**20}MiB"
    assert (tune_eval_batch(info, 256, cap, precision="bf16-mixed", max_micro_batch=64)
            > tune_eval_batch(info, 256, cap, training=run, max_micro_batch=64))


def test_an_sft_evaluation_is_estimated_through_trls_fused_head_as_it_runs():
    """SFTTrainer evaluates through TRL's fused LM head (``prediction_step`` ->
    ``compute_loss``): no (N, V) logits, but on a CPU its torch fallback's fp32 tiles. The
    model's own loss was estimated: TRL's ``sft.py`` on a tiny Qwen2 (V 32,000) with a tuned
    eval batch of 25 ran out of 1 GiB in its evaluation (1.6 GiB measured, 0.8 estimated)."""
    pytest.importorskip("trl")
    from autofit import measure
    from autofit.trial.step import RunSpec

    dev = resolve_device("cpu:2GiB")
    cfg = TrainConfig(micro_batch_size=2, precision="32-true", loss_impl="trl")
    r = measure("tiny-llama", cfg, seq_len=128, device=dev, isolation="subprocess",
                run=RunSpec(eval_batch_size=16, eval_length=128))
    assert not r.eval_oom and r.eval_device_total_bytes
    est = estimate_eval(probe_model("tiny-llama"), 16, 128, dev, training=cfg)
    assert est.device_total_bytes == pytest.approx(r.eval_device_total_bytes, rel=0.04)
    # the model's own loss (full logits, log-softmax) is a third less than what TRL holds
    plain = estimate_eval(probe_model("tiny-llama"), 16, 128, dev,
                          training=cfg.replace(loss_impl="model"))
    assert plain.device_total_bytes < 0.75 * r.eval_device_total_bytes
