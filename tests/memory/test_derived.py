"""Derived analytic coefficients are kept on disk: a new process does not run the forwards
again, a damaged file is derived again, an unwritable folder is one warning."""

import json
import logging

import pytest

from autofit import TrainConfig
from autofit.memory.analytic import _moments, derived
from autofit.probe.device import resolve_device
from autofit.probe.model import build_model, describe

CPU = resolve_device("cpu")


@pytest.fixture(scope="module")
def ia3():
    module, task = build_model("tiny-llama", peft_config={"peft_type": "IA3"})
    return module, describe(module, task=task)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty disk cache in tmp_path and an empty in-memory cache (a new process)."""
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path))
    derived._memory.cache_clear()
    return tmp_path


def _forwards(monkeypatch):
    """Count the derivations (the fake forwards) from here on."""
    calls = []
    real = derived._forward_saved

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(derived, "_forward_saved", counted)
    return calls


def test_a_new_process_reads_them_from_disk(ia3, fresh, monkeypatch):
    module, info = ia3
    calls = _forwards(monkeypatch)
    first = derived.derived_coefficients(module, info, TrainConfig(), CPU)
    assert len(calls) == 1
    (stored,) = (fresh / "derived").glob("*.json")
    assert json.loads(stored.read_text()) == first
    derived._memory().coefficients.clear()  # a new process: memory empty, disk kept
    assert derived.derived_coefficients(module, info, TrainConfig(), CPU) == first
    assert len(calls) == 1  # no forward ran
    # another precision is another entry
    derived.derived_coefficients(module, info, TrainConfig(precision="bf16-mixed"), CPU)
    assert len(calls) == 2 and len(list((fresh / "derived").glob("*.json"))) == 2


def test_changed_code_does_not_reuse_them(ia3, fresh, monkeypatch):
    module, info = ia3
    derived.derived_coefficients(module, info, TrainConfig(), CPU)
    derived._memory().coefficients.clear()
    monkeypatch.setattr(derived, "_code_hash", lambda: "another simulator")
    calls = _forwards(monkeypatch)
    derived.derived_coefficients(module, info, TrainConfig(), CPU)
    assert len(calls) == 1


@pytest.mark.parametrize("damage", ["", "{not json", '{"derived": true, "layer": {}}',
                                    '{"derived": true, "layer": {"c0": NaN, "T": 0, "s": 0, '
                                    '"F": 0}, "base": {"c0": 0, "T": 0, "s": 0, "F": 0}}'])
def test_a_damaged_file_is_derived_again_and_replaced(ia3, fresh, monkeypatch, damage):
    module, info = ia3
    good = derived.derived_coefficients(module, info, TrainConfig(), CPU)
    (stored,) = (fresh / "derived").glob("*.json")
    stored.write_text(damage)
    derived._memory().coefficients.clear()
    calls = _forwards(monkeypatch)
    assert derived.derived_coefficients(module, info, TrainConfig(), CPU) == good
    assert len(calls) == 1 and json.loads(stored.read_text()) == good


def test_an_unwritable_folder_is_one_warning(ia3, fresh, monkeypatch, caplog):
    module, info = ia3
    (fresh / "derived").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="autofit"):
        a = derived.derived_coefficients(module, info, TrainConfig(), CPU)
        derived._memory().coefficients.clear()
        b = derived.derived_coefficients(module, info, TrainConfig(), CPU)
    assert a == b and a["derived"] is True
    warnings = [r for r in caplog.records if "derived coefficients" in r.getMessage()]
    assert len(warnings) == 1 and "AUTOFIT_CACHE_DIR" in warnings[0].getMessage()


# ------------------------------------------------ the forward's moments (phi-1.5 on 4 bits)

def _at(moments: tuple[str, list[int], list[float]],
        transient: tuple[int, float, int] | None = None) -> _moments._AtShape:
    return _moments._AtShape([0.0], [0.0], [0.0], 0, transient or (max(moments[1]), 1.0, 0),
                            moments, [0], [("", [])], [1.0], 0, ("", []), 0, (0, False), [0.0], 0, 0)


def test_the_forward_transient_is_fitted_beside_the_share_it_is_used_with():
    """Qwen3-Next's causal LM with LoRA: at 4 x 32 its forward peaks inside the first
    block's recurrence (61.7 MB above 0.65 of the 98.2 MB it keeps), at the other shapes at
    the loss (share 1). The forward candidate is the fitted transient beside the largest
    share of the activations, so the fit must give back each shape's own peak; fitting the
    transients as they were put 4 x 128 at 133 MB above all activations (21% over)."""
    from autofit.config import TrainConfig

    MB = 10**6
    rows = {(2, 32): (8.73, 1.0, 55.4), (2, 64): (10.9, 1.0, 82.2),
            (2, 128): (15.21, 1.0, 155.9), (4, 32): (61.65, 0.648, 98.2)}
    ats = [_at(("a", [0], [1.0]), (int(t * MB), share, int(kept * MB)))
           for (t, share, kept) in (rows[shape] for shape in derived.SHAPES)]

    def at(fit, b, t):  # F + B*(s + a*T + b*T^2), as fitted
        return fit["F"] + b * (fit["s"] + fit["a"] * t + fit["b"] * t * t)

    fwd, share = derived._forward_fit(ats, TrainConfig())
    assert share == 1.0
    for (b, t), (transient, s, kept) in rows.items():
        assert at(fwd, b, t) + share * kept * MB == pytest.approx((transient + s * kept) * MB)
    # with checkpointing (share 1 at use, the checkpoints kept): the transients as they are
    ckpt, _ = derived._forward_fit(ats, TrainConfig(gradient_checkpointing=True))
    assert at(ckpt, 4, 32) == pytest.approx(61.65 * MB)


def test_the_forward_transient_is_the_highest_moment_at_the_shape():
    """Two moments of one forward: inside a 4-bit layer (its dequantized weight, 32 MiB at
    any shape) and at the loss (300 KiB a token). The highest of the two at each of the
    four shapes is 32 MiB + a little, 32 + more, then the loss's: one fit of those puts a
    T^2 term on a step whose highest point only moves. Each moment fitted on its own
    gives the loss's 300 KiB a token at 1,044 tokens (and the 32 MiB at a few)."""
    W, per_token = 32 * 2**20, 300 * 1024
    ats = [_at(("aa", [W + 1024 * b * t, per_token * b * t], [0.3, 1.0]))
           for b, t in derived.SHAPES]
    moments = _moments._transient_moments(ats)
    assert moments is not None and len(moments) == 2

    def at(form, b, t):
        return max(b * t * (form["c0"] + form["T"] * t) + b * form["s"], 0) + form["F"]

    assert max(at(m, 1, 1044) for m in moments) == pytest.approx(
        max(W + 1024 * 1044, per_token * 1044))
    assert max(at(m, 1, 16) for m in moments) == pytest.approx(W + 1024 * 16)
    assert sorted(m["share"] for m in moments) == [0.3, 1.0]
    # one fit of the highest points: the T^2 term (2.2 GiB at 1,044 tokens, 7x the loss's)
    single = _moments._solve([float(max(a.moments[1])) for a in ats])
    assert at(_moments._form(single), 1, 1044) > 7 * per_token * 1044
    # forwards whose events differ (another path at another shape): no moments
    assert _moments._transient_moments([ats[0], ats[1], ats[2], _at(("aaf", [1, 2, 3],
                                                                   [1.0] * 3))]) is None


def test_the_four_forwards_run_the_same_events(fresh):
    """After the step that is not kept, the four shapes' forwards are event for event
    alike (a model's lazily built caches would make the first other): the moments are
    told apart for tiny-llama, and its per-block saved bytes are per token with no fixed
    part."""
    module, task = build_model("tiny-llama")
    c = derived.derived_coefficients(module, describe(module, task=task), TrainConfig(),
                                     CPU)
    assert c["forward_moments"]
    assert c["layer"]["F"] == 0


def test_a_block_backward_no_hook_saw_is_no_scratch():
    """Where no block's backward hook fired (OpenAI-GPT's blocks; I-BERT's with LoRA), each
    stack's block scratch is 0, not an internal error (``zip`` of the starts and ends)."""
    from autofit.memory.breakdown import Component
    from autofit.memory.simulate._recorder import Record

    r = Record(0, 1 << 20, "backward", 0, Component.ACTIVATIONS)
    log = [("alloc", r, "backward"), ("free", r, "backward")]
    assert derived._block_backward(log, [-1, -1], set(), [([0, 1], [(0, 1), (1, 1)], 2)]) \
        == ([0], [("", [])])


def test_the_probe_lengths_reach_the_step():
    """The fits interpolate at the step's length: the base shapes up to 128 tokens, then the
    lengths doubled until the longest reaches it, within the model's positions."""
    assert derived.probe_shapes(None) == derived.probe_shapes(100) == derived.SHAPES
    assert derived.probe_shapes(300) == ((2, 128), (2, 256), (2, 512), (4, 128))
    assert max(t for _, t in derived.probe_shapes(4096, limit=512)) == 512
    assert derived.probe_shapes(4096, limit=64) == derived.SHAPES  # (refused later, as before)


def test_a_block_backward_is_the_highest_of_its_moments_at_the_step():
    """Ergo's dense first block: at the probe shapes its backward peaks at its weight's
    16-bit gradient (16 MiB, whatever the shape), at 4 x 128 tokens at its squared ReLU's
    backward (three (N, 32768) 16-bit temporaries beside one more). One fit of the
    highest points (the weight's at 64 and 128 tokens, a tie at 256) misses the second;
    fitted moment by moment, the estimate takes the higher at the step's shape."""
    from autofit.memory.analytic._closed_form import _signed

    mib, per_token = 1 << 20, 4 * 32768 * 2  # four (N, 32768) bf16 tensors at the peak
    shapes = derived.SHAPES
    per_shape = [("aa", [16 * mib + b * t * 32768 * 2, b * t * per_token - 16 * mib])
                 for b, t in shapes]
    moments = _moments._event_moments(per_shape, shapes)
    at_step = max(_signed(m, 4, 128) for m in moments)
    assert at_step == 4 * 128 * per_token - 16 * mib
    one_fit = _moments._solve([max(v) for _, v in per_shape], shapes)
    assert _signed(_moments._form(one_fit), 4, 128) < at_step
    # events that differ from one shape to another are not told apart
    assert _moments._event_moments([("aa", [1, 2])] * 3 + [("af", [1, 2])], shapes) is None
