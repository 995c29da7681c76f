"""Shared fixtures: tiny models built from configs (no hub access)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one fresh cache per test session (trials, checks, derived coefficients, checked fields):
# the suite never reads what an earlier run or a user's tune left in ~/.cache/autofit, and
# its subprocesses inherit it; a test of the cache's location sets or clears it itself
if "AUTOFIT_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["AUTOFIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="autofit-test-cache-")


def _native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); unknown: yes.
    ``AUTOFIT_TEST_NATIVE_BF16=0`` / ``1`` says it instead (to see the other host's set)."""
    forced = os.environ.get("AUTOFIT_TEST_NATIVE_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``half`` join the slow set on a CPU without native bf16: there torch's
    generic 16-bit gemm is ~40x slower than fp32 and those tests took 45-61 s each (an
    AVX2-only host, 2026-12-02), which kept ``pytest`` over its ten minutes. Runs before
    pytest's ``-m`` selection, so ``-m 'not slow'`` leaves them out there."""
    if _native_bf16():
        return
    for item in items:
        if item.get_closest_marker("half") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_llama_config():
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )


@pytest.fixture()
def tiny_llama(tiny_llama_config):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config)


@pytest.fixture()
def own_tmp(tmp_path, monkeypatch):
    """Work dirs of this process's trials go under tmp_path/tmp (where we can look)."""
    import tempfile

    from autofit.trial.process import _swept

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    _swept().clear()
    yield tmp
    _swept().clear()
