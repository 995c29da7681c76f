"""The copies CPU kernels make inside (``autofit.memory.simulate._cpu_kernels``), checked
against the process's high-water mark around the real op in a fresh process (glibc set as
the harness sets it: every block above 64 KiB is its own mapping, so a copy shows)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autofit.memory.simulate._cpu_kernels import cpu_kernel_temporaries
from autofit.memory.simulate._recorder import StorageRecorder
from autofit.probe.device import cpu_capability

ADD = torch.ops.aten.add.Tensor
ADD_ = torch.ops.aten.add_.Tensor
BMM = torch.ops.aten.bmm.default
SILU_BACKWARD = torch.ops.aten.silu_backward.default
MiB = 1 << 20
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _measured(setup: str) -> int:
    """The real op's transient in a fresh child (``benchmarks/cpu_kernel_copies.py``)."""
    sys.path.insert(0, str(BENCH))
    from cpu_kernel_copies import measured_inside

    return measured_inside(setup)


def test_a_mixed_dtype_add_copies_its_16_bit_input_to_fp32():
    x, y = torch.empty(1024, 2048, dtype=torch.bfloat16), torch.empty(1024, 2048)
    predicted = cpu_kernel_temporaries(ADD, (x, y), {}, x + y)
    assert predicted == 1024 * 2048 * 4  # the bf16 input as fp32: 8 MiB
    measured = _measured("x = torch.randn(1024, 2048).bfloat16(); y = torch.randn(1024, 2048)\n"
                         "def run(): return x + y")
    assert abs(measured - predicted) < 0.5 * MiB, (measured, predicted)


def test_an_op_of_one_dtype_copies_nothing():
    x = torch.empty(1024, 2048)
    assert cpu_kernel_temporaries(ADD, (x, x), {}, x) == 0
    assert cpu_kernel_temporaries(ADD, (x, torch.tensor(2.0, dtype=torch.float64)), {}, x) == 0
    assert _measured("x = torch.randn(1024, 2048)\ndef run(): return x + x") < 0.5 * MiB


def test_an_in_place_16_bit_add_of_fp32_casts_through_an_fp32_output():
    x, y = torch.empty(1024, 2048, dtype=torch.bfloat16), torch.empty(1024, 2048)
    # the bf16 input's fp32 copy and the fp32 output before it is cast back
    assert cpu_kernel_temporaries(ADD_, (x, y), {}, x) == 2 * 1024 * 2048 * 4
    measured = _measured("x = torch.randn(1024, 2048).bfloat16(); y = torch.randn(1024, 2048)\n"
                         "def run(): return x.add_(y)")
    assert abs(measured - 2 * 1024 * 2048 * 4) < 0.5 * MiB, measured


def test_a_backward_of_an_fp32_gradient_and_a_16_bit_input_copies_the_input():
    # (autocast's backward: the gradient arrives in fp32, the saved input is bf16)
    g, x = torch.empty(1024, 2048), torch.empty(1024, 2048, dtype=torch.bfloat16)
    predicted = cpu_kernel_temporaries(SILU_BACKWARD, (g, x), {}, torch.empty(1024, 2048))
    assert predicted == 1024 * 2048 * 4
    measured = _measured("g = torch.randn(1024, 2048); x = torch.randn(1024, 2048).bfloat16()\n"
                         "def run(): return torch.ops.aten.silu_backward(g, x)")
    assert abs(measured - predicted) < 0.5 * MiB, (measured, predicted)
    # a 16-bit output of an fp32 computation goes through an fp32 temporary
    assert cpu_kernel_temporaries(SILU_BACKWARD, (g, x), {}, x) == 2 * 1024 * 2048 * 4


@pytest.mark.skipif(not cpu_capability().startswith("AVX512"),
                    reason="16-bit matmuls go to oneDNN on an AVX512 CPU only")
def test_onednn_copies_an_operand_in_another_layout_contiguous():
    # overlapping chunks (Longformer's sliding window) and a transpose of the batch dims
    base = torch.empty(32, 512, 64, dtype=torch.bfloat16)
    chunks = base.as_strided((32, 3, 256, 64), (512 * 64, 128 * 64, 64, 1)).reshape(96, 256, 64)
    assert cpu_kernel_temporaries(BMM, (chunks.transpose(1, 2), torch.empty(
        96, 256, 64, dtype=torch.bfloat16)), {}, None) == 0  # a reshape copied: contiguous
    a = torch.empty(256, 32, 768, dtype=torch.bfloat16).transpose(0, 1)  # (32, 256, 768)
    b = torch.empty(32, 768, 64, dtype=torch.bfloat16)
    predicted = cpu_kernel_temporaries(BMM, (a, b), {}, None)
    assert predicted == 32 * 256 * 768 * 2  # 12 MiB
    assert cpu_kernel_temporaries(BMM, (b.transpose(1, 2).contiguous().transpose(1, 2),
                                        b.transpose(1, 2)), {}, None) == 0  # transposed: taken
    measured = _measured(
        "a = torch.randn(256, 32, 768).bfloat16().transpose(0, 1)\n"
        "b = torch.randn(32, 768, 64).bfloat16()\n"
        "def run(): return torch.bmm(a, b)")
    assert abs(measured - predicted) < 0.5 * MiB, (measured, predicted)
    assert cpu_kernel_temporaries(BMM, (a.float(), b.float()), {}, None) == 0  # fp32: MKL's


def test_the_recorder_holds_the_copy_while_the_op_runs_on_a_cpu_target_only():
    def peak(cpu: bool) -> int:
        rec = StorageRecorder()
        rec.cpu_kernels = cpu
        with FakeTensorMode(), rec:
            x = torch.empty(256, 256, dtype=torch.bfloat16)
            y = torch.empty(256, 256)
            _ = x + y
        live = high = 0
        for kind, r, _ in rec.events():
            live += r.size if kind == "alloc" else -r.size
            high = max(high, live)
        return high

    assert peak(True) - peak(False) == 256 * 256 * 4


def test_what_mkl_keeps_per_fp32_product_follows_the_epyc_measurements():
    """``_cpu_cache._amd_product`` (a stacked LM head's weight gradient on an AMD EPYC)
    against every cell of the table ``benchmarks/cpu_kernel_copies.py`` measured there, one
    (512, K) @ (K, N) product per fresh process: within 6% or 0.05 MiB."""
    from autofit.memory.analytic._cpu_cache import _amd_product

    text = (BENCH / "results" / "cpu_kernel_copies.md").read_text()
    table = text[text.index("| K \\ N |"):].splitlines()
    cols = [int(c) for c in table[0].strip("| ").split("|")[1:]]
    cells = 0
    for line in table[2:]:
        if not line.startswith("|"):
            break
        k, *kept = [c.strip() for c in line.strip("|").split("|")]
        for n, mib in zip(cols, kept, strict=True):
            rule = _amd_product(512, int(k), n) / MiB
            assert abs(rule - float(mib)) <= max(0.06 * float(mib), 0.05), (k, n, rule, mib)
            cells += 1
    assert cells == 25
