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


# --- several ranks: communication (autofit.search.comm) ------------------------------

def test_communication_bytes_follow_the_ring_collectives():
    from autofit.memory.analytic import gradients_bytes
    from autofit.search.comm import communication

    info = probe_model("tiny-llama")
    card = resolve_device("H100-80GB")
    n = 8
    trainable = sum(g.numel * g.count for g in info.params if g.trainable)
    one = TrainConfig(precision="32-true")
    g = gradients_bytes(info, one)
    assert g == trainable * 4
    ddp = communication(info, TrainConfig(nproc_per_node=n), card)
    assert ddp.per_micro_batch_bytes == 0 and ddp.per_step_bytes == pytest.approx(2 * (n - 1) / n * g)
    fsdp = communication(info, TrainConfig(nproc_per_node=n, strategy="fsdp"), card)
    # fp32: gather the parameters twice (forward, backward), reduce-scatter the gradients
    assert fsdp.per_micro_batch_bytes == pytest.approx(3 * (n - 1) / n * g)
    keep = communication(info, TrainConfig(nproc_per_node=n, strategy="fsdp-shard-grad-op"), card)
    assert keep.per_micro_batch_bytes == pytest.approx(2 * (n - 1) / n * g)
    # bf16 mixed: gathered in bf16 (half the bytes), gradients reduced in fp32
    mixed = communication(info, TrainConfig(nproc_per_node=n, strategy="fsdp",
                                            precision="bf16-mixed"), card)
    assert mixed.per_micro_batch_bytes == pytest.approx((2 * 0.5 + 1) * (n - 1) / n * g)
    assert communication(info, TrainConfig(), card).per_step_s == 0  # one rank sends nothing


def test_strategies_rank_by_links():
    info = probe_model("tiny-llama")
    h100, rtx = resolve_device("H100-80GB"), resolve_device("RTX-4090")

    def tps(card, **kw):
        c = TrainConfig(micro_batch_size=4, grad_accum_steps=4, precision="bf16-mixed",
                        nproc_per_node=8, **kw)
        return predict_speed(info, c, 1024, card)

    # one rank: no communication, the speed of before
    single = predict_speed(info, TrainConfig(micro_batch_size=4, grad_accum_steps=4,
                                             precision="bf16-mixed"), 1024, h100)
    assert single.communication_s == 0
    # NVLink hides what PCIe cannot; across nodes everything is slower
    assert tps(h100).communication_s < tps(rtx).communication_s
    assert tps(h100, nnodes=2).tokens_per_s < tps(h100).tokens_per_s
    # hybrid sharding keeps the gathers inside the node: faster than FSDP across nodes
    assert tps(rtx, nnodes=2, strategy="hsdp").tokens_per_s > \
        tps(rtx, nnodes=2, strategy="fsdp").tokens_per_s
    # gathering twice per micro batch costs more than keeping the parameters
    assert tps(rtx, strategy="fsdp").tokens_per_s < tps(rtx, strategy="fsdp-shard-grad-op").tokens_per_s
    # host offload waits on the host link and the host's optimizer step
    assert tps(h100, strategy="zero3", offload="optimizer").tokens_per_s < \
        tps(h100, strategy="zero3").tokens_per_s


def test_on_a_cpu_the_chunked_loss_costs_what_it_was_measured_to():
    """tiny-gpt2 on one thread: per-token speed flat in the micro batch, and the chunked loss
    1.53x the full-logits step at the same micro batch (speed.py's measurement): a large
    chunked-loss micro batch is not predicted faster than a small full-logits one."""
    info = probe_model("tiny-gpt2")
    cpu = resolve_device("cpu:1GiB")

    def tps(**kw):
        return predict_speed(info, TrainConfig(**kw), 256, cpu).tokens_per_s

    assert tps(micro_batch_size=4) == pytest.approx(tps(micro_batch_size=8), rel=0.06)  # optimizer
    assert tps(micro_batch_size=8) / tps(micro_batch_size=8, chunked_loss=True) == pytest.approx(
        1.53, rel=0.03)
    assert tps(micro_batch_size=4) > 1.4 * tps(micro_batch_size=16, chunked_loss=True)


def test_on_a_cpu_half_precision_is_charged_what_it_costs_here(monkeypatch):
    """bf16 / fp16 matmuls without AVX512-BF16 take torch's generic gemm (43x slower than
    fp32 on an AVX2-only EPYC): such a candidate must rank below fp32, and where half
    precision is native it must not be charged anything."""
    from autofit.probe import device as dev

    info = probe_model("tiny-gpt2")
    cpu = resolve_device("cpu:4GiB")

    def tps(precision):
        return predict_speed(info, TrainConfig(micro_batch_size=4, precision=precision), 256,
                             cpu).tokens_per_s

    monkeypatch.setattr(dev, "_cpu_rates", lambda: {"bf16": 1 / 32, "16": 1 / 32})
    assert tps("bf16-mixed") < tps("32-true") / 8
    assert tps("16-mixed") < tps("32-true") / 8
    monkeypatch.setattr(dev, "_cpu_rates", lambda: {"bf16": 1.0, "16": 1.0})
    assert tps("bf16-mixed") == pytest.approx(tps("32-true"), rel=0.3)


def test_the_cpu_rate_measurement_leaves_threads_and_rng_alone():
    import torch

    from autofit.probe.device import _cpu_rates, cpu_matmul_speed

    _cpu_rates.cache_clear()
    threads = torch.get_num_threads()
    state = torch.get_rng_state()
    rate = cpu_matmul_speed("bf16-mixed")
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), state)
    assert cpu_matmul_speed("32-true") == 1.0
    # a power of two (1 where the ratio is within 2x: noise is not a ranking)
    assert rate > 0 and (rate == 1.0 or abs(__import__("math").log2(rate) % 1) < 1e-9)
