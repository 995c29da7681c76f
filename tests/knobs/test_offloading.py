"""The activation offloading knob: CUDA only, with checkpointing; its memory rule (device and
host), its speed cost, its emitted field and its refusal on a CPU."""

from __future__ import annotations

import json
import random
import warnings

import pytest

from autofit import TrainConfig, estimate
from autofit.errors import BadInputError, InvalidConfigError
from autofit.knobs import CHECKPOINTING, KNOBS, OFFLOADING
from autofit.probe.device import resolve_device

H100 = resolve_device("H100-80GB")
MiB = 1 << 20
OFFLOADED = TrainConfig(micro_batch_size=8, precision="bf16-mixed", gradient_checkpointing=True,
                        activation_offloading=True)


def _both(model, config, seq_len=256, **kw):
    """(without, with offloading) estimates of ``config`` by each method on an H100."""
    out = {}
    for method in ("analytic", "simulate"):
        out[method] = tuple(
            estimate(model, config.replace(activation_offloading=off), seq_len=seq_len,
                     device=H100, method=method, **kw) for off in (False, True))
    return out


# ---------------------------------------------------------------- what it needs

@pytest.mark.parametrize("device", ["cpu", "cpu:4GiB"])
def test_refused_on_a_cpu_device_with_one_line(device):
    dev = resolve_device(device)
    with pytest.raises(BadInputError) as e:
        OFFLOADING.check(dev, True)
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2
    assert f"on {dev.name}" in msg and "activation_offloading=True" in msg and "H100-80GB" in msg
    OFFLOADING.check(dev, False)  # off is fine everywhere
    OFFLOADING.check(H100, True)
    assert OFFLOADING.suggest(dev) == () and OFFLOADING.suggest(H100) == (True,)


def test_estimate_and_measure_refuse_it_on_a_cpu():
    from autofit import measure

    with pytest.raises(BadInputError, match="host memory already"):
        estimate("tiny-llama", OFFLOADED, seq_len=32, device="cpu")
    with pytest.raises(BadInputError, match="host memory already"):
        measure("tiny-llama", OFFLOADED, seq_len=32, device="cpu:4GiB")  # before any trial


def test_cli_refuses_it_on_a_cpu_with_exit_2(capsys):
    from autofit.cli.main import main

    argv = ["estimate", "tiny-llama", "--batch-size", "2", "--seq-len", "32",
            "--gradient-checkpointing", "--activation-offloading"]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "drop --activation-offloading" in err
    assert "--device H100-80GB" in err  # the command line's words, not Python's
    assert main([*argv, "--device", "H100-80GB", "--json"]) == 0  # a catalog card plans it
    out = json.loads(capsys.readouterr().out)
    assert out["host_bytes"] > 0 and out["config"]["activation_offloading"] is True


def test_it_needs_checkpointing():
    with pytest.raises(InvalidConfigError, match="gradient_checkpointing=True"):
        TrainConfig(activation_offloading=True)
    with pytest.raises(InvalidConfigError, match="True or False"):
        TrainConfig(gradient_checkpointing=True, activation_offloading="yes")
    from autofit.cli.main import main

    assert main(["estimate", "tiny-llama", "--batch-size", "1", "--seq-len", "16",
                 "--activation-offloading", "--device", "H100-80GB"]) == 2


def test_searched_only_when_asked_and_never_without_checkpointing():
    from autofit.search.space import build_space

    plain = build_space(H100, precision="bf16-mixed", optimizer="adamw_torch", chunked_loss=False)
    assert plain.values("activation_offloading") == (False,)  # not by default
    assert OFFLOADING.saving is None  # never assumed by "nothing fits"' other ideas
    asked = build_space(H100, precision="bf16-mixed", optimizer="adamw_torch",
                        chunked_loss=False, activation_offloading=[False, True])
    combos = [(c["gradient_checkpointing"], c["activation_offloading"]) for c in asked.combos()]
    assert sorted(combos) == [(False, False), (True, False), (True, True)]
    with pytest.raises(BadInputError, match="search space is empty: activation offloading"):
        build_space(H100, activation_offloading=True, gradient_checkpointing=False)
    with pytest.raises(BadInputError, match="host memory already"):
        build_space(resolve_device("cpu"), activation_offloading=[False, True])


# ---------------------------------------------------------------- the memory rule

def test_the_device_keeps_what_is_offloaded_less_and_the_host_holds_it(tiny_llama):
    """The peak is at the start of backward (every block input saved): offloading takes the
    inputs off the device, and the pinned host memory holds exactly them (each a power of
    two here: 8 x 256 x 64 fp32 = 512 KiB, two blocks)."""
    inputs = 2 * 8 * 256 * 64 * 4
    got = _both(tiny_llama, OFFLOADED)
    for method, (off, on) in got.items():
        assert on.host_bytes == inputs and off.host_bytes == 0, method
        assert off.peak_allocated_bytes - on.peak_allocated_bytes == inputs, method
        assert on.peak_phase == "backward"
        assert any("pinned host memory" in n for n in on.notes)
        assert on.breakdown["activations"] < off.breakdown["activations"]
    a, s = got["analytic"][1], got["simulate"][1]
    assert abs(a.peak_allocated_bytes - s.peak_allocated_bytes) / s.peak_allocated_bytes < 0.03


def test_a_frozen_embeddings_output_stays_on_the_device(tiny_llama):
    """With LoRA the embedding is frozen: transformers makes its output a leaf that requires
    grad, held by autograd for the whole step, and llama passes that very tensor to the
    first block, so offloading it frees nothing there (both methods)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    block_input = 8 * 256 * 64 * 4
    for method, (off, on) in _both(model, OFFLOADED).items():
        assert on.host_bytes == 2 * block_input, method
        assert off.peak_allocated_bytes - on.peak_allocated_bytes == block_input, method


def test_offloading_never_adds_device_memory_where_the_peak_moves(tiny_llama):
    """In fp32 the peak moves to the recompute: offloading saves less than it moves to the
    host (or nothing), never more, by both methods, which agree within a few %."""
    got = _both(tiny_llama, OFFLOADED.replace(precision="32-true"))
    for method, (off, on) in got.items():
        saved = off.peak_allocated_bytes - on.peak_allocated_bytes
        assert 0 <= saved < on.host_bytes, (method, saved)
    a, s = got["analytic"][1], got["simulate"][1]
    assert abs(a.peak_allocated_bytes - s.peak_allocated_bytes) / s.peak_allocated_bytes < 0.12


def test_host_bytes_are_pinned_blocks_rounded_to_a_power_of_two():
    from autofit.memory.analytic import pinned_bytes

    assert [pinned_bytes(n) for n in (0, 1, 3 * MiB, 4 * MiB, 4 * MiB + 1)] == [
        0, 1, 4 * MiB, 4 * MiB, 8 * MiB]
    # tiny-llama: 4 blocks of (B*T, 512) fp32 inputs; 3 x 100 tokens -> 600 KiB -> 1 MiB each
    est = estimate("tiny-llama", OFFLOADED.replace(micro_batch_size=3), seq_len=100, device=H100)
    assert est.host_bytes == 4 * MiB
    assert "host_bytes" in est.to_dict()
    plain = estimate("tiny-llama", OFFLOADED.replace(activation_offloading=False), seq_len=100,
                     device=H100)
    assert plain.host_bytes == 0


def test_a_cpu_target_has_nothing_to_offload(tiny_llama):
    """``autofit check`` estimates a file on the device it is given; on a CPU it reports the
    refusal and counts no offloading (the activations are in host memory already)."""
    from autofit.memory.ranks import estimate_analytic
    from autofit.memory.simulate import simulate
    from autofit.probe.model import describe

    cpu = resolve_device("cpu")
    info = describe(tiny_llama, task="causal-lm")
    plain = OFFLOADED.replace(activation_offloading=False)
    on = estimate_analytic(info, OFFLOADED, 64, cpu)
    assert on.host_bytes == 0
    assert on.peak_allocated_bytes == estimate_analytic(info, plain, 64, cpu).peak_allocated_bytes
    sim = simulate(tiny_llama, OFFLOADED.replace(micro_batch_size=1), seq_len=16, device=cpu,
                   task="causal-lm")
    assert sim.host_bytes == 0


def test_the_simulation_leaves_torchs_save_on_cpu_in_place(tiny_llama):
    from torch.autograd.graph import save_on_cpu
    from transformers import modeling_utils

    estimate(tiny_llama, OFFLOADED.replace(micro_batch_size=1), seq_len=16, device=H100,
             method="simulate")
    assert modeling_utils.save_on_cpu is save_on_cpu


# ---------------------------------------------------------------- speed

def test_the_speed_model_charges_the_host_copies():
    from autofit.probe.model import probe_model
    from autofit.search.speed import predict_speed

    info = probe_model("meta-llama/Llama-3.2-1B")
    cfg = OFFLOADED.replace(micro_batch_size=4)
    on = predict_speed(info, cfg, 2048, H100)
    off = predict_speed(info, cfg.replace(activation_offloading=False), 2048, H100)
    moved = 16 * 4 * 2048 * 2048 * 4  # 16 blocks' (B*T, h) fp32 inputs, each way
    assert H100.host_link_gbs == 50  # PCIe gen5 x16, as pinned copies reach
    assert on.step_time_s - off.step_time_s == pytest.approx(2 * moved / 50e9)
    a100 = resolve_device("A100-80GB")
    assert a100.host_link_gbs == 25  # gen4: the copies take twice as long
    assert (predict_speed(info, cfg, 2048, a100).step_time_s
            - predict_speed(info, cfg.replace(activation_offloading=False), 2048,
                            a100).step_time_s) == pytest.approx(2 * moved / 25e9)


# ---------------------------------------------------------------- emitted fields

def test_emit_and_read_round_trip():
    from autofit.emit import training_arguments_dict
    from autofit.emit.training_args import config_from_arguments

    args = training_arguments_dict(OFFLOADED)
    assert args["activation_checkpointing"] is True
    assert args["activation_checkpointing_kwargs"] == {"use_reentrant": False, "offload": True}
    assert config_from_arguments(args) == OFFLOADED.replace(seq_len=None)
    # turned off again over a user's file that offloaded: the key goes
    off = training_arguments_dict(OFFLOADED.replace(activation_offloading=False), base=args)
    assert off["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    assert OFFLOADING.read(off) is False
    # transformers offloads only where it checkpoints; a JSON string reads too
    assert OFFLOADING.read({"activation_checkpointing": False,
                            "activation_checkpointing_kwargs": {"offload": True}}) is False
    assert OFFLOADING.read({"activation_checkpointing": True,
                            "activation_checkpointing_kwargs": '{"offload": true}'}) is True
    assert [k.name for k in KNOBS].index("activation_offloading") > KNOBS.index(CHECKPOINTING)


def test_a_plan_for_a_cuda_card_writes_the_field_and_loads_with_hfargumentparser(tmp_path):
    """Planned here (no GPU) for a catalog card: the tuned file offloads, and
    HfArgumentParser reads it back (the run itself needs the card)."""
    from autofit import autofit

    rng = random.Random(0)
    data = [{"input_ids": [rng.randrange(500) for _ in range(64)]} for _ in range(8)]
    r = autofit("tiny-llama", data, device="H100-80GB", target_batch_size=8, cache=None,
                precision=["bf16-mixed"], optimizer=["adamw_torch"], chunked_loss=False,
                activation_offloading=True)
    assert r.config.activation_offloading and r.config.gradient_checkpointing
    assert r.estimate.host_bytes > 0 and not r.confirmed
    kw = r.training_arguments_kwargs
    assert kw["activation_checkpointing_kwargs"] == {"use_reentrant": False, "offload": True}
    assert any(x.startswith("activation offloading: saves") and "pinned host memory" in x
               for x in r.reasons)
    path = r.save(tmp_path / "tuned.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (ta,) = _parse_on_this_machine(path, tmp_path)
    assert ta.activation_checkpointing is True
    assert ta.activation_checkpointing_kwargs == {"use_reentrant": False, "offload": True}
    from autofit.preflight import config_of

    assert config_of(ta).activation_offloading is True


def _parse_on_this_machine(path, tmp_path):
    """The tuned file through ``HfArgumentParser.parse_yaml_file``; bf16 cannot be built
    without a bf16 GPU, so on a CPU-only machine a copy with bf16 off (use_cpu) is read, every
    other field as written."""
    import torch
    import yaml
    from transformers import HfArgumentParser, TrainingArguments

    if not torch.cuda.is_available():
        fields = yaml.safe_load(path.read_text())
        fields.update(bf16=False, use_cpu=True)
        path = tmp_path / "here.yaml"
        path.write_text(yaml.safe_dump(fields))
    return HfArgumentParser(TrainingArguments).parse_yaml_file(str(path))


@pytest.mark.slow
def test_nothing_fits_offers_it_on_a_cuda_card():
    """49k-token samples, LoRA on a 1B Llama on an L4: checkpointed inputs (15 x 384 MiB)
    do not fit; held in host memory they do, and "nothing fits" says so with the number."""
    from autofit import autofit
    from autofit.errors import DoesNotFitError

    data = [{"input_ids": [1] * 49152}] * 2
    with pytest.raises(DoesNotFitError) as e:
        autofit("meta-llama/Llama-3.2-1B", data, device="L4", lora={"r": 16},
                precision=["bf16-mixed"], optimizer=["adamw_torch"], chunked_loss=True,
                gradient_checkpointing=True, margin=0.1, cache=None)
    msg = str(e.value)
    assert "activations offloaded (activation_offloading=[True]" in msg and "\n" not in msg
    import re

    offered = re.search(r"activations offloaded \(.*?\) ~([0-9.]+) GiB", msg)
    # under the 90% budget, and about what the simulated step needs (the least capacity its
    # allocation stream runs in, 14.95 GiB, + the context)
    assert offered and 15 < float(offered.group(1)) < 19.8
