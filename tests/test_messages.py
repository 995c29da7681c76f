"""Each side names its own fix: flags on the command line, keywords in Python."""

import pytest

from autofit import TrainConfig, estimate
from autofit.cli import main
from autofit.errors import AutofitError, fix, on_command_line

# (CLI argv, Python call, what the CLI message names, what the Python message names)
CASES = [
    (["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "8", "--device", "T4",
      "--precision", "bf16-mixed"],
     lambda: estimate("tiny-llama", TrainConfig(precision="bf16-mixed"), seq_len=8, device="T4"),
     "--precision 16-mixed", "precision='16-mixed'"),
]


def test_fix_follows_the_surface():
    assert fix("--a", "a=") == "a="
    with on_command_line():
        assert fix("--a", "a=") == "--a"
        with on_command_line():
            pass
        assert fix("--a", "a=") == "--a"
    assert fix("--a", "a=") == "a="


@pytest.mark.parametrize("argv,call,cli_words,py_words", CASES)
def test_each_side_names_its_own_fix(argv, call, cli_words, py_words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert cli_words in err and py_words not in err and len(err.splitlines()) == 1
    with pytest.raises(AutofitError) as e:
        call()
    assert py_words in str(e.value) and cli_words not in str(e.value)


def test_check_suggests_the_file_change_and_preflight_fix_true(tmp_path, capsys):
    # `autofit check` has no fix flag: it names the fields to set; Python names fix=True
    import json

    import autofit

    path = tmp_path / "big.yaml"
    path.write_text("output_dir: out\nper_device_train_batch_size: 512\n")
    assert main(["check", str(path), "--model", "tiny-llama", "--seq-len", "2048",
                 "--device", "T4", "--json"]) == 3
    problem = json.loads(capsys.readouterr().out)["problems"][0]
    assert "set per_device_train_batch_size: 4 and gradient_accumulation_steps: 128" in problem
    assert "fix=True" not in problem
    with pytest.raises(autofit.PreflightError) as e:
        autofit.preflight({"output_dir": "out", "per_device_train_batch_size": 512},
                          model="tiny-llama", seq_len=2048, device="T4")
    assert "pass fix=True" in str(e.value) and "per_device_train_batch_size:" not in str(e.value)
