import json
import resource

import pytest
import torch

from autofit.errors import (
    BadInputError,
    UnknownModelError,
    UnknownTaskError,
)
from autofit.probe.model import LoraSpec, bundled_models, describe, load_config, probe_model


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def test_pretrained_model(tiny_llama):
    info = probe_model(tiny_llama)
    assert info.num_params == _numel(tiny_llama)
    assert info.trainable_params == info.num_params and info.frozen_params == 0
    assert (info.model_type, info.task, info.num_layers) == ("llama", "causal-lm", 2)
    assert (info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim) == (64, 4, 2, 16)
    assert info.intermediate_size == 160 and info.vocab_size == 512
    assert info.attn_implementation == "sdpa" and not info.tie_word_embeddings
    b = info.blocks[0]
    assert b.gated_mlp and b.norm == "rmsnorm" and b.num_norms == 2
    names = [n.rsplit(".", 1)[-1] for n, *_ in b.linears]
    assert names == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    shares = {n.rsplit(".", 1)[-1]: s for n, _, _, s in b.linears}
    assert shares["k_proj"] and shares["v_proj"] and shares["up_proj"] and not shares["o_proj"]


def test_probe_reads_and_never_modifies(tiny_llama):
    before = {k: v.clone() for k, v in tiny_llama.state_dict().items()}
    flags = [p.requires_grad for p in tiny_llama.parameters()]
    tiny_llama.eval()
    probe_model(tiny_llama)
    assert not tiny_llama.training
    assert [p.requires_grad for p in tiny_llama.parameters()] == flags
    for k, v in tiny_llama.state_dict().items():
        assert torch.equal(v, before[k])


def test_plain_module():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    info = probe_model(m)
    assert info.num_params == 8 * 16 + 16 + 16 * 2 + 2
    assert info.model_type == "custom" and not info.is_transformer


def test_frozen_params_counted(tiny_llama):
    for p in tiny_llama.model.embed_tokens.parameters():
        p.requires_grad_(False)
    info = probe_model(tiny_llama)
    assert info.frozen_params == 512 * 64
    assert info.trainable_params == info.num_params - 512 * 64


def test_peft_model(tiny_llama):
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(tiny_llama, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    info = probe_model(pm)
    # A: (r, in), B: (out, r) per target per layer
    lora = 2 * (4 * 64 + 64 * 4) + 2 * (4 * 64 + 32 * 4)
    assert info.trainable_params == lora
    assert info.peft == "lora" and info.lora_r == 4 and info.lora_targets == ("q_proj", "v_proj")
    assert info.model_type == "llama" and info.num_layers == 2


def test_lora_by_name_on_meta():
    info = probe_model("tiny-llama", lora=LoraSpec(r=8, target_modules=("q_proj", "v_proj")))
    # tiny-llama: hidden 512, kv width 256, 4 layers
    assert info.trainable_params == 4 * (8 * 512 + 512 * 8 + 8 * 512 + 256 * 8)
    all_linear = probe_model("tiny-llama", lora={"r": 8}).lora_targets  # peft expands all-linear
    assert set(all_linear) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"}


def test_bundled_names():
    names = bundled_models()
    assert {"tiny-llama", "tiny-gpt2", "tiny-bert", "tiny-t5", "meta-llama/Llama-3.1-8B"} <= set(names)


def test_llama_8b_counts():
    info = probe_model("meta-llama/Llama-3.1-8B")
    assert info.num_params == 8_030_261_248  # the published parameter count


def test_70b_on_meta_takes_no_memory():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    info = probe_model("meta-llama/Llama-3.1-70B")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert info.num_params == 70_553_706_496
    assert grown_kib < 512 * 1024  # far below the 282 GB of its fp32 weights


@pytest.mark.parametrize("name,task,model_type,cross", [
    ("tiny-gpt2", "causal-lm", "gpt2", False),
    ("tiny-bert", "masked-lm", "bert", False),
    ("tiny-t5", "seq2seq", "t5", True),
])
def test_tasks_by_default(name, task, model_type, cross):
    info = probe_model(name)
    assert (info.task, info.model_type) == (task, model_type)
    assert any(b.cross_attention for b in info.blocks) is cross


def test_seq_cls_task():
    info = probe_model("tiny-bert", task="seq-cls")
    assert info.task == "seq-cls" and info.architecture == "BertForSequenceClassification"
    assert info.num_labels == 2


def test_token_cls_task():
    info = probe_model("tiny-bert", task="token-cls")
    assert info.task == "token-cls" and info.architecture == "BertForTokenClassification"
    assert info.num_labels == 2 and info.head_numel == 0 and not info.lm_logits


def test_the_heads_vocabulary_wide_columns_are_its_own_not_a_blocks():
    """MobileBERT's head multiplies by its tied embedding and a (hidden - 128, vocabulary)
    weight stacked: that weight is the head's (``head_columns``, in ``head_numel``); a
    block's linear that happens to be as wide as the vocabulary (a feed-forward 1024 ->
    256 beside a 1024-token vocabulary) is not, and LoRA on the stacked weight adds no
    head (its adapter never runs: the head reads the weight alone)."""
    import torch
    import transformers
    from peft import LoraConfig

    from autofit.probe.model import describe
    from autofit.probe.peft import apply_peft

    def on_meta(model_type: str, auto: type, intermediate: int) -> torch.nn.Module:
        cfg = transformers.AutoConfig.for_model(
            model_type, hidden_size=256, intermediate_size=intermediate, num_attention_heads=4,
            num_hidden_layers=2, vocab_size=1024)
        with torch.device("meta"):
            return auto.from_config(cfg)

    m = on_meta("mobilebert", transformers.AutoModelForMaskedLM, 512)
    info = describe(m, task="masked-lm")
    assert info.head_columns == 128 * 1024 and info.head_columns_trained
    assert info.head_numel == 1024 * 128 + 128 * 1024
    lora = describe(apply_peft(m, LoraConfig(r=8, target_modules="all-linear")),
                    task="masked-lm")
    assert lora.head_columns == 128 * 1024 and not lora.head_columns_trained
    info = describe(on_meta("llama", transformers.AutoModelForCausalLM, 1024), task="causal-lm")
    assert info.head_columns == 0 and info.head_numel == 1024 * 256


def test_t5s_token_classifier_is_its_encoder_alone():
    # T5ForTokenClassification runs T5EncoderModel under an encoder-decoder's config: read as
    # an encoder-decoder, the analytic estimate charged T5's encoder + decoder pair per
    # encoder block (66% over)
    info = probe_model("tiny-t5", task="token-cls")
    assert not info.is_encoder_decoder
    assert {b.role for b in info.blocks} == {"encoder"}
    assert probe_model("tiny-t5", task="seq-cls").is_encoder_decoder


def _bert(cls_name: str, **config):
    import transformers

    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=128, **config)
    return getattr(transformers, cls_name)(cfg)


@pytest.mark.parametrize("cls_name,task", [
    ("BertForSequenceClassification", "seq-cls"),
    ("BertForTokenClassification", "token-cls"),
    ("BertForMaskedLM", "masked-lm"),
    ("BertLMHeadModel", "causal-lm"),
])
def test_a_modules_task_is_its_class_not_its_configs_architectures(cls_name, task):
    # a classifier fine-tuned from a masked LM keeps architectures=["BertForMaskedLM"] in its
    # config (from_pretrained("bert-base-uncased", num_labels=2)): estimated as a masked LM
    # its analytic peak was the LM head's and the simulation failed on the labels' shape
    from autofit.probe.loading import module_task

    model = _bert(cls_name, architectures=["BertForMaskedLM"], is_decoder=task == "causal-lm")
    assert module_task(model) == task
    assert probe_model(model).task == task


def test_a_peft_modules_task_is_its_bases_class():
    peft = pytest.importorskip("peft")
    from autofit.probe.loading import module_task

    model = peft.get_peft_model(_bert("BertForTokenClassification"), peft.LoraConfig(
        r=2, target_modules=["query"], task_type="TOKEN_CLS"))
    assert module_task(model) == "token-cls"


def test_default_task_reads_architectures_before_the_encoder_decoder_flag():
    import transformers

    from autofit.probe.loading import default_task

    bart = transformers.BartConfig(architectures=["BartForSequenceClassification"])
    assert default_task(bart) == "seq-cls"
    assert default_task(transformers.BartConfig(architectures=["BartModel"])) == "seq2seq"
    # T5's old hub name: an encoder-decoder's LM head generates (seq2seq), not causal-lm
    assert default_task(transformers.T5Config(architectures=["T5WithLMHeadModel"])) == "seq2seq"


def test_tied_embeddings_detected():
    assert probe_model("tiny-gpt2").tie_word_embeddings
    assert not probe_model("tiny-llama").tie_word_embeddings


def test_local_directory_from_save_pretrained(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path / "m")
    info = probe_model(str(tmp_path / "m"))
    assert info.num_params == _numel(tiny_llama)
    # the same directory through transformers' hub-id path (what a user with a network uses)
    cfg = load_config(tmp_path / "m")
    assert cfg.hidden_size == 64


def test_config_json_path(tmp_path, tiny_llama_config):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(tiny_llama_config.to_dict()))
    assert probe_model(str(p)).num_layers == 2


def test_attn_implementation_option():
    assert probe_model("tiny-llama", attn_implementation="eager").attn_implementation == "eager"
    with pytest.raises(BadInputError, match="eager or sdpa"):
        probe_model("tiny-llama", attn_implementation="flashy")


def test_unknown_model_one_line():
    with pytest.raises(UnknownModelError) as e:
        probe_model("no-such-org/no-such-model-xyz")
    assert "\n" not in str(e.value) and "tiny-llama" in str(e.value)
    with pytest.raises(UnknownModelError):
        probe_model("missing/config.json")
    with pytest.raises(UnknownModelError):
        probe_model(42)


def test_bad_model_type_in_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "not-a-model", "hidden_size": 8}))
    with pytest.raises(UnknownModelError, match="not known"):
        probe_model(str(p))


def test_unknown_task():
    with pytest.raises(UnknownTaskError, match="causal-lm"):
        probe_model("tiny-llama", task="translation")
    with pytest.raises(UnknownTaskError, match="encoder-decoder"):
        probe_model("tiny-llama", task="seq2seq")


def test_lora_on_a_module_is_refused(tiny_llama):
    with pytest.raises(BadInputError, match="PeftModel"):
        probe_model(tiny_llama, lora={"r": 4})


def test_describe_meta_module():
    from autofit.probe.model import build_model

    module, task = build_model("tiny-t5")
    assert next(module.parameters()).device.type == "meta"
    info = describe(module, task=task)
    assert info.is_encoder_decoder and len(info.blocks) == 2


# -- issue 11: a bad config or hub id is one short line that says what to do ---------------
def _config_dir(tmp_path, **changes):
    d = json.loads((_BUNDLED / "tiny-llama.json").read_text())
    d.pop("_autofit_name")
    d.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


_BUNDLED = __import__("pathlib").Path(__file__).resolve().parents[2] / "autofit/data/models"


@pytest.mark.parametrize("text, needle", [
    ("garbage{", "not a readable JSON config"),
    ("[1, 2]", "holds a JSON object, got list"),
    ("\xff\xfe", "not a readable JSON config"),
])
def test_garbage_config_json(tmp_path, text, needle):
    (tmp_path / "config.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(UnknownModelError, match=needle) as e:
        probe_model(str(tmp_path))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("changes, needle", [
    ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
    ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
    ({"hidden_size": "big"}, "hidden_size must be a positive integer, got 'big'"),
    ({"hidden_size": 65}, "not a multiple of the number of attention heads"),
])
def test_bad_dimensions_in_a_config(tmp_path, changes, needle):
    with pytest.raises(BadInputError, match=needle) as e:
        probe_model(_config_dir(tmp_path, **changes))
    assert "\n" not in str(e.value) and "fix the config" in str(e.value)


def test_unknown_model_type_is_one_short_line_with_close_matches(tmp_path):
    with pytest.raises(UnknownModelError) as e:
        probe_model(_config_dir(tmp_path, model_type="lama"))
    msg = str(e.value)
    assert "'lama' is not known" in msg and "did you mean 'llama'" in msg
    assert len(msg) < 300 and "\n" not in msg  # not transformers' list of 800 types


def test_uncached_hub_id_offline_fails_fast_with_one_line(monkeypatch):
    import time

    import transformers

    calls = []
    real = transformers.AutoConfig.from_pretrained

    def spy(ref, *a, **kw):
        calls.append(kw.get("local_files_only", False))
        return real(ref, *a, **kw)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cpu = time.process_time()
    with pytest.raises(UnknownModelError) as e:
        probe_model("nobody/does-not-exist-xyz")
    assert time.process_time() - cpu < 5  # CPU seconds, not wall time
    assert "not found locally and no network (HF_HUB_OFFLINE is set)" in str(e.value)
    assert "\n" not in str(e.value) and calls == [True]  # never asked the hub
    # no offline variable, but the endpoint cannot be reached: the same, without retries
    from autofit.probe import loading

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(loading, "_hub_offline", lambda: "huggingface.co cannot be reached")
    calls.clear()
    with pytest.raises(UnknownModelError, match="not found locally and no network"):
        probe_model("nobody/does-not-exist-xyz")
    assert calls == [True]
    with pytest.raises(UnknownModelError, match="not a hub id"):
        probe_model("no such/model id")


def test_token_limits():
    from autofit.probe.model import build_model, token_limits

    assert token_limits(build_model("tiny-gpt2")[0]) == (50257, 1024)  # learned positions
    assert token_limits(build_model("tiny-llama")[0]) == (32000, None)  # rotary: no table
    from transformers import AutoConfig, AutoModelForMaskedLM

    with torch.device("meta"):
        roberta = AutoModelForMaskedLM.from_config(AutoConfig.for_model(
            "roberta", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, vocab_size=100, max_position_embeddings=66))
    assert token_limits(roberta) == (100, 64)  # positions start after padding_idx (1)


def test_a_tied_embedding_named_by_its_head_is_an_embedding():
    """CamemBERT registers its LM head before its embeddings, so ``named_parameters``
    names the tied weight ``lm_head.decoder.weight``; the Trainer's 32-bit states for
    8-bit optimizers go by the ``nn.Embedding`` module, so its role is the embedding's
    (as a linear's, 8-bit AdamW's states were 10.9% under)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("camembert", hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64,
                                  vocab_size=256, is_decoder=True)
    model = AutoModelForCausalLM.from_config(config)
    first = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    assert first == "lm_head.decoder.weight"  # (what the role once came from)
    info = describe(model, task="causal-lm")
    vocab = [g for g in info.params if tuple(g.shape) == (256, 32)]
    assert [g.role for g in vocab] == ["embedding"]
