"""Your file in, your file out (issue 21, item 3): ``autofit tune --training-args FILE`` with
a mixed arguments file in the shape of the transformers examples (``run_clm.py`` parses
ModelArguments, DataTrainingArguments and TrainingArguments from one file) or of
``trl sft --config``; ``check`` and ``report`` read the same files.

The tunes plan for a T4, which is not here: the estimate alone, no trial."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import yaml

from autofit.cli import main
from autofit.emit import TUNED_FIELDS


@dataclass
class ModelArguments:  # as run_clm.py has it (the fields its file sets)
    model_name_or_path: str | None = None
    tokenizer_name: str | None = None
    config_name: str | None = None


@dataclass
class DataTrainingArguments:  # as run_clm.py has it
    dataset_name: str | None = None
    train_file: str | None = None
    validation_file: str | None = None
    block_size: int | None = None
    max_train_samples: int | None = None
    preprocessing_num_workers: int | None = None
    overwrite_cache: bool = False
    extra: list[str] = field(default_factory=list)


MIXED_YAML = """\
# run_clm.py arguments
model_name_or_path: tiny-gpt2   # the model
dataset_name: tiny-samples
block_size: 64
max_train_samples: 100
preprocessing_num_workers: 2
overwrite_cache: true
output_dir: out
per_device_train_batch_size: 2   # what one device takes
gradient_accumulation_steps: 4
learning_rate: 0.0005
eval_strategy: steps
eval_steps: 5
save_steps: 5
logging_steps: 2
max_steps: 10
do_train: true
"""


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def _tuned_keys_only_changed(before: dict, after: dict) -> None:
    assert list(after)[:len(before)] == list(before)  # every key kept, in its place
    for k, v in before.items():
        if k not in TUNED_FIELDS:
            assert after[k] == v, k
    assert all(k in TUNED_FIELDS or k == "output_dir" for k in list(after)[len(before):])


def test_tune_a_mixed_yaml_file_keeps_it_and_the_script_parses_the_output(here, capsys):
    from transformers import HfArgumentParser, TrainingArguments

    src = here / "args.yaml"
    src.write_text(MIXED_YAML)
    code, out, err = run(capsys, "tune", "--training-args", src, "--device", "T4",
                         "--precision", "32-true", "--json")
    assert code == 0, err
    d = json.loads(out)
    tuned = here / "args-tuned.yaml"  # beside the input, its format; the input untouched
    assert d["output"] == str(tuned) and src.read_text() == MIXED_YAML
    before, after = yaml.safe_load(MIXED_YAML), yaml.safe_load(tuned.read_text())
    _tuned_keys_only_changed(before, after)
    cfg = d["config"]
    assert cfg["micro_batch_size"] * cfg["grad_accum_steps"] == 8  # the file's batch: 2 x 4
    assert after["per_device_train_batch_size"] == cfg["micro_batch_size"]
    text = tuned.read_text()
    assert "# the model" in text and "# what one device takes" in text  # comments kept
    note = next(r for r in d["reasons"] if "outside TrainingArguments" in r)
    for k in ("model_name_or_path", "dataset_name", "block_size", "max_train_samples"):
        assert k in note
    assert "model tiny-gpt2: the file's model_name_or_path" in d["reasons"]
    # the script packs its text into the file's 64-token blocks: that is what is planned
    assert any(r.startswith("sequence length 64:") for r in d["reasons"]), d["reasons"]
    assert any(r.startswith("block size 64: the file's block_size") for r in d["reasons"])
    assert any(r.startswith("target batch 8: from training_args") for r in d["reasons"])
    # the whole-run plan is the file's: 10 steps with evaluations and saves every 5
    assert any("the run replayed" in r and "10 optimizer steps" in r for r in d["reasons"])
    m, data, t = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments)
                                  ).parse_yaml_file(str(tuned))
    assert m.model_name_or_path == "tiny-gpt2" and data.block_size == 64
    assert t.per_device_train_batch_size == cfg["micro_batch_size"] and t.max_steps == 10


def test_json_in_json_out_and_the_command_line_target_wins(here, capsys):
    src = here / "args.json"
    before = yaml.safe_load(MIXED_YAML)
    src.write_text(json.dumps(before, indent=2))
    code, out, err = run(capsys, "tune", "--training-args", src, "--device", "T4",
                         "--precision", "32-true", "--target-batch-size", "4", "--json")
    assert code == 0, err
    d = json.loads(out)
    tuned = here / "args-tuned.json"
    after = json.loads(tuned.read_text())  # plain JSON, the metadata beside it
    assert (here / "args-tuned.autofit.json").is_file()
    _tuned_keys_only_changed(before, after)
    assert after["per_device_train_batch_size"] * after["gradient_accumulation_steps"] == 4
    assert not any(r.startswith("target batch") and "training_args" in r for r in d["reasons"])


def test_without_any_target_a_reason_says_which_batch_and_that_none_was_given(here, capsys):
    code, out, err = run(capsys, "tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device",
                         "T4", "--precision", "32-true", "--json", "-o", here / "t.yaml")
    assert code == 0, err
    d = json.loads(out)
    eff = d["config"]["micro_batch_size"] * d["config"]["grad_accum_steps"]
    assert any(r.startswith(f"effective batch {eff} ") and "no target batch was given" in r
               for r in d["reasons"]), d["reasons"]


def test_check_and_report_take_the_mixed_file(here, capsys):
    src = here / "args.yaml"
    src.write_text(MIXED_YAML)
    code, out, err = run(capsys, "check", src, "--device", "T4", "--no-trial", "--json")
    assert code in (0, 3), err  # judged, not refused
    d = json.loads(out)
    assert any("outside TrainingArguments kept untouched" in r for r in d["reasons"])
    # the script packs tiny-samples into the file's 64-token blocks (block_size: 64)
    assert d["config"]["micro_batch_size"] == 2 and d["seq_len"] == 64
    code, out, err = run(capsys, "report", src, "--device", "T4")
    assert code == 0, err
    assert (here / "args.png").is_file() and "kept untouched" in out


def test_check_still_refuses_a_wrong_training_arguments_value_in_a_mixed_file(here, capsys):
    src = here / "args.yaml"
    src.write_text(MIXED_YAML.replace("gradient_accumulation_steps: 4",
                                      "gradient_accumulation_steps: four"))
    code, _, err = run(capsys, "check", src, "--device", "T4", "--no-trial")
    assert code == 2 and "gradient_accumulation_steps: 'four' is not a whole number" in err
    assert "unknown field" not in err  # the script's keys are not refused


@pytest.mark.parametrize("argv,needle", [
    (["-o", "args.yaml"], "is your --training-args file"),
    (["--in-place", "-o", "other.yaml"], "drop -o"),
])
def test_the_input_is_overwritten_only_with_in_place(here, capsys, argv, needle):
    (here / "args.yaml").write_text(MIXED_YAML)
    code, _, err = run(capsys, "tune", "--training-args", "args.yaml", *argv)
    assert code == 2 and needle in err and err.count("\n") == 1
    assert (here / "args.yaml").read_text() == MIXED_YAML


def test_no_model_anywhere_is_one_line(here, capsys):
    (here / "args.yaml").write_text("per_device_train_batch_size: 2\n")
    code, _, err = run(capsys, "tune", "--training-args", "args.yaml", "--dataset",
                       "tiny-samples")
    assert code == 2 and "model_name_or_path" in err and err.count("\n") == 1


TRL_YAML = """\
model_name_or_path: tiny-llama
dataset_name: tiny-samples
use_peft: true
lora_r: 8
max_length: 128
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
max_steps: 5
"""


def test_a_trl_file_is_tuned_as_an_sft_config_with_its_lora(here, capsys):
    trl = pytest.importorskip("trl")
    from transformers import HfArgumentParser

    (here / "sft.yaml").write_text(TRL_YAML)
    code, out, err = run(capsys, "tune", "--training-args", "sft.yaml", "--device", "T4",
                         "--precision", "32-true", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["config"]["loss_impl"] == "trl"  # SFTTrainer's fused loss, as for an SFTConfig
    assert d["config"]["micro_batch_size"] * d["config"]["grad_accum_steps"] == 8
    assert d["estimate"]["trainable_params"] < d["estimate"]["num_params"] / 10  # LoRA
    assert any(r.startswith("LoRA r=8: the file's use_peft") for r in d["reasons"])
    # the file's max_length: SFTTrainer truncates there (tiny-samples' longest is 256)
    assert any(r.startswith("sequence length 128:") for r in d["reasons"]), d["reasons"]
    assert any("SFTConfig.max_length" in r for r in d["reasons"])
    text = (here / "sft-tuned.yaml").read_text()
    assert '"arguments_class":"trl.SFTConfig"' in text
    script, sft, model = HfArgumentParser((trl.ScriptArguments, trl.SFTConfig, trl.ModelConfig)
                                          ).parse_yaml_file("sft-tuned.yaml")
    assert model.use_peft and model.lora_r == 8 and sft.max_length == 128
    assert sft.per_device_train_batch_size == d["config"]["micro_batch_size"]


def test_a_trl_file_whose_data_is_a_datasets_mixture_is_tuned_and_checked_on_it(here, capsys):
    """``trl sft --config`` reads local data through its ``datasets`` mixture
    (``DatasetMixtureConfig``; ``dataset_name`` cannot name data files): autofit loads it as
    ``trl.get_dataset`` does (columns and fractions applied, the train split), where it said
    "no dataset" before."""
    pytest.importorskip("trl")
    rows = [{"input_ids": list(range(1, 9 + 7 * (i % 5))), "other": "x" * i} for i in range(40)]
    (here / "data").mkdir()
    (here / "data" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (here / "data" / "b.jsonl").write_text("".join(json.dumps({"input_ids": [1] * 80,
                                                               "other": ""}) + "\n"
                                                   for _ in range(40)))
    text = TRL_YAML.replace("dataset_name: tiny-samples\n", (
        "datasets:\n"
        "  - path: json\n    data_files: data/a.jsonl\n    split: train\n"
        "    columns: [input_ids]\n    fraction: 0.75\n"
        "  - path: json\n    data_files: [data/b.jsonl]\n    columns: [input_ids]\n"
        "    fraction: 0.25\n"))
    (here / "sft.yaml").write_text(text)
    code, out, err = run(capsys, "tune", "--training-args", "sft.yaml", "--device", "T4",
                         "--precision", "32-true", "--json")
    assert code == 0, err
    d = json.loads(out)
    # 40 of a and 13 of b (trl's shares: no dataset oversampled); b's 80 tokens the longest
    taken = [r for r in d["reasons"] if r.startswith("dataset: the file's datasets")]
    assert taken and "json data/a.jsonl; json data/b.jsonl" in taken[0], d["reasons"]
    assert "53 training samples" in taken[0]
    assert any(r.startswith("sequence length 80:") for r in d["reasons"]), d["reasons"]
    code, out, err = run(capsys, "check", "sft-tuned.yaml", "--device", "T4", "--json")
    assert code == 0, err
    assert any(r.startswith("sequence length 80:") for r in json.loads(out)["reasons"])
    # a mixture that cannot be read here: one line, exit 2
    (here / "bad.yaml").write_text(text.replace("data/a.jsonl", "data/missing.jsonl"))
    code, _, err = run(capsys, "tune", "--training-args", "bad.yaml", "--device", "T4")
    assert code == 2 and "datasets mixture could not be loaded" in err
    (here / "bad.yaml").write_text(text.replace("    columns: [input_ids]\n    fraction: 0.75",
                                                "    colums: [input_ids]"))
    code, _, err = run(capsys, "tune", "--training-args", "bad.yaml", "--device", "T4")
    assert code == 2 and "datasets[0] has unknown key 'colums'" in err


def test_check_and_report_of_a_trl_file_see_the_data_as_sfttrainer_prepares_it(here, capsys):
    """SFTTrainer ends every text in the EOS token before it truncates or packs: the tune
    planned for that, and check and report judge the same rows. They skipped SFTTrainer's
    preparation (the tuned file's max_seq_len read as a plain truncation): a TRL file on
    text was checked a token short, so the tuning run's trial was not found and the check
    measured a step without the run's growth (TRL's own sft.py on a tiny Qwen2, CPU bf16:
    733 MiB said where the tune had measured 965)."""
    pytest.importorskip("trl")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from autofit.probe.model import load_config

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>",
                            eos_token="</s>").save_pretrained(here / "m")
    AutoModelForCausalLM.from_config(load_config("tiny-llama")).save_pretrained(here / "m")
    (here / "train.jsonl").write_text("".join(
        json.dumps({"text": " ".join(f"w{(i + j) % 40}" for j in range(5 + i % 16))}) + "\n"
        for i in range(48)))  # 5..20 words
    (here / "sft.yaml").write_text(
        "model_name_or_path: m\ndatasets:\n  - path: json\n    data_files: train.jsonl\n"
        "max_length: 512\nper_device_train_batch_size: 4\nmax_steps: 5\n")
    code, out, err = run(capsys, "tune", "--training-args", "sft.yaml", "--device", "T4",
                         "--precision", "32-true", "--json")
    assert code == 0, err
    assert any(r.startswith("sequence length 21:") for r in json.loads(out)["reasons"])
    code, out, err = run(capsys, "check", "sft-tuned.yaml", "--device", "T4", "--json")
    assert code == 0, err
    reasons = json.loads(out)["reasons"]
    assert any(r.startswith("sequence length 21:") for r in reasons), reasons
    assert any("each text ending in '</s>'" in r for r in reasons), reasons
    code, _, err = run(capsys, "report", "sft-tuned.yaml", "--device", "T4", "-o",
                       str(here / "r.png"))
    assert code == 0, err
    assert "sequence length 21" in (here / "r.html").read_text()


def test_a_script_that_evaluates_after_training_is_planned_with_that_evaluation():
    from autofit.stages import RunPlan

    assert RunPlan.of({"do_eval": True}).eval_steps is not None  # trainer.evaluate() at the end
    assert RunPlan.of({"do_train": True}).eval_steps is None


def test_where_the_output_goes(tmp_path):
    from argparse import Namespace

    from autofit.cli.tune import _output
    from autofit.emit.args_file import read_args_file

    src = tmp_path / "args.json"
    src.write_text('{"per_device_train_batch_size": 2}')
    f = read_args_file(src)
    assert _output(Namespace(in_place=False, output=None), f) == tmp_path / "args-tuned.json"
    assert _output(Namespace(in_place=True, output=None), f) == src  # only when asked
    assert _output(Namespace(in_place=True, output=str(src)), f) == src
    assert str(_output(Namespace(in_place=False, output=None), None)) == "tuned.yaml"


def _ner_files(d, words_per_line=(5, 9, 14, 7)):
    """run_ner.py's inputs: a word-level tokenizer saved locally and CoNLL-style JSON lines
    (``tokens`` with a ``ner_tags`` label per word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(40)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]",
                            unk_token="[UNK]").save_pretrained(d / "tok")
    with open(d / "train.json", "w") as f:
        for i, n in enumerate(words_per_line * 5):
            words = [f"w{(i + j) % 40}" for j in range(n)]
            f.write(json.dumps({"tokens": words, "ner_tags": ["O"] * (n - 1) + ["B-PER"]}) + "\n")


@pytest.mark.parametrize("pad", [False, True])
def test_a_run_ner_file_is_tuned_as_a_token_classifier_at_the_scripts_lengths(here, capsys, pad):
    """run_ner.py's args file: its data (words with a label per word) is what a token
    classifier trains on, tokenized as pre-split words and truncated at the file's
    max_seq_length; with pad_to_max_length every batch is that long."""
    _ner_files(here)
    src = here / "args.json"
    keys = {"model_name_or_path": "tiny-bert", "tokenizer_name": "tok",
            "train_file": "train.json", "max_seq_length": 12, "task_name": "ner",
            "label_all_tokens": False, "output_dir": "out", "do_train": True,
            "per_device_train_batch_size": 4, "max_steps": 5, "pad_to_max_length": pad}
    src.write_text(json.dumps(keys))
    code, out, err = run(capsys, "tune", "--training-args", src, "--device", "T4", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert any(r.startswith("task token-cls: the data is words with a label per word "
                            "('ner_tags'") for r in d["reasons"]), d["reasons"]
    assert any(r.startswith("samples truncated at 12 tokens: the file's max_seq_length")
               for r in d["reasons"])
    # the longest sample is 14 words: 12 after truncation either way; the file's own keys
    # (task_name, label_all_tokens) are the script's, with no did-you-mean
    assert any(r.startswith("sequence length 12:") for r in d["reasons"]), d["reasons"]
    assert not any("did you mean" in r for r in d["reasons"])
    tuned = json.loads((here / "args-tuned.json").read_text())
    assert {k: tuned[k] for k in keys if k != "per_device_train_batch_size"} == {
        k: v for k, v in keys.items() if k != "per_device_train_batch_size"}
    code, out, err = run(capsys, "check", here / "args-tuned.json", "--json")
    assert code == 0, err
    assert json.loads(out)["estimate"]["seq_len"] == 12


def test_check_of_the_untuned_run_ner_file_says_what_it_read(here, capsys):
    """``autofit check`` on run_ner's own (untuned) file: the token classifier and the
    truncation are read from the data and the file's keys, and said."""
    _ner_files(here)
    (here / "args.json").write_text(json.dumps({
        "model_name_or_path": "tiny-bert", "tokenizer_name": "tok", "train_file": "train.json",
        "max_seq_length": 12, "output_dir": "out", "per_device_train_batch_size": 4}))
    code, out, err = run(capsys, "check", here / "args.json", "--device", "T4", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert any(r.startswith("task token-cls: the data is words") for r in d["reasons"])
    assert any(r.startswith("samples truncated at 12 tokens") for r in d["reasons"])
    assert d["estimate"]["seq_len"] == 12


def test_pad_to_max_length_plans_the_padded_length_not_the_longest_sample(here, capsys):
    _ner_files(here, words_per_line=(3, 4))  # samples of at most 4 words
    for pad, want in ((False, 4), (True, 16)):
        (here / "args.json").write_text(json.dumps({
            "model_name_or_path": "tiny-bert", "tokenizer_name": "tok", "train_file": "train.json",
            "max_seq_length": 16, "pad_to_max_length": pad, "output_dir": "out",
            "per_device_train_batch_size": 4}))
        code, out, err = run(capsys, "tune", "--training-args", here / "args.json", "--device",
                             "T4", "--json", "-o", here / f"tuned-{pad}.json")
        assert code == 0, err
        assert json.loads(out)["estimate"]["seq_len"] == want, pad


def test_check_of_a_step_that_fails_whatever_its_memory_exits_4(here, capsys):
    """DeBERTa in bf16: its attention fills 16-bit scores with float32's lowest value, which
    torch refuses; without a trial the estimate finds it, and says it is not a memory
    verdict (exit 4, as a trial's failure), not "does NOT fit"."""
    model = here / "deberta.json"
    model.write_text(json.dumps({"model_type": "deberta", "hidden_size": 64,
                                 "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "intermediate_size": 128, "vocab_size": 50265,
                                 "max_position_embeddings": 256}))
    src = here / "args.json"
    src.write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": 2,
                               "bf16": True}))
    code, out, err = run(capsys, "check", src, "--model", model, "--task", "masked-lm",
                         "--seq-len", 64, "--device", "A100-80GB", "--no-trial", "--json")
    assert code == 4, err
    d = json.loads(out)
    assert d["step_fails"] and not d["fits"]
    assert any("fails whatever its memory" in p and "32-true" in p for p in d["problems"])
