"""The training configurations whose CPU peak memory is measured as ground truth.

Each entry is a spec in the project-wide format read by ``measure_cpu.measure``:
a small model built from its config (no weights downloaded), a task, a batch shape
and the training knobs. They are sized so that each peak (above the weights) is
50-1500 MiB and each measuring child finishes in under ~30 s on one CPU thread.

    python benchmarks/measure_cpu.py --all --out benchmarks/results/measured.json
"""

from __future__ import annotations

from typing import Any

# Model dimensions (AutoConfig.for_model kwargs).
LLAMA = {  # ~56 M params, untied embeddings
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1376,
    "vocab_size": 32000,
}
LLAMA_SMALL = {  # ~7 M params, for the long batches (8 x 512)
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "vocab_size": 8000,
}
LLAMA_WIDE = {  # ~100 M params, a narrow vocabulary: the weights outweigh the logits
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 8000,
}
QWEN2 = {  # llama-like with q/k/v biases, ~56 M params
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1376,
    "vocab_size": 32000,
    "max_window_layers": 8,
}
OPT = {  # ~42 M params, relu, tied embeddings, dropout 0.1 (the default)
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "ffn_dim": 2048,
    "word_embed_proj_dim": 512,
    "vocab_size": 32000,
    "max_position_embeddings": 1024,
}
GEMMA2 = {  # ~33 M params, gated GELU, logit soft-capping, sliding + global layers
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1376,
    "vocab_size": 32000,
}
STABLELM = {  # ~38 M params, LayerNorm, gated MLP, rotary on a quarter of each head
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1376,
    "vocab_size": 32000,
}
GPT2 = {  # ~51 M params, tied embeddings, dropout 0.1 (the default) kept
    "n_embd": 512,
    "n_layer": 8,
    "n_head": 8,
    "n_positions": 1024,
    "vocab_size": 50257,
}
BERT = {  # ~41 M params
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "intermediate_size": 2048,
    "vocab_size": 30522,
}
T5 = {  # ~20 M params, encoder-decoder
    "d_model": 256,
    "d_ff": 1024,
    "d_kv": 64,
    "num_layers": 4,
    "num_decoder_layers": 4,
    "num_heads": 4,
    "vocab_size": 32128,
    "decoder_start_token_id": 0,  # as in the t5-small checkpoint; labels are shifted with it
}

LORA_QV = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0}
LORA_ALL = {
    "r": 16,
    "alpha": 32,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "dropout": 0.05,
}
LORA_GPT2 = {"r": 8, "alpha": 16, "target_modules": ["c_attn"], "dropout": 0.0}

# Any peft method (the spec's "peft" key): dicts as in an adapter_config.json; target
# modules left out take peft's defaults for the model type (llama: q_proj, v_proj;
# gpt2: c_attn). On the "-true" precisions the base is cast before get_peft_model, so
# the adapter layers stay fp32.
QV = ["q_proj", "v_proj"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_ALL = ["c_attn", "c_proj", "c_fc"]  # attention qkv and out, MLP in and out (Conv1D)
TOKENS = list(range(16))  # token ids made trainable
PEFT = {
    "dora": {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": QV,
             "use_dora": True},
    "lora-qv": {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": QV},
    "rslora": {"peft_type": "LORA", "r": 16, "lora_alpha": 16, "target_modules": QV,
               "use_rslora": True},
    "lora-drop-all": {"peft_type": "LORA", "r": 16, "lora_alpha": 32,
                      "target_modules": ALL_LINEAR, "lora_dropout": 0.1},
    "lora-tti": {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": QV,
                 "trainable_token_indices": TOKENS},
    "ia3": {"peft_type": "IA3"},  # k_proj, v_proj, down_proj (feed-forward)
    "loha": {"peft_type": "LOHA", "r": 8, "alpha": 16, "target_modules": QV},
    "lokr": {"peft_type": "LOKR", "r": 8, "alpha": 16, "target_modules": QV},
    "vera": {"peft_type": "VERA", "r": 64, "target_modules": QV},
    "oft": {"peft_type": "OFT", "oft_block_size": 32, "target_modules": QV},
    "boft": {"peft_type": "BOFT", "boft_block_size": 8, "boft_n_butterfly_factor": 1,
             "target_modules": QV},
    "adalora": {"peft_type": "ADALORA", "init_r": 12, "target_r": 8, "total_step": 1000,
                "target_modules": QV},
    "fourierft": {"peft_type": "FOURIERFT", "n_frequency": 1000, "target_modules": QV},
    "vblora": {"peft_type": "VBLORA", "r": 4, "num_vectors": 256, "vector_length": 256,
               "target_modules": QV},
    "randlora": {"peft_type": "RANDLORA", "r": 32, "target_modules": QV},
    "hra": {"peft_type": "HRA", "r": 8, "target_modules": QV},
    "prefix": {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 20},
    "prompt": {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 20},
    "ptuning": {"peft_type": "P_TUNING", "num_virtual_tokens": 20, "encoder_hidden_size": 256},
    "adaption": {"peft_type": "ADAPTION_PROMPT", "adapter_len": 10, "adapter_layers": 2},
    "ln": {"peft_type": "LN_TUNING"},
    "tokens": {"peft_type": "TRAINABLE_TOKENS", "token_indices": TOKENS},
    # the methods peft 0.18-0.21 added, each with peft's own defaults (its target modules
    # for llama), as autofit's default_config asks for them
    "beft": {"peft_type": "BEFT"},
    "c3a": {"peft_type": "C3A"},
    "cartridge": {"peft_type": "CARTRIDGE", "num_virtual_tokens": 20},
    "deft": {"peft_type": "DEFT"},
    "delora": {"peft_type": "DELORA"},
    "glora": {"peft_type": "GLORA"},
    "gralora": {"peft_type": "GRALORA"},
    "hira": {"peft_type": "HIRA"},
    "lily": {"peft_type": "LILY"},
    "miss": {"peft_type": "MISS"},
    "osf": {"peft_type": "OSF"},
    "peanut": {"peft_type": "PEANUT"},
    "psoft": {"peft_type": "PSOFT"},
    "pvera": {"peft_type": "PVERA"},
    "road": {"peft_type": "ROAD"},
    "shadow": {"peft_type": "SHADOW"},
    "supertuning": {"peft_type": "SUPERTUNING"},
    "tinylora": {"peft_type": "TINYLORA"},
    "unilora": {"peft_type": "UNILORA"},
    # gpt2 (Conv1D layers; peft's default targets differ by method)
    "gpt2-ia3": {"peft_type": "IA3"},  # c_attn, mlp.c_proj (feed-forward)
    "gpt2-dora-all": {"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                      "target_modules": GPT2_ALL, "use_dora": True, "lora_dropout": 0.1,
                      "fan_in_fan_out": True},
    # LoHa, LoKr, OFT, BOFT and HRA refuse gpt2's Conv1D layers
    "gpt2-vera": {"peft_type": "VERA", "r": 64, "target_modules": ["c_attn"],
                  "fan_in_fan_out": True},
    "gpt2-fourierft": {"peft_type": "FOURIERFT", "n_frequency": 1000,
                       "fan_in_fan_out": True},  # mlp.c_proj
    "gpt2-tokens": {"peft_type": "TRAINABLE_TOKENS", "token_indices": TOKENS,
                    "target_modules": ["wte"]},
}

# Quantized bases (the spec's "quantization" key): BitsAndBytesConfig fields; the base is
# loaded in bnb_4bit_compute_dtype (float32 when not given), as a user loads it.
INT8 = {"load_in_8bit": True}
INT8_BF16 = {"load_in_8bit": True, "bnb_4bit_compute_dtype": "bfloat16"}  # base in bf16
NF4_BF16 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_compute_dtype": "bfloat16"}
NF4_DQ_BF16 = {**NF4_BF16, "bnb_4bit_use_double_quant": True}
FP4_FP32 = {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4",
            "bnb_4bit_compute_dtype": "float32"}
NF4_DQ_FP32 = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
               "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "float32"}


def spec(
    name: str,
    model_type: str,
    config: dict[str, Any],
    task: str,
    batch: int,
    seq: int,
    precision: str = "32-true",
    gc: bool = False,
    optimizer: str = "adamw_torch",
    optim_args: str | None = None,
    attn: str = "sdpa",
    lora: dict[str, Any] | None = None,
    chunked: bool = False,
    compiled: bool = False,
    regional: bool = False,
    peft: dict[str, Any] | None = None,
    trl: bool = False,
    quantization: dict[str, Any] | None = None,
    accum: int = 1,
) -> dict[str, Any]:
    """One spec dict with exactly the project-wide keys (``chunked_loss``, ``torch_compile``,
    ``trl_loss`` only when on, ``peft`` and ``quantization`` only when given)."""
    out = {
        "name": name,
        "model_type": model_type,
        "config": dict(config),
        "task": task,
        "batch": batch,
        "seq": seq,
        "precision": precision,
        "gradient_checkpointing": gc,
        "optimizer": optimizer,
        "optim_args": optim_args,
        "attn_implementation": attn,
        "lora": None if lora is None else dict(lora),
    }
    if chunked:
        out["chunked_loss"] = True
    if compiled:
        out["torch_compile"] = True
    if regional:
        out["torch_compile"] = out["torch_compile_regional"] = True
    if peft is not None:
        out["peft"] = dict(peft)
    if trl:
        out["trl_loss"] = True
    if quantization is not None:
        out["quantization"] = dict(quantization)
    if accum > 1:
        out["grad_accum_steps"] = accum
    return out


def _llama(name: str, batch: int = 4, seq: int = 256, **kw: Any) -> dict[str, Any]:
    return spec(name, "llama", LLAMA, "causal-lm", batch, seq, **kw)


def _gpt2(name: str, batch: int = 4, seq: int = 256, **kw: Any) -> dict[str, Any]:
    return spec(name, "gpt2", GPT2, "causal-lm", batch, seq, **kw)


CONFIGS: list[dict[str, Any]] = [
    # llama, 4 x 256: precision, checkpointing, attention, optimizer
    _llama("llama-b4s256"),
    _llama("llama-b4s256-eager", attn="eager"),
    _llama("llama-b4s256-gc", gc=True),
    _llama("llama-b4s256-bf16m", precision="bf16-mixed"),
    _llama("llama-b4s256-bf16m-gc", precision="bf16-mixed", gc=True),
    _llama("llama-b4s256-bf16t", precision="bf16-true"),
    _llama("llama-b4s256-fp16m", precision="16-mixed"),
    _llama("llama-b4s256-fp16t", precision="16-true"),
    _llama("llama-b4s256-fp16t-gc", precision="16-true", gc=True),
    _llama("llama-b4s256-fp16m-gc", precision="16-mixed", gc=True),
    _llama("llama-b4s256-fused", optimizer="adamw_torch_fused"),
    _llama("llama-b4s256-sgd", optimizer="sgd"),
    _llama("llama-b4s256-sgdm", optimizer="sgd", optim_args="momentum=0.9"),
    _llama("llama-b4s256-adafactor", optimizer="adafactor"),
    _llama("llama-b4s256-bnb8", optimizer="adamw_bnb_8bit"),
    # ... every other optimizer TrainingArguments.optim names that autofit estimates
    _llama("llama-b4s256-paged8", optimizer="paged_adamw_8bit"),
    _llama("llama-b4s256-paged32", optimizer="paged_adamw_32bit"),
    _llama("llama-b4s256-lion8", optimizer="lion_8bit"),
    _llama("llama-b4s256-lion32", optimizer="lion_32bit"),
    _llama("llama-b4s256-paged-lion8", optimizer="paged_lion_8bit"),
    _llama("llama-b4s256-adagrad", optimizer="adagrad"),
    _llama("llama-b4s256-rmsprop", optimizer="rmsprop"),
    _llama("llama-b4s256-rmsprop-mc", optimizer="rmsprop", optim_args="momentum=0.9,centered=True"),
    _llama("llama-b4s256-bf16m-gc-lion8", precision="bf16-mixed", gc=True, optimizer="lion_8bit"),
    _llama("llama-b4s256-ademamix", optimizer="ademamix"),
    _llama("llama-b4s256-ademamix8", optimizer="ademamix_8bit"),
    _llama("llama-b4s256-rmsprop-bnb", optimizer="rmsprop_bnb"),
    _llama("llama-b4s256-rmsprop-bnb8", optimizer="rmsprop_bnb_8bit"),
    # llama, chunked loss (torch's linear_cross_entropy: no (B, T, V) logits)
    _llama("llama-b4s256-chunk", chunked=True),
    _llama("llama-b4s256-bf16m-chunk", precision="bf16-mixed", chunked=True),
    _llama("llama-b4s256-bf16t-chunk", precision="bf16-true", chunked=True),
    _llama("llama-b2s512-gc-chunk", batch=2, seq=512, gc=True, chunked=True),
    # TRL's SFT loss (SFTTrainer's fused LM head: (4096, 32768) tiles, no (B, T, V) logits)
    _llama("llama-b4s256-trl", trl=True),
    _llama("llama-b4s256-bf16m-trl", precision="bf16-mixed", trl=True),
    # ... compiled whole (SFTConfig(torch_compile=True)): no full logits to fuse, its compiled
    # backward above the eager step's
    _llama("llama-b4s256-trl-compile", trl=True, compiled=True),
    _llama("llama-b4s256-bf16m-trl-compile", precision="bf16-mixed", trl=True, compiled=True),
    _llama("llama-b4s256-bf16m-trl-compile-regional", precision="bf16-mixed", trl=True,
           regional=True),
    # llama, other shapes
    _llama("llama-b1s128", batch=1, seq=128),
    _llama("llama-b2s512", batch=2, seq=512),
    _llama("llama-b2s512-eager-gc", batch=2, seq=512, attn="eager", gc=True),
    _llama("llama-b2s512-bf16t-sgd", batch=2, seq=512, precision="bf16-true", optimizer="sgd"),
    # llama + LoRA
    _llama("llama-lora-b4s256", lora=LORA_QV),
    _llama("llama-lora-b4s256-bf16m-gc", precision="bf16-mixed", gc=True, lora=LORA_QV),
    _llama("llama-lora-b4s256-bf16t", precision="bf16-true", lora=LORA_QV),
    _llama("llama-lora-all-b2s512-eager", batch=2, seq=512, attn="eager", lora=LORA_ALL),
    # small llama, long batches
    spec("llamas-b8s512", "llama", LLAMA_SMALL, "causal-lm", 8, 512),
    spec("llamas-b8s512-eager", "llama", LLAMA_SMALL, "causal-lm", 8, 512, attn="eager"),
    spec(
        "llamas-b8s512-bf16m-gc", "llama", LLAMA_SMALL, "causal-lm", 8, 512, "bf16-mixed", gc=True
    ),
    spec("llama-cls-b4s256", "llama", LLAMA, "seq-cls", 4, 256),
    # qwen2
    spec("qwen2-b4s256", "qwen2", QWEN2, "causal-lm", 4, 256),
    spec(
        "qwen2-b4s256-bf16m-gc-sgdm",
        "qwen2",
        QWEN2,
        "causal-lm",
        4,
        256,
        "bf16-mixed",
        gc=True,
        optimizer="sgd",
        optim_args="momentum=0.9",
    ),
    # gpt2 (dropout 0.1 on)
    _gpt2("gpt2-b2s256", batch=2),
    _gpt2("gpt2-b2s256-eager", batch=2, attn="eager"),
    _gpt2("gpt2-b4s256-bf16m-gc", precision="bf16-mixed", gc=True),
    _gpt2("gpt2-b4s256-bf16t-sgd", precision="bf16-true", optimizer="sgd"),
    _gpt2("gpt2-b2s256-chunk", batch=2, chunked=True),
    _gpt2("gpt2-b4s256-bf16m-gc-chunk", precision="bf16-mixed", gc=True, chunked=True),
    _gpt2("gpt2-b4s256-trl", trl=True),  # tied head: the embedding gets both gradients
    _gpt2("gpt2-b2s256-fused", batch=2, optimizer="adamw_torch_fused"),
    _gpt2("gpt2-b1s512-adafactor", batch=1, seq=512, optimizer="adafactor"),
    _gpt2("gpt2-b1s128-bnb8", batch=1, seq=128, optimizer="adamw_bnb_8bit"),
    _gpt2("gpt2-b1s128-ademamix8", batch=1, seq=128, optimizer="ademamix_8bit"),
    _gpt2("gpt2-b1s128-rmsprop-bnb8", batch=1, seq=128, optimizer="rmsprop_bnb_8bit"),
    _gpt2("gpt2-b1s128-lion8", batch=1, seq=128, optimizer="lion_8bit"),
    # transformers' Adafactor upcasts a 16-bit parameter and its gradient to fp32 (random
    # lever draws, random_sweep.py: a bf16-true phi3 11% under with the gradient's alone)
    _gpt2("gpt2-b1s128-bf16t-adafactor", batch=1, seq=128, precision="bf16-true",
          optimizer="adafactor"),
    _llama("llama-b1s128-bf16t-adafactor", batch=1, seq=128, precision="bf16-true",
           optimizer="adafactor"),
    # ... and bitsandbytes' CPU update of a 16-bit parameter one fp32 copy of it more
    _llama("llama-b1s128-bf16t-bnb8", batch=1, seq=128, precision="bf16-true",
           optimizer="adamw_bnb_8bit"),
    _gpt2("gpt2-lora-b4s256", lora=LORA_GPT2),
    _gpt2(
        "gpt2-lora-b8s128-bf16m-gc",
        batch=8,
        seq=128,
        precision="bf16-mixed",
        gc=True,
        lora=LORA_GPT2,
    ),
    # llama + other PEFT methods (the "peft" key)
    _llama("llama-dora-b4s256", peft=PEFT["dora"]),
    _llama("llama-dora-b4s256-bf16t", precision="bf16-true", peft=PEFT["dora"]),
    _llama("llama-rslora-b4s256-bf16m-gc", precision="bf16-mixed", gc=True,
           peft=PEFT["rslora"]),
    _llama("llama-lora-drop-all-b2s256-bf16t", batch=2, precision="bf16-true",
           peft=PEFT["lora-drop-all"]),
    _llama("llama-lora-tti-b4s256", peft=PEFT["lora-tti"]),
    _llama("llama-ia3-b4s256", peft=PEFT["ia3"]),
    _llama("llama-ia3-b4s256-bf16t", precision="bf16-true", peft=PEFT["ia3"]),
    _llama("llama-loha-b4s256", peft=PEFT["loha"]),
    _llama("llama-lokr-b4s256-bf16m", precision="bf16-mixed", peft=PEFT["lokr"]),
    _llama("llama-vera-b4s256", peft=PEFT["vera"]),
    _llama("llama-oft-b4s256-gc", gc=True, peft=PEFT["oft"]),
    _llama("llama-boft-b2s256", batch=2, peft=PEFT["boft"]),
    _llama("llama-adalora-b4s256", peft=PEFT["adalora"]),
    _llama("llama-fourierft-b4s256", peft=PEFT["fourierft"]),
    _llama("llama-vblora-b4s256-bf16t", precision="bf16-true", peft=PEFT["vblora"]),
    _llama("llama-randlora-b4s256", peft=PEFT["randlora"]),
    _llama("llama-hra-b4s256", peft=PEFT["hra"]),
    # (AdaMSS: refused, its adapters' shapes come from clustering the real weights' SVD)
    _llama("llama-beft-b4s256", peft=PEFT["beft"]),
    _llama("llama-c3a-b4s256", peft=PEFT["c3a"]),
    _llama("llama-cartridge-b4s256", peft=PEFT["cartridge"]),
    _llama("llama-deft-b4s256", peft=PEFT["deft"]),
    _llama("llama-delora-b4s256", peft=PEFT["delora"]),
    _llama("llama-glora-b4s256", peft=PEFT["glora"]),
    _llama("llama-gralora-b4s256", peft=PEFT["gralora"]),
    _llama("llama-hira-b4s256", peft=PEFT["hira"]),
    _llama("llama-lily-b4s256", peft=PEFT["lily"]),
    _llama("llama-miss-b4s256", peft=PEFT["miss"]),
    _llama("llama-osf-b4s256", peft=PEFT["osf"]),
    _llama("llama-peanut-b4s256", peft=PEFT["peanut"]),
    _llama("llama-psoft-b4s256", peft=PEFT["psoft"]),
    _llama("llama-pvera-b4s256", peft=PEFT["pvera"]),
    _llama("llama-road-b4s256", peft=PEFT["road"]),
    _llama("llama-shadow-b4s256", peft=PEFT["shadow"]),
    _llama("llama-supertuning-b4s256", peft=PEFT["supertuning"]),
    _llama("llama-tinylora-b4s256", peft=PEFT["tinylora"]),
    _llama("llama-unilora-b4s256", peft=PEFT["unilora"]),
    _llama("llama-prefix-b4s256", peft=PEFT["prefix"]),
    _llama("llama-prompt-b4s256-bf16t", precision="bf16-true", peft=PEFT["prompt"]),
    _llama("llama-ptuning-b4s256-bf16m", precision="bf16-mixed", peft=PEFT["ptuning"]),
    _llama("llama-adaption-b4s256", peft=PEFT["adaption"]),
    _llama("llama-ln-b4s256-gc", gc=True, peft=PEFT["ln"]),
    _llama("llama-tokens-b4s256", peft=PEFT["tokens"]),
    # gpt2 + PEFT methods
    _gpt2("gpt2-ia3-b4s256", peft=PEFT["gpt2-ia3"]),
    _gpt2("gpt2-dora-all-b4s256-bf16m-gc", precision="bf16-mixed", gc=True,
          peft=PEFT["gpt2-dora-all"]),
    _gpt2("gpt2-vera-b4s256-bf16t", precision="bf16-true", peft=PEFT["gpt2-vera"]),
    _gpt2("gpt2-fourierft-b2s256", batch=2, peft=PEFT["gpt2-fourierft"]),
    _gpt2("gpt2-prefix-b4s256-bf16t", precision="bf16-true", peft=PEFT["prefix"]),
    _gpt2("gpt2-prompt-b4s256-gc", gc=True, peft=PEFT["prompt"]),
    _gpt2("gpt2-ln-b4s256-bf16t", precision="bf16-true", peft=PEFT["ln"]),
    _gpt2("gpt2-tokens-b2s256", batch=2, peft=PEFT["gpt2-tokens"]),
    # quantized bases (bitsandbytes) + LoRA: 8-bit LLM.int8 (MatMul8bitFp on the CPU: each
    # layer keeps its input, checkpointing or not), 4-bit nf4 / fp4, double quantization,
    # compute dtype bf16 vs fp32
    _llama("llama-int8-lora-b4s256", lora=LORA_QV, quantization=INT8),
    _llama("llama-int8-lora-b4s256-gc", gc=True, lora=LORA_QV, quantization=INT8),
    _llama("llama-int8bf16-lora-b4s256-bf16m", precision="bf16-mixed", lora=LORA_QV,
           quantization=INT8_BF16),
    _llama("llama-nf4bf16-lora-b4s256-bf16m", precision="bf16-mixed", lora=LORA_QV,
           quantization=NF4_BF16),
    _llama("llama-nf4dqbf16-lora-b4s256-gc", gc=True, lora=LORA_QV, quantization=NF4_DQ_BF16),
    _llama("llama-fp4-lora-b4s256", lora=LORA_QV, quantization=FP4_FP32),
    # QDoRA: DoRA on a 4-bit base (peft dequantizes each adapted weight in every forward)
    _llama("llama-nf4bf16-dora-b4s256-bf16m", precision="bf16-mixed", peft=PEFT["dora"],
           quantization=NF4_BF16),
    _llama("llama-nf4-dora-b4s256-gc", gc=True, peft=PEFT["dora"], quantization=NF4_DQ_FP32),
    _llama("llama-nf4dq-lora-all-b2s512-gc", batch=2, seq=512, gc=True, lora=LORA_ALL,
           quantization=NF4_DQ_FP32),
    _gpt2("gpt2-int8-lora-b4s256", lora=LORA_GPT2, quantization=INT8),
    _gpt2("gpt2-nf4bf16-lora-b4s256-bf16m-gc", precision="bf16-mixed", gc=True, lora=LORA_GPT2,
          quantization=NF4_BF16),
    # bert: masked-lm and sequence classification
    spec("bert-mlm-b4s256", "bert", BERT, "masked-lm", 4, 256),
    # BERT's and T5's heads take CrossEntropyLoss on their 16-bit logits under bf16-true:
    # the loss's gradients are bf16 (the closed form took fp32 ones: 35% and 18% over
    # against the simulations)
    spec("bert-mlm-b4s256-bf16t", "bert", BERT, "masked-lm", 4, 256, "bf16-true"),
    spec(
        "bert-mlm-b4s256-eager-bf16m", "bert", BERT, "masked-lm", 4, 256, "bf16-mixed", attn="eager"
    ),
    spec(
        "bert-mlm-b8s128-gc-adafactor",
        "bert",
        BERT,
        "masked-lm",
        8,
        128,
        gc=True,
        optimizer="adafactor",
    ),
    spec("bert-cls-b8s256", "bert", BERT, "seq-cls", 8, 256),
    spec(
        "bert-cls-b4s128-bf16t-sgdm",
        "bert",
        BERT,
        "seq-cls",
        4,
        128,
        "bf16-true",
        optimizer="sgd",
        optim_args="momentum=0.9",
    ),
    # torch.compile (inductor): fused pointwise chains save fewer activations; each
    # measuring child compiles first (~2-4 min here), outside the measured steps
    _llama("llama-b4s256-compile", compiled=True),
    _llama("llama-b4s256-bf16m-compile", precision="bf16-mixed", compiled=True),
    _llama("llama-b4s256-gc-compile", gc=True, compiled=True),
    spec("llamas-b8s512-compile", "llama", LLAMA_SMALL, "causal-lm", 8, 512, compiled=True),
    _gpt2("gpt2-b2s256-compile", batch=2, compiled=True),
    _gpt2("gpt2-b4s256-bf16m-gc-compile", precision="bf16-mixed", gc=True, compiled=True),
    # ... with 16-bit weights (bf16-true): the 16-bit logits' fp32 upcast is fused too (the
    # rule's fp32 coefficient put these 30-33% over); llama's eager row is above
    _llama("llama-b4s256-bf16t-compile", precision="bf16-true", compiled=True),
    _llama("llama-b4s256-bf16t-gc-compile", precision="bf16-true", gc=True, compiled=True),
    _gpt2("gpt2-b4s256-bf16t", precision="bf16-true"),
    _gpt2("gpt2-b4s256-bf16t-compile", precision="bf16-true", compiled=True),
    # accelerate's regional compilation (dynamo_use_regional_compilation: each decoder
    # block compiled, the head and the loss eager): the blocks' rule without the loss's
    _llama("llama-b4s256-compile-regional", regional=True),
    _llama("llama-b4s256-bf16m-compile-regional", precision="bf16-mixed", regional=True),
    _llama("llama-b4s256-bf16t-compile-regional", precision="bf16-true", regional=True),
    _llama("llama-b4s256-bf16t-gc-compile-regional", precision="bf16-true", gc=True,
           regional=True),
    _gpt2("gpt2-b4s256-bf16m-compile-regional", precision="bf16-mixed", regional=True),
    _gpt2("gpt2-b4s256-bf16t-compile-regional", precision="bf16-true", regional=True),
    # ... by depth (what the rule's blocks part and its loss part each take): 2 and 4 blocks
    spec("llamaL2-bf16-true-compile", "llama", {**LLAMA, "num_hidden_layers": 2}, "causal-lm", 4,
         256, precision="bf16-true", compiled=True),
    spec("llamaL2-bf16-mixed-compile", "llama", {**LLAMA, "num_hidden_layers": 2}, "causal-lm",
         4, 256, precision="bf16-mixed", compiled=True),
    spec("llamaL4-bf16-true-compile", "llama", {**LLAMA, "num_hidden_layers": 4}, "causal-lm", 4,
         256, precision="bf16-true", compiled=True),
    spec("llamaL4-bf16-mixed-compile", "llama", {**LLAMA, "num_hidden_layers": 4}, "causal-lm",
         4, 256, precision="bf16-mixed", compiled=True),
    spec("llamaL4-bf16true", "llama", {**LLAMA, "num_hidden_layers": 4}, "causal-lm", 4, 256,
         precision="bf16-true"),
    spec("llamaL4-bf16mixed", "llama", {**LLAMA, "num_hidden_layers": 4}, "causal-lm", 4, 256,
         precision="bf16-mixed"),
    spec("llamaL4-fp32", "llama", {**LLAMA, "num_hidden_layers": 4}, "causal-lm", 4, 256),
    spec("gpt2L4-bf16m", "gpt2", {**GPT2, "n_layer": 4}, "causal-lm", 4, 256,
         precision="bf16-mixed"),
    spec("gpt2L4-bf16t", "gpt2", {**GPT2, "n_layer": 4}, "causal-lm", 4, 256,
         precision="bf16-true"),
    spec("llamaL4-bf16true-regional", "llama", {**LLAMA, "num_hidden_layers": 4}, "causal-lm", 4,
         256, precision="bf16-true", regional=True),
    spec("llamaL4-bf16mixed-regional", "llama", {**LLAMA, "num_hidden_layers": 4}, "causal-lm",
         4, 256, precision="bf16-mixed", regional=True),
    spec("llamaL4-fp32-regional", "llama", {**LLAMA, "num_hidden_layers": 4}, "causal-lm", 4,
         256, regional=True),
    spec("gpt2L4-bf16m-regional", "gpt2", {**GPT2, "n_layer": 4}, "causal-lm", 4, 256,
         precision="bf16-mixed", regional=True),
    spec("gpt2L4-bf16t-regional", "gpt2", {**GPT2, "n_layer": 4}, "causal-lm", 4, 256,
         precision="bf16-true", regional=True),
    spec("llamas-b8s512-bf16t-compile-regional", "llama", LLAMA_SMALL, "causal-lm", 8, 512,
         precision="bf16-true", regional=True),
    spec("llamas-b8s512-bf16m-compile-regional", "llama", LLAMA_SMALL, "causal-lm", 8, 512,
         precision="bf16-mixed", regional=True),
    _gpt2("gpt2-b2s256-compile-regional", batch=2, regional=True),
    # torch.compile's modes on the CPU (no CUDA graphs here): beside the default mode
    spec("llamas-b4s256-compile", "llama", LLAMA_SMALL, "causal-lm", 4, 256, compiled=True),
    {**spec("llamas-b4s256-compile-ro", "llama", LLAMA_SMALL, "causal-lm", 4, 256,
            compiled=True), "torch_compile_mode": "reduce-overhead"},
    {**spec("llamas-b4s256-compile-ma", "llama", LLAMA_SMALL, "causal-lm", 4, 256,
            compiled=True), "torch_compile_mode": "max-autotune"},
    _gpt2("gpt2-b4s256-bf16m", precision="bf16-mixed"),
    _gpt2("gpt2-b4s256-bf16m-compile", precision="bf16-mixed", compiled=True),
    # torch.compile by MLP activation (benchmarks/compile_saved.py): torch's one-op tanh GELU
    # keeps what the compiled step keeps (the gelu_new rule took 3 (B, T, i) tensors off:
    # ~12% under), relu's compiled step keeps a bool mask more
    spec("gpt2t-b4s256-bf16t", "gpt2", {**GPT2, "activation_function": "gelu_pytorch_tanh"},
         "causal-lm", 4, 256, "bf16-true"),
    spec("gpt2t-b4s256-bf16t-compile", "gpt2",
         {**GPT2, "activation_function": "gelu_pytorch_tanh"}, "causal-lm", 4, 256, "bf16-true",
         compiled=True),
    spec("gpt2r-b2s256-compile", "gpt2", {**GPT2, "activation_function": "relu"},
         "causal-lm", 2, 256, compiled=True),
    # ... and on families the rule was not fitted on (its llama and GPT-2 coefficients by
    # block structure): Qwen2 (q/k/v biases), OPT (relu, learned positions), Gemma 2 (logit
    # soft-capping, eager attention), each beside its eager step
    spec("qwen2-b4s256-bf16t", "qwen2", QWEN2, "causal-lm", 4, 256, "bf16-true"),
    spec("qwen2-b4s256-bf16t-compile", "qwen2", QWEN2, "causal-lm", 4, 256, "bf16-true",
         compiled=True),
    spec("opt-b4s256-bf16t", "opt", OPT, "causal-lm", 4, 256, "bf16-true"),
    spec("opt-b4s256-bf16t-compile", "opt", OPT, "causal-lm", 4, 256, "bf16-true",
         compiled=True),
    # gradient accumulation under autocast with checkpointing: the forward's end holds the
    # earlier micro batches' gradients beside every block's cached 16-bit weight copy
    _llama("llama-b1s512-bf16m-gc-fused", batch=1, seq=512, precision="bf16-mixed", gc=True,
           optimizer="adamw_torch_fused"),
    _llama("llama-b1s512-bf16m-gc-ga4-fused", batch=1, seq=512, precision="bf16-mixed",
           gc=True, optimizer="adamw_torch_fused", accum=4),
    _gpt2("gpt2-b1s512-bf16m-gc-ga4-adafactor", batch=1, seq=512, precision="bf16-mixed",
          gc=True, optimizer="adafactor", accum=4),
    # ... and without checkpointing, the head's backward makes its weight's gradient anew
    # beside the held one and the logits' (untied; tied to the input embedding)
    _llama("llama-b1s512-ga4-adafactor", batch=1, seq=512, optimizer="adafactor", accum=4),
    _gpt2("gpt2-b1s512-ga4-adafactor", batch=1, seq=512, optimizer="adafactor", accum=4),
    # ... which dominate where the weights outweigh the logits (a narrow vocabulary)
    spec("llamaw-b1s256-bf16m-gc-ga4-adafactor", "llama", LLAMA_WIDE, "causal-lm", 1, 256,
         "bf16-mixed", gc=True, optimizer="adafactor", accum=4),
    # StableLM, whose compiled blocks saved less than the llama rule: its blocks as eager
    spec("stablelm-b4s256-bf16t", "stablelm", STABLELM, "causal-lm", 4, 256, "bf16-true"),
    spec("stablelm-b4s256-bf16t-compile", "stablelm", STABLELM, "causal-lm", 4, 256,
         "bf16-true", compiled=True),
    spec("gemma2-b4s256-bf16t", "gemma2", GEMMA2, "causal-lm", 4, 256, "bf16-true",
         attn="eager"),
    spec("gemma2-b4s256-bf16t-compile", "gemma2", GEMMA2, "causal-lm", 4, 256, "bf16-true",
         attn="eager", compiled=True),
    # issue 25: an independent harness found these under-estimated (small llama, seconds each)
    # LoRA on sequence classification: peft's SEQ_CLS task adds the head as a trainable copy
    spec("llamas-cls-lora-b4s256", "llama", LLAMA_SMALL, "seq-cls", 4, 256,
         peft=PEFT["lora-qv"]),
    spec("llama-cls-lora-b4s256", "llama", LLAMA, "seq-cls", 4, 256, peft=PEFT["lora-qv"]),
    # PEFT on a bf16-true base with checkpointing (adapters kept fp32 by get_peft_model)
    spec("llamas-lora-b4s256-bf16t-gc", "llama", LLAMA_SMALL, "causal-lm", 4, 256,
         "bf16-true", gc=True, peft=PEFT["lora-qv"]),
    spec("llamas-ia3-b4s256-bf16t-gc", "llama", LLAMA_SMALL, "causal-lm", 4, 256,
         "bf16-true", gc=True, peft=PEFT["ia3"]),
    spec("llamas-prompt-b4s256-bf16t-gc", "llama", LLAMA_SMALL, "causal-lm", 4, 256,
         "bf16-true", gc=True, peft=PEFT["prompt"]),
    spec("llama-lora-b4s256-bf16t-gc", "llama", LLAMA, "causal-lm", 4, 256,
         "bf16-true", gc=True, peft=PEFT["lora-qv"]),
    # a tied head and embedding with SGD: the end of backward (their two gradients and the
    # sum) is the step's peak, which AdamW's step hides
    _gpt2("gpt2-b1s64-sgd", batch=1, seq=64, optimizer="sgd"),
    # torch.compile on a small llama, with checkpointing
    spec("llamas-b4s256-gc-compile", "llama", LLAMA_SMALL, "causal-lm", 4, 256, gc=True,
         compiled=True),
    # t5: seq2seq
    spec("t5-b4s256", "t5", T5, "seq2seq", 4, 256),
    spec("t5-b4s256-eager", "t5", T5, "seq2seq", 4, 256, attn="eager"),
    spec("t5-b4s256-bf16t", "t5", T5, "seq2seq", 4, 256, "bf16-true", attn="eager"),
    spec("t5-b4s256-bf16m-gc", "t5", T5, "seq2seq", 4, 256, "bf16-mixed", gc=True, attn="eager"),
    spec("t5-b8s128-adafactor", "t5", T5, "seq2seq", 8, 128, optimizer="adafactor", attn="eager"),
]

_names = [c["name"] for c in CONFIGS]
assert len(_names) == len(set(_names)), "spec names must be unique"
