"""QuantSpec: how a base is quantized, read from what callers give; errors in one line."""

from __future__ import annotations

import json

import pytest
import torch

from autofit.errors import BadInputError, on_command_line
from autofit.probe.model import build_model, describe, fingerprint, probe_model
from autofit.probe.quant import QuantSpec, check_precision, resolve, spec_of_module

pytest.importorskip("bitsandbytes")


def test_shorthands() -> None:
    four = resolve(load_in_4bit=True)
    assert (four.bits, four.quant_type, four.double_quant, four.compute_dtype) == (
        4, "nf4", False, "bfloat16")
    eight = resolve(load_in_8bit=True)
    assert (eight.bits, eight.quant_type, eight.compute_dtype, eight.llm_int8_threshold) == (
        8, None, "float32", 6.0)
    assert resolve() is None


def test_overrides_of_the_command_line() -> None:
    spec = resolve(load_in_4bit=True, quant_type="fp4", compute_dtype="fp32", double_quant=True)
    assert (spec.quant_type, spec.compute_dtype, spec.double_quant) == ("fp4", "float32", True)
    # an 8-bit base's load dtype
    assert resolve(load_in_8bit=True, compute_dtype="bf16").compute_dtype == "bfloat16"


def test_bits_and_bytes_config_round_trip() -> None:
    from transformers import BitsAndBytesConfig

    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float16)
    spec = QuantSpec.read(qc)
    assert (spec.bits, spec.quant_type, spec.double_quant, spec.compute_dtype) == (
        4, "nf4", True, "float16")
    assert QuantSpec.read(spec.to_bnb_config()) == spec
    assert QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    # transformers' own defaults when a config says only load_in_4bit
    plain = QuantSpec.read({"load_in_4bit": True})
    assert (plain.quant_type, plain.compute_dtype) == ("fp4", "float32")
    eight = QuantSpec.read(BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0,
                                              llm_int8_skip_modules=["fc"]))
    assert (eight.bits, eight.llm_int8_threshold, eight.skip_modules) == (8, 0.0, ("fc",))


def test_key_differs_by_what_changes_memory() -> None:
    keys = {resolve(load_in_4bit=True).key, resolve(load_in_4bit=True, double_quant=True).key,
            resolve(load_in_4bit=True, compute_dtype="fp32").key, resolve(load_in_8bit=True).key}
    assert len(keys) == 4
    assert resolve(load_in_4bit=True).key == QuantSpec.read(
        {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
         "bnb_4bit_compute_dtype": "bfloat16"}).key


def test_read_from_files(tmp_path) -> None:
    f = tmp_path / "q.json"
    f.write_text(json.dumps({"load_in_8bit": True, "llm_int8_threshold": 3.0}))
    assert QuantSpec.read(str(f)).llm_int8_threshold == 3.0
    # a saved model's config.json (its directory too) carries its quantization_config
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "llama", "quantization_config": {"load_in_4bit": True,
                                                        "bnb_4bit_quant_type": "nf4"}}))
    assert QuantSpec.read(model).quant_type == "nf4"
    assert QuantSpec.read('{"load_in_4bit": true}').bits == 4


def test_a_checkpoint_saved_quantized_brings_its_spec(tmp_path) -> None:
    from autofit.probe.model import load_config

    cfg = load_config("tiny-llama").to_dict()
    cfg["quantization_config"] = {"load_in_8bit": True, "quant_method": "bitsandbytes"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    info = probe_model(str(tmp_path), lora={"r": 8})
    assert info.quant is not None and info.quant.bits == 8
    # an explicit request must agree with it
    with pytest.raises(BadInputError, match="disagrees"):
        probe_model(str(tmp_path), load_in_4bit=True,
                    quantization_config={"load_in_8bit": True})


@pytest.mark.parametrize(("value", "match"), [
    ({"load_in_4bit": True, "load_in_8bit": True}, "both load_in_4bit and load_in_8bit"),
    ({"load_in_4bit": False}, "neither load_in_4bit nor load_in_8bit"),
    ({"load_in_4bit": True, "bnb_4bit_quant_typ": "nf4"}, "unknown key.*bnb_4bit_quant_typ"),
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not modelled"),
    ({"load_in_8bit": True, "llm_int8_has_fp16_weight": True}, "llm_int8_has_fp16_weight"),
    ({"load_in_8bit": True, "llm_int8_enable_fp32_cpu_offload": True}, "cpu_offload"),
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "nf4 or fp4"),
    ({"load_in_4bit": True, "bnb_4bit_compute_dtype": "int8"}, "not a dtype"),
    ({"load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}, "quant_storage"),
    ({"load_in_8bit": True, "llm_int8_threshold": -1}, "threshold"),
    ("{not json", "not valid JSON"),
    ("/no/such/file.json", "neither a JSON file"),
    (3, "must be a transformers.BitsAndBytesConfig"),
])
def test_bad_configs_say_what_to_do(value, match) -> None:
    with pytest.raises(BadInputError, match=match) as e:
        QuantSpec.read(value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("kwargs", "python", "cli"), [
    (dict(load_in_4bit=True, load_in_8bit=True), "load_in_4bit=True or load_in_8bit=True",
     "--load-in-4bit or --load-in-8bit"),
    (dict(quant_type="nf4"), "add load_in_4bit=True", "add --load-in-4bit"),
    (dict(load_in_8bit=True, double_quant=True), "bnb_4bit_use_double_quant applies to 4-bit",
     "--bnb-4bit-use-double-quant applies to 4-bit"),
    (dict(load_in_8bit=True, quantization_config={"load_in_4bit": True}),
     "load_in_8bit=True disagrees", "--load-in-8bit disagrees"),
])
def test_conflicts_name_the_callers_own_options(kwargs, python, cli) -> None:
    with pytest.raises(BadInputError, match=python):
        resolve(**kwargs)
    with on_command_line(), pytest.raises(BadInputError, match=cli):
        resolve(**kwargs)


def test_meta_build_is_what_from_pretrained_loads() -> None:
    """Linear layers bitsandbytes', the output head kept, the rest in the compute dtype."""
    import bitsandbytes as bnb

    spec = resolve(load_in_4bit=True, double_quant=True, compute_dtype="bf16")
    module, task = build_model("tiny-llama", quantization_config=spec, lora={"r": 8})
    base = module.get_base_model()
    q = base.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q, bnb.nn.Linear4bit) and q.weight.compress_statistics
    assert q.weight.dtype == torch.bfloat16  # what from_pretrained quantizes
    assert type(base.lm_head) is torch.nn.Linear and base.lm_head.weight.dtype == torch.bfloat16
    info = describe(module, task=task)
    assert info.quant == spec and info.quantization == "4bit" and info.dtype == "bfloat16"
    assert spec_of_module(module) == spec
    eight, _ = build_model("tiny-gpt2", load_in_8bit=True, lora={"r": 8})
    assert isinstance(eight.get_base_model().transformer.h[0].mlp.c_fc.base_layer,
                      bnb.nn.Linear8bitLt)


def test_fingerprint_includes_the_spec() -> None:
    a = probe_model("tiny-llama", load_in_4bit=True, lora={"r": 8})
    b = probe_model("tiny-llama", lora={"r": 8},
                    quantization_config=resolve(load_in_4bit=True, double_quant=True))
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(probe_model("tiny-llama", load_in_4bit=True,
                                                     lora={"r": 8}))


def test_a_module_is_never_quantized() -> None:
    module, _ = build_model("tiny-llama")
    with pytest.raises(BadInputError, match="model given by name"):
        build_model(module, load_in_8bit=True)


def test_half_true_precision_must_be_the_base_dtype() -> None:
    spec = resolve(load_in_4bit=True)  # bfloat16
    check_precision(spec, "bfloat16", "bf16-true")
    check_precision(spec, "bfloat16", "32-true")  # no cast: the base stays as it is
    check_precision(spec, "bfloat16", "bf16-mixed")
    with pytest.raises(BadInputError, match="cannot be cast.*bnb_4bit_compute_dtype"):
        check_precision(spec, "float32", "bf16-true")
    check_precision(None, "float32", "bf16-true")


def test_device_without_bf16() -> None:
    """QLoRA's shorthand computes in fp16 where the device has no bf16; asking for bf16
    there is refused, and so is autocasting a 16-bit base to the other 16-bit type."""
    from autofit.errors import UnsupportedPrecisionError
    from autofit.probe.device import resolve_device

    t4, a100 = resolve_device("T4"), resolve_device("A100-80GB")
    assert resolve(load_in_4bit=True, device=t4).compute_dtype == "float16"
    assert resolve(load_in_4bit=True, device=a100).compute_dtype == "bfloat16"
    # the shorthand resolved early (the command line) still follows the device
    assert resolve(quantization_config=resolve(load_in_4bit=True), device=t4).compute_dtype \
        == "float16"
    assert resolve(load_in_4bit=True) == resolve(load_in_4bit=True, compute_dtype="bf16")
    with pytest.raises(UnsupportedPrecisionError, match="T4 does not support bf16"):
        resolve(load_in_4bit=True, compute_dtype="bf16", device=t4)
    with pytest.raises(BadInputError, match="autocasts to float16 a base loaded in bfloat16"):
        check_precision(resolve(load_in_4bit=True), "bfloat16", "16-mixed")
    check_precision(resolve(load_in_8bit=True), "float32", "16-mixed")  # fp32 base: any
