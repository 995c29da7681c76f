"""The installed library versions a memory rule depends on."""

import pytest

from autofit.probe import versions


@pytest.mark.parametrize(("installed", "keeps"), [
    ("0.41.1", True), ("0.42.0", True), ("0.43.1", True),  # MatMul4Bit kept (A, B)
    ("0.43.2", False), ("0.43.3", False), ("0.45.0", False), ("0.50.2", False),
    ("0.43.2.dev0", False), ("0.43.1.post1", True),
    (None, False),  # not installed: no 4-bit layer to keep anything
])
def test_which_bitsandbytes_keeps_4bit_inputs(monkeypatch, installed, keeps):
    """bitsandbytes PR #1270 (0.43.2) stopped ``MatMul4Bit`` keeping its input for a frozen
    weight; the versions before it kept every 4-bit layer's input for backward."""
    monkeypatch.setattr(versions, "installed_version",
                        lambda p: installed if p == "bitsandbytes" else "1.0")
    assert versions.bnb_4bit_keeps_input() is keeps


def test_library_versions_name_what_is_missing(monkeypatch):
    monkeypatch.setattr(versions, "installed_version",
                        lambda p: None if p == "bitsandbytes" else "1.0")
    got = versions.library_versions()
    assert got["bitsandbytes"] == "-" and got["torch"] == "1.0"
    assert set(got) == set(versions.VERSIONED)
