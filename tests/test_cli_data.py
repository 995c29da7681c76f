"""The data as the user's script sees it, from the command line and the API: --block-size
(group_texts packing), an SFTConfig's max_length / packing, .json files of JSON lines,
--tokenizer on check and report."""

import json
import random

import pytest

from autofit.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A word-level tokenizer saved locally and a .json file of JSON lines with text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("data")
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(510)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>",
                            eos_token="<eos>").save_pretrained(d / "tok")
    rng = random.Random(0)
    lengths = [rng.randint(5, 148) for _ in range(40)]
    # a .json holding JSON lines: what the transformers examples' json loader reads
    (d / "train.json").write_text("".join(
        json.dumps({"text": " ".join(f"w{rng.randint(0, 509)}" for _ in range(n))}) + "\n"
        for n in lengths))
    return d, sum(lengths)


def test_a_json_file_of_json_lines_is_a_dataset(files):
    from autofit.cli.datasets import load_dataset_file

    d, _ = files
    data = load_dataset_file(str(d / "train.json"))
    assert len(data) == 40 and set(data[0]) == {"text"}


def test_tune_plans_for_the_blocks_and_records_them(files, tmp_path, capsys):
    d, tokens = files
    out = tmp_path / "tuned.yaml"
    code, stdout, err = run(capsys, "tune", "tiny-gpt2", "--dataset", d / "train.json",
                            "--tokenizer", d / "tok", "--block-size", 64, "--device",
                            "A100-80GB", "--target-batch-size", 8, "--margin", 0.1, "--no-cache", "-o", out,
                            "--json")
    assert code == 0, err
    reasons = json.loads(stdout)["reasons"]
    line = f"samples packed into 64-token blocks ({tokens // 64} samples of 64 "
    assert any(r.startswith(line) for r in reasons), reasons
    assert "sequence length 64: the longest sample (p50 64, p99 64)" in reasons
    from autofit.emit import read_config

    _, meta = read_config(str(out))
    assert meta["block_size"] == 64 and meta["seq_len"] == 64


def test_check_rederives_a_tuned_files_blocks(files, tmp_path, capsys):
    from autofit.emit import write_config

    d, tokens = files
    out = write_config(tmp_path / "tuned.yaml", {"per_device_train_batch_size": 8,
                                                 "use_cpu": True},
                       {"model": "tiny-gpt2", "task": "causal-lm", "seq_len": 64,
                        "device": "A100-80GB", "block_size": 64})
    # check re-derives the same blocks from the file; --tokenizer tokenizes the text
    code, stdout, err = run(capsys, "check", out, "--dataset", d / "train.json", "--tokenizer",
                            d / "tok", "--no-trial", "--no-cache", "--json")
    assert code == 0, err
    rep = json.loads(stdout)
    line = f"samples packed into 64-token blocks ({tokens // 64} samples of 64 "
    assert rep["seq_len"] == 64 and any(r.startswith(line) for r in rep["reasons"])
    # a block size given on the command line wins over the file's
    code, stdout, err = run(capsys, "check", out, "--dataset", d / "train.json", "--tokenizer",
                            d / "tok", "--block-size", 32, "--no-trial", "--no-cache", "--json")
    assert code == 0, err
    assert json.loads(stdout)["seq_len"] == 32


def test_check_tokenizes_a_text_dataset_with_tokenizer(files, tmp_path, capsys):
    d, _ = files
    plain = tmp_path / "args.yaml"
    plain.write_text("per_device_train_batch_size: 2\nuse_cpu: true\n")
    argv = ["check", plain, "--model", "tiny-gpt2", "--dataset", d / "train.json", "--device",
            "A100-80GB", "--no-trial", "--no-cache", "--json"]
    code, _, err = run(capsys, *argv)  # the bundled model has no tokenizer
    assert code == 2 and "--tokenizer" in err and err.count("\n") == 1
    code, stdout, err = run(capsys, *argv, "--tokenizer", d / "tok")
    assert code == 0, err
    assert json.loads(stdout)["seq_len"] == 148  # the longest line, no packing


def test_estimate_and_report_plan_for_the_blocks(files, tmp_path, capsys):
    d, _ = files
    code, stdout, err = run(capsys, "estimate", "tiny-gpt2", "--batch-size", 2, "--dataset",
                            d / "train.json", "--tokenizer", d / "tok", "--block-size", 32,
                            "--device", "A100-80GB", "--json")
    assert code == 0, err
    est = json.loads(stdout)
    assert est["seq_len"] == 32 and est["notes"][0].startswith("samples packed into 32-token")
    plain = tmp_path / "args.yaml"
    plain.write_text("per_device_train_batch_size: 2\nuse_cpu: true\n")
    code, _, err = run(capsys, "report", plain, "--model", "tiny-gpt2", "--dataset",
                       d / "train.json", "--tokenizer", d / "tok", "--block-size", 32,
                       "--device", "A100-80GB")
    assert code == 0, err
    html = (tmp_path / "args.html").read_text()
    assert "samples packed into 32-token blocks" in html


@pytest.mark.parametrize("size,needle", [
    (0, "positive integer"), (-5, "positive integer"),
    (2048, "more than the model's 1024 learned positions"),
    (100000, "more than the whole dataset's"),
])
def test_bad_block_sizes_exit_2_with_one_line(files, capsys, size, needle):
    d, _ = files
    code, _, err = run(capsys, "estimate", "tiny-gpt2", "--batch-size", 1, "--dataset",
                       d / "train.json", "--tokenizer", d / "tok", "--block-size", size,
                       "--device", "A100-80GB")
    assert code == 2 and needle in err and err.count("\n") == 1, err


def test_measure_runs_the_packed_batch(files, capsys):
    d, _ = files
    code, stdout, err = run(capsys, "measure", "tiny-gpt2", "--batch-size", 2, "--dataset",
                            d / "train.json", "--tokenizer", d / "tok", "--block-size", 32,
                            "--device", "cpu", "--measure-steps", 1, "--json")
    assert code == 0, err
    assert json.loads(stdout)["batch_shape"] == [2, 32]


def test_preflight_packs_with_block_size():
    import autofit

    rng = random.Random(1)
    data = [{"input_ids": [rng.randint(2, 500) for _ in range(rng.randint(5, 148))]}
            for _ in range(20)]
    r = autofit.preflight({"per_device_train_batch_size": 2}, model="tiny-gpt2", dataset=data,
                          block_size=32, device="A100-80GB", cache=False)
    assert r.seq_len == 32 and any(x.startswith("samples packed into 32-token") for x in r.reasons)


@pytest.mark.parametrize("packing,seq,line", [
    ({}, 64, "samples truncated at 64 tokens: SFTConfig.max_length"),
    ({"packing": True}, 64, "samples packed into 64-token blocks"),
    ({"max_length": 32, "packing": True, "packing_strategy": "wrapped"}, 32,
     "samples packed into 32-token blocks"),
])
def test_an_sft_config_brings_its_max_length_and_packing(packing, seq, line):
    pytest.importorskip("trl")
    from trl import SFTConfig

    import autofit

    rng = random.Random(0)
    data = [{"input_ids": [rng.randint(2, 500) for _ in range(rng.randint(5, 148))]}
            for _ in range(40)]
    args = SFTConfig(output_dir="unused", **{"max_length": 64, **packing},
                     per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False)
    r = autofit.autofit("tiny-gpt2", data, device="A100-80GB", training_args=args, cache=False)
    assert r.meta["seq_len"] == seq and any(x.startswith(line) for x in r.reasons), r.reasons
    if packing:
        assert r.meta["block_size"] == seq
        assert r.meta["packing"] == packing.get("packing_strategy", "bfd")
    else:
        assert r.meta["max_seq_len"] == 64 and "block_size" not in r.meta


def test_a_mixed_files_block_size_packs_when_the_metadata_says_nothing(files):
    import argparse

    from autofit.cli.options import file_subject

    d, _ = files
    args = argparse.Namespace(config="args.yaml", model="tiny-gpt2", dataset=str(d / "train.json"),
                              seq_len=None, device="cpu", task=None, max_seq_len=None,
                              tokenizer=str(d / "tok"), block_size=None)
    assert file_subject(args, {}, {"block_size": 128}).block_size == 128
    assert file_subject(args, {"block_size": 64}, {"block_size": 128}).block_size == 64
    args.block_size = 32  # the command line wins
    assert file_subject(args, {"block_size": 64}, {"block_size": 128}).block_size == 32


def test_tune_takes_the_tokenizer_of_a_model_folder_as_run_clm_does(files, tmp_path, capsys):
    """Text data and no --tokenizer: the model folder's own tokenizer (run_clm.py loads it from
    model_name_or_path when no tokenizer_name is given), not an error."""
    import shutil

    from transformers import AutoConfig

    d, _ = files
    model = tmp_path / "model"
    shutil.copytree(d / "tok", model)
    AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=2, vocab_size=512,
                         n_positions=256).save_pretrained(model)
    code, stdout, err = run(capsys, "tune", model, "--dataset", d / "train.json", "--device",
                            "A100-80GB", "--target-batch-size", 8, "--no-cache", "-o",
                            tmp_path / "tuned.yaml", "--json")
    assert code == 0, err
    reasons = json.loads(stdout)["reasons"]
    assert any(r.startswith("sequence length ") for r in reasons)
