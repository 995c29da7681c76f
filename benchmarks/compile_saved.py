"""What torch.compile stops saving for backward, per block and token, by MLP activation.

The memory rule of ``autofit.knobs.compile`` (``_MLP_FUSED``) says how many (B, T, i)
tensors a block's MLP keeps eagerly that the compiled step (inductor, AOTAutograd's min-cut
partitioner) recomputes instead. This measures it without autofit: the bytes of the
distinct storages an eager and a compiled training step of transformers' own GPT-2 and
llama models hand to ``saved_tensors_hooks`` (the compiled graph's saved tensors go through
them too), at 2 and 4 blocks; the difference of the two depths is one block's. One
configuration per line, in a child process each (a compile's caches stay out of the next)::

    python benchmarks/compile_saved.py                  # the table of results/compile_saved.md
    python benchmarks/compile_saved.py --one gpt2 relu 0.0 bfloat16
    python benchmarks/compile_saved.py --zoo mistral,qwen2,gemma   # against the rule

``--zoo``: each family's own small configuration (the zoo's ``s`` size, ``zoo.shrink``) at 2
and 4 blocks, in bf16, beside what autofit's rule takes off per block
(``autofit.knobs.compile.compiled_saving_parts``): a rule above the measurement would
estimate a compiled step under (``results/compile_saved_zoo.md``).

Widths: hidden 256, intermediate 1024, 4 heads of 64 (llama: 2 key/value heads), vocabulary
1024, 2 x 128 tokens, sdpa attention, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "results" / "compile_saved.md"
CASES = [  # (family, activation, dropout, dtype)
    ("gpt2", "gelu_new", 0.0, "bfloat16"),
    ("gpt2", "gelu_new", 0.0, "float32"),
    ("gpt2", "gelu_fast", 0.0, "bfloat16"),
    ("gpt2", "quick_gelu", 0.0, "bfloat16"),
    ("gpt2", "gelu", 0.0, "bfloat16"),
    ("gpt2", "gelu_pytorch_tanh", 0.0, "bfloat16"),
    ("gpt2", "relu", 0.0, "float32"),
    ("gpt2", "gelu_pytorch_tanh", 0.1, "float32"),
    ("llama", "silu", 0.0, "bfloat16"),
    ("llama", "gelu_pytorch_tanh", 0.0, "bfloat16"),
    ("llama", "relu", 0.0, "bfloat16"),
]
H, INTER, HEADS, KV_HEADS, VOCAB, B, T = 256, 1024, 4, 2, 1024, 2, 128


def _model(family: str, act: str, drop: float, dtype: str, layers: int) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = AutoConfig.for_model("gpt2", n_embd=H, n_layer=layers, n_head=HEADS,
                                   vocab_size=VOCAB, n_positions=256, activation_function=act,
                                   resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop)
    else:
        cfg = AutoConfig.for_model(family, hidden_size=H, intermediate_size=INTER, head_dim=H // HEADS,
                                   num_hidden_layers=layers, num_attention_heads=HEADS,
                                   num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                                   max_position_embeddings=256, hidden_act=act,
                                   attention_dropout=drop)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype)).train()


def _saved_bytes(model: Any, ids: Any) -> int:
    """Bytes of the distinct non-parameter storages one training step saves for backward."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Any) -> Any:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return sum(seen.values())


def one(family: str, act: str, drop: float, dtype: str) -> dict[str, Any]:
    """One block's bytes a token saved eagerly and compiled (the 4-block step less the
    2-block one, halved)."""
    import torch

    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    per: dict[str, list[int]] = {"eager": [], "compiled": []}
    for layers in (2, 4):
        per["eager"].append(_saved_bytes(_model(family, act, drop, dtype, layers), ids))
        compiled = torch.compile(_model(family, act, drop, dtype, layers))
        _saved_bytes(compiled, ids)  # compiles
        per["compiled"].append(_saved_bytes(compiled, ids))
    block = {k: (v[1] - v[0]) / 2 / (B * T) for k, v in per.items()}
    elem = 2 if dtype == "bfloat16" else 4
    return {"family": family, "activation": act, "dropout": drop, "dtype": dtype,
            "eager": block["eager"], "compiled": block["compiled"],
            "fewer": block["eager"] - block["compiled"],
            "fewer_i": (block["eager"] - block["compiled"]) / (INTER * elem)}


def _zoo_model(model_type: str, layers: int, dtype: str) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from zoo import _LAYERS, _attention, _fewer, shrink

    base = AutoConfig.for_model(model_type)
    kw = shrink(base, "s")
    for name in _LAYERS:
        if name in kw:
            kw[name] = layers
    if "layer_types" in kw:
        kw["layer_types"] = _fewer(base.layer_types, layers)
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = _attention(model_type, "causal-lm")  # as from_pretrained picks
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype)).train()


def zoo_one(model_type: str, dtype: str) -> dict[str, Any]:
    """One block's bytes a token the compiled step saves fewer, measured and by the rule."""
    import torch

    from autofit import TrainConfig
    from autofit.knobs.compile import compiled_saving_parts
    from autofit.memory.analytic._activations import _family
    from autofit.probe.model import describe

    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    fewer, rule = [], []
    for layers in (2, 4):
        model = _zoo_model(model_type, layers, dtype)
        eager = _saved_bytes(model, ids)
        compiled = torch.compile(_zoo_model(model_type, layers, dtype))
        _saved_bytes(compiled, ids)
        fewer.append(eager - _saved_bytes(compiled, ids))
        info = describe(model, task="causal-lm")
        half = dtype == "bfloat16"
        config = TrainConfig(micro_batch_size=B, torch_compile=True,
                             precision="bf16-true" if half else "32-true")
        rule.append(compiled_saving_parts(info, config, T, family=_family(info),
                                          element=2 if half else 4)[0])
        torch._dynamo.reset()
    b = info.blocks[0]
    return {"model_type": model_type, "family": _family(info), "activation": b.activation,
            "dtype": dtype,
            "measured": (fewer[1] - fewer[0]) / 2 / (B * T),
            "rule": (rule[1] - rule[0]) / 2 / (B * T)}


def zoo(types: list[str]) -> int:
    rows = []
    for mt in types:
        for dtype in ("bfloat16", "float32"):  # (inductor's CPU code for bf16 fails on some)
            run = subprocess.run([sys.executable, __file__, "--zoo-one", mt, dtype],
                                 capture_output=True, text=True)
            if not run.returncode:
                break
        if run.returncode:
            last = (run.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"model_type": mt, "error": last[:160]})
        else:
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    out = OUT.with_name("compile_saved_zoo.md")
    lines = ["# torch.compile's rule against each family's saved tensors", "",
             f"`python benchmarks/compile_saved.py --zoo ...` (torch {_version('torch')}, "
             f"transformers {_version('transformers')}, CPU, inductor, {B} x {T} tokens, "
             "each family's zoo `s` configuration at 2 and 4 blocks; in fp32 where inductor's CPU "
             "code for bf16 does not compile). Bytes a block and token "
             "the compiled step saves fewer than eager: measured (`saved_tensors_hooks`) and "
             "by autofit's rule (`compiled_saving_parts`, its blocks' part). The rule above "
             "the measurement: an estimate under.", "",
             "| family | rule family | activation | dtype | measured B | rule B | rule - measured |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model_type']} | | | | failed: {r['error']} | | |")
            continue
        lines.append(f"| {r['model_type']} | {r['family']} | {r['activation']} | {r['dtype']} | "
                     f"{r['measured']:.0f} | {r['rule']:.0f} | {r['rule'] - r['measured']:+.0f} |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=4, metavar=("FAMILY", "ACT", "DROPOUT", "DTYPE"))
    ap.add_argument("--zoo", help="comma-separated model types: each against the rule")
    ap.add_argument("--zoo-one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.zoo_one:
        print(json.dumps(zoo_one(*args.zoo_one)))
        return 0
    if args.zoo:
        return zoo(args.zoo.split(","))
    if args.one:
        fam, act, drop, dtype = args.one
        print(json.dumps(one(fam, act, float(drop), dtype)))
        return 0
    rows = []
    for fam, act, drop, dtype in CASES:
        out = subprocess.run([sys.executable, __file__, "--one", fam, act, str(drop), dtype],
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    lines = ["# What torch.compile stops saving, per block and token", "",
             f"`python benchmarks/compile_saved.py` (torch {_version('torch')}, transformers "
             f"{_version('transformers')}, CPU, inductor). Bytes of the distinct storages one "
             "training step hands to `saved_tensors_hooks`, one block's (4 blocks less 2, "
             f"halved) per token; hidden {H}, intermediate i = {INTER}, {HEADS} heads (llama: "
             f"{KV_HEADS} key/value heads), {B} x {T} tokens, sdpa. `fewer / i`: in "
             "intermediate-sized tensors of the dtype (the rule's `_MLP_FUSED`; the llama rows "
             "include the attention's and norms' part, 4 x hidden here).", "",
             "| family | activation | dropout | dtype | eager B | compiled B | fewer B | fewer / i |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['activation']} | {r['dropout']} | {r['dtype']} | "
                     f"{r['eager']:.0f} | {r['compiled']:.0f} | {r['fewer']:+.0f} | "
                     f"{r['fewer_i']:+.2f} |")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")
    return 0


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


if __name__ == "__main__":
    raise SystemExit(main())
