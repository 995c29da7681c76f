"""Quantized bases (bitsandbytes 8-bit LLM.int8 and 4-bit nf4/fp4): both estimators against
a real step of a real quantized model on the CPU.

The real step runs a tiny llama loaded as a user loads it (``from_pretrained`` with a
``BitsAndBytesConfig``, on the CPU) through the Trainer's step, its storages counted at
the dispatch level on the real tensors — a sanity check of what the estimators model;
the independent truth is the accuracy benchmark (peak RSS of isolated processes,
``benchmarks/measure_cpu.py``, the ``*-int8-*``, ``*-nf4*`` and ``*-fp4-*`` rows).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from autofit import TrainConfig, estimate
from autofit.memory.analytic import (
    kept_input_bytes,
    quantized_weight_bytes,
    weights_bytes,
)
from autofit.memory.simulate._bnb import bnb_target
from autofit.memory.simulate._model import prepare_for_training, weight_tensors
from autofit.memory.simulate._recorder import StorageRecorder
from autofit.memory.simulate._step import StepTarget, build_optimizer, run_steps
from autofit.probe.device import resolve_device
from autofit.probe.model import probe_model
from autofit.probe.quant import resolve

pytest.importorskip("bitsandbytes")

MiB = 2**20
LORA = {"r": 8, "target_modules": ["q_proj", "v_proj"]}
INT8 = {"load_in_8bit": True}
NF4_DQ = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
          "bnb_4bit_compute_dtype": "float32"}
FP4_BF16 = {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4",
            "bnb_4bit_compute_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-llama (fp32, seeded) saved as a checkpoint, to be loaded back quantized."""
    from transformers import AutoModelForCausalLM

    from autofit.probe.model import load_config

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(load_config("tiny-llama")).save_pretrained(path)
    return path


def _loaded(path, q: dict) -> torch.nn.Module:
    """What a user's script trains: the base loaded quantized in its compute dtype, LoRA."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    spec = resolve(quantization_config=q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=BitsAndBytesConfig(**{**q, "bnb_4bit_compute_dtype":
                                                             spec.torch_dtype}),
            device_map="cpu", dtype=spec.torch_dtype)
        return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))


def _real_step(model: torch.nn.Module, config: TrainConfig, seq_len: int,
               steps: int = 2) -> tuple[int, int, int]:
    """(peak, weights, alive at the end of the first forward) bytes of ``steps`` real
    Trainer steps of a copy of ``model`` on the CPU, its storages counted as they are
    allocated and freed."""
    work = copy.deepcopy(model)
    prepare_for_training(work, gradient_checkpointing=config.gradient_checkpointing)
    rec = StorageRecorder()
    weights = sum(rec.track(t, "weights").size for t in weight_tensors(work))
    target = StepTarget("cpu")
    optimizer = build_optimizer(work, config, target)
    with warnings.catch_warnings(), rec, bnb_target(work, rec, "cpu"):
        warnings.simplefilter("ignore")
        run_steps(work, optimizer, config, task="causal-lm", seq_len=seq_len, rec=rec,
                  target=target, steps=steps)
    live = peak = 0
    forward_end = None
    for kind, r, phase in rec.events():
        if not r.storage:  # the autograd graph's host bytes, a kernel's workspace: no tensor
            continue
        if phase == "backward" and forward_end is None:
            forward_end = live - weights
        live += r.size if kind == "alloc" else -r.size
        peak = max(peak, live)
    return peak, weights, forward_end


@pytest.mark.half
@pytest.mark.parametrize(("q", "config"), [
    (INT8, TrainConfig(micro_batch_size=2)),
    (INT8, TrainConfig(micro_batch_size=2, gradient_checkpointing=True)),
    (NF4_DQ, TrainConfig(micro_batch_size=2, precision="bf16-mixed")),
    (FP4_BF16, TrainConfig(micro_batch_size=2, gradient_checkpointing=True)),
])
def test_estimates_match_a_real_quantized_step(saved, q, config, monkeypatch) -> None:
    seq = 128
    real, real_weights, _ = _real_step(_loaded(saved, q), config, seq)
    kw = dict(seq_len=seq, device="cpu", lora=LORA, quantization_config=q)
    # both estimates without the math libraries' caches, which are no tensor (the simulated
    # one counts the step's 16-bit matmul shapes for them: tests/memory/test_analytic.py)
    for where in ("autofit.memory.analytic._cpu_cache", "autofit.memory.analytic._closed_form"):
        monkeypatch.setattr(f"{where}.cpu_library_cache_bytes", lambda *a, **k: 0)
        monkeypatch.setattr(f"{where}.cpu_library_once_bytes", lambda *a, **k: 0)
    # nor the autograd graph's host memory (no tensor either: the real step counts tensors)
    monkeypatch.setattr("autofit.memory.simulate._step._host_bytes", lambda *a, **k: 0)
    sim = estimate("tiny-llama", config, method="simulate", **kw)
    ana = estimate("tiny-llama", config, **kw)
    # the weights as loaded: packed / int8 values, their quantization states, the rest in
    # the compute dtype (same storages, byte for byte)
    assert sim.breakdown["weights"] >= real_weights * 0.999
    assert abs(weights_bytes(probe_model("tiny-llama", lora=LORA, quantization_config=q),
                             config) - real_weights) <= 64 * 1024
    # the fake step runs bitsandbytes' own layers: the same peak as the real step (the
    # simulated one replayed through the CPU allocator model: page rounding); the closed
    # form within 3%
    # (the real step counts tensors: the simulated heap's holes between small ones, which
    # a CPU step holds as well, are its overhead)
    sim_peak = sim.peak_allocated_bytes - sim.breakdown["overhead"]
    ana_peak = ana.peak_allocated_bytes
    assert abs(sim_peak / real - 1) < 0.003, (sim_peak, real)
    assert abs(ana_peak / real - 1) < 0.03, (ana_peak, real)


@pytest.mark.half
def test_int8_layers_keep_their_inputs_past_checkpointing(saved) -> None:
    """LLM.int8's autograd node holds its input (``ctx.A``), which checkpointing's hooks do
    not see: with checkpointing, a real 8-bit step holds at the end of its forward what the
    same 4-bit step (same dtypes) holds plus exactly what ``kept_input_bytes`` states."""
    seq = 128
    config = TrainConfig(micro_batch_size=2, gradient_checkpointing=True)
    kept8 = _real_step(_loaded(saved, INT8), config, seq, steps=1)[2]
    kept4 = _real_step(_loaded(saved, NF4_DQ), config, seq, steps=1)[2]
    info = probe_model("tiny-llama", lora=LORA, load_in_8bit=True)
    tokens, h, i = 2 * seq, info.hidden_size, info.intermediate_size
    # per llama block: the inputs of q (shared by k, v), o, gate (shared by up) and down
    rule = kept_input_bytes(info, tokens, 4)
    assert rule == info.num_layers * tokens * (3 * h + i) * 4
    assert kept8 - kept4 == rule
    assert kept_input_bytes(probe_model("tiny-llama", lora=LORA, load_in_4bit=True),
                           tokens, 4) == 0


def _old_bitsandbytes(monkeypatch) -> None:
    """The step as bitsandbytes 0.42 ran it (autofit.probe.versions answers 0.42.0)."""
    from autofit.probe import versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version",
                        lambda p: "0.42.0" if p == "bitsandbytes" else real(p))


@pytest.mark.half
def test_old_4bit_layers_keep_their_inputs(saved, monkeypatch) -> None:
    """Up to bitsandbytes 0.43.1 a 4-bit layer kept its input in its autograd node too
    (``MatMul4Bit``: ``ctx.tensors = (A, B)``; QLoRA's "memory bug", PR #1270): the step of
    such a bitsandbytes, with checkpointing, holds at the end of its forward exactly what
    ``kept_input_bytes`` states more than today's, and both estimators add it."""
    seq = 128
    config = TrainConfig(micro_batch_size=2, gradient_checkpointing=True)
    model = _loaded(saved, NF4_DQ)
    kw = dict(seq_len=seq, device="cpu", lora=LORA, quantization_config=NF4_DQ)
    new = _real_step(model, config, seq, steps=1)[2]
    new_est = {m: estimate("tiny-llama", config, method=m, **kw).peak_allocated_bytes
               for m in ("analytic", "simulate")}
    _old_bitsandbytes(monkeypatch)
    old = _real_step(model, config, seq, steps=1)[2]
    info = probe_model("tiny-llama", lora=LORA, quantization_config=NF4_DQ)
    tokens, h, i = 2 * seq, info.hidden_size, info.intermediate_size
    rule = kept_input_bytes(info, tokens, 4)
    assert rule == info.num_layers * tokens * (3 * h + i) * 4
    assert old - new == rule
    for m in ("analytic", "simulate"):
        grown = estimate("tiny-llama", config, method=m, **kw).peak_allocated_bytes - new_est[m]
        assert abs(grown - rule) <= 0.02 * rule, (m, grown, rule)


def test_quantized_weight_rules() -> None:
    from autofit.probe.model import ParamGroup

    g = ParamGroup(shape=(1376, 512), count=1, dtype="bfloat16", trainable=False,
                   quantized="4bit", role="linear")
    n = 1376 * 512
    plain = resolve(load_in_4bit=True)
    nested = resolve(load_in_4bit=True, double_quant=True)
    assert quantized_weight_bytes(g, plain) == n // 2 + n // 64 * 4 + 64
    blocks = n // 64
    assert quantized_weight_bytes(g, nested) == (n // 2 + blocks + math.ceil(blocks / 256) * 4
                                                 + 1024 + 4 + 64)
    fp4 = resolve(load_in_4bit=True, quant_type="fp4")
    assert quantized_weight_bytes(g, fp4) == quantized_weight_bytes(g, plain)  # same size
    g8 = ParamGroup(shape=(1376, 512), count=1, dtype="float32", trainable=False,
                    quantized="8bit", role="linear")
    assert quantized_weight_bytes(g8, resolve(load_in_8bit=True)) == n + 1376 * 4


def test_compute_dtype_sets_the_base_and_its_activations() -> None:
    """bf16 vs fp32 compute: the base (embeddings, head) and the activations in that dtype."""
    config = TrainConfig(micro_batch_size=4)
    kw = dict(seq_len=256, device="cpu", lora=LORA)
    f32 = estimate("tiny-llama", config, quantization_config={**NF4_DQ}, **kw)
    b16 = estimate("tiny-llama", config,
                   quantization_config={**NF4_DQ, "bnb_4bit_compute_dtype": "bfloat16"}, **kw)
    assert b16.breakdown["weights"] < 0.6 * f32.breakdown["weights"]
    assert b16.breakdown["activations"] < 0.9 * f32.breakdown["activations"]


def test_cuda_target_runs_matmul8bitlt() -> None:
    """On a CUDA target the 8-bit layers train through MatMul8bitLt (int8 GEMM into int32,
    fp16 dequantization), which allocates more in forward than the CPU's path."""
    config = TrainConfig(micro_batch_size=2)
    from autofit.memory.simulate import Simulator
    from autofit.probe.model import build_model

    module, task = build_model("tiny-llama", lora=LORA, load_in_8bit=True)
    cuda = Simulator(module, task=task, device=resolve_device("H100-80GB")).events(config,
                                                                                    seq_len=64)
    cpu = Simulator(module, task=task, device=resolve_device("cpu")).events(config, seq_len=64)
    # the fp16 dequantization of the gate/up GEMMs, (2 x 64 tokens, 1376) x 2 bytes: CUDA only
    size = 2 * 64 * 1376 * 2
    assert any(e.kind == "alloc" and e.size == size and e.phase == "forward" for e in cuda)
    assert not any(e.kind == "alloc" and e.size == size and e.phase == "forward" for e in cpu)
    # (the forward's temporaries: a CPU step also holds its autograd graph's host memory,
    # node by node, as activations)
    forward = [sum(e.kind == "alloc" and e.phase == "forward" and e.category == "temporaries"
                   for e in ev) for ev in (cuda, cpu)]
    assert forward[0] > forward[1]
    import bitsandbytes as bnb
    from bitsandbytes.autograd._functions import matmul

    assert bnb.matmul is matmul  # restored after the simulation
