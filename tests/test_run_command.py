"""``autofit run``: the user's own command, measured from inside its processes.

Each test runs a tiny script in a fresh process under the hook
(``autofit.trial.runhook``): it builds a tiny model, then allocates and touches a
known amount, so the measured peak must be that amount (not the ~200 MiB of the
interpreter and torch imported before the model).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from autofit.emit import write_config
from autofit.preflight.run import RunRecord, run_command

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

ALLOC = textwrap.dedent("""
    import sys, torch
    model = torch.nn.Linear(4, 4)        # the baseline: the first nn.Module
    x = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8)
    x.fill_(1)                           # touched: resident
    print("allocated", sys.argv[1], "MiB")
""")


@pytest.fixture(scope="module")
def alloc(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("run") / "alloc.py"
    p.write_text(ALLOC)
    return p


def cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "autofit", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, **kw)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_measures_the_allocation_above_the_model_start(alloc):
    r = run_command([sys.executable, str(alloc), "200"], device="cpu:1GiB")
    assert isinstance(r, RunRecord)
    assert r.exit_code == 0 and r.survived and not r.out_of_memory
    assert r.measured_kind == "cpu" and r.cap_bytes == 1 << 30
    (p,) = r.processes
    assert p.exited and p.error is None
    # 200 MiB touched; the imports (torch: well over 100 MiB) are below the baseline
    assert 200 * MiB <= r.measured_bytes <= 200 * MiB * 1.05
    assert p.baseline_bytes > 100 * MiB


def test_a_script_that_probes_for_torch_first_is_measured(tmp_path):
    """``datasets`` / ``evaluate`` ask ``importlib.util.find_spec("torch")`` before torch is
    imported (run_clm.py imports them first): the hook must still see torch's import."""
    script = tmp_path / "probe_first.py"
    script.write_text("import importlib.util\nassert importlib.util.find_spec('torch')\n"
                      + ALLOC)
    r = run_command([sys.executable, str(script), "100"], device="cpu")
    assert r.survived and r.measured_kind == "cpu", r.notes
    assert 100 * MiB <= r.measured_bytes <= 100 * MiB * 1.05


def test_modules_built_while_a_library_is_imported_do_not_take_the_baseline(alloc, tmp_path):
    # transformers.activations builds a GELUActivation at import; the imports after it
    # (here 60 MiB held by the library) are the interpreter's, not the run's
    (tmp_path / "lib.py").write_text(textwrap.dedent("""
        import torch
        ACT = torch.nn.GELU()
        BLOB = torch.ones(60 * 2**20, dtype=torch.uint8)
    """))
    script = tmp_path / "train.py"
    script.write_text("import lib\n" + ALLOC)
    r = run_command([sys.executable, str(script), "100"], device="cpu")
    assert r.exit_code == 0
    assert 100 * MiB <= r.measured_bytes <= 100 * MiB * 1.06


def test_a_cap_smaller_than_the_allocation_kills_the_run(alloc, tmp_path):
    record = tmp_path / "run.json"
    p = cli(["--device", "cpu:100MiB", "--json", "--record", str(record), "--",
             sys.executable, str(alloc), "200"])
    assert p.returncode == 1, p.stderr[-2000:]
    assert "can't allocate memory" in p.stderr  # the script's own traceback, live
    out = last_json(p.stdout)
    assert out["survived"] is False and out["out_of_memory"] is True
    assert out["exit_code"] == 1 and out["cap_bytes"] == 100 * MiB
    assert "DefaultCPUAllocator: can't allocate memory" in out["processes"][0]["error"]
    assert json.loads(record.read_text()) == out


def test_the_json_record_compares_with_the_tuned_file_it_finds(alloc, tmp_path):
    tuned = tmp_path / "tuned.yaml"
    write_config(tuned, {"per_device_train_batch_size": 4},
                 {"device": "cpu:1GiB", "predicted_run_bytes": 400 * MiB})
    script = tmp_path / "train.py"  # takes the tuned file as its argument, as a script would
    script.write_text(ALLOC.replace("sys.argv[1]", "sys.argv[2]"))
    p = cli(["--device", "cpu:1GiB", "--json", "--", sys.executable, str(script), str(tuned),
             "100"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "allocated 100 MiB" in p.stdout  # the command's output passes through
    out = last_json(p.stdout)
    assert set(out) == {"command", "device", "cap_bytes", "exit_code", "survived",
                        "out_of_memory", "measured_bytes", "measured_kind", "predicted_bytes",
                        "config", "processes", "notes", "ratio", "guarded", "rescues"}
    assert out["guarded"] is False and out["rescues"] == []  # no --guard
    assert out["config"] == str(tuned) and out["predicted_bytes"] == 400 * MiB
    assert out["device"] == "cpu:1GiB" and out["notes"] == []
    assert out["ratio"] == pytest.approx(out["measured_bytes"] / (400 * MiB))
    assert 0.24 < out["ratio"] < 0.27  # ~100 MiB of 400
    (proc,) = out["processes"]
    assert set(proc) == {"pid", "rank", "cpu_peak_bytes", "baseline_bytes", "peak_bytes",
                         "cuda_peak_reserved_bytes", "cuda_peak_allocated_bytes",
                         "address_space_bytes", "exited", "error"}
    # the 100 MiB tensor in both; RSS also counts pages mapped before the baseline
    assert proc["address_space_bytes"] >= 100 * MiB and proc["cpu_peak_bytes"] >= 100 * MiB
    # the table, without --json
    p = cli(["--config", str(tuned), "--", sys.executable, str(alloc), "10"])
    assert p.returncode == 0
    assert "measured / predicted" in p.stdout and "survived" in p.stdout


def test_a_missing_command_is_bad_input():
    p = cli(["--", "no-such-command-autofit"])
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "autofit: error: no-such-command-autofit: command not found; give the program to run "
        "after --, e.g. autofit run -- python train.py tuned.yaml"]
    p = cli([])
    assert p.returncode == 2 and "no command to run" in p.stderr


def test_a_command_without_torch_runs_and_keeps_its_exit_code(tmp_path):
    # an existing sitecustomize the hook shadows still runs (chained)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    code = ("import os, sys; print('chained', os.environ.get('CHAINED'), 'torch' in sys.modules)"
            "; sys.exit(4)")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{site}")
    p = subprocess.run([sys.executable, "-m", "autofit", "run", "--json", "--",
                        sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 4, p.stderr
    assert "chained yes False" in p.stdout  # the hook itself never imports torch
    out = last_json(p.stdout)
    assert out["measured_bytes"] is None and out["processes"] == []
    assert out["survived"] is False and not out["out_of_memory"]
    assert out["notes"] == ["no process built a torch model: nothing measured"]


def test_every_process_of_the_command_is_measured(alloc, tmp_path):
    # a launcher-like parent (no model) starting two "ranks" that inherit the hook
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys
        for rank, mib in ((0, 30), (1, 120)):
            subprocess.run([sys.executable, {str(alloc)!r}, str(mib)], check=True,
                           env=dict(os.environ, RANK=str(rank)))
    """))
    r = run_command([sys.executable, str(script)], device="cpu")
    assert r.exit_code == 0
    assert [p.rank for p in r.processes] == [0, 1]  # the launcher built no model
    small, big = (p.cpu_peak_bytes for p in r.processes)
    assert 30 * MiB <= small < 40 * MiB and 120 * MiB <= big < 130 * MiB
    assert r.measured_bytes == big


def _as_a_terminal_starts_it() -> None:
    """Ctrl-C's signal at its default and no signal blocked, whatever this test process
    inherited (a pytest worker's state is not a terminal's: ignored or blocked there, the
    command would never see the SIGINT and sleep on)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def test_ctrl_c_reaches_the_command_and_its_status_is_returned(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "autofit", "run", "--json", "--",
                          sys.executable, str(script)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=_as_a_terminal_starts_it)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "KeyboardInterrupt" in err  # the command's, not autofit's "interrupted"
    assert last_json(out)["exit_code"] == 130


def test_sigterm_is_forwarded(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "autofit", "run", "--json", "--",
                          sys.executable, str(script)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)  # to autofit only
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 143
    assert last_json(out)["exit_code"] == 143


def test_bad_options_are_refused_before_the_command_starts(alloc, tmp_path):
    marker = tmp_path / "started"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    p = cli(["--config", str(tmp_path / "nope.yaml"), *command])
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no such file" in p.stderr
    p = cli(["--record", str(tmp_path), *command])  # a folder
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "is a folder" in p.stderr
    p = cli(["--device", "H100-80GB", *command])
    assert p.returncode == 2 and "not a device of this machine" in p.stderr
    assert not marker.exists()


def test_cuda_peaks_are_the_allocator_s_and_the_run_s_is_the_largest_rank(monkeypatch):
    import types

    from autofit.preflight import run as run_mod
    from autofit.trial import runhook

    used = {0: (300 * MiB, 320 * MiB), 1: (0, 0)}  # device 1 never touched: left out
    cuda = types.SimpleNamespace(
        is_initialized=lambda: True, device_count=lambda: 2,
        max_memory_allocated=lambda i: used[i][0], max_memory_reserved=lambda i: used[i][1])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    peaks = runhook._cuda_peaks()
    assert peaks == [{"index": 0, "peak_allocated_bytes": 300 * MiB,
                      "peak_reserved_bytes": 320 * MiB}]
    raw = [{"pid": 11, "rank": "0", "exited": True, "cuda": peaks},
           {"pid": 12, "rank": "1", "exited": True, "baseline_rss_bytes": 1, "peak_bytes": 5,
            "cuda": [dict(peaks[0], peak_reserved_bytes=400 * MiB)]},
           {"pid": 10, "exited": True}]  # the launcher: no model, no CUDA
    r = run_mod._record(["torchrun", "train.py"], "auto", None, 0, raw, 800 * MiB, "t.yaml", [])
    assert [p.rank for p in r.processes] == [0, 1]
    assert r.measured_kind == "cuda" and r.measured_bytes == 400 * MiB and r.ratio == 0.5
    assert r.processes[1].peak_bytes == 400 * MiB  # CUDA's, not the host's 5 bytes


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_run_reports_the_allocator_peak(tmp_path):
    script = tmp_path / "cuda.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4).cuda()\n"
                      "x = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')\n")
    r = run_command([sys.executable, str(script)])
    assert r.exit_code == 0 and r.measured_kind == "cuda"
    (p,) = r.processes
    assert 256 * MiB <= p.cuda_peak_allocated_bytes < 257 * MiB
    assert p.cuda_peak_reserved_bytes >= p.cuda_peak_allocated_bytes


@pytest.mark.slow
def test_the_example_trains_within_the_tuned_promise(tmp_path):
    # the README's hand-over: tune, then train the tuned file with a plain Trainer under the cap
    env = dict(os.environ, PYTHONPATH=str(ROOT), AUTOFIT_CACHE_DIR=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    tuned = tmp_path / "tuned.yaml"
    p = subprocess.run([sys.executable, "-m", "autofit", "tune", "tiny-gpt2",
                        "--dataset", "tiny-samples", "--device", "cpu:1GiB",
                        "--target-batch-size", "16", "--no-chunked-loss", "--max-trials", "2",
                        "-o", str(tuned)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "autofit", "run", "--device", "cpu:1GiB", "--json",
                        "--", sys.executable, "examples/train_tuned.py", str(tuned)],
                       cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    out = last_json(p.stdout)
    assert out["survived"] and out["config"] == str(tuned)
    # measured 0.82 here (685 MiB of 837 MiB: the figure is an evaluation at the tuned
    # eval batch, which this run does not do; the trial's step measured 691 MiB). With
    # examples/tiny-model the ratio was 0.47. The promise: <= 1.05
    assert 0.3 < out["ratio"] <= 1.05


SPIKE = textwrap.dedent("""
    import sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(cfg)
    def planted(module, args):  # a batch of more than 4 samples "runs out of memory"
        if args[0].shape[0] > 4:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1")
    model.model.layers[0].register_forward_pre_hook(planted)
    rows = [{"input_ids": torch.arange(1, 9), "labels": torch.arange(1, 9)} for _ in range(16)]
    args = TrainingArguments(sys.argv[2], per_device_train_batch_size=8, max_steps=2,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=rows).train()
    print("trained")
""")


def test_guard_absorbs_an_oom_in_the_user_s_own_trainer(tmp_path):
    script = tmp_path / "spike.py"
    script.write_text(SPIKE)
    tuned = write_config(tmp_path / "tuned.yaml", {"per_device_train_batch_size": 8},
                         {"model": "tiny-llama", "predicted_run_bytes": 64 * MiB})
    # unguarded, this run dies at the spike (benchmarks/guard_spike.py); here the one rescue
    # is the out-of-memory error the guard absorbed
    r = cli(["--guard", "--json", "--", sys.executable, str(script), str(tuned),
             str(tmp_path / "o2")])
    assert r.returncode == 0, r.stderr[-2000:]
    d = last_json(r.stdout)
    assert d["survived"] and d["guarded"] and len(d["rescues"]) == 1
    assert "in a training micro step of 8 x 8" in d["rescues"][0]
    # the evidence beside the tuned file, where `autofit check` looks
    from autofit.trial.guard import read_record, record_beside

    assert [x.batch_shape for x in read_record(record_beside(tuned))] == [(8, 8)]


EVALUATING = textwrap.dedent("""
    # examples/train_tuned.py with an evaluation every 2 steps at the tuned eval batch
    import sys, tempfile, torch
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments
    from autofit.cli.datasets import load_dataset_ref
    from autofit.probe.model import load_config

    (args,) = HfArgumentParser(TrainingArguments).parse_yaml_file(sys.argv[1])
    args.max_steps, args.report_to, args.save_strategy = 3, [], "no"
    args.eval_strategy, args.eval_steps = "steps", 2
    args.output_dir = tempfile.mkdtemp(prefix="autofit-eval-")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config("tiny-gpt2"))
    data = load_dataset_ref("tiny-samples")

    def collate(rows):
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, -100)}

    Trainer(model=model, args=args, train_dataset=data, eval_dataset=data,
            data_collator=collate).train()
""")


@pytest.mark.slow
def test_an_evaluating_run_stays_within_the_tuned_promise(tmp_path):
    # the whole-run figure counts the evaluation at the tuned eval batch as the trial
    # measured it (its ratio to the estimate), not the raw estimate (837 MiB promised and
    # 949 measured, 1.13x, before), and what the first step's one-time set-up leaves
    # resident, which the trial measures apart and the run counts (978 MiB promised and
    # 1011 measured, 1.034x, before: eval batch 8, now 7)
    env = dict(os.environ, PYTHONPATH=str(ROOT), AUTOFIT_CACHE_DIR=str(tmp_path / "cache"),
               OMP_NUM_THREADS="1")
    tuned = tmp_path / "tuned.yaml"
    p = subprocess.run([sys.executable, "-m", "autofit", "tune", "tiny-gpt2",
                        "--dataset", "tiny-samples", "--device", "cpu:1GiB",
                        "--target-batch-size", "16", "--no-chunked-loss", "--max-trials", "2",
                        "-o", str(tuned)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "per_device_eval_batch_size" in tuned.read_text()
    script = tmp_path / "train_eval.py"
    script.write_text(EVALUATING)
    p = subprocess.run([sys.executable, "-m", "autofit", "run", "--device", "cpu:1GiB", "--json",
                        "--config", str(tuned), "--", sys.executable, str(script), str(tuned)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-2000:]
    out = last_json(p.stdout)
    assert out["survived"]
    # within the CPU's stated 3% safety (the Trainer's own objects are not modelled)
    assert out["measured_bytes"] <= out["predicted_bytes"] * 1.03, out


def test_a_regional_compile_s_environment_is_set_for_the_command(tmp_path):
    """A tuned file whose launch file compiles regionally runs so under ``autofit run`` even
    as a plain ``python train.py``: the command gets the environment accelerate launch would
    set (which the Trainer reads), with a note; a value the user set is kept."""
    tuned = tmp_path / "tuned.yaml"
    write_config(tuned, {"per_device_train_batch_size": 4, "torch_compile": True},
                 {"device": "cpu:1GiB", "predicted_run_bytes": 400 * MiB})
    (tmp_path / "tuned-accelerate.yaml").write_text(
        "distributed_type: 'NO'\nnum_processes: 1\ndynamo_config:\n  dynamo_backend: INDUCTOR\n"
        "  dynamo_use_regional_compilation: true\n")
    script = tmp_path / "env.py"
    script.write_text("import os, torch\nm = torch.nn.Linear(2, 2)\n"
                      "print('REGIONAL', os.environ.get("
                      "'ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION'))\n")
    env = {k: v for k, v in os.environ.items()
           if k != "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"}
    env["PYTHONPATH"] = str(ROOT)
    command = [sys.executable, "-m", "autofit", "run", "--json", "--", sys.executable,
               str(script), str(tuned)]
    p = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "REGIONAL true" in p.stdout
    assert any("regional torch.compile" in n for n in last_json(p.stdout)["notes"])
    env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "false"
    p = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert "REGIONAL false" in p.stdout and last_json(p.stdout)["notes"] == []
