"""The engine with fake estimators and fake trials: the exact sequence of sizes tried."""

from dataclasses import dataclass

import pytest

from autofit.errors import BadInputError, MissingDependencyError, UnsupportedPrecisionError
from autofit.probe.device import resolve_device
from autofit.search import Engine, SearchSpace, build_space, micro_batch_options

GiB = 2**30


@dataclass
class FakeTrial:
    oom: bool
    device_total_bytes: int | None
    tokens_per_s: float | None
    error: str | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None


def true_bytes(c):
    per_sample = 0.15 if c.gradient_checkpointing else 0.5
    return int((1 + per_sample * c.micro_batch_size) * GiB)


def true_speed(c):
    ckpt = 0.75 if c.gradient_checkpointing else 1.0
    return 1000 * ckpt * c.micro_batch_size / (c.micro_batch_size + 4)


def make(space, *, capacity=10 * GiB, bias=1.0, speed_bias=None, margin=0.10, **kw):
    tried = []

    def trial(c):
        tried.append((c.gradient_checkpointing, c.micro_batch_size))
        need = true_bytes(c)
        if need > capacity:
            return FakeTrial(True, None, None, "CUDA out of memory. Tried to allocate 2.00 GiB")
        return FakeTrial(False, need, true_speed(c))

    engine = Engine(space, capacity,
                    estimate=lambda c: int(true_bytes(c) * bias),
                    speed=speed_bias or true_speed, trial=trial, seq_len=128, margin=margin, **kw)
    return engine, tried


def knob_space(precision, ckpt, optimizer, micro, target=None):
    return SearchSpace({"precision": precision, "gradient_checkpointing": ckpt,
                        "optimizer": optimizer}, micro, target)


def space(ckpt=(False, True), micro=tuple(range(1, 65)), target=None):
    return knob_space(("bf16-mixed",), ckpt, ("adamw_torch",), micro, target)


def test_exact_estimate_confirms_at_the_limit_with_no_oom():
    engine, tried = make(space(ckpt=(False,)))
    out = engine.run()
    # budget 9 GiB: 1 + 0.5 B <= 9 -> B = 16, confirmed in one trial
    assert tried == [(False, 16)]
    assert out.config.micro_batch_size == 16 and out.confirmed and out.ooms == 0


def test_underestimate_bisects_down_after_one_oom():
    # the estimate is 20% low: 0.8 * (1 + 0.5 * 20) = 8.8 GiB <= 9 predicts 20, which needs
    # 11 GiB > 10: OOM. The ratio is then at least 10 / 8.8, which predicts 17: it runs
    # (9.5 GiB) but breaks the margin; measured, the ratio is exact and 16 is confirmed.
    engine, tried = make(space(ckpt=(False,)), bias=0.8)
    out = engine.run()
    assert tried == [(False, 20), (False, 17), (False, 16)]
    assert out.ooms == 1 and out.config.micro_batch_size == 16


def test_overestimate_goes_up_in_a_narrow_window():
    engine, tried = make(space(ckpt=(False,)), bias=1.25)
    out = engine.run()
    assert tried[0][1] < 16 and tried[-1] == (False, 16)
    assert out.ooms == 0 and out.config.micro_batch_size == 16
    assert len(tried) == 2  # recalibrated after the first trial, straight to the limit


def test_fastest_measured_combination_wins():
    engine, tried = make(space())
    out = engine.run()
    # no checkpointing: B=16 -> 1000*16/20 = 800; checkpointing: B=53 -> 750*53/57 = 697
    assert out.config.gradient_checkpointing is False and out.config.micro_batch_size == 16
    assert {t[0] for t in tried} == {False, True}  # both confirmed


def test_measured_speed_overrides_prediction():
    # predicted: checkpointing looks faster (1.5x: within what the model may be wrong by,
    # PREDICTED_SLOWER); measured: it is not
    engine, tried = make(space(), speed_bias=lambda c: 150.0 if c.gradient_checkpointing else 100.0)
    out = engine.run()
    assert tried[0][0] is True  # tried first, as predicted fastest
    assert out.config.gradient_checkpointing is False


def test_candidates_keep_the_estimate_before_calibration():
    # the estimate is 20% low; the trial calibrates it. The candidate keeps both numbers.
    engine, tried = make(space(ckpt=(False,)), bias=0.8)
    out = engine.run()
    c = out.choice
    b = out.config.micro_batch_size
    assert c.raw_estimate_bytes == int(true_bytes(out.config) * 0.8)
    assert c.estimate_bytes == c.measured_bytes == true_bytes(out.config)
    assert abs(c.applied_calibration - 1.25) < 0.01 and b == c.micro_batch


def test_target_batch_kept():
    sp = knob_space(("bf16-mixed",), (False,), ("adamw_torch",), micro_batch_options(48, 1, 256)[0], 48)
    engine, tried = make(sp)
    out = engine.run()
    # divisors of 48 below the limit 16: 16 -> accumulation 3
    assert out.config.micro_batch_size == 16 and out.config.grad_accum_steps == 3
    assert out.config.effective_batch_size == 48
    assert any("effective batch kept" in r for r in out.reasons)


def test_nothing_fits_returns_no_choice():
    engine, tried = make(space(), capacity=GiB)
    out = engine.run()
    assert out.config is None and tried == []
    assert all(c.status == "infeasible" for c in out.candidates)


def test_plan_without_device_is_unconfirmed():
    engine = Engine(space(), 10 * GiB, estimate=lambda c: true_bytes(c), speed=true_speed,
                    trial=None, seq_len=128)
    out = engine.run()
    assert not out.confirmed and out.trials == [] and out.config.micro_batch_size == 16
    assert any("estimate alone" in r for r in out.reasons)


def test_time_budget_returns_best_so_far():
    t = [0.0]

    def clock():
        t[0] += 10.0
        return t[0]

    engine, tried = make(space(), time_budget_s=25.0, clock=clock)
    out = engine.run()
    assert len(tried) == 1 and out.confirmed and out.stopped_early
    assert any("time budget" in r for r in out.reasons)


def test_failed_trial_is_rejected_not_guessed():
    sp = space(ckpt=(False,))

    def trial(c):
        return FakeTrial(False, None, None, "timeout after 10s")

    out = Engine(sp, 10 * GiB, estimate=true_bytes, speed=true_speed, trial=trial,
                 seq_len=128).run()
    assert out.candidates[0].status == "rejected" and "timeout" in out.candidates[0].reason
    assert not out.confirmed


def test_micro_batch_options():
    assert micro_batch_options(12, 1, 256) == ((1, 2, 3, 4, 6, 12), None)
    assert micro_batch_options(12, 2, 4) == ((1, 2, 3), None)
    opts, note = micro_batch_options(10, 4, 256)
    assert note and "nearest" in note
    assert micro_batch_options(None, 1, 3) == ((1, 2, 3), None)
    with pytest.raises(BadInputError):
        micro_batch_options(0, 1, 8)


def test_build_space_defaults_and_constraints():
    reasons = []
    sp = build_space(resolve_device("A100-80GB"), reasons=reasons)
    assert sp.values("precision") == ("bf16-mixed", "32-true")
    assert sp.values("gradient_checkpointing") == (False, True)
    assert "adamw_torch" in sp.values("optimizer") and reasons
    t4 = build_space(resolve_device("T4"))
    assert t4.values("precision")[0] == "16-mixed"
    with pytest.raises(UnsupportedPrecisionError):
        build_space(resolve_device("T4"), precision=["bf16-mixed"])
    only = build_space(resolve_device("cpu"), precision="bf16-mixed", optimizer=["sgd"],
                       gradient_checkpointing=False, chunked_loss=False, max_micro_batch=8)
    assert only.values("precision") == ("bf16-mixed",) and only.values("optimizer") == ("sgd",)
    assert only.values("gradient_checkpointing") == (False,) and only.micro_batches[-1] == 8
    assert len(only.combos()) == 1 and only.combos()[0] == {
        "precision": "bf16-mixed", "gradient_checkpointing": False, "optimizer": "sgd",
        "chunked_loss": False, "liger_kernels": False, "activation_offloading": False,
        "torch_compile": False, "strategy": "ddp", "offload": "none"}
    assert sp.values("chunked_loss") == (False, True)  # no math change: searched by default
    assert sp.values("liger_kernels") == (False,)  # liger-kernel is not installed here
    assert sp.values("activation_offloading") == (False,)  # host copies: only when asked
    assert sp.values("torch_compile") == (False,)  # searched only when asked
    asked = build_space(resolve_device("cpu"), torch_compile=[False, True])
    assert asked.values("torch_compile") == (False, True)
    with pytest.raises(BadInputError, match="unknown knob"):
        build_space(resolve_device("cpu"), attention=["sdpa"])


def test_build_space_without_bitsandbytes(monkeypatch):
    from autofit.knobs import base

    monkeypatch.setattr(base, "installed", lambda package: package != "bitsandbytes")
    with pytest.raises(MissingDependencyError):
        build_space(resolve_device("cpu"), optimizer=["adamw_bnb_8bit"])
    assert "adamw_bnb_8bit" not in build_space(resolve_device("cpu")).values("optimizer")


def test_measured_fragmentation_is_kept_free_once():
    # Each trial's device total is its reserved peak: allocated + 0.5 GiB fragmentation.
    # The margin (10% of 10 GiB) is kept above it: 1 + 0.5 B + 0.5 <= 9 -> B = 15 (16
    # without fragmentation). Subtracting the fragmentation from the budget as well
    # (the old engine) counted it twice and chose 14.
    def trial(c):
        need = true_bytes(c)
        return FakeTrial(False, need + GiB // 2, true_speed(c), peak_allocated_bytes=need,
                         peak_reserved_bytes=need + GiB // 2)

    sp = space(ckpt=(False,))
    frag = Engine(sp, 10 * GiB, estimate=true_bytes, speed=true_speed, trial=trial,
                  seq_len=128, add_fragmentation=True)
    out = frag.run()
    assert frag.fragmentation == GiB // 2 and frag.budget == int(9 * GiB)
    assert out.config.micro_batch_size == 15
    assert any("fragmentation" in r and "above the allocated peak" in r for r in out.reasons)


def test_one_optimizers_misestimate_does_not_condemn_the_others():
    # weights + states dominate: 6 GiB + 0.1 GiB per sample, budget 9 GiB -> 30 fits.
    # The 8-bit optimizer's estimate is 2.5x too low; AdamW's is exact. Borrowing the
    # 8-bit ratio (2.5) for AdamW would put even micro batch 1 at 15 GiB: "nothing fits".
    sp = knob_space(("32-true",), (False,), ("adamw_bnb_8bit", "adamw_torch"), tuple(range(1, 65)))

    def need(c):
        return int((6 + 0.1 * c.micro_batch_size) * GiB)

    def est(c):
        return int(need(c) / 2.5) if c.optimizer == "adamw_bnb_8bit" else need(c)

    def trial(c):
        if need(c) > 10 * GiB:
            return FakeTrial(True, None, None, "out of memory")
        return FakeTrial(False, need(c), 100.0 if c.optimizer == "adamw_torch" else 50.0)

    def speed(c):
        return 100.0 if c.optimizer == "adamw_bnb_8bit" else 60.0  # 8-bit tried first

    out = Engine(sp, 10 * GiB, estimate=est, speed=speed, trial=trial, seq_len=128).run()
    assert out.config is not None and out.config.optimizer == "adamw_torch"
    assert out.config.micro_batch_size == 30


def test_fixed_cost_misestimate_lands_on_the_limit_without_walking():
    # True need 6 GiB + 0.05 GiB per sample (budget 9 GiB -> 60 fits); the estimate gets
    # the fixed part right but the per-sample part 2.5x low. A ratio alone walks toward
    # 60 one size at a time (64, 56, 63, 57, ...); two measurements give the line.
    sp = space(ckpt=(False,))

    def need(c):
        return int((6 + 0.05 * c.micro_batch_size) * GiB)

    tried = []

    def trial(c):
        tried.append(c.micro_batch_size)
        return FakeTrial(False, need(c), 100.0 * c.micro_batch_size)

    est = lambda c: int((6 + 0.02 * c.micro_batch_size) * GiB)  # noqa: E731
    out = Engine(sp, 10 * GiB, estimate=est, speed=true_speed, trial=trial, seq_len=128).run()
    assert out.config.micro_batch_size == 60
    assert tried == [64, 56, 60]


def test_flat_peak_over_the_margin_is_rejected_in_two_trials():
    # The peak is the optimizer step's (9.5 GiB at any micro batch, over the 9 GiB budget);
    # the estimate grows with the batch. Two measurements show the line is flat.
    sp = space(ckpt=(False,))
    tried = []

    def trial(c):
        tried.append(c.micro_batch_size)
        return FakeTrial(False, int(9.5 * GiB), 100.0)

    est = lambda c: int((5 + 0.05 * c.micro_batch_size) * GiB)  # noqa: E731
    out = Engine(sp, 10 * GiB, estimate=est, speed=true_speed, trial=trial, seq_len=128).run()
    assert out.config is None and len(tried) == 2
    assert out.candidates[0].status == "rejected"


def test_measured_speeds_within_noise_are_ranked_by_the_model():
    # fused and unfused AdamW take the same memory; their trials measure 1000 and 980
    # tokens/s (2% apart: noise), the model predicts fused 10% faster -> fused, with a reason.
    # 20% apart is not noise: the measurement wins.
    def run(unfused_speed):
        sp = knob_space(("bf16-mixed",), (False,), ("adamw_torch", "adamw_torch_fused"), tuple(range(1, 65)))

        def trial(c):
            s = unfused_speed if c.optimizer == "adamw_torch" else 980.0
            return FakeTrial(False, true_bytes(c), s)

        def speed(c):
            return 1100.0 if c.optimizer == "adamw_torch_fused" else 1000.0

        return Engine(sp, 10 * GiB, estimate=true_bytes, speed=speed, trial=trial,
                      seq_len=128).run()

    out = run(1000.0)
    assert out.config.optimizer == "adamw_torch_fused"
    assert any("measured speed does not decide" in r and "predicts it fastest" in r
               and "adamw_torch measured 1,000 vs 980 tokens/s" in r for r in out.reasons)
    out = run(1250.0)
    assert out.config.optimizer == "adamw_torch"
    assert not any("step-time noise" in r for r in out.reasons)
    out = run(960.0)  # a tie the model and the measurement agree on: still said
    assert out.config.optimizer == "adamw_torch_fused"
    assert any("measured speed does not decide" in r for r in out.reasons)


def test_a_tie_predicted_alike_goes_to_the_lower_measured_memory():
    # fused AdamW measured 2% slower (noise) but 1 GiB lower; the model predicts both alike:
    # the measured speed does not decide, the lower peak does, and the reasons say so.
    sp = knob_space(("bf16-mixed",), (False,), ("adamw_torch", "adamw_torch_fused"),
                    tuple(range(1, 9)))

    def trial(c):
        fused = c.optimizer == "adamw_torch_fused"
        return FakeTrial(False, (4 if fused else 5) * GiB, 980.0 if fused else 1000.0)

    out = Engine(sp, 10 * GiB, estimate=lambda c: 5 * GiB, speed=lambda c: 1000.0, trial=trial,
                 seq_len=128).run()
    assert out.config.optimizer == "adamw_torch_fused" and out.config.micro_batch_size == 8
    assert any("does not decide" in r and "measured the least memory" in r for r in out.reasons)


def test_nothing_fits_quotes_the_measured_peak_and_calibrated_suggestions():
    # The trial measured 3x the analytic estimate; the message must quote the measurement
    # (not the uncalibrated estimate) and suggest a sequence length whose calibrated
    # estimate fits the budget.
    from autofit.config import TrainConfig
    from autofit.memory.ranks import estimate_analytic
    from autofit.probe.model import probe_model
    from autofit.search.suggest import nothing_fits

    info = probe_model("tiny-llama")
    dev = resolve_device("cpu:1GiB")
    seq = 1024

    def est(c):
        return estimate_analytic(info, c, seq, dev).device_total_bytes

    one = est(TrainConfig(micro_batch_size=1, precision="32-true", optimizer="adamw_torch"))
    cap = int(3.2 * one)  # the estimate fits the budget with room; 3x fits the device only
    measured = {}

    def trial(c):
        m = 3 * est(c)
        measured[c.micro_batch_size] = m
        return FakeTrial(False, m, 100.0)

    sp = knob_space(("32-true",), (False,), ("adamw_torch",), tuple(range(1, 9)))
    engine = Engine(sp, cap, estimate=est, speed=lambda c: 1.0, trial=trial, seq_len=seq,
                    margin=0.10)
    out = engine.run()
    assert out.config is None and measured  # rejected after its trial(s)
    msg = str(nothing_fits(info, sp, engine, seq, dev))
    from autofit.probe.device import format_bytes

    if 1 in measured:
        assert f"measured {format_bytes(measured[1])}" in msg
    else:
        assert f"needs ~{format_bytes(3 * one)}" in msg and "x3.00, as trials measured" in msg
    assert format_bytes(one) not in msg.split(";")[0]  # not the uncalibrated number
    import re

    m = re.search(r"max_seq_len=(\d+)", msg)
    assert m is not None and int(m.group(1)) % 8 == 0 and int(m.group(1)) < seq
    shorter = TrainConfig(micro_batch_size=1, precision="32-true", optimizer="adamw_torch")
    assert 3 * estimate_analytic(info, shorter, int(m.group(1)), dev).device_total_bytes \
        <= engine.budget * 1.02  # the suggestion fits once calibrated


def test_a_target_with_no_fitting_divisor_near_the_limit_says_which_would():
    # target 47 (prime): only 1 and 47 divide it; 16 fits. The choice keeps 47 exactly
    # (1 x 47) and the reasons name the nearby targets that keep micro batches of 16.
    sp = knob_space(("bf16-mixed",), (False,), ("adamw_torch",), micro_batch_options(47, 1, 256)[0], 47)
    engine, tried = make(sp)
    out = engine.run()
    assert out.config.micro_batch_size == 1 and out.config.effective_batch_size == 47
    hint = [r for r in out.reasons if "would keep micro batches of 16" in r]
    assert hint and "32 or 48" in hint[0]
    sp48 = knob_space(("bf16-mixed",), (False,), ("adamw_torch",), micro_batch_options(48, 1, 256)[0], 48)
    out48 = make(sp48)[0].run()  # 16 divides 48: nothing to say
    assert not any("would keep micro batches" in r for r in out48.reasons)


def test_nothing_fits_never_suggests_a_length_past_the_model_positions():
    # issue 11 item 4: a rotary model trained on 256 positions, given 8192-token samples on a
    # device where ~1000 tokens would fit: the suggestion stays within the 256 positions.
    import dataclasses
    import re

    from autofit.config import TrainConfig
    from autofit.memory.ranks import estimate_analytic
    from autofit.probe.model import probe_model
    from autofit.search.suggest import nothing_fits

    info = dataclasses.replace(probe_model("tiny-llama"), max_position_embeddings=256)
    dev = resolve_device("cpu:1GiB")
    seq = 8192
    cfg = TrainConfig(micro_batch_size=1, precision="32-true", optimizer="adamw_torch")
    cap = int(estimate_analytic(info, cfg, 1024, dev).device_total_bytes / 0.9) + 1

    def est(c):
        return estimate_analytic(info, c, seq, dev).device_total_bytes

    sp = knob_space(("32-true",), (False,), ("adamw_torch",), (1, 2))
    engine = Engine(sp, cap, estimate=est, speed=lambda c: 1.0, trial=None, seq_len=seq)
    assert engine.run().config is None
    msg = str(nothing_fits(info, sp, engine, seq, dev))
    lengths = [int(x) for x in re.findall(r"max_seq_len=(\d+)", msg)]
    assert lengths and max(lengths) <= 256, msg


def test_batch_sizes_are_bounded_and_typed():
    # issue 11 item 1: a target of 1000000007 grew past 22 GB listing divisor hints
    from autofit.search.space import MAX_BATCH_SIZE, divisors

    for bad in (1000000007, MAX_BATCH_SIZE + 1, 0, -4, True, "16", 7.5):
        with pytest.raises(BadInputError, match="target_batch_size") as e:
            micro_batch_options(bad, 1, 256)
        assert "\n" not in str(e.value)
    with pytest.raises(BadInputError, match="max_micro_batch"):
        micro_batch_options(None, 1, 10**9)
    opts, _ = micro_batch_options(MAX_BATCH_SIZE, 1, MAX_BATCH_SIZE)
    assert opts == tuple(2**k for k in range(21))
    assert all(divisors(n) == [d for d in range(1, n + 1) if n % d == 0] for n in range(1, 300))
    assert divisors(2 * 999_983) == [1, 2, 999_983, 2 * 999_983]


def test_divisor_hint_on_a_large_target_materialises_nothing():
    # the hint searched range(b + 1, per + 1) as a list: O(target) memory
    import tracemalloc

    target = 1_048_573  # prime, below MAX_BATCH_SIZE: only 1 and itself divide it
    sp = knob_space(("bf16-mixed",), (False,), ("adamw_torch",),
                    micro_batch_options(target, 1, 256)[0], target)
    engine = Engine(sp, 10 * GiB, estimate=true_bytes, speed=true_speed, trial=None, seq_len=128)
    tracemalloc.start()
    out = engine.run()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out.config.micro_batch_size == 1
    assert any("would keep micro batches of 16" in r for r in out.reasons)
    assert peak < 2**20, peak  # under 1 MiB: no list of a million sizes


def test_a_suggested_max_seq_len_is_a_real_cut():
    # 64-token cuts of 65-token samples were suggested (seq_len - 1, then a multiple of 8):
    # a suggestion is at most ~90% of the length, a multiple of 8 (64 from 512 up), or none.
    import re

    from autofit.config import TrainConfig
    from autofit.memory.ranks import estimate_analytic
    from autofit.probe.model import probe_model
    from autofit.search.suggest import _shorter_length, nothing_fits

    assert _shorter_length(65, None, lambda n: True) == 56
    assert _shorter_length(16, None, lambda n: True) is None  # 14 -> 8: too short to offer
    assert _shorter_length(8192, None, lambda n: n <= 3000) == 2944  # 46 x 64
    assert _shorter_length(1000, None, lambda n: True) == 896  # 900 -> 14 x 64
    assert _shorter_length(8192, 300, lambda n: True) == 296
    assert _shorter_length(4096, None, lambda n: n <= 12) is None
    info = probe_model("tiny-llama")
    dev = resolve_device("cpu:1GiB")
    # micro batch 64: activations matter at 65 tokens (at 1 the weights' step dominates)
    cfg = TrainConfig(micro_batch_size=64, precision="32-true", optimizer="adamw_torch")

    def need(length):
        return estimate_analytic(info, cfg, length, dev).device_total_bytes

    # 65-token samples, 64 fit: 56; 17-token samples, 16 fit: no cut of 10% is 16 or more
    for seq, fitting in ((65, 64), (17, 16)):
        cap = int((need(fitting) + need(fitting + 1)) / 2 / 0.9)
        sp = knob_space(("32-true",), (False,), ("adamw_torch",), (64,))
        engine = Engine(sp, cap, estimate=lambda c, seq=seq: estimate_analytic(
            info, c, seq, dev).device_total_bytes, speed=lambda c: 1.0, trial=None, seq_len=seq)
        assert engine.run().config is None
        msg = str(nothing_fits(info, sp, engine, seq, dev))
        lengths = [int(x) for x in re.findall(r"max_seq_len=(\d+)", msg)]
        assert lengths == ([56] if seq == 65 else []), msg


def _sizes(text):
    """Every byte count in a message (format_bytes' '802 MiB', '2.64 GiB'), in bytes."""
    import re

    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return [float(n) * units[u] for n, u in re.findall(r"([\d.]+) (B|KiB|MiB|GiB|TiB)\b", text)]


def _ideas(msg):
    """'would fit' suggestions of a "nothing fits" message: {label: bytes}."""
    import re

    tail = msg.split("; would fit: ", 1)[1] if "; would fit: " in msg else ""
    found = re.findall(r"(.*?) ~([\d.]+ (?:B|KiB|MiB|GiB|TiB))(?:; |$)", tail)
    assert "".join(f"{a} ~{b}; " for a, b in found) == tail + "; " if tail else True, tail
    return {label: _sizes(size)[0] for label, size in found}


def test_nothing_fits_quotes_calibrated_numbers_everywhere():
    # Trials measure 1.3x the estimate. Every number of the message is the measured or
    # calibrated one: the smallest candidate's need and each alternative's (checkpointing,
    # other precisions and optimizers, LoRA, QLoRA, a shorter sequence) at 1.3x its
    # estimate; the same search with an exact estimate on a device 1.3x smaller offers the
    # same alternatives at the uncalibrated numbers.
    from autofit.config import TrainConfig
    from autofit.memory.ranks import estimate_analytic
    from autofit.probe.device import format_bytes
    from autofit.probe.model import probe_model
    from autofit.search.suggest import nothing_fits

    info = probe_model("tiny-llama")
    dev = resolve_device("cpu:8GiB")
    seq = 1024

    def est(c):
        return estimate_analytic(info, c, seq, dev).device_total_bytes

    one = est(TrainConfig(micro_batch_size=1, precision="32-true", optimizer="adamw_torch"))
    cap = int(1.2 * one / 0.9)  # the estimate fits the budget; 1.3x does not
    measured = {}

    def trial(c):
        measured[c.micro_batch_size] = int(1.3 * est(c))
        return FakeTrial(False, measured[c.micro_batch_size], 100.0)

    sp = knob_space(("32-true",), (False,), ("adamw_torch",), tuple(range(1, 9)))
    engine = Engine(sp, cap, estimate=est, speed=lambda c: 1.0, trial=trial, seq_len=seq)
    assert engine.run().config is None and measured
    msg = str(nothing_fits(info, sp, engine, seq, dev))
    head = msg.split("; would fit: ")[0]
    need = measured.get(1, int(1.3 * one))
    assert _sizes(head) == pytest.approx([engine.budget, cap, need], rel=0.006), msg
    assert (f"measured {format_bytes(need)}" if 1 in measured else
            f"needs ~{format_bytes(need)} (the estimate x1.30, as trials measured)") in head

    ref = Engine(sp, int(cap / 1.3), estimate=est, speed=lambda c: 1.0, trial=None, seq_len=seq)
    assert ref.run().config is None
    raw = _ideas(str(nothing_fits(info, sp, ref, seq, dev)))
    got = _ideas(msg)
    assert len(got) >= 4 and any("max_seq_len" in k for k in got), msg
    assert got.keys() == raw.keys(), msg
    for label, n in got.items():
        assert n == pytest.approx(1.3 * raw[label], rel=0.012), label


def test_nothing_fits_says_what_its_numbers_come_from():
    # The engine's own estimate (e.g. the simulated step) is 1.3x the closed form and no
    # trial ran: the message quotes the engine's number, and no "as trials measured"
    # (nothing was measured). Simulated trials are called simulated, not measured.
    from autofit.config import TrainConfig
    from autofit.memory.ranks import estimate_analytic
    from autofit.probe.device import format_bytes
    from autofit.probe.model import probe_model
    from autofit.search.suggest import nothing_fits

    info = probe_model("tiny-llama")
    dev = resolve_device("cpu:8GiB")
    seq = 1024

    def est(c):
        return int(1.3 * estimate_analytic(info, c, seq, dev).device_total_bytes)

    one = est(TrainConfig(micro_batch_size=1, precision="32-true", optimizer="adamw_torch"))
    sp = knob_space(("32-true",), (False,), ("adamw_torch",), tuple(range(1, 9)))
    engine = Engine(sp, int(one / 1.1 / 0.9), estimate=est, speed=lambda c: 1.0, trial=None,
                    seq_len=seq)
    assert engine.run().config is None
    msg = str(nothing_fits(info, sp, engine, seq, dev))
    assert f"needs ~{format_bytes(one)}; would fit" in msg and "measured" not in msg, msg

    def simulated(c):
        return FakeTrial(False, int(1.5 * est(c)), 100.0)

    cap = int(1.2 * one / 0.9)
    engine = Engine(sp, cap, estimate=est, speed=lambda c: 1.0, trial=simulated, seq_len=seq,
                    trial_word="simulated")
    assert engine.run().config is None
    msg = str(nothing_fits(info, sp, engine, seq, dev))
    assert f"simulated {format_bytes(int(1.5 * one))}" in msg and "measured" not in msg, msg


def _bracket(need, micro, est=lambda b: 5 * GiB, max_trials=12):
    """A search of one combination whose device total is ``need(b)`` (OOM above 10 GiB,
    budget 9 GiB) and whose estimate is ``est(b)``: (outcome, sizes tried in order)."""
    tried = []

    def trial(c):
        b = c.micro_batch_size
        tried.append(b)
        if need(b) > 10 * GiB:
            return FakeTrial(True, None, None, "CUDA out of memory. Tried to allocate 2.00 GiB")
        return FakeTrial(False, int(need(b)), 100.0 * b)

    sp = knob_space(("bf16-mixed",), (False,), ("adamw_torch",), micro)
    out = Engine(sp, 10 * GiB, estimate=lambda c: int(est(c.micro_batch_size)),
                 speed=true_speed, trial=trial, seq_len=128, max_trials=max_trials).run()
    return out, tried


def test_a_flat_estimate_bisects_between_fit_and_failure():
    # The estimate is flat in the micro batch (a frozen base whose weights dominate); the
    # need grows 0.1 GiB per sample: 40 is the limit. Calibrated by the OOM at 256, every
    # size looked like 10 GiB: the combination was rejected after one trial ("nothing
    # fits"); measured flat, it stepped down one size per failure. The bracket halves
    # (geometric midpoint): O(log n) trials.
    import math

    out, tried = _bracket(lambda b: (5 + 0.1 * b) * GiB, tuple(range(1, 257)))
    assert out.config.micro_batch_size == 40 and out.confirmed
    assert tried == [256, 16, 64, 32, 45, 38, 41, 39, 40]
    for n, per in ((4096, 0.004), (65536, 0.0001)):  # limit 1000, 40000
        out, tried = _bracket(lambda b, per=per: (5 + per * b) * GiB, tuple(range(1, n + 1)),
                              max_trials=64)
        assert out.config.micro_batch_size == round(4 / per)
        assert len(tried) <= math.log2(n) + math.log2(math.log2(n)) + 1, tried
    # allowed sizes that are divisors of a target: the same bracket over them
    out, tried = _bracket(lambda b: (5 + 0.1 * b) * GiB, micro_batch_options(720, 1, 720)[0])
    assert out.config.micro_batch_size == 40 and tried == [720, 24, 120, 48, 36, 40, 45]


def test_a_peak_flat_until_an_oom_bisects_and_keeps_the_measured_fits():
    # Flat estimate, flat peak (6 GiB) up to 99, out of memory from 100: after a fit the
    # calibrated estimate says every size fits, the failed one too; bisected, not walked.
    out, tried = _bracket(lambda b: 6 * GiB if b < 100 else 11 * GiB, tuple(range(1, 257)))
    assert out.config.micro_batch_size == 99
    assert tried == [256, 16, 64, 128, 91, 108, 99, 103, 101, 100]
    # A growing estimate, a peak that jumps past the capacity above 40: the OOM at 41 used
    # to raise the ratio over the fit measured at 7, condemning 8..40 (7 was chosen).
    out, tried = _bracket(lambda b: 5 * GiB if b <= 40 else 11 * GiB, tuple(range(1, 257)),
                          est=lambda b: (5 + 0.01 * b) * GiB)
    assert out.config.micro_batch_size == 40 and tried[-3:] == [34, 39, 40]


def test_a_flat_peak_over_the_margin_everywhere_is_rejected_in_log_n_trials():
    out, tried = _bracket(lambda b: 9.5 * GiB if b < 100 else 11 * GiB, tuple(range(1, 257)))
    assert out.config is None and tried == [256, 16, 4, 2, 1]
    c = out.candidates[0]
    assert c.status == "rejected" and "nothing smaller is allowed" in c.reason


def test_a_combination_predicted_far_slower_than_a_confirmed_one_is_not_tried():
    # checkpointing predicted 3x slower than no checkpointing, which fits: not tried
    engine, tried = make(space(), speed_bias=lambda c: true_speed(c) / (
        3.0 if c.gradient_checkpointing else 1.0))
    out = engine.run()
    assert tried == [(False, 16)] and out.config.gradient_checkpointing is False
    skipped = [c for c in out.candidates if c.choice["gradient_checkpointing"]]
    assert skipped[0].status == "skipped" and "x slower than" in skipped[0].reason
    # predicted only 1.33x slower (true_speed): both are confirmed, measurement decides
    engine, tried = make(space())
    engine.run()
    assert {ckpt for ckpt, _ in tried} == {False, True}


def test_one_timed_step_when_no_rival_could_beat_the_candidate():
    asked = []

    def run(sp, speed):
        def trial(c, timed_steps=None):
            asked.append(timed_steps)
            return FakeTrial(False, true_bytes(c), true_speed(c))

        trial.timed_steps = True
        Engine(sp, 10 * GiB, estimate=true_bytes, speed=speed, trial=trial, seq_len=128).run()

    run(space(), lambda c: true_speed(c) / (3.0 if c.gradient_checkpointing else 1.0))
    assert asked == [1]  # the only rival is predicted 3x slower: its speed decides nothing
    asked.clear()
    run(space(), true_speed)
    assert asked[0] is None  # a rival within 2x: the trial's default timed steps


def test_a_trial_outpaced_by_a_confirmed_rival_stops_and_is_never_chosen():
    # checkpointing is predicted 1.33x slower (a rival: both are tried) but measures 2x
    # slower: its trial is told the speed under which to stop (the confirmed rival's over
    # OUTPACED), stops after one timed step, and is neither confirmed nor chosen
    from autofit.search.engine import OUTPACED

    asked = []

    def trial(c, timed_steps=None, outpaced_below=None):
        asked.append((c.gradient_checkpointing, outpaced_below))
        speed = true_speed(c) / (2.0 if c.gradient_checkpointing else 1.0)
        r = FakeTrial(False, true_bytes(c), speed)
        r.outpaced = outpaced_below is not None and speed < outpaced_below
        return r

    trial.timed_steps = True
    trial.outpaced_below = True
    out = Engine(space(), 10 * GiB, estimate=true_bytes, speed=true_speed, trial=trial,
                 seq_len=128).run()
    (first, none), (second, below) = asked
    assert first is False and none is None  # nothing confirmed yet: nothing to outpace
    fast = true_speed(out.config)
    assert second is True and below == pytest.approx(fast / OUTPACED)
    assert out.config.gradient_checkpointing is False and out.confirmed
    slow = next(c for c in out.candidates if c.choice["gradient_checkpointing"])
    assert slow.status == "slower" and slow.confirmed_micro_batch is None
    ratio = fast / slow.measured_tokens_per_s
    assert ratio > OUTPACED and f"{ratio:.1f}x slower than" in slow.reason
    assert "its run not replayed" in slow.reason
    # measured as predicted (1.15x slower): not outpaced, confirmed, the measurement decides
    def close(c, timed_steps=None, outpaced_below=None):
        speed = true_speed(c)
        r = FakeTrial(False, true_bytes(c), speed)
        r.outpaced = outpaced_below is not None and speed < outpaced_below
        return r

    close.timed_steps = close.outpaced_below = True
    out = Engine(space(), 10 * GiB, estimate=true_bytes, speed=true_speed, trial=close,
                 seq_len=128).run()
    assert {c.status for c in out.candidates if c.status != "estimated"} == {"confirmed"}


@pytest.mark.parametrize("share, tried", [(0.01, 1), (0.2, 3)])
def test_an_optimizer_sibling_is_tried_only_when_its_optimizer_step_could_matter(share, tried):
    """Three optimizers at one micro batch run the same forward and backward: when the
    confirmed one's optimizer step is 1% of its run's step, even a free optimizer step
    could not make a sibling 5% faster (skipped, with the reason); at 20% it could."""
    optimizers = ("adamw_torch_fused", "adamw_torch", "sgd")
    sp = knob_space(("32-true",), (False,), optimizers, tuple(range(1, 9)), target=8)
    ran = []

    def trial(c):
        ran.append(c.optimizer)
        r = FakeTrial(False, true_bytes(c), true_speed(c))
        r.optimizer_share = share
        return r

    out = Engine(sp, 10 * GiB, estimate=true_bytes, speed=true_speed, trial=trial,
                 seq_len=128).run()
    assert len(ran) == tried and out.confirmed
    skipped = [c for c in out.candidates if c.status == "skipped"]
    assert len(skipped) == 3 - tried
    for c in skipped:
        assert "but for its optimizer" in c.reason and "within the 5% measurement tie" in c.reason


def test_a_combination_whose_memory_cannot_be_estimated_is_never_chosen():
    """A simulated step the estimate refuses (``UnmodelledStepError``: RWKV's checkpointed
    CPU recurrence) leaves its combination out with the refusal as its reason, where a
    faster-predicted combination would otherwise have won; the others are planned as
    before."""
    from autofit.errors import UnmodelledStepError

    def est(c):
        if c.gradient_checkpointing:
            raise UnmodelledStepError("simulate cannot estimate a checkpointed recurrence")
        return true_bytes(c)

    def speed(c):  # checkpointing predicted faster: without the refusal it would win
        return true_speed(c) * (2.0 if c.gradient_checkpointing else 1.0)

    out = Engine(space(), 10 * GiB, estimate=est, speed=speed, trial=None, seq_len=128).run()
    assert out.config is not None and not out.config.gradient_checkpointing
    assert out.config.micro_batch_size == 16
    refused = [c for c in out.candidates if c.choice["gradient_checkpointing"]]
    assert refused and all(c.status == "infeasible" and "recurrence" in c.reason
                           for c in refused)
