"""Every bad input is exit 2 with one line that says what to do (issue 11).

One table of bad inputs, each walked through the command line (``autofit.cli.main``
in-process: return code 2, exactly one line on stderr, no traceback, no file
written) and, where the input exists in Python, through the API
(``pytest.raises(AutofitError)``, a one-line message). Every row is rejected before
any trial: models are built on the meta device, devices are catalog cards or
inputs are refused before a step runs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from autofit.errors import (
    AutofitError,
    BadInputError,
    EmptyDatasetError,
    UnknownDeviceError,
    UnknownModelError,
    UnknownTaskError,
    UnsupportedPrecisionError,
)

_MODELS = Path(__file__).resolve().parents[1] / "autofit" / "data" / "models"
GOOD = [{"input_ids": list(range(1, 33))} for _ in range(8)]


def _llama(**changes: Any) -> dict[str, Any]:
    d = json.loads((_MODELS / "tiny-llama.json").read_text())
    d.pop("_autofit_name")
    return {**d, **changes}


# files the rows refer to as {tmp}/<name>: datasets (.json) and models (directories)
FILES: dict[str, Any] = {
    "vocab.json": GOOD + [{"input_ids": [5, 60000] + [7] * 40}],  # tiny-gpt2: 50257 tokens
    "negative.json": GOOD + [{"input_ids": [5, -3]}],
    "strings.json": [{"input_ids": ["hello", "world"]}],
    "floats.json": GOOD + [{"input_ids": [1.5, 2.0]}],
    "nested.json": [{"input_ids": [[1, 2], [3]]}],
    "empty-sample.json": GOOD + [{"input_ids": []}],
    "all-empty.json": [{"input_ids": []}, {"input_ids": []}],
    "too-long.json": GOOD + [{"input_ids": [3] * 1100}],  # tiny-gpt2: 1024 positions
    "no-ids.json": GOOD + [{"label": 1}],
    "no-columns.json": [{"foo": 1}],
    "text-only.json": [{"text": "hello world"}],
    "no-samples.json": [],
    "not-a-list.json": 5,
    "garbage-data.json": "this is { not json",
    "config-garbage/config.json": "garbage{",
    "config-list/config.json": [1, 2],
    "config-no-type/config.json": {"hidden_size": 64},
    "config-type/config.json": _llama(model_type="lama"),
    "config-negative/config.json": _llama(hidden_size=-64),
    "config-zero-heads/config.json": _llama(num_attention_heads=0),
    "config-string-dim/config.json": _llama(hidden_size="big"),
    "config-negative-layers/config.json": _llama(num_hidden_layers=-2),
    "no-config/README": "a directory without config.json",
    # a family outside the analytic table, with fewer positions than its derivation needs
    "config-phi-64/config.json": {"model_type": "phi", "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "vocab_size": 128,
                                  "max_position_embeddings": 64},
    # hostile files (issue 23, item 5): bytes that are not text, nesting past any recursion
    "binary.json": b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 64,
    "deep.json": "[" * 100_000 + "]" * 100_000,
    "deep.yaml": "per_device_train_batch_size: " + "[" * 100_000 + "]" * 100_000 + "\n",
}


@dataclass(frozen=True)
class Bad:
    """One bad input: its CLI arguments and/or its Python call, and what the message says."""

    name: str
    needle: str  # a piece of the one-line message (what is wrong or what to do)
    argv: tuple[str, ...] | None = None  # "{tmp}" is the test's folder
    api: Callable[[Path], Any] | None = None
    error: type[AutofitError] = BadInputError
    cli_needle: str | None = None  # when the command line words it differently (argparse)


def tune(*extra: str, model: str = "tiny-gpt2", dataset: str = "tiny-samples",
         device: str = "A100-80GB") -> tuple[str, ...]:
    return ("tune", model, "--dataset", dataset, "--device", device, "-o", "{tmp}/tuned.yaml",
            *extra)


def fit(data: Any = None, model: str = "tiny-gpt2", **kw: Any) -> Callable[[Path], Any]:
    """autofit(model, data, device=A100-80GB, **kw); a str data names a file of FILES."""
    def call(tmp: Path) -> Any:
        from autofit import autofit

        d = GOOD if data is None else (json.loads((tmp / data).read_text())
                                       if isinstance(data, str) else data)
        m = str(tmp / model) if isinstance(model, str) and (tmp / model).exists() else model
        return autofit(m, d, **{"device": "A100-80GB", **kw})
    return call


def measured(batch: Any = None, model: str = "tiny-gpt2", **kw: Any) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        from autofit import TrainConfig, measure

        return measure(model, TrainConfig(micro_batch_size=1), batch, device="cpu", **kw)
    return call


def compare(**kw: Any) -> Callable[[Path], Any]:
    def call(tmp: Path) -> Any:
        from autofit import compare_peft

        return compare_peft("tiny-gpt2", seq_len=64, device="A100-80GB", **kw)
    return call


def _ids(rows: list[list[int]]) -> dict[str, Any]:
    import torch

    return {"input_ids": torch.tensor(rows)}


def _measure_chunked_classifier(tmp: Path) -> Any:
    from autofit import TrainConfig, measure

    return measure("tiny-llama", TrainConfig(micro_batch_size=1, chunked_loss=True), seq_len=16,
                   device="cpu", task="seq-cls")


ROWS = [
    # -- the data (item 4, 9, 11) ------------------------------------------------------------
    Bad("id at or above the vocabulary", "vocabulary size 50257",
        tune(dataset="{tmp}/vocab.json"), fit("vocab.json")),
    Bad("negative id", "negative token id", tune(dataset="{tmp}/negative.json"),
        fit("negative.json")),
    Bad("string input_ids", "not integer token ids", tune(dataset="{tmp}/strings.json"),
        fit("strings.json")),
    Bad("input_ids a string", "tokenize the text first", None, fit([{"input_ids": "hello"}])),
    Bad("chunked loss measured on a classifier", "chunked loss: a seq-cls model's loss is not",
        None, _measure_chunked_classifier),
    Bad("float ids", "not integer token ids (got float 1.5)", tune(dataset="{tmp}/floats.json"),
        fit("floats.json")),
    Bad("nested ids", "not integer token ids", tune(dataset="{tmp}/nested.json"),
        fit("nested.json")),
    Bad("an empty sample", "sample 8 has no tokens", tune(dataset="{tmp}/empty-sample.json"),
        fit("empty-sample.json")),
    Bad("every sample empty", "drop empty samples", tune(dataset="{tmp}/all-empty.json"),
        fit("all-empty.json")),
    Bad("longer than the learned positions", "truncate with max_seq_len=1024",
        tune(dataset="{tmp}/too-long.json"), fit("too-long.json")),
    Bad("truncated, still past the positions", "after truncation at 2048",
        tune("--max-seq-len", "2048", dataset="{tmp}/too-long.json"),
        fit("too-long.json", max_seq_len=2048)),
    Bad("a sample without input_ids", "sample 8 has no input_ids",
        tune(dataset="{tmp}/no-ids.json"), fit("no-ids.json")),
    Bad("samples with no usable column", "neither input_ids nor a text column",
        tune(dataset="{tmp}/no-columns.json"), fit("no-columns.json")),
    Bad("text without a tokenizer", "tokenizer", tune(dataset="{tmp}/text-only.json"),
        fit("text-only.json")),
    Bad("an empty dataset", "no samples", tune(dataset="{tmp}/no-samples.json"),
        fit("no-samples.json"), EmptyDatasetError),
    Bad("a dataset that is not a list", "a list of",
        tune(dataset="{tmp}/not-a-list.json"), fit(5)),
    Bad("a dataset that is not JSON", "not readable JSON",
        tune(dataset="{tmp}/garbage-data.json")),
    Bad("a missing dataset file", "not found", tune(dataset="{tmp}/nothing-here.json")),
    Bad("an unknown bundled dataset", "bundled name", tune(dataset="tiny-nothing")),
    Bad("measure: ids past the vocabulary", "vocabulary size 50257",
        ("measure", "tiny-gpt2", "--batch-size", "1", "--seq-len", "64", "--device", "cpu",
         "--dataset", "{tmp}/vocab.json"), measured(_ids([[1, 50257]]))),
    Bad("measure: longer than the positions", "seq_len=1024 (--seq-len 1024)",
        ("measure", "tiny-gpt2", "--batch-size", "1", "--seq-len", "2048", "--device", "cpu"),
        measured(seq_len=2048)),
    Bad("measure: float batch", "integer token ids", None, measured({"input_ids": [[0.5]]})),
    Bad("measure: empty batch", "the batch is empty", None, measured({"input_ids": [[]]})),
    # -- the model (item 9, 11) --------------------------------------------------------------
    Bad("an uncached hub id, offline", "not found locally and no network",
        tune(model="nobody/does-not-exist-xyz"), fit(model="nobody/does-not-exist-xyz"),
        UnknownModelError),
    Bad("not a path, name or hub id", "not a hub id", tune(model="no such model"),
        fit(model="no such model"), UnknownModelError),
    Bad("a garbage config.json", "not a readable JSON config",
        tune(model="{tmp}/config-garbage"), fit(model="config-garbage"), UnknownModelError),
    Bad("a config.json that is a list", "holds a JSON object",
        tune(model="{tmp}/config-list"), fit(model="config-list"), UnknownModelError),
    Bad("a config without model_type", "no 'model_type'",
        tune(model="{tmp}/config-no-type"), fit(model="config-no-type"), UnknownModelError),
    Bad("an unknown model_type", "did you mean 'llama'", tune(model="{tmp}/config-type"),
        fit(model="config-type"), UnknownModelError),
    Bad("a negative dimension", "hidden_size must be a positive integer, got -64",
        tune(model="{tmp}/config-negative"), fit(model="config-negative")),
    Bad("zero attention heads", "num_attention_heads must be a positive integer",
        tune(model="{tmp}/config-zero-heads"), fit(model="config-zero-heads")),
    Bad("a string dimension", "hidden_size", tune(model="{tmp}/config-string-dim"),
        fit(model="config-string-dim")),
    Bad("negative layers", "num_hidden_layers must be a positive integer",
        tune(model="{tmp}/config-negative-layers"), fit(model="config-negative-layers")),
    Bad("a directory without config.json", "without a config.json",
        tune(model="{tmp}/no-config"), fit(model="no-config"), UnknownModelError),
    Bad("a missing config.json path", "no such file", tune(model="{tmp}/nowhere/config.json"),
        error=UnknownModelError),
    Bad("a model that is not a model", "must be an nn.Module", None, fit(model=42),
        UnknownModelError),
    Bad("an unknown task", "choose one of", tune("--task", "translation"),
        fit(task="translation"), UnknownTaskError),
    # -- numbers (item 1, 10, 11) ------------------------------------------------------------
    Bad("a huge target batch", "more than 1048576 samples per step",
        tune("--target-batch-size", "1000000007"), fit(target_batch_size=1000000007)),
    Bad("target batch 0", "target_batch_size must be at least 1",
        tune("--target-batch-size", "0"), fit(target_batch_size=0)),
    Bad("negative target batch", "target_batch_size must be at least 1",
        tune("--target-batch-size", "-8"), fit(target_batch_size=-8)),
    Bad("target batch as a string", "target_batch_size must be a whole number",
        tune("--target-batch-size", "sixteen"), fit(target_batch_size="16"),
        cli_needle="--target-batch-size: invalid int value"),
    Bad("target batch 7.5", "target_batch_size must be a whole number", None,
        fit(target_batch_size=7.5)),
    Bad("target batch True", "target_batch_size must be a whole number", None,
        fit(target_batch_size=True)),
    Bad("max micro batch 0", "max_micro_batch must be at least 1",
        tune("--max-micro-batch", "0"), fit(max_micro_batch=0)),
    Bad("a huge max micro batch", "max_micro_batch 1000000000 is more than",
        tune("--max-micro-batch", "1000000000"), fit(max_micro_batch=10**9)),
    Bad("negative time budget", "time_budget_s must be a positive number",
        tune("--time-budget", "-1"), fit(time_budget_s=-1)),
    Bad("NaN time budget", "time_budget_s must be a positive number",
        tune("--time-budget", "nan"), fit(time_budget_s=math.nan)),
    Bad("negative max trials", "max_trials must be a positive integer",
        tune("--max-trials", "-1"), fit(max_trials=-1)),
    Bad("zero max trials", "max_trials must be a positive integer",
        tune("--max-trials", "0"), fit(max_trials=0)),
    Bad("NaN margin", "margin must be a fraction in [0, 1)", tune("--margin", "nan"),
        fit(margin=math.nan)),
    Bad("negative margin", "margin must be a fraction", tune("--margin", "-0.1"),
        fit(margin=-0.1)),
    Bad("margin of 1 or more", "margin must be a fraction", tune("--margin", "1.5"),
        fit(margin=1.5)),
    Bad("margin as a string", "margin must be a fraction", None, fit(margin="0.1")),
    Bad("max seq len 0", "max_seq_len must be a positive integer",
        tune("--max-seq-len", "0"), fit(max_seq_len=0)),
    Bad("negative max seq len", "max_seq_len must be a positive integer",
        tune("--max-seq-len", "-5"), fit(max_seq_len=-5)),
    Bad("confirm top 0", "confirm_top must be a positive integer", None, fit(confirm_top=0)),
    Bad("negative trial timeout", "trial_timeout_s must be a positive", None,
        fit(trial_timeout_s=-1)),
    Bad("infinite trial timeout", "trial_timeout_s must be a positive, finite", None,
        fit(trial_timeout_s=math.inf)),
    Bad("training_args with a word for a number", "'four' is not a whole number", None,
        fit(training_args={"per_device_train_batch_size": "four"})),
    Bad("training_args that is not a mapping", "expected a mapping", None,
        fit(training_args=["per_device_train_batch_size", 4])),
    Bad("all the bad numbers at once", "time_budget_s must be a positive number", None,
        fit(time_budget_s=-1, max_trials=0, margin=2.0)),
    # -- devices and knobs -----------------------------------------------------------------
    Bad("an unknown device", "Z80", tune(device="Z80"), fit(device="Z80"), UnknownDeviceError),
    Bad("bf16 on a T4", "bf16", tune("--precision", "bf16-mixed", device="T4"),
        fit(device="T4", precision=["bf16-mixed"]), UnsupportedPrecisionError),
    Bad("an unknown precision", "precision", tune("--precision", "fp7"),
        fit(precision=["fp7"])),
    Bad("an unknown optimizer", "adamw_nope", tune("--optim", "adamw_nope"),
        fit(optimizer=["adamw_nope"])),
    Bad("an unknown option", "unknown option", None, fit(batch=3)),
    Bad("an unknown objective", "unknown objective", None, fit(objective="latency")),
    Bad("a tuned file name that is not yaml or json", ".yaml or .json",
        ("tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", "A100-80GB",
         "-o", "{tmp}/tuned.txt")),
    Bad("estimate: batch size 0", "micro_batch_size",
        ("estimate", "tiny-gpt2", "--batch-size", "0", "--seq-len", "64")),
    Bad("estimate: negative seq len", "seq_len must be a positive integer",
        ("estimate", "tiny-gpt2", "--batch-size", "1", "--seq-len", "-5")),
    # -- typed fields of JSON input (issue 23, item 1): a word is not a bool -----------------
    Bad("quantization: load_in_4bit \"no\"", "load_in_4bit must be a JSON bool",
        tune("--quantization-config", '{"load_in_4bit": "no"}'),
        fit(quantization_config={"load_in_4bit": "no"})),
    Bad("quantization: load_in_8bit \"false\"", "load_in_8bit must be a JSON bool",
        tune("--quantization-config", '{"load_in_8bit": "false"}'),
        fit(quantization_config={"load_in_8bit": "false"})),
    Bad("quantization: a number as text", "llm_int8_threshold must be a number",
        tune("--quantization-config", '{"load_in_8bit": true, "llm_int8_threshold": "6"}')),
    Bad("peft: use_dora \"no\"", "use_dora must be a JSON bool",
        tune("--peft-config", '{"peft_type": "LORA", "use_dora": "no"}'),
        fit(peft_config={"peft_type": "LORA", "use_dora": "no"})),
    Bad("peft: r as text", "r must be a number, got '8'",
        tune("--peft-config", '{"peft_type": "LORA", "r": "8"}'),
        fit(peft_config={"peft_type": "LORA", "r": "8"})),
    Bad("peft: an unknown key", "did you mean 'lora_alpha'",
        tune("--peft-config", '{"peft_type": "LORA", "lora_alhpa": 16}'),
        fit(peft_config={"peft_type": "LORA", "lora_alhpa": 16})),
    # -- hostile files (issue 23, item 5) ----------------------------------------------------
    Bad("a binary PEFT config", "not a text file", tune("--peft-config", "{tmp}/binary.json")),
    Bad("a binary quantization config", "not a text file",
        tune("--quantization-config", "{tmp}/binary.json")),
    Bad("a binary dataset", "not a UTF-8 JSON text file", tune(dataset="{tmp}/binary.json")),
    Bad("a PEFT config nested 100k deep", "nested too deep",
        tune("--peft-config", "{tmp}/deep.json")),
    Bad("a quantization config nested 100k deep", "nested too deep",
        tune("--quantization-config", "{tmp}/deep.json")),
    Bad("a dataset nested 100k deep", "nested too deep", tune(dataset="{tmp}/deep.json")),
    Bad("check: YAML nested 100k deep", "nested too deep", ("check", "{tmp}/deep.yaml")),
    # -- compare-peft (issue 23, item 4): names checked before any estimate --------------------
    Bad("compare-peft: a misspelt method", "did you mean 'lora'",
        ("compare-peft", "tiny-gpt2", "--seq-len", "64", "--device", "A100-80GB",
         "--methods", "lorra", "--plot", "{tmp}/c.png"), compare(methods=["lorra"])),
    Bad("compare-peft: a refused method next to a valid one", "cannot model PEFT method cpt",
        ("compare-peft", "tiny-gpt2", "--seq-len", "64", "--device", "A100-80GB",
         "--methods", "lora,cpt", "--plot", "{tmp}/c.png"), compare(methods="lora,cpt")),
    Bad("compare-peft: a negative --confirm-top", "confirm_top must be 0",
        ("compare-peft", "tiny-gpt2", "--seq-len", "64", "--device", "A100-80GB",
         "--methods", "lora", "--confirm-top", "-3", "--plot", "{tmp}/c.png"),
        compare(methods=["lora"], confirm_top=-3)),
    # -- outputs and the Python API's own types (issue 23, items 6, 7) -----------------------
    Bad("-o a dangling link into a missing folder", "whose folder does not exist",
        tune("-o", "{tmp}/dangling.yaml")),
    Bad("estimate: seed as a word", "seed must be a whole number", None,
        lambda tmp: __import__("autofit").estimate("tiny-gpt2", seq_len=64, device="A100-80GB",
                                                   seed="x")),
    # -- ranks (issue 23, smaller): refused before a process starts -------------------------
    Bad("estimate: a sharding strategy on one process", "shards over several processes",
        ("estimate", "tiny-gpt2", "--batch-size", "1", "--seq-len", "64", "--device",
         "A100-80GB", "--strategy", "fsdp"),
        lambda tmp: __import__("autofit").estimate(
            "tiny-gpt2", __import__("autofit").TrainConfig(strategy="fsdp"), seq_len=64,
            device="A100-80GB")),
    Bad("tune: a sharding strategy on one process", "shards over several processes",
        tune("--strategy", "fsdp"), fit(strategy=["fsdp"])),
    Bad("measure: FSDP2 offload on CPU ranks", "CPU ranks cannot run it",
        ("measure", "tiny-gpt2", "--batch-size", "1", "--seq-len", "32", "--device", "cpu",
         "--nproc-per-node", "2", "--strategy", "fsdp", "--offload", "optimizer+params")),
    Bad("measure: FSDP2 with a bitsandbytes optimizer", "does not run on FSDP2's sharded",
        ("measure", "tiny-gpt2", "--batch-size", "1", "--seq-len", "32", "--device", "cpu",
         "--nproc-per-node", "2", "--strategy", "fsdp", "--optim", "adamw_bnb_8bit")),
    Bad("a simulate-only model, estimated analytically", "use method='simulate'",
        ("estimate", "{tmp}/config-phi-64", "--batch-size", "1", "--seq-len", "8", "--device",
         "A100-80GB"),
        lambda tmp: __import__("autofit").estimate(str(tmp / "config-phi-64"), seq_len=8,
                                                   device="A100-80GB")),
    Bad("estimate: a sample past the learned positions", "truncate with max_seq_len=1024",
        ("estimate", "tiny-gpt2", "--batch-size", "1", "--device", "A100-80GB", "--dataset",
         "{tmp}/too-long.json"),
        lambda tmp: __import__("autofit").estimate(
            "tiny-gpt2", device="A100-80GB", dataset=json.loads((tmp / "too-long.json").read_text()))),
    Bad("compare-peft: a sample past the learned positions", "truncate with max_seq_len=1024",
        ("compare-peft", "tiny-gpt2", "--device", "A100-80GB", "--dataset", "{tmp}/too-long.json",
         "--methods", "lora", "--plot", "{tmp}/c.png"),
        lambda tmp: __import__("autofit").compare_peft(
            "tiny-gpt2", json.loads((tmp / "too-long.json").read_text()), device="A100-80GB",
            methods=["lora"])),
    # -- PEFT on a quantized base (issue 23, item 2): one line, not peft's internals ----------
    Bad("LoHa on a 4-bit base", "its step fails in peft itself",
        ("estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "32", "--device",
         "A100-80GB", "--load-in-4bit", "--peft-config",
         '{"peft_type": "LOHA", "target_modules": ["q_proj"]}'),
        lambda tmp: __import__("autofit").estimate(
            "tiny-llama", seq_len=32, device="A100-80GB", load_in_4bit=True,
            peft_config={"peft_type": "LOHA", "target_modules": ["q_proj"]})),
    Bad("DoRA on an 8-bit base (dies at its 2nd step in bitsandbytes on a CPU)",
        "DoRA on an 8-bit base fails in bitsandbytes",
        ("estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "32", "--device",
         "A100-80GB", "--load-in-8bit", "--peft-config", '{"peft_type": "LORA", "use_dora": true}')),
    Bad("1000 ranks per node on a card (estimate)", "1000 ranks per node on H100-80GB",
        ("estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "32", "--device",
         "H100-80GB", "--nproc-per-node", "1000", "--strategy", "fsdp")),
    Bad("1000 ranks per node (tune)", "1000 ranks per node",
        ("tune", "tiny-llama", "--dataset", "tiny-samples", "--device", "A100-80GB",
         "--nproc-per-node", "1000")),
    Bad("check: JSON nested 100k deep", "nested too deep",
        ("check", "{tmp}/deep.json", "--model", "tiny-gpt2", "--seq-len", "64")),
]


def _write_files(tmp: Path) -> None:
    for name, content in FILES.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content if isinstance(content, str) else json.dumps(content))


def _links(tmp: Path) -> None:
    (tmp / "dangling.yaml").symlink_to(tmp / "missing" / "folder" / "tuned.yaml")


def _listing(tmp: Path) -> set[str]:
    return {str(p.relative_to(tmp)) for p in tmp.rglob("*")}


@pytest.fixture()
def tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # a default output would land here, and be seen
    _write_files(tmp_path)
    _links(tmp_path)
    return tmp_path


# Each side names its own fix (autofit.errors.fix): where Python names a keyword, the
# command line names the flag, and never the keyword.
CLI_WORDS = {"target_batch_size": "--target-batch-size", "max_micro_batch": "--max-micro-batch",
             "time_budget_s": "--time-budget", "max_trials": "--max-trials",
             "margin must": "--margin must", "max_seq_len=": "--max-seq-len ",
             "max_seq_len must": "--max-seq-len must", "confirm_top must": "--confirm-top must",
             "method='simulate'": "--method simulate"}


def _cli_needle(row: Bad) -> tuple[str, str | None]:
    """(what the CLI line says, the Python word it must not say)."""
    if row.cli_needle is not None:
        return row.cli_needle, None
    for py, cli in CLI_WORDS.items():
        if py in row.needle:
            return row.needle.replace(py, cli), py.rstrip("=").split()[0]
    return row.needle, None


def test_the_table_is_large_enough():
    assert len(ROWS) >= 40 and len({r.name for r in ROWS}) == len(ROWS)
    assert sum(r.argv is not None for r in ROWS) >= 40


@pytest.mark.parametrize("row", [r for r in ROWS if r.argv is not None], ids=lambda r: r.name)
def test_cli_exits_2_with_one_line(row, tmp, capsys):
    from autofit.cli import main

    before = _listing(tmp)
    argv = [a.replace("{tmp}", str(tmp)) for a in row.argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors (an int option given a word)
        code = e.code
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and "Traceback" not in err + out, err
    needle, python_word = _cli_needle(row)
    assert needle in lines[0], lines[0]
    if python_word:  # the keyword itself, not inside its flag (--margin)
        assert not re.search(rf"(?<![-\w]){python_word}", lines[0]), lines[0]
    assert _listing(tmp) == before  # no tuned file, no cache


@pytest.mark.parametrize("row", [r for r in ROWS if r.api is not None], ids=lambda r: r.name)
def test_python_api_raises_one_line(row, tmp):
    before = _listing(tmp)
    with pytest.raises(row.error) as e:
        row.api(tmp)
    msg = str(e.value)
    assert "\n" not in msg and row.needle in msg, msg
    assert e.value.exit_code == 2
    assert _listing(tmp) == before
