"""Optional packages: a path that needs a missing one says so before any work (exit 2, the pip
command named), never "internal error: ModuleNotFoundError"; matplotlib is core.

A package is made missing with ``sys.modules[name] = None`` (an import raises
``ModuleNotFoundError``, ``find_spec`` answers None) or ``autofit.knobs.base.installed``."""

import json
import sys
from pathlib import Path

import pytest

from autofit.cli import main
from autofit.errors import MissingDependencyError, require


@pytest.fixture(autouse=True)
def _forget_definitions():
    """What was read with a package hidden is not kept for the tests after (in-process
    caches of the TrainingArguments family: SFTConfig's fields when trl is here)."""
    yield
    from autofit.emit.args_file import _trl_fields
    from autofit.emit.validate import _clean, _definitions

    _definitions.cache_clear()
    _trl_fields.cache_clear()
    _clean().clear()


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def missing(monkeypatch, *names):
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_matplotlib_is_a_core_dependency_and_every_extra_has_its_pip_command():
    from autofit.errors import OPTIONAL_PACKAGES

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("matplotlib") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    for extra in ("bnb", "deepspeed", "trl", "liger"):
        assert extra in extras
        assert f"'autofit[{extra}]'" in " ".join(OPTIONAL_PACKAGES.values())


def test_require_names_the_pip_command(monkeypatch):
    missing(monkeypatch, "trl")
    with pytest.raises(MissingDependencyError, match=r"needs trl.*pip install 'autofit\[trl\]'"):
        require("trl", "an SFTConfig plan")
    require("json", "nothing")  # present: no error


def test_report_without_matplotlib_is_exit_2_before_any_work(monkeypatch, capsys, tmp_path):
    missing(monkeypatch, "matplotlib")
    # the file does not exist: a check after the work would say that instead
    code, _, err = run(capsys, "report", str(tmp_path / "none.yaml"))
    assert code == 2 and "pip install matplotlib" in err and "internal error" not in err
    assert err.count("\n") == 1


def test_compare_peft_json_never_draws(monkeypatch, capsys, tmp_path):
    missing(monkeypatch, "matplotlib")
    code, out, err = run(capsys, "compare-peft", "tiny-llama", "--seq-len", "32", "--device",
                         "cpu:1GiB", "--methods", "ia3", "--confirm-top", "0", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["plot"] is None and d["rows"][0]["method"] == "ia3"


def test_compare_peft_picture_without_matplotlib_is_exit_2_before_estimating(monkeypatch,
                                                                            capsys):
    import autofit.compare

    def estimated(*a, **k):
        raise AssertionError("estimated before the check")

    monkeypatch.setattr(autofit.compare, "compare_peft", estimated)
    missing(monkeypatch, "matplotlib")
    code, _, err = run(capsys, "compare-peft", "tiny-llama", "--seq-len", "32", "--device",
                       "cpu:64MiB", "--methods", "ia3")
    assert code == 2 and "pip install matplotlib" in err and err.count("\n") == 1


def test_check_of_an_sftconfig_plan_without_trl_is_exit_2(monkeypatch, capsys, tmp_path):
    plan = tmp_path / "tuned.yaml"
    plan.write_text("# autofit: {}\n"
                    "per_device_train_batch_size: 1\noutput_dir: out\n")
    missing(monkeypatch, "trl")
    code, _, err = run(capsys, "check", str(plan), "--trainer", "trl", "--model", "tiny-gpt2", "--device", "cpu",
                       "--seq-len", "16")
    assert code == 2 and "pip install 'autofit[trl]'" in err and "internal error" not in err


def test_sftconfig_arguments_without_trl_name_the_extra(monkeypatch):
    from autofit.emit.training_args import build_training_arguments
    from autofit.knobs.trl_loss import SFT_CONFIG

    missing(monkeypatch, "trl")
    with pytest.raises(MissingDependencyError, match=r"autofit\[trl\]"):
        build_training_arguments({"output_dir": "out"}, SFT_CONFIG)


def test_tune_of_zero_without_deepspeed_is_exit_2(monkeypatch, capsys, tmp_path):
    from autofit.knobs import base

    monkeypatch.setattr(base, "installed", lambda package: package != "deepspeed")
    code, _, err = run(capsys, "tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", "cpu:1GiB",
                       "--nproc-per-node", "2", "--strategy", "zero2",
                       "-o", str(tmp_path / "t.yaml"))
    assert code == 2 and "pip install 'autofit[deepspeed]'" in err


def test_4bit_base_without_bitsandbytes_is_exit_2(monkeypatch, capsys):
    missing(monkeypatch, "bitsandbytes")
    code, _, err = run(capsys, "estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8",
                       "--load-in-4bit")
    assert code == 2 and "pip install 'autofit[bnb]'" in err and "internal error" not in err


@pytest.mark.parametrize("name, pip", [("liger_kernel", "'autofit[liger]'"),
                                       ("deepspeed", "'autofit[deepspeed]'"),
                                       ("bitsandbytes", "'autofit[bnb]'")])
def test_an_unchecked_optional_import_is_still_exit_2(monkeypatch, capsys, name, pip):
    """The last line of defence: an optional import a path forgot to check first."""
    def fails(*a, **k):
        raise ModuleNotFoundError(f"No module named '{name}'", name=name)

    monkeypatch.setattr("autofit.api.estimate", fails)
    code, _, err = run(capsys, "estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8")
    assert code == 2 and f"pip install {pip}" in err and "internal error" not in err


def test_a_missing_core_module_stays_an_internal_error(monkeypatch, capsys):
    def fails(*a, **k):
        raise ModuleNotFoundError("No module named 'nonesuch'", name="nonesuch")

    monkeypatch.setattr("autofit.api.estimate", fails)
    code, _, err = run(capsys, "estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8")
    assert code == 1 and "internal error" in err


def test_a_cached_check_reads_no_transformers(tmp_path):
    """The second check of a file: the fields were found clean, the trial is cached, and
    neither torch nor transformers is imported (issue 22: a cached check <= 3 s)."""
    import os
    import subprocess

    plan = tmp_path / "args.yaml"
    plan.write_text("per_device_train_batch_size: 1\noutput_dir: out\n")
    env = {**os.environ, "AUTOFIT_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(Path(__file__).parents[1])}
    argv = ["check", str(plan), "--model", "tiny-gpt2", "--seq-len", "16", "--device", "cpu:1GiB"]
    code = ("import sys; from autofit.cli import main; rc = main(sys.argv[1:]); "
            "print('IMPORTED', 'torch' in sys.modules, 'transformers' in sys.modules); "
            "sys.exit(rc)")
    first = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True,
                           text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    again = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0 and "answered from the check cache" in again.stdout
    assert "IMPORTED False False" in again.stdout
