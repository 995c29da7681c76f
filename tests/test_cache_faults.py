"""The tuning cache answers only the same question and survives its faults (issue 11: 2, 6, 12).

* the key covers what the trials are fed (the worst-case rows' content, the collator);
* a failed trial (not an OOM) is never reused nor makes a cached answer;
* a garbage or truncated studies.db, a read-only or blocked cache folder, racing first
  runs: one warning line, the run goes on (a fresh cache or none); never exit 1;
* runs on one cache at once share their trials.

Most tests replace the trial (``autofit.trial.measure``) by a fake that returns a
made-up measurement at once; the concurrency tests run real capped trials in two
processes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import autofit.trial as trial_mod
from autofit.api import autofit
from autofit.cli import main
from autofit.trial.result import TrialResult

DEVICE = "cpu:1GiB"
ROOT = Path(__file__).resolve().parent.parent
TWO = dict(precision=["32-true"], optimizer=["adamw_torch", "sgd"], gradient_checkpointing=False,
           chunked_loss=False)
ONE = dict(precision=["32-true"], optimizer=["adamw_torch"], gradient_checkpointing=False,
           chunked_loss=False)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture()
def cache_dir(tmp_path) -> Path:
    return tmp_path / "cache"


def _rows(seed: int = 0, n: int = 48, vocab: int = 512) -> list[dict]:
    rng, shapes = random.Random(seed), random.Random(99)  # the same lengths for every seed
    lengths = [shapes.randint(8, 40) for _ in range(n)]
    rows = [{"input_ids": [rng.randrange(1, vocab) for _ in range(k)]} for k in lengths]
    rows[5]["input_ids"] = [rng.randrange(1, vocab) for _ in range(64)]  # the worst case
    return rows


@pytest.fixture(scope="module")
def data():
    return _rows(0)


def _fake_result(config, batch, device, error=None, seq_len=None) -> TrialResult:
    """A made-up measurement: fits, sgd twice as fast; or a failure with ``error``."""
    b, t = ((int(x) for x in batch["input_ids"].shape) if isinstance(batch, dict)
            else (config.micro_batch_size, int(seq_len or 8)))  # check: random tokens
    total = None if error else 40 * 2**20 + b * t * 4096
    speed = None if error else b * t * (200.0 if config.optimizer == "sgd" else 100.0)
    return TrialResult(oom=False, peak_allocated_bytes=total, peak_reserved_bytes=total,
                       device_total_bytes=total, step_time_s=None if error else 0.01,
                       tokens_per_s=speed, samples_per_s=None, error=error,
                       config=config.to_dict(), device=device.name, batch_shape=(b, t),
                       isolation="in-process", isolation_reason="fake", steps=0 if error else 3,
                       capacity_bytes=device.capacity_bytes)


@pytest.fixture()
def fake(monkeypatch):
    """A fake trial: ``fake.calls`` lists the configs measured, ``fake.fail`` the optimizers
    whose trial crashes (an IndexError in the step, say), ``fake.batches`` what was fed."""

    class Fake:
        calls: list = []
        batches: list = []
        fail: set = set()

        def __call__(self, model, config, batch, device, **kw):
            self.calls.append(config)
            self.batches.append(batch)
            err = ("IndexError: index out of range in self" if config.optimizer in self.fail
                   else None)
            return _fake_result(config, batch, device, err, kw.get("seq_len"))

    f = Fake()
    f.calls, f.batches, f.fail = [], [], set()
    monkeypatch.setattr(trial_mod, "measure", f)
    return f


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "autofit" and r.levelno >= logging.WARNING]


def _tune_cli(capsys, tmp_path, *extra):
    code = main(["tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", DEVICE,
                 "--precision", "32-true", "--optim", "adamw_torch", "--no-gradient-checkpointing",
                 "--max-trials", "2",
                 "-o", str(tmp_path / "tuned.yaml"), *extra])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ item 2: the key, failures


def test_a_failed_trial_is_neither_reused_nor_cached(tiny_llama, data, fake):
    fake.fail = {"adamw_torch"}  # its trial crashes (not an OOM); sgd's fits
    first = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **TWO)
    assert first.config.optimizer == "sgd" and first.confirmed
    assert any("trial failed: IndexError" in str(c["reason"]) for c in first.candidates)
    assert {c.optimizer for c in fake.calls} == {"adamw_torch", "sgd"}
    # the fault is gone: the failed trial runs again (sgd's is resumed), no cached answer
    fake.fail, fake.calls[:] = set(), []
    second = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **TWO)
    assert not second.from_cache
    assert [c.optimizer for c in fake.calls] == ["adamw_torch"]
    assert not any("trial failed" in str(c["reason"]) for c in second.candidates)
    assert all(t.error is None for t in second.trials)
    # an answer with no failure in it is the cached one
    fake.calls[:] = []
    third = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **TWO)
    assert third.from_cache and fake.calls == [] and third.config == second.config


def test_a_run_whose_every_trial_failed_is_not_answered_again(tiny_llama, data, fake):
    from autofit.errors import DoesNotFitError

    fake.fail = {"adamw_torch"}
    with pytest.raises(DoesNotFitError):
        autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **ONE)
    fake.fail, fake.calls[:] = set(), []
    r = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **ONE)
    assert r.confirmed and len(fake.calls) == 1


def test_the_key_covers_the_worst_case_rows_content(tiny_llama, data, fake):
    autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **ONE)
    assert len(fake.calls) == 1
    other = _rows(seed=1)  # the same lengths, other token ids
    assert [len(r["input_ids"]) for r in other] == [len(r["input_ids"]) for r in data]
    r = autofit(tiny_llama, other, device=DEVICE, target_batch_size=16, **ONE)
    assert not r.from_cache and len(fake.calls) == 2
    # a row no trial is fed (one of the shortest; micro batches are at most 16) is not
    # part of the question
    shortest = min(range(len(data)), key=lambda i: len(data[i]["input_ids"]))
    edited = [dict(x) for x in data]
    edited[shortest] = {"input_ids": [7] * len(data[shortest]["input_ids"])}
    r = autofit(tiny_llama, edited, device=DEVICE, target_batch_size=16, **ONE)
    assert r.from_cache and len(fake.calls) == 2


def _pad_collate(features, pad=0):
    import torch

    t = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), t), pad, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
    return {"input_ids": ids, "attention_mask": (ids != pad).long()}


@dataclass
class _Collator:
    pad_to_multiple_of: int | None = None

    def __call__(self, features):
        return _pad_collate(features)


def test_the_key_covers_the_collator(tiny_llama, data, fake):
    kw = dict(device=DEVICE, target_batch_size=16, **ONE)
    autofit(tiny_llama, data, **kw)
    runs = [autofit(tiny_llama, data, collator=c, **kw) for c in (
        _pad_collate, functools.partial(_pad_collate, pad=3), _Collator(), _Collator(8))]
    assert [r.from_cache for r in runs] == [False] * 4 and len(fake.calls) == 5
    again = autofit(tiny_llama, data, collator=_Collator(8), **kw)
    assert again.from_cache and len(fake.calls) == 5


def test_collator_identity_says_what_it_does_not_hash():
    from autofit.search.study import collator_identity

    assert collator_identity(None) is None
    assert "not hashed deeper" in collator_identity(_pad_collate)["note"]
    assert collator_identity(_Collator(8)) != collator_identity(_Collator(None))
    assert collator_identity(_Collator(8)) == collator_identity(_Collator(8))


# ------------------------------------------------------------------ item 6: cache faults


def _study_db(cache_dir: Path) -> Path:
    return cache_dir / "studies.db"


def test_garbage_studies_db_is_moved_aside_and_a_fresh_one_started(
        tiny_llama, data, fake, cache_dir, caplog):
    cache_dir.mkdir()
    _study_db(cache_dir).write_bytes(b"this is not a database\n" * 300)
    r = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **ONE)
    assert r.confirmed and not r.from_cache
    (line,) = _warnings(caplog)
    assert "unreadable" in line and "started a fresh one" in line and "\n" not in line
    (aside,) = cache_dir.glob("studies.db.corrupt-*")
    assert aside.read_bytes().startswith(b"this is not a database")
    # the fresh cache works: the same question is answered from it, with no warning
    caplog.clear()
    again = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **ONE)
    assert again.from_cache and _warnings(caplog) == []


def test_truncated_studies_db_through_the_cli(tmp_path, fake, cache_dir, capsys, caplog):
    code, _, _ = _tune_cli(capsys, tmp_path)
    assert code == 0
    db = _study_db(cache_dir)
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])  # cut in the middle of a write
    code, out, err = _tune_cli(capsys, tmp_path)
    assert code == 0, err
    (line,) = _warnings(caplog)
    assert "malformed" in line and "started a fresh one" in line
    assert "Traceback" not in err and "internal error" not in err
    assert list(cache_dir.glob("studies.db.corrupt-*"))
    with sqlite3.connect(db) as con:  # a sound database again
        assert con.execute("PRAGMA quick_check").fetchone()[0] == "ok"


def test_a_file_in_the_way_of_the_cache_folder_runs_without_the_cache(
        tmp_path, fake, monkeypatch, capsys, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(blocker / "autofit"))
    code, out, err = _tune_cli(capsys, tmp_path)
    assert code == 0, err
    (line,) = _warnings(caplog)
    assert "running without the cache" in line and "AUTOFIT_CACHE_DIR" in line
    assert (tmp_path / "tuned.yaml").is_file() and fake.calls
    # the next run cannot answer from a cache: it measures again
    n = len(fake.calls)
    assert _tune_cli(capsys, tmp_path)[0] == 0 and len(fake.calls) == 2 * n


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="running as root: file modes do not stop writes (see the read-only "
                           "database test below, which simulates it)")
def test_read_only_cache_folder_runs_without_the_cache(tiny_llama, data, fake, cache_dir, caplog):
    cache_dir.mkdir()
    cache_dir.chmod(0o555)
    try:
        r = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **ONE)
    finally:
        cache_dir.chmod(0o755)
    assert r.confirmed
    (line,) = _warnings(caplog)
    assert "read-only" in line and "running without the cache" in line


def test_a_database_that_refuses_writes_mid_run_is_one_warning(
        tiny_llama, data, fake, monkeypatch, caplog):
    """What a read-only studies.db does (simulated: file modes do not stop root)."""
    from optuna.storages import RDBStorage
    from sqlalchemy.exc import OperationalError

    def refuse(self, *a, **k):
        raise OperationalError("UPDATE trials", {},
                               sqlite3.OperationalError("attempt to write a readonly database"))

    monkeypatch.setattr(RDBStorage, "set_trial_user_attr", refuse)
    r = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **TWO)
    assert r.confirmed and len(fake.calls) == 2
    (line,) = _warnings(caplog)
    assert "readonly database" in line and "without the cache" in line


def test_racing_table_creation_is_retried(tiny_llama, data, fake, monkeypatch, caplog):
    """Two first-ever runs: the loser meets "table studies already exists" (simulated)."""
    from optuna.storages import RDBStorage
    from sqlalchemy.exc import OperationalError

    real = RDBStorage.__init__
    raised = []

    def racing(self, *a, **k):
        if not raised:
            raised.append(1)
            raise OperationalError("CREATE TABLE studies", {},
                                   sqlite3.OperationalError("table studies already exists"))
        real(self, *a, **k)

    monkeypatch.setattr(RDBStorage, "__init__", racing)
    autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **ONE)
    assert raised and _warnings(caplog) == []
    again = autofit(tiny_llama, data, device=DEVICE, target_batch_size=16, **ONE)
    assert again.from_cache  # the cache was used, not skipped


_RACE = """
import sys, time
from autofit.probe.device import resolve_device
from autofit.search import build_space
from autofit.search.study import TrialRecorder
dev = resolve_device("cpu:1GiB")
space = build_space(dev, max_micro_batch=4, target_batch_size=None, world_size=1,
                    optim_args=None, reasons=[], precision=None, gradient_checkpointing=None,
                    optimizer=None)
while time.time() < float(sys.argv[2]):
    pass
TrialRecorder("race", storage=sys.argv[1], space=space, capacity_bytes=dev.capacity_bytes)
print("opened")
"""


def test_first_ever_runs_racing_to_create_the_tables_all_open_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    url = f"sqlite:///{tmp_path / 'fresh' / 'studies.db'}"
    (tmp_path / "fresh").mkdir()
    start = time.time() + 8  # after the imports: all create the tables at once
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, url, str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-400:] for _, e in outs]
    assert all(o.strip() == "opened" for o, _ in outs)


# -------------------------------------------------------- item 6: the pre-flight CheckCache


def _check_args(tmp_path) -> list[str]:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "max_position_embeddings": 256}))
    cfg = tmp_path / "args.yaml"
    cfg.write_text(yaml.safe_dump({"output_dir": "out", "per_device_train_batch_size": 2,
                                   "optim": "adamw_torch"}))
    return ["check", str(cfg), "--model", str(model), "--seq-len", "32", "--device", "cpu",
            "--json"]


def test_check_with_a_garbage_cache_warns_once_and_answers(tmp_path, fake, cache_dir, capsys,
                                                          caplog):
    cache_dir.mkdir()
    _study_db(cache_dir).write_bytes(os.urandom(4096))
    argv = _check_args(tmp_path)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["fits"] is True and len(fake.calls) == 1
    (line,) = _warnings(caplog)
    assert "unreadable" in line
    # the fresh cache answers the same check; a torn JSON copy of the entry is a miss
    for side in (cache_dir / "checks").glob("*.json"):
        side.write_text('{"trial": {"oom": fal')
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["from_cache"] is True and len(fake.calls) == 1, err


def test_check_with_a_blocked_cache_folder_prints_one_warning_line(tmp_path):
    """The real command line (no pytest logging): exit 0, one warning line on stderr."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOFIT_CACHE_DIR": str(blocker)}
    p = subprocess.run([sys.executable, "-m", "autofit", *_check_args(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["fits"] is True
    # one line about the cache, however often it is asked for; nothing else of its (a
    # loaded machine may add an unrelated line, e.g. the in-process trial's baseline note)
    about = [x for x in p.stderr.splitlines() if "cache" in x.lower()]
    assert len(about) == 1, p.stderr
    assert "running without the cache" in about[0] and str(blocker) in about[0]
    assert "Traceback" not in p.stderr, p.stderr


# ------------------------------------------------------------ item 12: runs that share trials


def test_a_claim_left_by_a_dead_process_does_not_block(tmp_path):
    import optuna

    from autofit.config import TrainConfig
    from autofit.probe.device import resolve_device
    from autofit.search import build_space
    from autofit.search.study import TrialRecorder

    dev = resolve_device(DEVICE)
    space = build_space(dev, max_micro_batch=4, target_batch_size=None, world_size=1,
                        optim_args=None, reasons=[], **{k: None for k in
                                                        ("precision", "gradient_checkpointing",
                                                         "optimizer")})
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    rec = TrialRecorder("dead", storage=url, space=space, capacity_bytes=dev.capacity_bytes)
    config = TrainConfig(micro_batch_size=2, precision="32-true", optimizer="adamw_torch")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    template = optuna.trial.create_trial(
        state=optuna.trial.TrialState.RUNNING,
        params={**{n: getattr(config, n) for n in rec.knobs}, "micro_batch_size": 2},
        distributions=rec.distributions,
        user_attrs={"claim": {"host": socket.gethostname(), "pid": gone.pid, "at": time.time()}})
    rec.storage.create_new_trial(rec.storage.get_study_id_from_name(rec.study.study_name),
                                template_trial=template)
    t0 = time.monotonic()
    result, claim = rec.reserve(config, on_wait=lambda: pytest.fail("waited for a dead run"))
    assert result is None and claim is not None and time.monotonic() - t0 < 5
    states = [t.state for t in rec.study.get_trials()]
    assert optuna.trial.TrialState.FAIL in states  # the void claim is closed


_SHARE = """
import json, random, sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import autofit.trial as trial_mod
from autofit.api import autofit

cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                           max_position_embeddings=256)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg)
rng = random.Random(0)
rows = [{"input_ids": [rng.randrange(1, 512) for _ in range(rng.randint(8, 40))]}
        for _ in range(48)]
ran = []
real = trial_mod.measure
def counting(*a, **k):
    ran.append(a[1].to_dict())
    return real(*a, **k)
trial_mod.measure = counting
while time.time() < float(sys.argv[1]):
    time.sleep(0.01)
r = autofit(model, rows, device="cpu:1GiB", target_batch_size=16, precision=["32-true"],
            optimizer=["adamw_torch", "sgd"], gradient_checkpointing=False, chunked_loss=False)
print(json.dumps({"config": r.config.to_dict(), "ran": len(ran), "trials": len(r.trials),
                  "from_cache": r.from_cache}))
"""


@pytest.mark.slow  # two tunes started together (12 s of waiting for both to be past their imports)
def test_two_runs_at_once_share_their_trials(tmp_path, cache_dir):
    from optuna.storages import RDBStorage

    cache_dir.mkdir()
    RDBStorage(f"sqlite:///{_study_db(cache_dir)}")  # an existing cache: the tables are made
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOFIT_CACHE_DIR": str(cache_dir)}
    start = time.time() + 12  # both past their imports: they search at the same time
    procs = [subprocess.Popen([sys.executable, "-c", _SHARE, str(start)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-600:] for _, e in outs]
    a, b = (json.loads(o.strip().splitlines()[-1]) for o, _ in outs)
    assert a["config"] == b["config"]  # the same answer
    # (one trial suffices: the optimizer-only sibling is skipped when its step is too small
    # a share of the run's to make it 5% faster -- the sharing rules below still decide)
    assert a["trials"] >= 1 and b["trials"] >= 1
    # every trial ran once, in one of the two: each saw the other's
    assert a["ran"] + b["ran"] < a["trials"] + b["trials"]
    assert a["ran"] + b["ran"] == max(a["trials"], b["trials"])
