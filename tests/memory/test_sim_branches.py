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


def test_the_autograd_graph_is_charged_per_node_and_saved_tensor():
    """A CPU step's autograd graph is host memory no tensor shows: ``graph_host_bytes``
    charges each node and each saved-variable slot of a node (a binary ``mul`` has two,
    used or not: the rule is calibrated per op so, ``benchmarks/autograd_host.py``), and
    grows with a per-token loop as RWKV's recurrence makes one."""
    import torch

    from autofit.memory.simulate._step import (
        _NODE_HOST_BYTES,
        _SAVED_HOST_BYTES,
        graph_host_bytes,
        graph_nodes,
    )

    w = torch.randn(16, requires_grad=True)
    x = torch.randn(16)
    # Sum, Exp (one slot: its result), Mul (two: its inputs), AccumulateGrad (w)
    loss = torch.exp(x * w).sum()
    assert len(graph_nodes(loss)) == 4
    assert graph_host_bytes(loss) == 4 * _NODE_HOST_BYTES + 3 * _SAVED_HOST_BYTES

    def chain(n):
        y = x * w
        for _ in range(n):
            y = torch.exp(y) * 0.5  # two nodes, three slots per step
        return y.sum()

    grown = graph_host_bytes(chain(100)) - graph_host_bytes(chain(0))
    assert grown == 100 * (2 * _NODE_HOST_BYTES + 3 * _SAVED_HOST_BYTES)
    assert graph_host_bytes(torch.ones(2).sum()) == 0  # no graph, nothing held
