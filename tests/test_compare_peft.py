"""compare-peft: every method on the user's model and device, in Python and on the CLI."""

from __future__ import annotations

import json

import pytest

from autofit import compare_peft, estimate
from autofit.cli import main
from autofit.config import TrainConfig
from autofit.errors import BadInputError


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tiny_llama_config):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_config.save_pretrained(path)
    return str(path)


def test_rows_are_the_estimates_of_each_method(llama_dir):
    c = compare_peft(llama_dir, seq_len=128, device="cpu:64MiB", margin=0.1,
                     methods=["lora", "ia3", {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 4}],
                     micro_batch_size=2, confirm_top=0)
    rows = {r.method: r for r in c.rows}
    assert list(rows) == ["lora", "ia3", "prefix_tuning"]
    for name in ("lora", "ia3", "prefix_tuning"):
        r = rows[name]
        assert r.error is None and r.trainable_params > 0
        # the peak column is the estimate of that method at the compared micro batch
        est = estimate(llama_dir, TrainConfig(micro_batch_size=2, precision=c.config.precision),
                       seq_len=128, device="cpu:64MiB", peft_config=r.peft_config)
        assert r.peak_bytes == est.device_total_bytes
        # the largest micro batch fits the budget and the next one does not
        fit = estimate(llama_dir, TrainConfig(micro_batch_size=r.max_micro_batch,
                                              precision=c.config.precision), seq_len=128,
                       device="cpu:64MiB", peft_config=r.peft_config)
        over = estimate(llama_dir, TrainConfig(micro_batch_size=r.max_micro_batch + 1,
                                               precision=c.config.precision), seq_len=128,
                        device="cpu:64MiB", peft_config=r.peft_config)
        assert fit.device_total_bytes <= c.budget_bytes < over.device_total_bytes
        assert r.tokens_per_s > 0 and r.measured_bytes is None  # confirm_top=0
    assert c.best is not None and c.best.method in ("lora", "ia3", "prefix_tuning")
    d = json.loads(c.to_json())
    assert d["best"] == c.best.method and len(d["rows"]) == 3


@pytest.mark.parametrize("methods,needle", [
    (["lora", "xlora"], "cannot model PEFT method xlora"),
    (["lora", "lorra"], "unknown PEFT method 'lorra': did you mean 'lora'?"),
    (["bogus"], "unknown PEFT method 'bogus'"),
])
def test_an_unknown_or_refused_method_is_bad_input_before_any_estimate(methods, needle,
                                                                        monkeypatch):
    # issue 23: was an n/a row (exit 0 next to a valid method, exit 3 alone)
    import autofit.compare as compare

    def no_estimate(*a, **k):
        raise AssertionError("estimated before the names were checked")

    monkeypatch.setattr(compare, "_row", no_estimate)
    with pytest.raises(BadInputError) as e:
        compare_peft("tiny-gpt2", seq_len=32, device="A100-80GB", methods=methods)
    assert needle in str(e.value)


def test_one_method_named_by_a_string_is_one_method():
    c = compare_peft("tiny-gpt2", seq_len=32, device="A100-80GB", methods="lora")
    assert [r.method for r in c.rows] == ["lora"]  # not "l", "o", "r", "a"


def test_the_fastest_is_confirmed_by_a_trial_on_a_present_device(llama_dir):
    c = compare_peft(llama_dir, seq_len=64, device="cpu:256MiB", methods=["lora", "ia3"],
                     confirm_top=1, max_micro_batch=4)
    confirmed = [r for r in c.rows if r.measured_bytes is not None or r.measured_oom]
    assert len(confirmed) == 1
    r = confirmed[0]
    assert r.max_micro_batch == 4  # the limit asked for
    assert r.measured_oom is False and 0 < r.measured_bytes <= c.capacity_bytes
    assert r.measured_tokens_per_s > 0


def test_bad_input(llama_dir, tiny_llama):
    with pytest.raises(BadInputError, match="not a module"):
        compare_peft(tiny_llama, seq_len=64, device="cpu")
    with pytest.raises(BadInputError, match="seq_len"):
        compare_peft(llama_dir, device="cpu")
    with pytest.raises(BadInputError, match="micro_batch_size"):
        compare_peft(llama_dir, seq_len=64, device="cpu", micro_batch_size=0)


def test_cli_prints_the_table_and_writes_the_picture(llama_dir, tmp_path, capsys):
    png = tmp_path / "peft.png"
    code = main(["compare-peft", llama_dir, "--seq-len", "64", "--device", "cpu:64MiB",
                 "--methods", "lora,ia3", "--confirm-top", "0", "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    assert "lora" in out and "ia3" in out and "fastest that fits" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code = main(["compare-peft", llama_dir, "--seq-len", "64", "--device", "cpu:64MiB",
                 "--methods", "ia3", "--confirm-top", "0", "--plot", str(png), "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["rows"][0]["method"] == "ia3" and d["plot"] == str(png)


def test_cli_nothing_fits_exits_3_and_bad_plot_exits_2(llama_dir, tmp_path, capsys):
    code = main(["compare-peft", llama_dir, "--seq-len", "64", "--device", "cpu:1MiB",
                 "--methods", "ia3", "--confirm-top", "0", "--plot", str(tmp_path / "a.png")])
    assert code == 3 and "no method fits" in capsys.readouterr().out
    code = main(["compare-peft", llama_dir, "--seq-len", "64", "--device", "cpu",
                 "--plot", str(tmp_path / "a.txt")])
    err = capsys.readouterr().err
    assert code == 2 and "--plot must be a .png" in err and err.count("\n") == 1


def test_estimate_and_measure_take_a_peft_config(llama_dir, tmp_path, capsys):
    code = main(["estimate", llama_dir, "--batch-size", "2", "--seq-len", "64", "--device", "cpu",
                 "--peft-config", '{"peft_type": "IA3"}', "--json"])
    d = json.loads(capsys.readouterr().out)
    want = estimate(llama_dir, TrainConfig(micro_batch_size=2), seq_len=64, device="cpu",
                    peft_config={"peft_type": "IA3"})
    assert code == 0 and d["trainable_params"] == want.trainable_params
    assert d["peak_allocated_bytes"] == want.peak_allocated_bytes
    cfg = tmp_path / "adapter_config.json"
    cfg.write_text(json.dumps({"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"],
                               "inference_mode": True}))
    code = main(["estimate", llama_dir, "--batch-size", "2", "--seq-len", "64", "--device", "cpu",
                 "--peft-config", str(cfg), "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["trainable_params"] == 2 * 2 * (64 + 64)
    for bad, needle in (("/no/such.json", "neither a JSON file"),
                        ('{"peft_type": "POLY"}', "cannot model PEFT method poly")):
        code = main(["estimate", llama_dir, "--batch-size", "2", "--seq-len", "64",
                     "--peft-config", bad])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and err.count("\n") == 1
    code = main(["measure", llama_dir, "--batch-size", "1", "--seq-len", "32", "--device", "cpu",
                 "--isolation", "in-process", "--measure-steps", "1",
                 "--peft-config", '{"peft_type": "IA3"}', "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["oom"] is False and d["error"] is None


def test_a_tune_with_a_peft_method_is_checked_with_it(llama_dir, tmp_path, capsys, monkeypatch):
    # the tuned file records the adapter; `autofit check` rebuilds the model with it
    from autofit import autofit

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    data = [{"input_ids": [(7 * i + j) % 500 + 1 for j in range(40 + i)]} for i in range(24)]
    result = autofit(llama_dir, data, device="A100-80GB", target_batch_size=8,
                     peft_config={"peft_type": "IA3"})
    path = result.save(tmp_path / "tuned.yaml")
    from autofit.emit import read_config

    _, meta = read_config(path)
    assert meta["adapter"]["peft_type"] == "IA3"
    assert result.estimate.trainable_params == estimate(
        llama_dir, TrainConfig(), seq_len=64, device="cpu",
        peft_config={"peft_type": "IA3"}).trainable_params
    code = main(["check", str(path), "--device", "A100-80GB", "--no-cache", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["fits"] is True
    assert d["estimate"]["trainable_params"] == result.estimate.trainable_params
