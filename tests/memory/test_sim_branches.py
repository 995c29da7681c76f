"""What the simulator answers when a step reads a tensor's value (fake tensors have none):
a mask's ``any()`` takes the branch that does the work, a sanity check (inf / NaN) the
branch without the error, and a value-dependent shape or a number read is refused in one
line (``ValueDependentShapeError``), never traced down the wrong branch."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autofit.errors import ValueDependentShapeError
from autofit.memory.simulate._recorder import StorageRecorder


@pytest.fixture
def traced():
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    rec = StorageRecorder()
    with fake, rec:
        yield torch.randn(4, 8)


def test_a_mask_s_any_takes_the_branch_that_does_the_work(traced):
    mask = traced > 0  # e.g. Longformer's "is some token global?"
    assert bool(mask.any()) is True
    assert bool(mask.view(-1).transpose(0, 0).any()) is True  # through views of the mask
    assert bool(mask.all()) is True


def test_a_sanity_check_takes_the_branch_without_the_error(traced):
    assert bool(traced.isinf().any()) is False  # VB-LoRA's logits.isinf().any()
    assert bool(torch.isnan(traced).flatten().any()) is False


def test_a_value_dependent_shape_is_refused_in_one_line(traced):
    with pytest.raises(ValueDependentShapeError) as e:
        torch.nonzero(traced > 0)
    assert e.value.op == "nonzero" and "\n" not in str(e.value)
    assert "measure" in str(e.value)


def test_a_number_read_into_python_is_refused(traced):
    with pytest.raises(ValueDependentShapeError) as e:
        traced.sum().item()
    assert "\n" not in str(e.value) and "item" in str(e.value)
