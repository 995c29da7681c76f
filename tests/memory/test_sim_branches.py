"""What the simulator answers when a step reads a tensor's value (fake tensors have none):
a mask's ``any()`` takes the branch that does the work, a sanity check (inf / NaN) the
branch without the error, and a value-dependent shape or a number read is refused in one
line (``ValueDependentShapeError``), never traced down the wrong branch -- unless the
values come from the batch the simulation made, or a factory (``_values``): then they are
the real ones."""

from __future__ import annotations

import re

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


def test_a_checkpointed_graph_is_charged_its_handles_and_one_rebuilt_block():
    """With non-reentrant checkpointing a saved slot holds the checkpoint's handle, and
    backward rebuilds one block's graph beside the step's (each rebuilt saved tensor also
    in the recompute's map); checked against the resident bytes of a real checkpointed
    chain (``benchmarks/autograd_host.py``'s child)."""
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from autofit.memory.simulate._step import (
        _NODE_HOST_BYTES,
        _RECOMPUTE_SAVED_HOST_BYTES,
        _SAVED_CKPT_HOST_BYTES,
        graph_host_bytes,
    )

    w = torch.randn(16, requires_grad=True)
    loss = torch.exp(torch.randn(16) * w).sum()  # 4 nodes, 3 slots
    step = 4 * _NODE_HOST_BYTES + 3 * _SAVED_CKPT_HOST_BYTES
    assert graph_host_bytes(loss, 2) == step + (4 * _NODE_HOST_BYTES
                                                + 3 * _RECOMPUTE_SAVED_HOST_BYTES) // 2
    if platform.system() != "Linux":
        return
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import autograd_host
        from measure_cpu import CHILD_ENV
    finally:
        sys.path.remove(str(bench))
    for kind, saved in (("exp", 1), ("mul", 2)):
        out = subprocess.run([sys.executable, "-c", autograd_host._CHILD, "5000", kind, "1"],
                             check=True, capture_output=True, text=True, timeout=120,
                             env={**os.environ, **CHILD_ENV})
        _, peak = map(float, out.stdout.split())
        # one block: the step's graph (handles) and its rebuilt graph at the peak, and the
        # rebuilt output's data (an 80 B chunk; the simulator's stream counts it)
        charged = (2 * _NODE_HOST_BYTES + saved * (_SAVED_CKPT_HOST_BYTES
                                                  + _RECOMPUTE_SAVED_HOST_BYTES)) + 80
        assert abs(charged - peak) / peak < 0.10, (kind, charged, peak)


def test_a_checkpointed_recurrence_on_a_cpu_is_refused_and_only_then():
    """RWKV's CPU kernel runs its recurrence op by op: with checkpointing a block's graph
    has thousands of nodes, whose host memory is not modelled within the targets (the zoo's
    RWKV rows in bf16 with checkpointing: 5-12% under); the simulation refuses it in one
    line naming the node count and what to do, and estimates the same model without
    checkpointing, or checkpointed for a CUDA card (whose device holds no host objects)."""
    import transformers

    from autofit import TrainConfig, estimate
    from autofit.errors import UnmodelledStepError

    cfg = transformers.AutoConfig.for_model(
        "rwkv", hidden_size=32, attention_hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, vocab_size=128, context_length=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    c = TrainConfig(micro_batch_size=1, precision="bf16-mixed", gradient_checkpointing=True)
    with pytest.raises(UnmodelledStepError) as e:
        estimate(model, c, seq_len=64, device="cpu", method="simulate", task="causal-lm")
    line = str(e.value)
    assert "\n" not in line and "gradient_checkpointing=False" in line
    nodes = re.search(r"\(([\d,]+) autograd nodes a block", line)
    assert nodes is not None and int(nodes.group(1).replace(",", "")) > 1000
    plain = estimate(model, c.replace(gradient_checkpointing=False), seq_len=64, device="cpu",
                     method="simulate", task="causal-lm")
    card = estimate(model, c, seq_len=64, device="A100-80GB", method="simulate",
                    task="causal-lm")
    assert plain.peak_allocated_bytes > 0 and card.peak_allocated_bytes > 0


@pytest.fixture
def recorded():
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, StorageRecorder():
        yield fake


def test_shapes_from_the_batch_s_values_are_followed(recorded):
    """Token ids the simulation made carry their values (``_values``): a mask of them, its
    sums, a ``unique_consecutive`` of those and a boolean index by the mask get their real
    shapes (BART's classifier's end-of-sequence pooling); a number read is the real one."""
    from autofit.memory.simulate._values import values_of, with_values

    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # (made as make_batch does)
        real = torch.tensor([[1, 2, 3, 2], [0, 2, 1, 1]])
    ids = with_values(recorded.from_tensor(real), real)
    mask = ids.eq(2)
    assert values_of(mask) is not None and int(mask.sum().item()) == 3
    assert torch.unique_consecutive(mask.sum(1)).shape == (2,)
    hidden = torch.randn(2, 4, 8)  # from the weights: no values
    assert hidden[mask].shape == (3, 8) and torch.nonzero(mask).shape == (3, 2)
    # a factory's values are its arguments' (Longformer's all-ones mask: no global token)
    ones = torch.ones(2, 4)
    assert bool((ones > 1).any()) is False and torch.nonzero(ones > 1).shape == (0, 2)


def test_values_written_from_the_weights_are_forgotten(recorded):
    """A tensor with values written in place from one without (a zeros mask filled from the
    weights through a slice) has none any more, nor has its view: a value-dependent shape
    there is refused, never answered with the old zeros."""
    from autofit.memory.simulate._values import values_of

    mask = torch.zeros(4, 8)
    view = mask[:, :2]
    view.copy_(torch.randn(4, 2) > 0)
    assert values_of(mask) is None and values_of(view) is None
    with pytest.raises(ValueDependentShapeError):
        torch.nonzero(mask)


def test_a_number_lifted_in_carries_its_value(recorded):
    """``torch.tensor(0)`` in a step is a real tensor lifted into the fake mode: it keeps
    its value, so filling a tensor with values by it keeps theirs (Longformer's masks were
    forgotten, and refused, without it)."""
    from autofit.memory.simulate._values import values_of

    mask = torch.ones(4)
    mask.fill_(torch.tensor(2))
    assert values_of(mask) is not None and int(mask.sum().item()) == 8
