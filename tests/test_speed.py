import pytest

from autofit import TrainConfig
from autofit.probe.device import resolve_device
from autofit.probe.model import probe_model
from autofit.search.speed import flops_per_token, predict_speed


@pytest.fixture(scope="module")
def llama8b():
    return probe_model("meta-llama/Llama-3.1-8B")


def test_flops_per_token_is_about_6n(llama8b):
    f = flops_per_token(llama8b, TrainConfig(), 1)  # seq 1: attention negligible
    embedding = 128256 * 4096  # a lookup, not a matmul
    assert f == pytest.approx(6 * (llama8b.num_params - embedding), rel=0.001)


def test_checkpointing_costs_one_forward(llama8b):
    f = flops_per_token(llama8b, TrainConfig(), 2048)
    g = flops_per_token(llama8b, TrainConfig(gradient_checkpointing=True), 2048)
    assert g == pytest.approx(f * 4 / 3, rel=0.01)


def test_lora_skips_weight_gradients():
    lora = probe_model("meta-llama/Llama-3.2-1B", lora={"r": 8})
    full = probe_model("meta-llama/Llama-3.2-1B")
    assert flops_per_token(lora, TrainConfig(), 1) == pytest.approx(
        flops_per_token(full, TrainConfig(), 1) * 2 / 3, rel=0.02)


def test_ranking(llama8b):
    h100 = resolve_device("H100-80GB")

    def tps(**kw):
        return predict_speed(llama8b, TrainConfig(**kw), 2048, h100).tokens_per_s

    assert tps(micro_batch_size=4, precision="bf16-mixed") > tps(micro_batch_size=1, precision="bf16-mixed")
    assert tps(micro_batch_size=4, precision="bf16-mixed") > tps(micro_batch_size=4, precision="32-true")
    assert tps(micro_batch_size=4, precision="bf16-mixed") > tps(
        micro_batch_size=4, precision="bf16-mixed", gradient_checkpointing=True)
    assert tps(micro_batch_size=4, precision="bf16-mixed", optimizer="adamw_torch_fused") > tps(
        micro_batch_size=4, precision="bf16-mixed")
    # H100 is faster than an A10G for the same configuration
    a10 = predict_speed(llama8b, TrainConfig(micro_batch_size=4, precision="bf16-mixed"), 2048,
                        resolve_device("A10G")).tokens_per_s
    assert tps(micro_batch_size=4, precision="bf16-mixed") > 5 * a10
