"""The whole run replayed: the simulated step's pieces in the run's order, through the
allocator model."""

import random

import pytest

from autofit.config import TrainConfig
from autofit.errors import BadInputError
from autofit.memory.run import _least_capacity, _replay_run, bucket_edges, simulate_run
from autofit.probe.run import run_order

MiB = 1 << 20


@pytest.fixture(scope="module")
def sims():
    from autofit.memory.simulate import Simulator
    from autofit.probe.device import resolve_device
    from autofit.probe.model import build_model

    module, task = build_model("tiny-gpt2")
    return {d: Simulator(module, task=task, device=resolve_device(d))
            for d in ("A100-80GB", "cpu")}


def _lengths(n=160, seed=0):
    rng = random.Random(seed)
    return [min(256, int(rng.lognormvariate(4, 0.8))) + 1 for _ in range(n)]


def test_bucket_edges_round_every_length_up():
    lengths = _lengths(500)
    edges = bucket_edges(lengths, 5)
    assert len(edges) <= 5 and edges[-1] == max(lengths)
    assert all(any(e >= n for e in edges) for n in lengths)
    assert bucket_edges([3, 3, 9], 8) == [3, 9]
    with pytest.raises(BadInputError):
        bucket_edges([1], 0)


def test_a_run_of_one_length_needs_what_its_step_needs(sims):
    # identical steps find the cache the first two left: the run is the step
    cfg = TrainConfig(micro_batch_size=4, precision="bf16-mixed")
    order = run_order([128] * 40, micro_batch_size=4)
    r = simulate_run(sims["A100-80GB"], cfg, order)
    step = sims["A100-80GB"].simulate(cfg, seq_len=128)
    assert r.fragmentation_bytes == 0 and r.steps == 10
    assert r.device_total_bytes == step.device_total_bytes
    assert r.peak_allocated_bytes == step.peak_allocated_bytes
    assert r.converged_step <= 2


@pytest.mark.parametrize("accum", [1, 3])
def test_varied_lengths_on_a_cuda_target(sims, accum):
    sim = sims["A100-80GB"]
    cfg = TrainConfig(micro_batch_size=4, grad_accum_steps=accum, precision="bf16-mixed")
    order = run_order(_lengths(), micro_batch_size=4, grad_accum_steps=accum)
    r = simulate_run(sim, cfg, order, max_buckets=4)
    assert len(r.buckets) <= 4 and r.buckets[0][1] == max(order.lengths)
    need = r.device_total_bytes - r.overhead_bytes
    # never below the worst-case step (the longest batch throughout, what trials measure);
    # above it only by what the run's own sequence needs, at most what it reserves unbounded
    assert r.step_peak_reserved_bytes <= need
    assert need <= max(r.step_peak_reserved_bytes, r.unlimited_peak_reserved_bytes)
    assert len(r.reserved_by_step) == r.steps == len(order.steps)
    assert list(r.reserved_by_step) == sorted(r.reserved_by_step)  # a peak only grows
    assert r.oom_step is None and any("bucket" in n for n in r.notes)


def test_the_need_is_the_least_capacity_the_run_goes_through(sims):
    # the bisection's answer: the replay fits at it and runs out of memory 2 MiB below it
    from autofit.memory.run import _cut

    sim = sims["A100-80GB"]
    cfg = TrainConfig(micro_batch_size=4, grad_accum_steps=2, precision="bf16-mixed")
    order = run_order(_lengths(80), micro_batch_size=4, grad_accum_steps=2)
    edges = bucket_edges(order.lengths, 3)
    shapes = [(s, min(e for e in edges if e >= n)) for s, n in zip(order.sizes, order.lengths, strict=True)]
    pieces = {sh: _cut(sim.run(cfg.replace(micro_batch_size=sh[0]), seq_len=sh[1]))
              for sh in set(shapes)}
    free = _replay_run(pieces, shapes, order.steps, "cuda", None)
    need = _least_capacity(pieces, shapes, order.steps, "cuda", lo=free.peak_allocated,
                           hi=free.peak_reserved)
    assert _replay_run(pieces, shapes, order.steps, "cuda", need).oom_step is None
    below = need - max(2 * MiB, need // 100)
    assert below < free.peak_allocated or (
        _replay_run(pieces, shapes, order.steps, "cuda", below).oom_step is not None)


def test_on_the_cpu_nothing_is_cached(sims):
    sim = sims["cpu"]
    cfg = TrainConfig(micro_batch_size=4, grad_accum_steps=2)
    order = run_order(_lengths(), micro_batch_size=4, grad_accum_steps=2)
    r = simulate_run(sim, cfg, order, max_buckets=4)
    # large blocks are mapped and given back whole: what the run holds above its worst
    # step is only the heap's holes between small tensors that other lengths left (KiB)
    assert 0 <= r.fragmentation_bytes < (64 << 10)
    assert r.device_total_bytes - r.overhead_bytes >= r.step_peak_reserved_bytes


def test_a_run_too_big_for_the_card_says_at_which_step(sims):
    # an A100 shrunk to 60% of what the 256-token step reserves: the run (one micro batch
    # whose longest sample has 256 tokens) runs out at its first step, and says so
    from dataclasses import replace

    from autofit.memory.simulate import Simulator

    base = sims["A100-80GB"]
    cfg = TrainConfig(micro_batch_size=4, precision="bf16-mixed")
    step = base.simulate(cfg, seq_len=256)
    dev = replace(base.device, capacity_bytes=int(base.device.overhead_bytes
                                                   + 0.6 * step.peak_reserved_bytes))
    sim = Simulator(base.module, task=base.task, device=dev)
    order = run_order([64, 64, 256, 64], micro_batch_size=4, sampling="sequential")
    r = simulate_run(sim, cfg, order)
    assert r.oom_step == 1 and r.device_total_bytes > dev.capacity_bytes


def test_bad_arguments(sims):
    cfg = TrainConfig(micro_batch_size=2)
    with pytest.raises(BadInputError, match="max_steps"):
        simulate_run(sims["cpu"], cfg, run_order([8, 8], micro_batch_size=2), max_steps=0)


@pytest.mark.slow
def test_estimate_with_a_dataset_adds_the_run(capsys):
    # Python and the CLI: run_* fields/keys, and the breakdown's own line
    import json

    from autofit import estimate
    from autofit.cli import main
    from autofit.cli.datasets import load_dataset_ref

    cfg = TrainConfig(micro_batch_size=8, grad_accum_steps=2, precision="bf16-mixed")
    data = load_dataset_ref("tiny-samples")
    est = estimate("tiny-gpt2", cfg, device="A100-80GB", dataset=data)
    assert est.seq_len == max(len(s["input_ids"]) for s in data)  # the longest batch's step
    assert est.run_device_total_bytes >= est.device_total_bytes
    assert est.run_peak_reserved_bytes >= est.peak_reserved_bytes
    assert est.fits == (est.run_device_total_bytes <= est.capacity_bytes)
    assert any("optimizer steps replayed" in n for n in est.notes)
    plain = estimate("tiny-gpt2", cfg, device="A100-80GB", seq_len=est.seq_len)
    assert plain.run_device_total_bytes is None and plain.device_total_bytes == est.device_total_bytes
    argv = ["estimate", "tiny-gpt2", "--batch-size", "8", "--grad-accum", "2", "--precision",
            "bf16-mixed", "--device", "A100-80GB", "--dataset", "tiny-samples"]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["run_device_total_bytes"] == est.run_device_total_bytes
    assert d["run_peak_reserved_bytes"] == est.run_peak_reserved_bytes
    # the text the CLI prints for it (autofit.report.terminal, as `estimate` without --json)
    from autofit.report.terminal import render_estimate

    out = render_estimate(est)
    assert "fragmentation" in out and "over the run" in out and "run device total" in out


def test_evaluations_and_saves_between_the_steps(sims):
    # 16 optimizer steps: every 5th evaluates (3 times), every 7th saves (twice); an
    # interval longer than the run still evaluates once, at its end
    sim = sims["cpu"]
    cfg = TrainConfig(micro_batch_size=2)
    order = run_order(_lengths(32), micro_batch_size=2)
    plain = simulate_run(sim, cfg, order)
    r = simulate_run(sim, cfg, order, eval_steps=5, eval_bytes=MiB, save_steps=7)
    assert (r.evaluations, r.saves) == (3, 2)
    assert simulate_run(sim, cfg, order, eval_steps=1000, eval_bytes=MiB).evaluations == 1
    # a small evaluation fits in the room the training steps leave: the run is unchanged
    assert r.device_total_bytes == plain.device_total_bytes and r.peak_phase == "train"


def test_an_evaluation_larger_than_a_step_decides_the_run(sims):
    # on the CPU nothing is cached: an evaluation's need is what the run keeps between
    # steps (weights, optimizer states) + its working set, exactly, byte for byte
    sim = sims["cpu"]
    cfg = TrainConfig(micro_batch_size=2)
    order = run_order(_lengths(32), micro_batch_size=2)
    big = [simulate_run(sim, cfg, order, eval_steps=4, eval_bytes=n * 1024 * MiB)
           for n in (2, 3)]
    assert all(r.peak_phase == "eval" for r in big)
    assert big[1].device_total_bytes - big[0].device_total_bytes == 1024 * MiB
    assert big[0].device_total_bytes > simulate_run(sim, cfg, order).device_total_bytes
    # a save that allocates on the device (the CPU's copy) decides it the same way
    saved = simulate_run(sim, cfg, order, save_steps=4, save_bytes=2048 * MiB)
    assert saved.peak_phase == "save" and saved.device_total_bytes == big[0].device_total_bytes


def test_on_a_card_an_evaluation_after_the_steps_costs_more_than_its_bytes(sims):
    # the cache the training steps left is not where a large eval block fits: the run
    # needs at least the live bytes + the eval block, and the replay says how much
    sim = sims["A100-80GB"]
    cfg = TrainConfig(micro_batch_size=2, precision="bf16-mixed")
    order = run_order(_lengths(32), micro_batch_size=2)
    plain = simulate_run(sim, cfg, order)
    r = simulate_run(sim, cfg, order, eval_steps=4, eval_bytes=1024 * MiB)
    assert r.device_total_bytes >= plain.device_total_bytes
    assert r.device_total_bytes >= 1024 * MiB + plain.overhead_bytes
    with pytest.raises(BadInputError, match="eval_steps"):
        simulate_run(sim, cfg, order, eval_steps=0)
