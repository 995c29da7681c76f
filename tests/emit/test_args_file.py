"""``autofit.emit.args_file``: a mixed arguments file split into TrainingArguments fields and
the script's keys, and written back with only the tuned fields changed."""

from __future__ import annotations

import json

import pytest
import yaml

from autofit.emit import write_config
from autofit.emit.args_file import merged_yaml, read_args_file
from autofit.errors import BadInputError

TRL = """\
model_name_or_path: tiny-llama
dataset_name: my/chat-data
use_peft: true
lora_r: 16
max_length: 512
packing: true
per_device_train_batch_size: 4
"""


def test_split_keeps_the_script_keys_and_warns_a_near_miss(tmp_path):
    p = tmp_path / "args.yaml"
    p.write_text("model_name_or_path: gpt2\nblock_size: 128\nlearning_rte: 0.001\n"
                 "per_device_train_batch_size: 4\n")
    f = read_args_file(p)
    assert f.fields == {"per_device_train_batch_size": 4} and not f.sft
    assert f.other == ("model_name_or_path", "block_size", "learning_rte")
    assert f.model == "gpt2" and f.dataset is None
    assert any("kept untouched" in n and "block_size" in n for n in f.notes)
    warn = [n for n in f.notes if n.startswith("warning:")]
    assert len(warn) == 1 and "did you mean learning_rate?" in warn[0]  # block_size: known


def test_a_trl_file_is_an_sft_config(tmp_path):
    pytest.importorskip("trl")
    from autofit.cli.tune import _fields_of
    from autofit.knobs.trl_loss import is_sft_config, loss_impl_of

    p = tmp_path / "sft.yaml"
    p.write_text(TRL)
    f = read_args_file(p)
    assert f.sft and {"max_length", "packing", "per_device_train_batch_size"} <= set(f.fields)
    assert f.other == ("model_name_or_path", "dataset_name", "use_peft", "lora_r")
    args = _fields_of(f)
    assert is_sft_config(args) and loss_impl_of(args) == "trl"
    assert not any(n.startswith("warning:") for n in f.notes)


def test_train_file_is_read_from_the_working_directory_else_beside_the_file(tmp_path,
                                                                             monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "train.jsonl").write_text('{"input_ids": [1, 2]}\n')
    p = tmp_path / "conf" / "args.yaml"
    p.write_text("train_file: train.jsonl\n")
    monkeypatch.chdir(tmp_path)
    f = read_args_file(p)  # not in the working directory: beside the file, said so
    assert f.dataset == str(tmp_path / "conf" / "train.jsonl") and f.dataset_key == "train_file"
    assert any("beside args.yaml" in n for n in f.notes)
    (tmp_path / "train.jsonl").write_text('{"input_ids": [1]}\n')
    assert read_args_file(p).dataset == "train.jsonl"  # as the script reads it
    p.write_text("train_file: missing.jsonl\n")
    with pytest.raises(BadInputError, match="working directory"):
        read_args_file(p)


def test_a_block_value_that_changes_drops_the_comments_with_a_note(tmp_path):
    p = tmp_path / "args.yaml"
    p.write_text("# mine\nblock_size: 64\noptim_args:\n  - a\nper_device_train_batch_size: 4\n")
    src = read_args_file(p)
    text, kept = merged_yaml(src, {"per_device_train_batch_size": 8, "optim_args": "b=1"})
    assert not kept and "# mine" not in text
    assert yaml.safe_load(text) == {"block_size": 64, "optim_args": "b=1",
                                    "per_device_train_batch_size": 8}
    out = write_config(tmp_path / "t.yaml", {"per_device_train_batch_size": 8,
                                             "optim_args": "b=1"}, {"reasons": []}, source=src)
    assert "its comments are not kept" in out.read_text()


def test_a_tuned_file_tuned_again_has_one_header(tmp_path):
    p = tmp_path / "args.yaml"
    p.write_text("# mine\nblock_size: 64\nper_device_train_batch_size: 4  # micro\n")
    first = write_config(tmp_path / "t.yaml", {"per_device_train_batch_size": 8},
                         {"reasons": ["one"]}, source=read_args_file(p))
    again = write_config(tmp_path / "u.yaml", {"per_device_train_batch_size": 2},
                         {"reasons": ["two"]}, source=read_args_file(first))
    text = again.read_text()
    assert text.count("# autofit: ") == 1 and text.count("# Tuned by autofit") == 1
    assert "# mine" in text and "per_device_train_batch_size: 2  # micro" in text
    assert yaml.safe_load(text) == {"block_size": 64, "per_device_train_batch_size": 2}


def test_json_keeps_the_order_and_writes_the_sidecar(tmp_path):
    p = tmp_path / "args.json"
    p.write_text(json.dumps({"train_file": None, "per_device_train_batch_size": 4,
                             "block_size": 8}))
    out = write_config(tmp_path / "t.json", {"per_device_train_batch_size": 2, "fp16": True},
                       {"model": "x"}, source=read_args_file(p))
    assert list(json.loads(out.read_text())) == ["train_file", "per_device_train_batch_size",
                                                 "block_size", "fp16"]
    assert json.loads((tmp_path / "t.autofit.json").read_text())["model"] == "x"
