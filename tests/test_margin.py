"""The margin from evidence: the modelled run above its longest step + a stated safety."""

import random

import pytest

from autofit import TrainConfig
from autofit.api import autofit
from autofit.probe.device import resolve_device
from autofit.probe.run import run_order
from autofit.search.margin import SAFETY, given_margin, run_margin
from autofit.stages import RunPlan

MiB = 1 << 20


def _rows(n=96, seed=0):
    rng = random.Random(seed)
    return [{"input_ids": list(range(1, 2 + min(400, int(rng.lognormvariate(4, 0.9)))))}
            for _ in range(n)]


def test_on_the_cpu_the_margin_is_the_safety_alone():
    m = run_margin(None, None, None, resolve_device("cpu:4GiB"))
    assert (m.fraction, m.run_bytes, m.run) == (SAFETY, 0, None)
    assert m.reason.startswith("margin 3% of 4.00 GiB: a stated safety")
    assert "not cached" in m.reason and "replays the run's first lengths" in m.reason


def test_a_given_margin_is_kept_as_given():
    m = given_margin(0.2, resolve_device("cpu:4GiB"))
    assert m.fraction == 0.2 and "as given" in m.reason


@pytest.mark.slow  # 20 s; test_a_plan_for_a_card_carries_the_runs_need_and_why stays fast
def test_on_a_card_the_margin_is_what_the_replayed_run_adds():
    from autofit.memory.run import simulate_run
    from autofit.memory.simulate import Simulator
    from autofit.probe.model import build_model

    module, task = build_model("tiny-llama")
    dev = resolve_device("A100-80GB")
    sim = Simulator(module, task=task, device=dev)
    cfg = TrainConfig(micro_batch_size=8, grad_accum_steps=4, precision="bf16-mixed")
    lengths = [len(r["input_ids"]) for r in _rows(400)]
    order = run_order(lengths, micro_batch_size=8, grad_accum_steps=4)
    m = run_margin(sim, cfg, order, dev, eval_steps=5, eval_bytes=64 * MiB)
    run = simulate_run(sim, cfg, order, max_buckets=4, max_steps=200, eval_steps=5,
                       eval_bytes=64 * MiB)
    assert m.run_bytes == run.fragmentation_bytes
    assert m.fraction == pytest.approx(SAFETY + run.fragmentation_bytes / dev.capacity_bytes)
    assert m.config == cfg and m.run is not None and m.run.evaluations == run.evaluations > 0
    assert f"{run.steps} optimizer steps" in m.reason and m.reason.endswith("+ 3% safety")


def test_the_run_plan_reads_the_trainers_arguments():
    assert RunPlan.of(None).eval_steps and RunPlan.of(None).assumed  # autofit writes an eval batch
    plan = RunPlan.of({"eval_strategy": "steps", "eval_steps": 50, "save_strategy": "no",
                        "num_train_epochs": 2, "seed": 7, "max_steps": -1})
    assert (plan.eval_steps, plan.save_steps, plan.epochs, plan.seed, plan.max_steps) == (
        50, None, 2.0, 7, None)
    plan = RunPlan.of({"eval_strategy": "IntervalStrategy.STEPS", "eval_steps": None,
                        "logging_steps": 20, "save_strategy": "epoch", "max_steps": 30})
    assert (plan.eval_steps, plan.save_steps, plan.max_steps) == (20, 10**9, 30)
    assert RunPlan.of({"eval_strategy": "no"}).eval_steps is None


def test_a_plan_for_a_card_carries_the_runs_need_and_why():
    r = autofit("tiny-llama", _rows(), device="A100-80GB", precision=["bf16-mixed"],
                optimizer=["adamw_torch"], gradient_checkpointing=False, max_micro_batch=16)
    margin = r.meta["margin"]
    assert margin >= SAFETY
    assert any(x.startswith(f"margin {100 * margin:.1f}%") for x in r.reasons)
    est = r.estimate
    # planned from the estimate: the predicted run is the estimate's run; the run never
    # needs less than its longest step, and the replay says what it adds
    assert r.predicted_run_bytes == est.run_device_total_bytes >= est.device_total_bytes
    assert r.meta["predicted_run_bytes"] == r.predicted_run_bytes
    assert any(x.startswith("whole run: needs ~") for x in r.reasons)
    given = autofit("tiny-llama", _rows(), device="A100-80GB", precision=["bf16-mixed"],
                    optimizer=["adamw_torch"], gradient_checkpointing=False,
                    max_micro_batch=16, margin=0.25)
    assert given.meta["margin"] == 0.25 and any("as given" in x for x in given.reasons)


def test_a_run_that_does_not_evaluate_needs_no_evaluation():
    """A training_args whose run does not evaluate (no eval_strategy, no do_eval) still gets
    an eval batch that fits, but the whole run's need (the promise ``autofit run`` compares
    with) is its training alone; a run that evaluates, or no training_args (an evaluation
    assumed), counts the evaluation when it needs more."""
    kw = dict(device="A100-80GB", precision=["bf16-mixed"], optimizer=["adamw_torch"],
              gradient_checkpointing=False, max_micro_batch=4, target_batch_size=4)
    base = {"output_dir": "out", "per_device_train_batch_size": 4}
    quiet = autofit("tiny-llama", _rows(), training_args=base, **kw)
    evaluating = autofit("tiny-llama", _rows(),
                         training_args={**base, "eval_strategy": "steps", "eval_steps": 5}, **kw)
    assert quiet.config == evaluating.config and quiet.eval_micro_batch is not None
    assert any("no evaluation counted" in x for x in quiet.reasons)
    assert not any("no evaluation counted" in x for x in evaluating.reasons)
    assert quiet.predicted_run_bytes < evaluating.predicted_run_bytes
    assert quiet.estimate.run_device_total_bytes <= evaluating.estimate.run_device_total_bytes
    assert quiet.predicted_run_bytes >= quiet.estimate.device_total_bytes
