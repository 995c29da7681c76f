import pytest

from autofit.errors import UnknownDeviceError
from autofit.probe.device import (
    catalog,
    format_bytes,
    parse_bytes,
    resolve_device,
)

REQUIRED = ["T4", "V100-16GB", "V100-32GB", "A10G", "L4", "RTX-3090", "RTX-4090", "A100-40GB",
            "A100-80GB", "L40S", "H100-80GB", "H200", "B200", "MI300X"]


def test_catalog_has_required_cards_with_all_fields():
    cat = catalog()
    for name in REQUIRED:
        d = cat[name]
        for field in ("memory_mib", "bf16", "fp16", "bf16_tflops", "fp16_tflops", "bandwidth_gbs"):
            assert field in d, (name, field)
        assert d["memory_mib"] > 10_000 and d["bandwidth_gbs"] > 100


@pytest.mark.parametrize("name,gib,bf16", [("T4", 15, False), ("V100-16GB", 15.8, False),
                                           ("A100-80GB", 79.1, True), ("H100-80GB", 79.2, True),
                                           ("H200", 140.4, True), ("MI300X", 192, True)])
def test_catalog_cards(name, gib, bf16):
    d = resolve_device(name)
    assert d.capacity_bytes == pytest.approx(gib * 2**30, rel=0.01)
    assert d.bf16 is bf16 and not d.present and d.allocator == "cuda"
    assert d.overhead_bytes > 200 * 2**20  # CUDA context + cuBLAS workspace


def test_aliases_and_case():
    assert resolve_device("h100").name == "H100-80GB"
    assert resolve_device("a100_80gb").name == "A100-80GB"
    assert resolve_device("NVIDIA-GeForce-RTX-4090").name == "RTX-4090"


def test_hopper_workspace_is_larger():
    assert resolve_device("H100").workspace_bytes == 32 * 2**20
    assert resolve_device("A100-80GB").workspace_bytes == int(8.5 * 2**20)


def test_cpu_and_capped_cpu():
    cpu = resolve_device("cpu")
    assert cpu.present and cpu.allocator == "cpu" and cpu.overhead_bytes == 0
    assert 0 < cpu.capacity_bytes <= cpu.total_bytes
    capped = resolve_device("cpu:4GiB")
    assert capped.capacity_bytes == 4 * 2**30 and capped.capped and capped.name == "cpu:4GiB"
    assert resolve_device("cpu:512MiB").capacity_bytes == 512 * 2**20


def test_auto_is_cpu_without_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert resolve_device("auto").kind == "cpu"


def test_cuda_absent_says_what_to_do():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(UnknownDeviceError, match="catalog name"):
        resolve_device("cuda:0")


def test_unknown_device_lists_close_matches():
    with pytest.raises(UnknownDeviceError) as e:
        resolve_device("H1000")
    assert "H100-80GB" in str(e.value)
    with pytest.raises(UnknownDeviceError, match="cpu:8GiB"):
        resolve_device("tpu-v5")


@pytest.mark.parametrize("bad", ["cpu:4XB", "cpu:0", "cpu:", "cpu:-1GiB"])
def test_bad_caps(bad):
    with pytest.raises(UnknownDeviceError):
        resolve_device(bad)


def test_cap_above_machine_memory():
    with pytest.raises(UnknownDeviceError, match="more than this machine"):
        resolve_device("cpu:1000TiB")


def test_parse_and_format_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(512) == "512 B"
