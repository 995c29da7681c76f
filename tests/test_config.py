import pytest

from autofit import TrainConfig
from autofit.config import OPTIMIZERS, PRECISIONS, UNSIZED_OPTIMIZERS, parse_optim_args
from autofit.errors import AutofitError, BadInputError, InvalidConfigError


def test_defaults_and_effective_batch():
    c = TrainConfig(micro_batch_size=4, grad_accum_steps=8, world_size=2)
    assert c.effective_batch_size == 64
    assert c.precision == "32-true" and c.optimizer == "adamw_torch"


@pytest.mark.parametrize("alias,name", [("bf16", "bf16-mixed"), ("fp16", "16-mixed"),
                                        ("32", "32-true"), ("BF16-TRUE", "bf16-true")])
def test_precision_aliases(alias, name):
    assert TrainConfig(precision=alias).precision == name


def test_lightning_and_trainingarguments_names():
    assert set(PRECISIONS) == {"32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"}
    from transformers.training_args import OptimizerNames

    hf = {o.value for o in OptimizerNames}
    assert set(OPTIMIZERS) <= hf, set(OPTIMIZERS) - hf


@pytest.mark.parametrize("kwargs", [
    {"micro_batch_size": 0}, {"micro_batch_size": -1}, {"grad_accum_steps": 0},
    {"micro_batch_size": 1.5}, {"micro_batch_size": True}, {"seq_len": 0},
    {"precision": "bf17"}, {"optimizer": "adam"}, {"optim_args": "momentum"},
])
def test_bad_values_raise_one_error(kwargs):
    with pytest.raises(InvalidConfigError) as e:
        TrainConfig(**kwargs)
    assert isinstance(e.value, AutofitError) and "\n" not in str(e.value)


def test_all_problems_reported_at_once():
    with pytest.raises(InvalidConfigError) as e:
        TrainConfig(micro_batch_size=0, precision="bf17", optimizer="adamw")
    msg = str(e.value)
    assert "micro_batch_size" in msg and "bf17" in msg and "adamw" in msg
    assert "did you mean" in msg


def test_every_transformers_optimizer_is_sized_or_refused_with_its_reason():
    """A new TrainingArguments.optim name fails here until autofit sizes it or says why not."""
    from transformers.training_args import OptimizerNames

    names = {o.value for o in OptimizerNames}
    assert set(OPTIMIZERS) | set(UNSIZED_OPTIMIZERS) == names
    assert not set(OPTIMIZERS) & set(UNSIZED_OPTIMIZERS)
    with pytest.raises(InvalidConfigError) as e:
        TrainConfig(optimizer="galore_adamw")
    msg = str(e.value)
    assert "cannot size yet" in msg and "low-rank" in msg and "\n" not in msg
    assert "unknown optimizer" in str(pytest.raises(InvalidConfigError, TrainConfig,
                                                    optimizer="adamw_torch_foo").value)


def test_optim_args():
    assert parse_optim_args("momentum=0.9, nesterov=True") == {"momentum": "0.9", "nesterov": "True"}
    assert parse_optim_args(None) == {}
    assert TrainConfig(optimizer="sgd", optim_args="momentum=0.9").optim_kwargs == {"momentum": "0.9"}


def test_frozen_and_replace():
    c = TrainConfig()
    with pytest.raises(AttributeError):
        c.micro_batch_size = 3  # type: ignore[misc]
    assert c.replace(micro_batch_size=3).micro_batch_size == 3
    with pytest.raises(InvalidConfigError):
        c.replace(micro_batch_size=0)
    assert TrainConfig(**c.to_dict()) == c


def test_a_step_autograd_refuses_in_place_is_one_line_saying_what_to_do():
    """transformers' xLSTM trains with checkpointing only: its step without it modifies a
    tensor saved for backward; both methods say so, as a run would fail."""
    from autofit.errors import inplace_autograd_error

    err = RuntimeError("one of the variables needed for gradient computation has been "
                       "modified by an inplace operation: [torch.FloatTensor [4, 4, 32]]")
    off = inplace_autograd_error(err, "xlstm", TrainConfig())
    assert isinstance(off, BadInputError) and "gradient_checkpointing=True" in str(off)
    on = inplace_autograd_error(err, "xlstm", TrainConfig(gradient_checkpointing=True))
    assert "checkpointed step fails" in str(on)
    assert inplace_autograd_error(RuntimeError("shape mismatch"), "x", TrainConfig()) is None
