"""Derived analytic coefficients are kept on disk: a new process does not run the forwards
again, a damaged file is derived again, an unwritable folder is one warning."""

import json
import logging

import pytest

from autofit import TrainConfig
from autofit.memory.analytic import derived
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
