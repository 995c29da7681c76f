"""The request, typed: ``ModelSpec`` (what the model is) and ``TuneOptions`` (what the search
may do) are frozen, each option has one default, and bad values are refused once, at the
boundary, with the messages the public functions always gave."""

from __future__ import annotations

import dataclasses

import pytest

from autofit import autofit
from autofit.config import ModelSpec, QuantRequest
from autofit.errors import BadInputError
from autofit.knobs import knob_names
from autofit.stages.options import MODEL_OPTIONS, TuneOptions
from autofit.trial.model import ModelRef, for_device, model_spec

DATA = [{"input_ids": list(range(1, 17))}] * 4


@pytest.mark.parametrize("spec", [ModelSpec("tiny-llama"), TuneOptions()], ids=type)
def test_specs_are_frozen(spec):
    name = dataclasses.fields(spec)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(spec, name, None)


def test_the_knob_constraints_cannot_be_changed_in_place():
    opts = TuneOptions.of({"precision": ["bf16-mixed"]})
    with pytest.raises(TypeError):
        opts.knobs["precision"] = ["32-true"]  # type: ignore[index]
    wider = opts.with_knobs(optimizer=["sgd"])
    assert dict(opts.knobs) == {"precision": ["bf16-mixed"]}  # the original is untouched
    assert wider.asked("optimizer") == ["sgd"] and wider.asked("precision") == ["bf16-mixed"]


def test_each_option_has_one_default():
    # the builder adds no default of its own: what is not given is the field's default
    assert TuneOptions.of({}) == TuneOptions()
    assert (TuneOptions().max_micro_batch, TuneOptions().confirm_top, TuneOptions().max_trials,
            TuneOptions().trial_timeout_s, TuneOptions().method) == (256, 3, 12, 600.0, "analytic")
    given = TuneOptions.of({"max_micro_batch": 8, "confirm_top": 1, "task": "causal-lm"})
    assert (given.max_micro_batch, given.confirm_top) == (8, 1)  # the model's keywords: not here


def test_autofit_accepts_exactly_the_options_the_specs_hold():
    fields = {f.name for f in dataclasses.fields(TuneOptions)} - {"knobs", "recipe"}
    with pytest.raises(BadInputError) as e:
        autofit("tiny-llama", DATA, device="cpu", bogus=1)
    known = e.value.args[0].split("known: ")[1].split(", ")
    assert set(known) == fields | set(MODEL_OPTIONS) | set(knob_names())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"bogus": 1}, "unknown option(s) bogus; known: "),
    ({"objective": "memory"}, "unknown objective 'memory'; use 'throughput'"),
    ({"method": "guess"}, "unknown method 'guess'; choose one of analytic, simulate"),
    ({"max_micro_batch": 0}, "max_micro_batch must be at least 1, got 0"),
    ({"margin": 1.5}, "margin must be a fraction in [0, 1) of the capacity kept free"),
    ({"time_budget_s": -1}, "time_budget_s must be a positive number of seconds"),
    ({"trial_timeout_s": float("inf")}, "trial_timeout_s must be a positive, finite number"),
    ({"max_trials": 0}, "max_trials must be a positive integer, got 0"),
    ({"lora": {"r": 8}, "peft_config": {"peft_type": "LORA"}}, "not both"),
    ({"load_in_4bit": True, "load_in_8bit": True}, "load_in_8bit=True, not both"),
])
def test_bad_values_are_refused_at_the_boundary(kwargs, message):
    with pytest.raises(BadInputError) as e:
        autofit("tiny-llama", DATA, device="cpu", **kwargs)
    assert message in str(e.value)


def test_every_bad_number_is_reported_at_once():
    with pytest.raises(BadInputError) as e:
        TuneOptions.of({"max_trials": 0, "confirm_top": -1}, margin=2.0)
    text = str(e.value)
    assert "margin" in text and "max_trials" in text and "confirm_top" in text


def test_model_spec_generalises_the_trial_reference():
    assert ModelRef is ModelSpec  # trial/ carries the same spec
    spec = model_spec("tiny-llama", lora={"r": 4}, load_in_4bit=True)
    assert spec.ref == "tiny-llama" and spec.lora == {"r": 4}
    assert spec.quant is not None and spec.quant.bits == 4
    assert spec.quant_request == QuantRequest(load_in_4bit=True)  # resolved again per device
    from autofit.probe.device import resolve_device

    on_t4 = for_device(spec, resolve_device("T4"))  # no bf16: QLoRA computes in fp16 there
    assert on_t4.quant.compute_dtype == "float16" and spec.quant.compute_dtype == "bfloat16"
    assert model_spec("tiny-llama").quant is None
