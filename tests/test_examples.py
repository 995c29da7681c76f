"""The examples run as the README and their docstrings say (each in a fresh process).

One tuned file is made by ``examples/pipeline.sh`` (tune, check, train) and reused by
``examples/train_tuned.py``; ``train_with_callback.py`` fixes (or, with --no-fix,
refuses) a configuration that does not fit a capped CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# long end to end (a tune with trials, then training, each in a fresh process): the slow set.
# The fast set covers each step: tune (test_autofit, test_cli), check (test_preflight), the
# callback's fix (test_preflight), a tuned file loading (test_cli_files).
pytestmark = pytest.mark.slow


def run(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("examples")
    return dict(os.environ, AUTOFIT_CACHE_DIR=str(tmp / "cache"),
                CONFIG=str(tmp / "tuned.yaml"), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def tuned(env):
    p = run(["bash", "examples/pipeline.sh"], env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "trained 2 steps" in p.stdout
    return Path(env["CONFIG"])


def test_pipeline_tunes_checks_and_trains(tuned):
    from transformers import HfArgumentParser, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(tuned))
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 16


def test_pipeline_stops_before_training_on_a_device_too_small(tuned, env):
    p = run(["bash", "examples/pipeline.sh"], dict(env, AUTOFIT_DEVICE="cpu:64MiB"))
    assert p.returncode == 3
    assert "training not started" in p.stderr and "trained" not in p.stdout


def test_train_tuned_loads_the_tuned_file(tuned, env):
    p = run([sys.executable, "examples/train_tuned.py", str(tuned), "examples/tiny-model"], env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "micro batch" in p.stdout


def test_train_with_callback_fixes_or_refuses(env):
    p = run([sys.executable, "examples/train_with_callback.py"], env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "micro batch 8 x accumulation 4 (effective batch 32)" in p.stdout
    p = run([sys.executable, "examples/train_with_callback.py", "--no-fix"], env)
    assert p.returncode == 3
    assert "does not fit" in p.stdout + p.stderr
