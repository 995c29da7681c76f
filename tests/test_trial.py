"""Trials: real micro-steps on a capped CPU, OOM survived, the model untouched."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
import warnings

import numpy as np
import pytest
import torch

from autofit.config import TrainConfig
from autofit.errors import BadInputError, EmptyDatasetError, UnknownDeviceError
from autofit.trial import TrialResult, is_oom, measure
from autofit.trial import loop as trial_loop
from autofit.trial import runner as trial_runner

MiB = 1 << 20

TINY = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "architectures": ["LlamaForCausalLM"],
}
# big enough to run out of 64 MiB: the (16, 512, 1000) fp32 logits alone are 32 MiB
OOM_CASE = {"config": TrainConfig(micro_batch_size=16), "seq_len": 512, "device": "cpu:64MiB"}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-llama-128.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def tiny_module():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY)
    cfg.pop("architectures")
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))


@pytest.fixture(autouse=True)
def _fresh_isolation_state():
    trial_runner._failed_recovery().clear()
    yield
    trial_runner._failed_recovery().clear()


# ---------------------------------------------------------------- is_oom


class FakeCudnnError(RuntimeError):
    pass


OOM_TABLE = [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (
        RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.15 GiB total)"),
        True,
    ),
    (RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"), True),
    (RuntimeError("XPU out of memory. Tried to allocate 512.00 MiB"), True),
    (RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB)"), True),
    (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."), True),
    (
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        True,
    ),
    (FakeCudnnError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 8192000 bytes. Error code 12"
        ),
        True,
    ),
    (RuntimeError("std::bad_alloc"), True),
    (MemoryError(), True),
    (OSError(12, "Cannot allocate memory"), True),
    # near misses
    (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."), False),
    (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"), False),
    (RuntimeError("Expected all tensors to be on the same device"), False),
    (ValueError("CUDA out of memory"), False),  # only RuntimeErrors carry allocator messages
    (OSError(2, "No such file or directory"), False),
    (KeyboardInterrupt(), False),
]


@pytest.mark.parametrize(("exc", "expected"), OOM_TABLE, ids=lambda x: str(x)[:40])
def test_is_oom_table(exc, expected):
    assert is_oom(exc) is expected


def test_is_oom_follows_the_cause():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert is_oom(outer)
    assert not is_oom(None)


# ---------------------------------------------------------------- capped CPU (subprocess)


def test_fits_on_capped_cpu(tiny_path):
    r = measure(tiny_path, TrainConfig(micro_batch_size=4), seq_len=128, device="cpu:1GiB")
    assert isinstance(r, TrialResult)
    assert r.fits and not r.oom and r.error is None
    assert r.isolation == "subprocess" and "capped" in r.isolation_reason
    # 3 timed steps by default (their median is the step time: one slow step does not decide)
    assert r.batch_shape == (4, 128) and r.steps == 3 and r.warmup_steps == 1
    # weights (~2.3 MiB fp32) + AdamW state + activations + (4, 128, 1000) logits
    assert 4 * MiB < r.peak_allocated_bytes < 256 * MiB
    assert r.peak_allocated_bytes == r.peak_reserved_bytes == r.device_total_bytes
    assert r.resident_bytes is not None and r.resident_bytes < r.peak_allocated_bytes
    assert r.step_time_s > 0
    assert r.tokens_per_s == pytest.approx(4 * 128 / r.step_time_s)
    assert r.samples_per_s == pytest.approx(4 / r.step_time_s)
    assert r.config["micro_batch_size"] == 4 and r.config["seq_len"] == 128
    assert r.capacity_bytes == 1 << 30


def test_oom_on_capped_cpu_reports_the_peak_up_to_the_failure(tiny_path):
    r = measure(tiny_path, **OOM_CASE)
    assert r.oom and not r.fits
    assert "DefaultCPUAllocator" in r.error
    assert r.isolation == "subprocess"
    # measured up to the failure; RSS can pass the address-space cap by a few pages
    assert 8 * MiB < r.peak_allocated_bytes < 80 * MiB
    assert r.step_time_s is None and r.tokens_per_s is None


# ---------------------------------------------------------------- the model untouched


def _state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict(keep_vars=True).items():
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        h.update(str(bool(getattr(t, "requires_grad", False))).encode())
    for name, m in model.named_modules():
        h.update(f"{name}:{m.training}:{getattr(m, 'gradient_checkpointing', None)}".encode())
        h.update(str(sorted(m._forward_hooks)).encode())
        h.update(str(sorted(m._forward_pre_hooks)).encode())
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    return h.hexdigest()


def _rng_hash() -> str:
    h = hashlib.sha256()
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()).encode())
    return h.hexdigest()


@pytest.mark.parametrize(
    ("config", "device", "isolation", "expect_oom"),
    [
        (TrainConfig(micro_batch_size=2, gradient_checkpointing=True), "cpu", "auto", False),
        (TrainConfig(micro_batch_size=2, precision="bf16-true"), "cpu", "auto", False),  # a copy
        (OOM_CASE["config"], "cpu:64MiB", "in-process", True),
    ],
    ids=["in-place-fits", "copy-bf16-true", "in-place-oom"],
)
def test_model_and_rng_untouched(config, device, isolation, expect_oom):
    torch.manual_seed(1)
    model = tiny_module()
    if expect_oom:
        # A process's first large step grows what the CPU libraries keep for the process
        # (oneDNN's primitive cache and scratchpad): not the trial's to give back. In a
        # busy test worker that growth can land in this trial and read as a leak, so one
        # trial of the same size runs first; what is checked is this trial's own return.
        measure(model, config, seq_len=512, device=device, isolation=isolation)
    model.eval()
    model.model.embed_tokens.weight.requires_grad_(False)
    model.config.use_cache = True
    sentinel = torch.ones_like(model.lm_head.weight)
    model.lm_head.weight.grad = sentinel  # the user's own gradient
    before, rng_before = _state_hash(model), _rng_hash()
    from accelerate.state import PartialState

    accelerate_before = dict(PartialState._shared_state)
    r = measure(
        model, config, seq_len=512 if expect_oom else 32, device=device, isolation=isolation
    )
    assert r.oom is expect_oom and r.isolation == "in-process"
    assert _state_hash(model) == before
    assert _rng_hash() == rng_before
    assert PartialState._shared_state == accelerate_before  # TrainingArguments' side effect undone
    assert model.lm_head.weight.grad is sentinel
    assert not model.training and model.config.use_cache is True
    assert not model.is_activation_checkpointing
    assert r.recovered is True


def test_oom_then_success_in_process_back_at_baseline():
    model = tiny_module()
    first = measure(model, **{**OOM_CASE, "seq_len": 512}, isolation="in-process")
    assert first.oom and first.recovered is True
    assert first.leaked_bytes < 32 * MiB
    second = measure(
        model,
        TrainConfig(micro_batch_size=2),
        seq_len=64,
        device="cpu:1GiB",
        isolation="in-process",
    )
    assert second.fits and second.recovered is True
    assert second.leaked_bytes < 32 * MiB
    assert second.peak_allocated_bytes < first.peak_allocated_bytes


_LEAK: list[torch.Tensor] = []


def _leaky_hook(module, args, output):
    _LEAK.append(torch.ones(8 * MiB))  # 32 MiB that nobody frees


def test_failed_recovery_warns_and_switches_to_subprocess(tiny_path):
    model = tiny_module()
    handle = model.register_forward_hook(_leaky_hook)
    try:
        with pytest.warns(RuntimeWarning, match="did not return to its baseline"):
            r = measure(model, TrainConfig(micro_batch_size=1), seq_len=16, device="cpu")
    finally:
        handle.remove()
        _LEAK.clear()
    assert r.fits and r.recovered is False and r.leaked_bytes >= 64 * MiB
    assert any("baseline" in n for n in r.notes)
    nxt = measure(tiny_path, TrainConfig(micro_batch_size=1), seq_len=16, device="cpu")
    assert nxt.isolation == "subprocess" and "recover" in nxt.isolation_reason
    assert nxt.fits and nxt.recovered is None


# ---------------------------------------------------------------- inputs, modes, timeouts


def test_dataset_and_batch_inputs(tiny_path):
    data = [{"input_ids": list(range(5, 5 + n))} for n in (3, 40, 7, 12, 9)]
    r = measure(tiny_path, TrainConfig(micro_batch_size=2), data, device="cpu", measure_steps=1)
    assert r.fits and r.batch_shape == (2, 40)  # the worst case: 40 and 12, padded to 40
    r = measure(
        tiny_path, TrainConfig(micro_batch_size=2), data, seq_len=16, device="cpu", measure_steps=1
    )
    assert r.batch_shape == (2, 16)
    one_row = {"input_ids": torch.arange(10).unsqueeze(0), "labels": torch.arange(10).unsqueeze(0)}
    r = measure(tiny_path, TrainConfig(micro_batch_size=3), one_row, device="cpu", measure_steps=1)
    assert r.fits and r.batch_shape == (3, 10)


@pytest.mark.parametrize(
    "config",
    [
        TrainConfig(micro_batch_size=2, precision="bf16-mixed", grad_accum_steps=4),
        TrainConfig(
            micro_batch_size=2, precision="16-mixed", optimizer="sgd", optim_args="momentum=0.9"
        ),
        TrainConfig(micro_batch_size=2, precision="bf16-true", optimizer="adafactor"),
        TrainConfig(micro_batch_size=2, optimizer="adamw_torch_fused"),
    ],
    ids=lambda c: f"{c.precision}-{c.optimizer}",
)
def test_precisions_and_optimizers_run(tiny_path, config):
    r = measure(tiny_path, config, seq_len=32, device="cpu", measure_steps=1)
    assert r.fits, r.error
    assert r.micro_batches_per_step == min(config.grad_accum_steps, 2)


@pytest.mark.parametrize(
    ("config", "task"),
    [
        (
            {
                "model_type": "t5",
                "d_model": 64,
                "d_ff": 128,
                "d_kv": 16,
                "num_heads": 4,
                "num_layers": 2,
                "vocab_size": 1000,
                "is_encoder_decoder": True,
            },
            "seq2seq",
        ),
        (
            {
                "model_type": "bert",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 1000,
            },
            "seq-cls",
        ),
        (
            {
                "model_type": "bert",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 1000,
            },
            "masked-lm",
        ),
    ],
    ids=["t5-seq2seq", "bert-seq-cls", "bert-masked-lm"],
)
def test_other_tasks(tmp_path, config, task):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))  # NB: the T5 config has no decoder_start_token_id
    r = measure(
        str(path),
        TrainConfig(micro_batch_size=2),
        seq_len=16,
        device="cpu",
        task=task,
        measure_steps=1,
    )
    assert r.fits, r.error


def test_lora_by_reference(tiny_path):
    from autofit.probe.model import LoraSpec

    r = measure(
        tiny_path,
        TrainConfig(micro_batch_size=2),
        seq_len=32,
        device="cpu",
        lora=LoraSpec(r=4, target_modules=("q_proj", "v_proj")),
        measure_steps=1,
    )
    assert r.fits, r.error


def test_timeout_in_process_stops_between_steps(tiny_path):
    r = measure(
        tiny_path,
        TrainConfig(micro_batch_size=1),
        seq_len=16,
        device="cpu",
        timeout_s=1e-3,
        warmup_steps=1,
        measure_steps=5,
    )
    assert r.timed_out and r.error == "timeout after 0.001s" and not r.oom
    assert r.steps < 5


def test_timeout_kills_the_subprocess(tiny_path, monkeypatch):
    # a fresh child (seconds of imports; a warm trial server's fork steps this model in
    # 0.2 s) is still starting when the 0.5 s deadline passes: killed, nothing measured
    monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "0")
    r = measure(
        tiny_path, TrainConfig(micro_batch_size=1), seq_len=16, device="cpu:1GiB", timeout_s=0.5
    )
    assert r.timed_out and r.error == "timeout after 0.5s" and not r.oom
    assert r.isolation == "subprocess" and r.peak_allocated_bytes is None


def test_bad_input(tiny_path):
    cfg = TrainConfig(micro_batch_size=2)
    with pytest.raises(EmptyDatasetError):
        measure(tiny_path, cfg, [], device="cpu")
    with pytest.raises(UnknownDeviceError):
        measure(tiny_path, cfg, seq_len=8, device="tpu-9000")
    with pytest.raises(UnknownDeviceError, match="not present"):
        measure(tiny_path, cfg, seq_len=8, device="H100-80GB")
    with pytest.raises(BadInputError, match="empty"):
        measure(tiny_path, cfg, {"input_ids": torch.zeros(0, 8, dtype=torch.long)}, device="cpu")
    with pytest.raises(BadInputError, match="seq_len"):
        measure(tiny_path, cfg, device="cpu")
    with pytest.raises(BadInputError, match="isolation"):
        measure(tiny_path, cfg, seq_len=8, device="cpu", isolation="thread")
    with pytest.raises(BadInputError, match="measure_steps"):
        measure(tiny_path, cfg, seq_len=8, device="cpu", measure_steps=0)


def test_result_is_frozen_and_serializable():
    fields = {f.name for f in dataclasses.fields(TrialResult)}
    assert {
        "oom",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "device_total_bytes",
        "step_time_s",
        "tokens_per_s",
        "samples_per_s",
        "error",
        "config",
        "device",
        "batch_shape",
        "isolation",
        "isolation_reason",
        "steps",
    } <= fields
    r = TrialResult(
        oom=True,
        peak_allocated_bytes=None,
        peak_reserved_bytes=None,
        device_total_bytes=None,
        step_time_s=None,
        tokens_per_s=None,
        samples_per_s=None,
        error="x",
        config={},
        device="cpu",
        batch_shape=(1, 2),
        isolation="in-process",
        isolation_reason="r",
        steps=0,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.oom = False  # type: ignore[misc]
    assert json.loads(json.dumps(r.to_dict()))["batch_shape"] == [1, 2]


def test_unpicklable_module_falls_back_in_process_under_the_cap():
    class Local(torch.nn.Module):  # defined here: pickle cannot name it
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.head = torch.nn.Linear(16, 50)

        def forward(self, input_ids, labels=None, attention_mask=None):
            logits = self.head(self.emb(input_ids))
            return {
                "loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            }

    batch = {"input_ids": torch.randint(0, 50, (2, 8)), "labels": torch.randint(0, 50, (2, 8))}
    r = measure(Local(), TrainConfig(micro_batch_size=2), batch, device="cpu:1GiB")
    assert r.fits and r.isolation == "in-process" and "pickle" in r.isolation_reason
    with pytest.raises(BadInputError, match="in-process"):
        measure(
            Local(), TrainConfig(micro_batch_size=2), batch, device="cpu", isolation="subprocess"
        )


def test_a_child_that_dies_is_judged_by_its_stderr(tiny_path, tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho \"terminate called after throwing an instance of 'std::bad_alloc'\" >&2\n"
        "kill -ABRT $$\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(trial_runner.sys, "executable", str(fake))
    monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "0")  # the fake stands in for a fresh child
    r = measure(tiny_path, TrainConfig(micro_batch_size=1), seq_len=8, device="cpu:1GiB")
    assert r.oom and "SIGABRT" in r.error and "bad_alloc" in r.error


def test_accelerator_meter_on_fake_counters(monkeypatch):

    class FakeAPI:  # what _AccelAPI offers, with counters the test sets
        def __init__(self):
            self.alloc, self.max_alloc, self.max_res, self.emptied = 100 * MiB, 0, 0, 0

        def index(self):
            return 0

        def synchronize(self, idx):
            pass

        def empty_cache(self):
            self.emptied += 1

        def allocated(self, idx):
            return self.alloc

        def max_allocated(self, idx):
            return self.max_alloc

        def max_reserved(self, idx):
            return self.max_res

        def reset_peak(self, idx):
            self.max_alloc = self.max_res = self.alloc

        def mem_info(self, idx):
            return 1000 * MiB, 5000 * MiB

    api = FakeAPI()
    monkeypatch.setattr(trial_loop, "_accel", lambda device_type: api)
    meter = trial_loop._AccelMeter(torch.device("cuda", 0), excluded=10 * MiB)
    assert meter.baseline() == 100 * MiB and api.emptied == 1
    meter.arm()
    assert api.max_alloc == 100 * MiB
    api.max_alloc, api.max_res = 700 * MiB, 900 * MiB
    assert meter.peaks() == (690 * MiB, 890 * MiB, 3990 * MiB)
    assert meter.leaked() == 0
    api.alloc += 3 * MiB  # a tensor the trial did not free
    assert meter.leaked() == 3 * MiB > meter.tolerance


# ---------------------------------------------------------------- accelerators


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_counters(tiny_path):
    r = measure(tiny_path, TrainConfig(micro_batch_size=4), seq_len=128, device="cuda")
    assert r.fits and r.isolation == "in-process"
    assert 0 < r.peak_allocated_bytes <= r.peak_reserved_bytes <= r.device_total_bytes
    assert r.recovered is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_on_device_untouched():
    model = tiny_module().cuda()
    before = _state_hash(model)
    r = measure(model, TrainConfig(micro_batch_size=2), seq_len=64, device="cuda")
    assert r.fits and _state_hash(model) == before


# ---------------------------------------------------------------- CLI


def _cli(argv):
    from autofit.cli.measure import add_measure_parser, run_measure

    parser = argparse.ArgumentParser(prog="autofit")
    add_measure_parser(parser.add_subparsers(dest="command"))
    return run_measure(parser.parse_args(argv))


def test_cli_fits_json(tiny_path, capsys):
    code = _cli(
        [
            "measure",
            tiny_path,
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--device",
            "cpu",
            "--json",
            "--measure-steps",
            "1",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(out) == {f.name for f in dataclasses.fields(TrialResult)}
    assert out["oom"] is False and out["batch_shape"] == [2, 32]


def test_cli_oom_exit_3_with_suggestion(tiny_path, capsys):
    code = _cli(
        [
            "measure",
            tiny_path,
            "--batch-size",
            "16",
            "--seq-len",
            "512",
            "--device",
            "cpu:64MiB",
            "--isolation",
            "in-process",
        ]  # the subprocess OOM path is tested above; this is fast
    )
    out = capsys.readouterr().out
    assert code == 3
    assert "does not fit" in out and "--batch-size 8" in out and "--gradient-checkpointing" in out


def test_cli_bad_input_exit_2(tiny_path, tmp_path, capsys):
    assert (
        _cli(["measure", tiny_path, "--batch-size", "2", "--seq-len", "8", "--device", "nope"]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert _cli(["measure", tiny_path, "--batch-size", "0", "--seq-len", "8"]) == 2
    assert (
        _cli(
            [
                "measure",
                tiny_path,
                "--batch-size",
                "2",
                "--dataset",
                str(tmp_path / "missing.jsonl"),
            ]
        )
        == 2
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _cli(["measure", tiny_path, "--batch-size", "2", "--dataset", str(empty)]) == 2


def test_cli_dataset_file(tiny_path, tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"input_ids": list(range(n))}) for n in (4, 30, 9)))
    code = _cli(
        [
            "measure",
            tiny_path,
            "--batch-size",
            "2",
            "--dataset",
            str(path),
            "--device",
            "cpu",
            "--json",
            "--measure-steps",
            "1",
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out)["batch_shape"] == [2, 30]


def test_no_warning_leaks_from_a_clean_trial(tiny_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        measure(
            tiny_path, TrainConfig(micro_batch_size=1), seq_len=16, device="cpu", measure_steps=1
        )


def test_a_trial_step_time_is_the_median_of_at_least_3_steps():
    # issue 12: with 2 timed steps the "median" was their mean, and one slow step on a busy
    # CPU moved a candidate's speed by half its slowness
    import inspect

    from autofit.cli import build_parser
    from autofit.trial import MEASURE_STEPS
    from autofit.trial.loop import RawTrial

    assert MEASURE_STEPS >= 3
    assert inspect.signature(measure).parameters["measure_steps"].default == MEASURE_STEPS
    args = build_parser().parse_args(["measure", "tiny-llama", "--batch-size", "1", "--seq-len", "8"])
    assert args.measure_steps is None  # the CLI passes nothing: the API's default applies
    assert RawTrial(step_times_s=[0.10, 0.31, 0.11]).step_time_s == 0.11


def test_the_set_up_step_is_one_sample_at_the_batchs_full_length(monkeypatch):
    """The first real-size step maps memory a process keeps (a one-time cost the set-up
    step pays before the baseline and the cap, ``step.setup_batch``): one row, full length."""
    from autofit.trial import step as trial_step

    shapes: list[tuple[int, ...]] = []
    real_step = trial_step.Stepper.step

    def recorded(self, batch):
        shapes.append(tuple(batch["input_ids"].shape))
        return real_step(self, batch)

    monkeypatch.setattr(trial_step.Stepper, "step", recorded)
    r = measure(tiny_module(), TrainConfig(micro_batch_size=4), seq_len=96, device="cpu",
                isolation="in-process", measure_steps=1)
    assert r.fits
    assert shapes[0] == (1, 96)  # the set-up step
    assert shapes[1:] == [(4, 96)] * (r.warmup_steps + r.steps)
