"""Trials that see the run: the run's other lengths before the measured steps, and an
evaluation step after them measured apart (autofit.trial.step.RunSpec)."""

from types import SimpleNamespace

import pytest

from autofit import TrainConfig, measure
from autofit.probe.device import resolve_device
from autofit.probe.model import probe_model
from autofit.stages import TuneOptions
from autofit.stages.run import eval_from_trial, trial_run
from autofit.trial.step import RunSpec, cut_batch

CAP = "cpu:1GiB"


def test_cut_batch_cuts_lengths_and_repeats_rows():
    import torch

    b = {"input_ids": torch.arange(12).reshape(3, 4), "labels": torch.ones(3, 4, dtype=torch.long)}
    c = cut_batch(b, 2, rows=7)
    assert c["input_ids"].shape == (7, 2) and c["input_ids"][3].tolist() == [0, 1]
    assert cut_batch(b, 4, rows=2)["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("isolation", ["subprocess",
                                       pytest.param("in-process", marks=pytest.mark.slow)])
def test_an_evaluation_is_measured_apart_from_the_training(isolation):
    cfg = TrainConfig(micro_batch_size=2)
    plain = measure("tiny-llama", cfg, seq_len=64, device=CAP, isolation=isolation)
    r = measure("tiny-llama", cfg, seq_len=64, device=CAP, isolation=isolation,
                run=RunSpec(lengths=(16, 32, 48), eval_batch_size=4))
    assert not r.oom and r.run_steps == 3 and r.steps == plain.steps
    assert not r.eval_oom and r.eval_error is None
    # the evaluation keeps the weights and the AdamW states (what the run holds between
    # its steps), so it needs more than them; 4 x 64 tokens of fp32 logits fit the cap
    resident = r.resident_bytes
    assert resident < r.eval_device_total_bytes < resident * 4 + (400 << 20)
    # an evaluation too large for the cap is its own out-of-memory, not the training's
    big = measure("tiny-llama", cfg, seq_len=64, device=CAP, isolation=isolation,
                  run=RunSpec(eval_batch_size=512))
    assert big.eval_oom and not big.oom and "evaluation step" in big.eval_error
    assert big.fits
    # its training peak is the plain one's: the evaluation's failed request is not in it.
    # In-process the peak is the RSS of a process that has run other trials (and, in the
    # suite, other tests): measured again after ``big`` too, ``big`` lies within 10% of one
    again = measure("tiny-llama", cfg, seq_len=64, device=CAP, isolation=isolation)
    assert any(big.device_total_bytes == pytest.approx(p.device_total_bytes, rel=0.1)
               for p in (plain, again)), (plain.device_total_bytes, big.device_total_bytes,
                                          again.device_total_bytes)


def test_what_a_trial_replays_of_the_run():
    from autofit.probe.model import build_model
    from autofit.search.margin import RunMargin
    from autofit.stages import Probed, RunPlan

    module, task = build_model("tiny-llama")
    info = probe_model(module)
    data = SimpleNamespace(lengths=tuple(range(10, 200, 3)))
    cfg = TrainConfig(micro_batch_size=4)
    on_cpu = Probed("tiny-llama", module, task, info, data, resolve_device("cpu:2GiB"), 197)
    order = RunPlan.of(None).order(data.lengths, cfg, None)
    spec = trial_run(on_cpu, cfg, None, None, TuneOptions())
    # on the CPU the run's first lengths (short batches fragment glibc's heap) and an eval
    assert spec.lengths == tuple(order.lengths[:12]) and len(set(spec.lengths)) > 1
    assert spec.eval_batch_size >= 1 and spec.eval_length == 197
    assert trial_run(on_cpu, cfg, None, None, TuneOptions(generate_max_new_tokens=8)).eval_batch_size is None
    same = Probed("tiny-llama", module, task, info, SimpleNamespace(lengths=(64,) * 40),
                   resolve_device("cpu:2GiB"), 64)
    assert trial_run(same, cfg, None, None, TuneOptions()).lengths == ()  # one length: nothing to replay
    bare = trial_run(same, cfg, None, None, TuneOptions(generate_max_new_tokens=8))
    assert bare.lengths == () and bare.eval_batch_size is None
    # the search's budget stops a trial once its peak passes it; the replay is time-bound
    assert spec.stop_above_bytes == int(on_cpu.device.capacity_bytes * (1 - 0.03))
    assert spec.replay_s > 0 and 0 < spec.decisive_spread < 0.05
    # a card whose modelled run fragments (a present one is not here: the rule is the same)
    card = Probed("tiny-llama", module, task, info, data, resolve_device("A100-80GB"), 197)
    kept = RunMargin(0.05, 1 << 30, "why")
    spec = trial_run(card, cfg, kept, None, TuneOptions())
    assert spec.lengths == tuple(order.lengths[:12]) and len(set(spec.lengths)) > 1
    assert trial_run(card, cfg, RunMargin(0.03, 0, "why"), None, TuneOptions()).lengths == ()


def _outcome(cfg, eval_bytes, eval_oom=False, setup_bytes=None):
    t = SimpleNamespace(eval_device_total_bytes=eval_bytes, eval_oom=eval_oom, oom=False,
                        config=cfg.to_dict(), setup_bytes=setup_bytes)
    return SimpleNamespace(trials=[t])


def test_a_cpu_trial_keeps_what_its_set_up_step_left_apart_and_the_run_counts_it():
    """A run is measured from its model's construction (``autofit run``), so it counts what
    the first step's one-time set-up leaves resident (autograd, the math libraries, their
    code's pages); a trial runs that step before its baseline. A fresh trial process
    measures it apart (``setup_bytes``), outside its peaks, and the eval batch and whole-run
    figure count it: tiny-gpt2's evaluating run measured 1011 MiB where 978 was promised."""
    from autofit.stages.run import setup_residue

    cfg = TrainConfig(micro_batch_size=2)
    r = measure("tiny-llama", cfg, seq_len=64, device=CAP, isolation="subprocess")
    assert r.fits and r.setup_bytes is not None
    assert 0 < r.setup_bytes < 200 << 20, r.setup_bytes
    assert r.device_total_bytes > r.resident_bytes  # the peaks are the steps' own, as before
    info = probe_model("tiny-llama")
    dev = resolve_device(CAP)
    budget = int(dev.capacity_bytes * 0.97)
    # an evaluation measured under the budget, but not with the set-up beside it: smaller
    under = budget - (10 << 20)
    reasons = []
    assert eval_from_trial(_outcome(cfg, under), cfg, 16, info, 128, dev, 0.03, 256,
                           reasons)[:2] == (16, under)
    b, _, _ = eval_from_trial(_outcome(cfg, under, setup_bytes=20 << 20), cfg, 16, info, 128,
                              dev, 0.03, 256, reasons)
    assert b is not None and b < 16
    assert "+ 20.0 MiB of one-time set-up > budget" in reasons[-1]
    assert setup_residue(SimpleNamespace(trials=[
        SimpleNamespace(setup_bytes=None), SimpleNamespace(setup_bytes=5 << 20),
        SimpleNamespace(setup_bytes=7 << 20)])) == 7 << 20
    assert setup_residue(SimpleNamespace(trials=[])) == 0


def test_the_eval_batch_written_is_the_one_the_trial_ran():
    from autofit.memory.eval import estimate_eval

    info = probe_model("tiny-llama")
    dev = resolve_device("cpu:1GiB")
    cfg = TrainConfig(micro_batch_size=2)
    reasons = []
    b, need, how = eval_from_trial(_outcome(cfg, 600 << 20), cfg, 16, info, 128, dev, 0.03, 256,
                                   reasons)
    assert (b, need, how) == (16, 600 << 20, "measured 600 MiB")
    assert "measured 600 MiB in the trial" in reasons[-1]
    # measured over the budget: re-tuned smaller, from the estimate scaled to the trial
    b, need, how = eval_from_trial(_outcome(cfg, 1000 << 20), cfg, 16, info, 128, dev, 0.03,
                                   256, reasons)
    assert b is not None and b < 16
    assert "scaled x" in reasons[-1] and "measured 1000 MiB > budget" in reasons[-1]
    # ... and the need written for it is that scaled estimate, not the raw one: the trial
    # measured 1.2x the estimate at 16, so the smaller batch needs 1.2x its estimate too
    # (tiny-gpt2 printed its raw 837 MiB where the trial had said x1.06)
    at16 = estimate_eval(info, 16, 128, dev, training=cfg).device_total_bytes
    over = int(at16 * 1.2)
    b, need, how = eval_from_trial(_outcome(cfg, over), cfg, 16, info, 128, dev, 0.03, 256,
                                   reasons)
    raw = estimate_eval(info, b, 128, dev, training=cfg).device_total_bytes
    assert b < 16 and need == int(raw * over / at16) and "x1.20" in how
    assert "x1.20" in reasons[-1] and "needs ~" in how
    b2, _, _ = eval_from_trial(_outcome(cfg, 0, eval_oom=True), cfg, 16, info, 128, dev, 0.03,
                               256, reasons)
    assert b2 is not None and b2 < 16 and "ran out of memory" in reasons[-1]
    # no trial ran an evaluation of this configuration: the estimate's batch stands
    other = TrainConfig(micro_batch_size=3)
    assert eval_from_trial(_outcome(other, 1), cfg, 16, info, 128, dev, 0.03, 256,
                           []) == (16, None, "")


def test_a_trial_costs_what_it_must():
    """A trial stops once its peak passes the budget (its first timed step runs before the
    replay), bounds its replay by time, skips it far under the budget, stops an outpaced
    trial after one timed step, and stops timing after two steps that agree
    (autofit.trial.loop)."""
    cfg = TrainConfig(micro_batch_size=2)
    kw = {"seq_len": 64, "device": "cpu", "isolation": "in-process"}
    over = measure("tiny-llama", cfg, **kw, run=RunSpec(lengths=(16, 32, 48), eval_batch_size=2,
                                                         stop_above_bytes=1))
    # stopped after the first timed step, before the replay: no evaluation, not an OOM
    assert over.over_budget and not over.oom and over.error is None
    assert over.run_steps == 0 and over.steps == 1 and over.eval_device_total_bytes is None
    assert over.device_total_bytes > 1 and any("passed the budget" in n for n in over.notes)
    assert "replay" in over.phase_s and over.phase_s["replay"] == 0.0
    bounded = measure("tiny-llama", cfg, **kw, run=RunSpec(lengths=(16, 32, 48), replay_s=0.0,
                                                           decisive_spread=10.0))
    # the replay's first length only; the timed steps stop after two (they agree within
    # 1000%): one before the replay, one after it; the peak and the speed are measured
    assert bounded.run_steps == 1 and bounded.steps == 2 and not bounded.over_budget
    assert bounded.step_time_s and bounded.device_total_bytes
    assert any("replayed 1 of the run's 3" in n for n in bounded.notes)
    full = measure("tiny-llama", cfg, **kw, run=RunSpec(lengths=(16, 32), replay_s=60.0,
                                                        stop_above_bytes=1 << 40))
    assert full.run_steps == 2 and full.steps == 3 and not full.over_budget
    assert set(full.phase_s) >= {"set-up", "warm-up", "replay", "timed", "clean-up"}


def test_a_trial_skips_what_cannot_change_its_verdict():
    """The replay far under the budget, and everything after the first timed step of a
    trial a confirmed rival outpaces (autofit.trial.loop). In trial processes: in-process
    trials grow this process's heap, which a later in-process cap (RLIMIT_AS over VmSize)
    would let a step reuse."""
    cfg = TrainConfig(micro_batch_size=2)
    kw = {"seq_len": 32, "device": "cpu", "isolation": "subprocess"}
    # one timed step asked, close to the budget: one before the replay, the longest again
    # after it
    near = measure("tiny-llama", cfg, **kw, measure_steps=1,
                   run=RunSpec(lengths=(16, 24), replay_s=60.0, stop_above_bytes=1 << 40,
                               replay_within=1e9))
    assert near.run_steps == 2 and near.steps == 2
    # far under the budget: the replay cannot change the verdict, it is not run; a rival
    # it keeps up with does not stop it
    far = measure("tiny-llama", cfg, **kw, run=RunSpec(lengths=(16, 24), replay_s=60.0,
                                                       stop_above_bytes=1 << 40,
                                                       replay_within=0.10,
                                                       outpaced_below_tokens_per_s=1e-3))
    assert far.run_steps == 0 and far.steps == 3 and not far.over_budget and not far.outpaced
    assert any("not replayed" in n and "10% under the budget" in n for n in far.notes)
    # a rival confirmed far faster: stopped after its first timed step, no replay, no
    # evaluation; its speed and that step's peak are measured, it is not over the budget
    slow = measure("tiny-llama", cfg, **kw, run=RunSpec(lengths=(16, 24), eval_batch_size=2,
                                                        outpaced_below_tokens_per_s=1e12))
    assert slow.outpaced and slow.steps == 1 and slow.run_steps == 0
    assert slow.tokens_per_s and slow.device_total_bytes and not slow.over_budget
    assert slow.eval_device_total_bytes is None and slow.error is None
    assert any("stopped after its first timed step" in n for n in slow.notes)
    assert slow.phase_s["load"] >= 0 and "evaluation" not in slow.phase_s


def test_two_timed_steps_decide_only_when_a_third_cannot_move_the_median():
    from autofit.trial.loop import _decided

    assert _decided([1.0, 1.02], 0.025, 3)
    assert not _decided([1.0, 1.1], 0.025, 3)  # a third step would decide the median
    assert not _decided([1.0, 1.0], None, 3)  # not asked (measure's own runs)
    assert not _decided([1.0, 1.0], 0.025, 5)  # more steps asked: a third can move it
    assert not _decided([1.0], 0.025, 3)


def test_the_run_amortises_the_optimizer_step_over_its_accumulation():
    """A trial steps the optimizer after 2 micro batches; the run after ``accum``: its step
    is the micro batches' time scaled, plus one optimizer step."""
    from autofit.trial.loop import run_step_s

    # 2 micro batches of 1 s + an optimizer step of 0.5 s, for a run at accumulation 8
    assert run_step_s(2.5, 0.5, micro=2, accum=8) == pytest.approx(8.5)
    assert run_step_s(2.5, 0.5, micro=2, accum=2) == 2.5  # the trial is the run's step
    assert run_step_s(1.5, 0.5, micro=1, accum=1) == 1.5
    # no optimizer time measured (a rank trial): scaled as a whole, as before
    assert run_step_s(2.5, None, micro=2, accum=8) == pytest.approx(10.0)
    # a fused and a plain AdamW: 1.2x apart in a trial's step, 1.05x apart in the run's
    fused, plain = run_step_s(2.2, 0.2, 2, 8), run_step_s(2.6, 0.6, 2, 8)
    assert 2.6 / 2.2 > 1.18 and plain / fused < 1.06


def test_a_tunes_trial_holds_its_set_up_once():
    """A tune's trial totals hold the set-up step's resident memory (the run counts it, the
    search and the eval batch must): added once, marked, never again; the whole run and the
    eval batch then add nothing more for it."""
    import dataclasses

    from autofit.probe.model import build_model
    from autofit.stages import Probed, WholeRun
    from autofit.stages.run import setup_residue
    from autofit.trial.result import TrialResult

    module, task = build_model("tiny-llama")
    info = probe_model(module)
    data = SimpleNamespace(lengths=tuple(range(10, 200, 3)))
    probed = Probed("tiny-llama", module, task, info, data, resolve_device("cpu:2GiB"), 197)
    whole = WholeRun(probed, None, TuneOptions())
    cfg = TrainConfig(micro_batch_size=4)  # 32-true: no oneDNN kernels per shape to add
    raw = TrialResult(oom=False, peak_allocated_bytes=500 << 20, peak_reserved_bytes=500 << 20,
                      device_total_bytes=500 << 20, step_time_s=1.0, tokens_per_s=1.0,
                      samples_per_s=1.0, error=None, config=cfg.to_dict(), device="cpu:2GiB",
                      batch_shape=(4, 197), isolation="subprocess", isolation_reason="",
                      steps=2, eval_device_total_bytes=700 << 20, setup_bytes=20 << 20)
    held = whole.with_growth(raw, cfg)
    assert held.setup_counted and held.device_total_bytes == 520 << 20
    assert held.eval_device_total_bytes == 720 << 20
    assert any("set-up step left resident" in n for n in held.notes)
    assert whole.with_growth(held, cfg) == held  # once
    outcome = SimpleNamespace(trials=[held])
    assert setup_residue(outcome) == 0 and setup_residue(outcome, counted=True) == 20 << 20
    # the eval batch is held to the budget by the trial's total, the set-up already in it
    reasons = []
    b, need, _ = eval_from_trial(outcome, cfg, 8, info, 197, probed.device, 0.03, 64, reasons)
    assert (b, need) == (8, 720 << 20) and "of one-time set-up" not in reasons[-1]
    assert dataclasses.replace(raw, setup_bytes=None) == whole.with_growth(
        dataclasses.replace(raw, setup_bytes=None), cfg)  # nothing measured: unchanged
