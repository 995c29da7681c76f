"""Trials of a quantized base given by reference: built quantized on the device itself.

On the CPU (here) the base is built from its config with bitsandbytes' layers and each
layer's weight is drawn and quantized in place; on an accelerator a checkpoint is loaded
with ``from_pretrained(..., quantization_config=..., device_map={"": index})`` (mocked
here: this machine has no GPU).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from autofit import TrainConfig, estimate
from autofit.errors import BadInputError
from autofit.memory.simulate._recorder import StorageRecorder
from autofit.probe.quant import resolve
from autofit.trial import measure
from autofit.trial.model import ModelRef, is_quantized_model, materialize

pytest.importorskip("bitsandbytes")

LORA = {"r": 8, "target_modules": ["q_proj", "v_proj"]}


class _HostRecorder(StorageRecorder):
    """Storages with memory behind them (meta tensors are free: left out)."""

    def track(self, t, category=None):
        return None if t.device.type == "meta" else super().track(t, category)


def _peak(rec: StorageRecorder) -> tuple[int, int]:
    live = peak = 0
    for kind, r, _ in rec.events():
        live += r.size if kind == "alloc" else -r.size
        peak = max(peak, live)
    return peak, live


def test_an_8bit_trial_on_a_capped_cpu_matches_the_estimate():
    """The feature end to end: a trial of an 8-bit base by name runs (in a capped child,
    single-threaded) and its measured peak is what both estimators say."""
    config = TrainConfig(micro_batch_size=2)
    r = measure("tiny-llama", config, seq_len=64, device="cpu:2GiB", load_in_8bit=True,
                lora=LORA, measure_steps=1)
    assert r.fits and r.error is None, r.error
    kw = dict(seq_len=64, device="cpu", load_in_8bit=True, lora=LORA)
    for method in ("analytic", "simulate"):
        est = estimate("tiny-llama", config, method=method, **kw)
        # NB: the child's RSS also holds the math libraries' caches (~1-3%, simulate.py)
        assert -0.01 < r.peak_allocated_bytes / est.peak_allocated_bytes - 1 < 0.06, method


@pytest.mark.half
@pytest.mark.parametrize("bits", [4])  # 8 bits: refused (tests/test_bad_input.py)
def test_dora_on_a_quantized_base_is_estimated_and_its_trial_runs(bits):
    """QDoRA (issue 23): peft initialises DoRA's magnitudes from the dequantized weights, and
    dequantizes every layer's weight again in each forward. The meta build gives them a
    stand-in, the simulation dequantizes the fake packed weights as peft does, a trial's
    real base is dequantized by peft itself; the trial's peak is what both estimators say
    (the independent harness: tests/memory/test_measured_rows.py)."""
    dora = {"peft_type": "LORA", "use_dora": True, "r": 8, "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"]}
    quant = {"load_in_4bit": True} if bits == 4 else {"load_in_8bit": True}
    config = TrainConfig(micro_batch_size=2)
    r = measure("tiny-llama", config, seq_len=64, device="cpu:2GiB", peft_config=dora,
                measure_steps=1, **quant)
    assert r.fits and r.error is None, r.error
    for method in ("analytic", "simulate"):
        est = estimate("tiny-llama", config, seq_len=64, device="cpu", method=method,
                       peft_config=dora, **quant)
        assert -0.01 < r.peak_allocated_bytes / est.peak_allocated_bytes - 1 < 0.06, method
    # and on a card (the CUDA simulation of the 4-bit dequantization in every forward)
    card = estimate("tiny-llama", config, seq_len=64, device="A100-80GB", method="simulate",
                    peft_config=dora, **quant)
    plain = estimate("tiny-llama", config, seq_len=64, device="A100-80GB", method="simulate",
                     peft_config={**dora, "use_dora": False}, **quant)
    assert card.peak_allocated_bytes > plain.peak_allocated_bytes


def test_the_base_is_built_quantized_on_the_device_one_layer_at_a_time():
    """Materializing a 4-bit base from a config never holds the model in full precision:
    at any moment at most one layer's weight exists unquantized."""
    spec = resolve(load_in_4bit=True, compute_dtype="fp32")
    ref = ModelRef("tiny-llama", task="causal-lm", lora=LORA, quant=spec)
    rec = _HostRecorder()
    with warnings.catch_warnings(), rec:
        warnings.simplefilter("ignore")
        model = materialize(ref, torch.device("cpu"))
    peak, live = _peak(rec)
    import bitsandbytes as bnb

    q = model.get_base_model().model.layers[0].mlp.down_proj
    assert isinstance(q, bnb.nn.Linear4bit) and q.weight.bnb_quantized
    assert q.weight.dtype == torch.uint8 and q.weight.quant_state.dtype == torch.float32
    assert is_quantized_model(model)
    largest = 512 * 1376 * 4  # one fp32 (out, in) weight, drawn then quantized
    fp32_linears = sum(m.in_features * m.out_features * 4 for m in model.modules()
                       if isinstance(m, bnb.nn.Linear4bit))
    assert peak <= live + largest + 64 * 1024
    assert peak < live + fp32_linears / 4
    # the weights are real draws (a trial's activations must not be all zeros)
    w = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state)
    assert 0.01 < float(w.std()) < 0.03


def test_cuda_builds_from_pretrained_on_the_device(tmp_path, monkeypatch):
    """On an accelerator a checkpoint is loaded quantized straight onto it: one
    ``from_pretrained`` call with the spec's BitsAndBytesConfig, the device map and the
    compute dtype, and no full-precision copy on the host."""
    import transformers

    from autofit.probe.model import build_model, load_config

    (tmp_path / "config.json").write_text(json.dumps(load_config("tiny-llama").to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"")  # weights are there (not read: mocked)
    spec = resolve(load_in_4bit=True, double_quant=True)
    calls = []

    def from_pretrained(ref, **kwargs):
        calls.append((ref, kwargs))
        module, _ = build_model("tiny-llama", quantization_config=spec)  # meta: no memory
        return module

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        staticmethod(from_pretrained))
    rec = _HostRecorder()
    with rec:
        model = materialize(ModelRef(str(tmp_path), task="causal-lm", quant=spec),
                            torch.device("cuda", 1))
    assert len(calls) == 1
    ref, kwargs = calls[0]
    assert ref == str(tmp_path) and kwargs["device_map"] == {"": 1}
    assert kwargs["dtype"] == torch.bfloat16
    qc = kwargs["quantization_config"]
    assert isinstance(qc, transformers.BitsAndBytesConfig)
    assert qc.load_in_4bit and qc.bnb_4bit_use_double_quant and qc.bnb_4bit_quant_type == "nf4"
    assert _peak(rec)[0] < 64 * 1024  # nothing of the model's size on the host
    assert is_quantized_model(model)


def test_cuda_without_weights_builds_from_the_config(tmp_path, monkeypatch):
    """A config (or a bundled name) has no weights: no from_pretrained, the config path."""
    import transformers

    import autofit.trial.model as trial_model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        staticmethod(lambda *a, **k: pytest.fail("from_pretrained called")))
    built = []
    monkeypatch.setattr(trial_model, "_materialize_meta",
                        lambda module, device: built.append(device))
    monkeypatch.setattr(trial_model, "_quantize_layers",
                        lambda module, spec, device: built.append(spec))
    spec = resolve(load_in_8bit=True)
    materialize(ModelRef("tiny-llama", task="causal-lm", quant=spec), torch.device("cuda", 0))
    assert built == [torch.device("cuda", 0), spec]


def test_a_half_true_precision_of_another_dtype_is_refused():
    with pytest.raises(BadInputError, match="cannot be cast"):
        measure("tiny-llama", TrainConfig(micro_batch_size=1, precision="bf16-true"),
                seq_len=16, device="cpu", load_in_8bit=True, lora=LORA)
