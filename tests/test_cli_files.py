"""The command line's files: outputs checked before any work, configuration files checked
as TrainingArguments would, and every bad file an exit 2 with one line that says what to do
(issue 11, items 7, 8 and the file side of 9)."""

from __future__ import annotations

import json
import os

import pytest

from autofit.cli import main
from autofit.errors import AutofitError, BadInputError, InvalidArgumentsError

ROOT = os.geteuid() == 0
AS_ROOT = "running as root: chmod does not stop root's writes (the simulated case covers it)"

# a plan made for a GPU, as `autofit tune --device A100-80GB -o` writes it
PLAN = {"output_dir": "autofit-output", "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 2, "bf16": True, "fp16": False,
        "activation_checkpointing": False, "optim": "adamw_torch_fused",
        "per_device_eval_batch_size": 8}
META = {"model": "tiny-llama", "task": "causal-lm", "seq_len": 64, "device": "A100-80GB",
        "margin": 0.1, "reasons": ["chosen: fastest predicted"], "confirmed": False}


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad_input(code, err, *needles):
    """Exit 2, one stderr line, no traceback, and the line says what it must."""
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    for n in needles:
        assert n in err, (n, err)


def snapshot(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def tuned_file(path, fields=None, meta=None):
    """A tuned file as write_config writes it (the metadata line above the fields)."""
    from autofit.emit import write_config

    return write_config(path, PLAN if fields is None else fields, META if meta is None else meta)


@pytest.fixture()
def no_tuning(monkeypatch, tmp_path):
    """autofit() and the dataset loader record calls instead of working: the output must be
    refused before either runs."""
    import autofit.api
    import autofit.cli.datasets

    calls = []
    monkeypatch.setattr(autofit.api, "autofit", lambda *a, **k: calls.append("autofit"))
    monkeypatch.setattr(autofit.cli.datasets, "load_dataset_ref",
                        lambda *a, **k: calls.append("dataset") or [])
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return calls


def tune(capsys, output):
    return run(capsys, "tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", "cpu:1GiB",
               "-o", output)


# ---------------------------------------------------------------- item 7: the output first


def test_tune_output_that_is_a_folder_is_refused_before_any_work(tmp_path, capsys, no_tuning):
    (tmp_path / "out.yaml").mkdir()
    before = snapshot(tmp_path)
    code, _, err = tune(capsys, tmp_path / "out.yaml")
    assert_bad_input(code, err, "is a folder", "give a file name")
    assert no_tuning == [] and snapshot(tmp_path) == before


def test_tune_output_under_a_regular_file_is_refused(tmp_path, capsys, no_tuning):
    (tmp_path / "notes").write_text("x")
    code, _, err = tune(capsys, tmp_path / "notes" / "tuned.yaml")
    assert_bad_input(code, err, "is a file, not a folder")
    assert no_tuning == []


def test_tune_json_output_whose_metadata_file_is_a_folder_is_refused(tmp_path, capsys,
                                                                      no_tuning):
    (tmp_path / "tuned.autofit.json").mkdir()  # where a .json's metadata goes
    code, _, err = tune(capsys, tmp_path / "tuned.json")
    assert_bad_input(code, err, "tuned.autofit.json is a folder")
    assert no_tuning == []


def test_tune_output_with_another_suffix_is_refused_before_any_work(tmp_path, capsys,
                                                                   no_tuning):
    code, _, err = tune(capsys, tmp_path / "tuned.txt")
    assert_bad_input(code, err, ".yaml or .json")
    assert no_tuning == []


@pytest.mark.skipif(ROOT, reason=AS_ROOT)
def test_tune_output_in_a_read_only_folder_is_refused(tmp_path, capsys, no_tuning):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, _, err = tune(capsys, ro / "tuned.yaml")
    finally:
        ro.chmod(0o700)
    assert_bad_input(code, err, "no file can be created in")
    assert no_tuning == [] and list(ro.iterdir()) == []


@pytest.mark.skipif(ROOT, reason=AS_ROOT)
def test_tune_output_over_a_read_only_file_is_refused(tmp_path, capsys, no_tuning):
    f = tmp_path / "tuned.yaml"
    f.write_text("old: 1\n")
    f.chmod(0o400)
    code, _, err = tune(capsys, f)
    assert_bad_input(code, err, "cannot be written")
    assert no_tuning == [] and f.read_text() == "old: 1\n"


def test_tune_output_in_a_folder_that_refuses_new_files(tmp_path, capsys, no_tuning,
                                                        monkeypatch):
    # what a read-only folder (or mount) answers, simulated: it holds for root as well
    import tempfile

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    code, _, err = tune(capsys, tmp_path / "sub" / "tuned.yaml")
    assert_bad_input(code, err, "no file can be created in", "Permission denied")
    assert no_tuning == [] and not (tmp_path / "sub").exists()


def test_tune_output_over_a_file_that_refuses_writes(tmp_path, capsys, no_tuning, monkeypatch):
    import autofit.emit.output

    f = tmp_path / "tuned.yaml"
    f.write_text("old: 1\n")

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(autofit.emit.output, "open", refuse, raising=False)
    code, _, err = tune(capsys, f)
    assert_bad_input(code, err, "cannot be written")
    assert no_tuning == [] and f.read_text() == "old: 1\n"


def test_the_output_check_leaves_no_probe_and_missing_folders_are_still_made(tmp_path):
    from autofit.emit import check_config_output

    before = snapshot(tmp_path)
    check_config_output(tmp_path / "runs" / "a" / "tuned.yaml")
    (tmp_path / "old.yaml").write_text("x: 1\n")
    before = snapshot(tmp_path)
    check_config_output(tmp_path / "old.yaml")
    assert snapshot(tmp_path) == before and (tmp_path / "old.yaml").read_text() == "x: 1\n"
    # the writer creates the missing folders, as before
    path = tuned_file(tmp_path / "runs" / "a" / "tuned.yaml")
    assert path.is_file()


def _result():
    from autofit import TrainConfig, estimate
    from autofit.emit import training_arguments_dict
    from autofit.result import FitResult

    config = TrainConfig(micro_batch_size=2, grad_accum_steps=2, seq_len=32)
    est = estimate("tiny-llama", config, seq_len=32, device="cpu:4GiB")
    return FitResult(config=config, estimate=est, trials=(), reasons=("chosen",),
                     confirmed=False, device="cpu:4GiB",
                     training_arguments_kwargs=training_arguments_dict(config, use_cpu=True),
                     meta=dict(META))


def test_fit_result_save_and_report_refuse_unwritable_paths(tmp_path):
    r = _result()
    (tmp_path / "out.yaml").mkdir()
    (tmp_path / "notes").write_text("x")
    before = snapshot(tmp_path)
    for path in (tmp_path / "out.yaml", tmp_path / "notes" / "t.yaml", tmp_path / "t.txt"):
        with pytest.raises(BadInputError) as e:
            r.save(path)
        assert len(str(e.value).splitlines()) == 1
    for path in (tmp_path / "out.yaml", tmp_path / "notes" / "r"):
        with pytest.raises(BadInputError, match="folder"):
            r.report(path)
    assert snapshot(tmp_path) == before
    assert r.save(tmp_path / "ok.yaml").is_file()


def test_report_output_is_checked_before_drawing(tmp_path, capsys, monkeypatch):
    import autofit.report.files

    drawn = []
    monkeypatch.setattr(autofit.report.files, "write_report",
                        lambda *a, **k: drawn.append(1) or (None, None))
    path = tuned_file(tmp_path / "tuned.yaml")
    (tmp_path / "out").mkdir()
    (tmp_path / "notes").write_text("x")
    before = snapshot(tmp_path)
    code, _, err = run(capsys, "report", path, "-o", tmp_path / "out")
    assert_bad_input(code, err, "-o", "is a folder")
    code, _, err = run(capsys, "report", path, "-o", tmp_path / "notes" / "r.html")
    assert_bad_input(code, err, "is a file, not a folder")
    (tmp_path / "tuned.png").mkdir()  # the default output beside the file cannot be written
    code, _, err = run(capsys, "report", path)
    assert_bad_input(code, err, "tuned.png is a folder", "give -o")
    assert drawn == [] and snapshot(tmp_path) == sorted([*before, "tuned.png"])


# ---------------------------------------------------------------- item 8: fields as TrainingArguments


def _check(capsys, path, *extra):
    return run(capsys, "check", path, "--device", "A100-80GB", "--no-cache", "--no-trial", *extra)


@pytest.mark.parametrize("edit,needles", [
    ({"fp16": True}, ["bf16 and fp16 are both true"]),
    ({"per_device_train_batch_size": "four"}, ["per_device_train_batch_size", "'four'",
                                                "not a whole number"]),
    ({"per_device_train_batch_size": 2.5}, ["per_device_train_batch_size: 2.5"]),
    ({"learning_rate": "1e-4"}, ["learning_rate: '1e-4' is text", "write 0.0001"]),
    ({"fp16": "false"}, ["fp16: 'false' is text", "write false"]),
    ({"optim": "adamw_tourch"}, ["optim", "did you mean adamw_torch?"]),
    ({"eval_strategy": "step"}, ["eval_strategy", "did you mean steps?"]),
    ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps must be at least 1"]),
    ({"seed": None}, ["seed: needs a value"]),
    ({"load_best_model_at_end": True, "eval_strategy": "epoch"},
     ["load_best_model_at_end needs save_strategy and eval_strategy to match"]),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, ["needs an eval_strategy"]),
])
def test_check_refuses_fields_training_arguments_refuses(tmp_path, capsys, edit, needles):
    path = tuned_file(tmp_path / "tuned.yaml", {**PLAN, **edit})
    code, out, err = _check(capsys, path)
    assert_bad_input(code, err, str(path), *needles)
    assert out == ""


def test_check_lists_every_problem_at_once(tmp_path, capsys):
    path = tuned_file(tmp_path / "tuned.yaml", {**PLAN, "learning_rte": 1e-4, "fp16": True,
                                                "per_device_train_batch_size": "four"})
    code, _, err = _check(capsys, path)
    # a key outside TrainingArguments is the script's (issue 21): not a problem
    assert_bad_input(code, err, "2 problems", "bf16 and fp16 are both true",
                     "'four' is not a whole number")
    assert "learning_rte" not in err
    # the same file drawn by `autofit report`: the same refusal, nothing drawn
    before = snapshot(tmp_path)
    code, _, err = run(capsys, "report", path)
    assert_bad_input(code, err, "2 problems")
    assert snapshot(tmp_path) == before


def test_a_gpu_plan_stays_checkable_on_a_cpu_machine(tmp_path, capsys):
    # bf16 + a fused optimizer: TrainingArguments(**fields) raises here without use_cpu;
    # the check reads the fields without building it
    path = tuned_file(tmp_path / "tuned.yaml")
    code, out, err = _check(capsys, path, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["fits"] and d["config"]["precision"] == "bf16-mixed"


def test_fields_training_arguments_takes_are_not_flagged(tmp_path, capsys):
    from autofit.emit import training_arguments_problems

    fields = {**PLAN, "learning_rate": 1.0e-4, "num_train_epochs": 3, "report_to": ["none"],
              "fsdp": ["full_shard"], "lr_scheduler_type": "cosine", "debug": "",
              "include_num_input_tokens_seen": "all", "eval_strategy": "steps", "eval_steps": 50,
              "save_steps": 100, "load_best_model_at_end": True, "label_names": ["labels"],
              "lr_scheduler_kwargs": {"num_cycles": 2}, "max_grad_norm": 1,
              "predict_with_generate": True}  # a Seq2SeqTrainingArguments field
    assert training_arguments_problems(fields) == []
    path = tuned_file(tmp_path / "tuned.yaml", fields)
    code, _, err = _check(capsys, path)
    assert code == 0, err


def test_preflight_with_a_dict_lists_every_problem(tmp_path):
    import autofit

    with pytest.raises(InvalidArgumentsError) as e:
        autofit.preflight({"per_device_train_batch_size": "four", "learning_rte": 1e-4,
                           "bf16": True, "fp16": True}, model="tiny-llama", seq_len=16,
                          device="A100-80GB", cache=False)
    assert isinstance(e.value, AutofitError) and e.value.exit_code == 2
    assert len(e.value.problems) == 3 and len(str(e.value).splitlines()) == 1
    # world_size is read by the check although it is not a TrainingArguments field
    from autofit.preflight import config_of

    assert config_of({"per_device_train_batch_size": 2, "world_size": 4}).world_size == 4


# ---------------------------------------------------------------- item 9: bad files


def _edit_meta(path, line):
    text = path.read_text().splitlines()
    text = [line if t.startswith("# autofit: ") else t for t in text]
    path.write_text("\n".join(text) + "\n")
    return path


def _cut_meta(tmp_path):
    path = tuned_file(tmp_path / "tuned.yaml")
    meta_line = next(t for t in path.read_text().splitlines() if t.startswith("# autofit: "))
    return _edit_meta(path, meta_line[:40])


def _wrong_types(tmp_path):
    path = tuned_file(tmp_path / "tuned.yaml")
    return _edit_meta(path, "# autofit: " + json.dumps({**META, "seq_len": "long",
                                                         "estimate": 5}))


def _meta_list(tmp_path):
    return _edit_meta(tuned_file(tmp_path / "tuned.yaml"), '# autofit: ["tiny-llama"]')


def _bad_sidecar(tmp_path):
    path = tuned_file(tmp_path / "tuned.json")
    (tmp_path / "tuned.autofit.json").write_text('{"model": "tiny-llama", "seq_')
    return path


def _text(name, text):
    def make(tmp_path):
        p = tmp_path / name
        p.write_text(text)
        return p
    return make


def _binary(tmp_path):
    p = tmp_path / "tuned.yaml"
    p.write_bytes(b"\xff\xfe\x00\x81garbage\x00")
    return p


def _folder(tmp_path):
    p = tmp_path / "tuned.yaml"
    p.mkdir()
    return p


@pytest.mark.parametrize("make,needles", [
    (_cut_meta, ["'# autofit:' line is cut off", "re-run autofit tune", "delete that line"]),
    (_wrong_types, ["was edited", "seq_len should be a positive whole number", "estimate"]),
    (_meta_list, ["not a mapping", "re-run autofit tune"]),
    (_bad_sidecar, ["tuned.autofit.json", "cut off", f"delete {'tuned.autofit.json'}"]),
    (_text("list.yaml", "- per_device_train_batch_size\n- 8\n"),
     ["holds a list", "one field per line"]),
    (_text("scalar.yaml", "hello\n"), ["not a mapping"]),
    (_text("empty.yaml", ""), ["is empty", "per_device_train_batch_size: 8"]),
    (_text("blank.json", "  \n"), ["is empty"]),
    (_text("comments.yaml", "# nothing here\n"), ["no TrainingArguments fields"]),
    (_text("tag.yaml", "!!python/object/apply:os.system ['true']\n"), ["not valid YAML"]),
    (_text("four.yaml", "per_device_train_batch_size: four\n"), ["'four' is not a whole number"]),
    (_binary, ["not a text file"]),
    (_folder, ["is a folder"]),
])
def test_bad_files_exit_2_with_what_to_do(tmp_path, capsys, make, needles):
    path = make(tmp_path)
    before = snapshot(tmp_path)
    # --model and --seq-len given: nothing else could stop the check
    code, _, err = _check(capsys, path, "--model", "tiny-llama", "--seq-len", "16")
    assert_bad_input(code, err, *needles)
    code, _, err = run(capsys, "report", path, "--model", "tiny-llama", "--seq-len", "16")
    assert_bad_input(code, err, *needles)
    assert snapshot(tmp_path) == before
    # the Python side: the same one-line error
    from autofit.emit import check_training_arguments, read_config

    with pytest.raises(BadInputError) as e:
        check_training_arguments(read_config(path)[0], source=str(path))
    assert all(n in str(e.value) for n in needles) and len(str(e.value).splitlines()) == 1


def test_a_pasted_blob_does_not_flood_the_line(tmp_path, capsys):
    path = tuned_file(tmp_path / "tuned.yaml", {**PLAN, "seed": "x" * 5000, "y" * 5000: 1})
    code, _, err = _check(capsys, path)
    assert_bad_input(code, err, "1 problem", "seed:")
    assert len(err) < 600
    # the pasted key is the script's: named in the note, cut short
    path = tuned_file(tmp_path / "tuned.yaml", {**PLAN, "y" * 5000: 1})
    code, out, err = _check(capsys, path, "--json")
    note = next(r for r in json.loads(out)["reasons"] if "kept untouched" in r)
    assert code == 0 and len(note) < 200, err


def test_a_misspelled_field_is_a_did_you_mean_warning_not_a_refusal(tmp_path, capsys):
    path = tuned_file(tmp_path / "tuned.yaml", {**PLAN, "learning_rte": 1e-4})
    code, out, err = _check(capsys, path, "--json")
    assert code == 0, err
    assert any(r.startswith("warning:") and "'learning_rte'" in r
               and "did you mean learning_rate?" in r for r in json.loads(out)["reasons"])
