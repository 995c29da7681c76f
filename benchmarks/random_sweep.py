"""Lever combinations drawn at random, measured by the independent harness (issue 25).

The zoo (``zoo.py``) measures every family under four fixed setups at two tiny sizes; the
accuracy table (``accuracy.py``) holds hand-picked configurations. A user combines the
levers as neither does: bf16-true with 8-bit Lion and checkpointing, a 4-bit base under
rank-64 LoRA with dropout at 1024 tokens, accumulation with Adafactor on an encoder. This
draws such combinations from a seeded generator (``draw``: a popular family and task, a
width, depth, vocabulary, micro batch, sequence, precision, checkpointing, accumulation,
attention, optimizer and adaptation -- full, LoRA or QLoRA; from seed 3 on (``WIDE_FROM_SEED``)
more families, 16-true, an 8-bit base, DoRA / rsLoRA / IA3 / LoHa, autofit's chunked loss,
SGD with momentum and 4 micro batches too), measures each in a fresh child
of ``benchmarks/measure_cpu.py`` (no autofit code: the kernel's high-water mark) and
estimates it with ``autofit.estimate(method="analytic" | "simulate", device="cpu")``. The
error is ``(estimate - measured) / measured`` on the absolute peak; negative is an
underestimate, an OOM waiting for a user.

    python benchmarks/random_sweep.py --draws 40 --seed 1 --workers 2   # measure + report
    python benchmarks/random_sweep.py --reestimate                      # after a model change
    python benchmarks/random_sweep.py --report

Rows accumulate in ``benchmarks/results/random_sweep.json`` (a draw's name holds its seed
and index, so a sweep resumes and another seed adds rows); ``--report`` writes
``random_sweep.md`` with the zoo's targets.

Known limitations:
    NB: a draw the harness cannot run (a family that refuses a lever, a config its
    sizes make invalid) is kept with its error and what autofit says of it, as the zoo's
    failed rows are.
    NB: sizes stay small enough for this 2-core machine (at most 4,096 tokens a micro
    batch, ~60M parameters); the CPU math libraries' fixed caches are a larger share of
    such peaks than at real sizes.
"""

from __future__ import annotations

import argparse
import random
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import zoo  # noqa: E402  (the families' shrinking, the rows' estimates and CPU rules)

FAMILIES = {
    "causal-lm": ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                  "phi3", "gpt2", "gpt_neox", "opt", "falcon", "stablelm", "olmo2", "granite",
                  "starcoder2", "mixtral", "qwen3_moe", "smollm3", "cohere"],
    "seq-cls": ["llama", "qwen2", "gemma", "mistral", "bert", "roberta", "deberta-v2",
                "distilbert", "electra", "modernbert", "xlm-roberta"],
    "token-cls": ["bert", "roberta", "deberta-v2", "distilbert", "modernbert", "llama"],
    "masked-lm": ["bert", "roberta", "deberta-v2", "distilbert", "electra", "modernbert"],
    "seq2seq": ["t5", "bart", "mt5", "pegasus"],
}
# seeds from WIDE_FROM_SEED on draw from a wider space (the first two seeds' draws stay as
# they were): more families, 16-true, an 8-bit base, other PEFT methods, autofit's chunked
# loss, SGD with momentum, accumulation over 4 micro batches
WIDE_FROM_SEED = 3
WIDER_FAMILIES = {
    "causal-lm": ["bloom", "phi", "gpt_bigcode", "gptj", "codegen", "olmoe", "qwen2_moe",
                  "granitemoe", "mpt", "persimmon", "nemotron", "exaone4", "glm", "helium"],
    "seq-cls": ["phi3", "gpt2", "opt", "bart", "albert", "mpnet", "funnel"],
    "token-cls": ["electra", "xlm-roberta", "gpt2", "qwen2", "bloom"],
    "masked-lm": ["xlm-roberta", "albert", "camembert", "rembert", "mobilebert", "funnel"],
    "seq2seq": ["bart", "mbart", "marian", "umt5", "blenderbot"],
}
OTHER_PEFT = {
    "dora": {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": True,
             "target_modules": "all-linear"},
    "rslora": {"peft_type": "LORA", "r": 16, "lora_alpha": 16, "use_rslora": True,
               "target_modules": "all-linear"},
    "ia3": {"peft_type": "IA3"},
    "loha": {"peft_type": "LOHA", "r": 8, "target_modules": "all-linear"},
}
TASK_WEIGHTS = {"causal-lm": 5, "seq-cls": 2, "token-cls": 1, "masked-lm": 1, "seq2seq": 1}
FULL_OPTIMIZERS = {"adamw_torch": 5, "adamw_torch_fused": 3, "adamw_bnb_8bit": 3,
                   "adafactor": 2, "sgd": 2, "lion_8bit": 1, "lion_32bit": 1,
                   "paged_adamw_8bit": 1, "rmsprop": 1, "adagrad": 1, "ademamix_8bit": 1}
ADAPTER_OPTIMIZERS = {"adamw_torch": 4, "adamw_torch_fused": 2, "adamw_bnb_8bit": 1,
                      "paged_adamw_32bit": 1, "sgd": 1}
PRECISION_WEIGHTS = {"32-true": 3, "bf16-mixed": 3, "bf16-true": 3, "16-mixed": 1}
MAX_TOKENS = 4096  # a micro batch's tokens (batch x sequence)
MAX_PARAMS = 60_000_000
zoo.PROBE_MAX_PARAMS = MAX_PARAMS  # (the worker processes fork with it)


def _pick(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def draw(seed: int, index: int) -> dict[str, Any]:
    """The ``index``-th draw of ``seed``: a size key for ``zoo.SIZES`` and the spec's levers
    (the model's config is filled in by ``build``). Deterministic in (seed, index)."""
    rng = random.Random(f"{seed}-{index}")
    wide = seed >= WIDE_FROM_SEED
    task = _pick(rng, TASK_WEIGHTS)
    model_type = rng.choice(FAMILIES[task] + (WIDER_FAMILIES[task] if wide else []))
    hidden = rng.choice([256, 384, 512, 768])
    ffn = 64 * round(hidden * rng.choice([2.0, 2.75, 4.0]) / 64)
    vocab = rng.choice([8192, 16384, 32768, 50257])
    while True:
        batch, seq = rng.choice([1, 2, 4, 8]), rng.choice([128, 256, 512, 1024])
        if batch * seq <= MAX_TOKENS:
            break
    size = (hidden, rng.choice([2, 3, 4]), hidden // 64, ffn, vocab, batch, seq)
    adapt = (rng.choices(["full", "lora", "qlora", "int8", "peft"], weights=[40, 25, 12, 8, 15])
             if wide else rng.choices(["full", "lora", "qlora"], weights=[45, 40, 15]))[0]
    precision = _pick(rng, {**PRECISION_WEIGHTS, "16-true": 1} if wide else PRECISION_WEIGHTS)
    spec: dict[str, Any] = {
        "model_type": model_type, "task": task, "batch": batch, "seq": seq,
        "precision": precision, "gradient_checkpointing": rng.random() < 0.5,
        "optim_args": None, "lora": None}
    if adapt == "full":
        spec["optimizer"] = _pick(rng, FULL_OPTIMIZERS)
    else:
        spec["optimizer"] = _pick(rng, ADAPTER_OPTIMIZERS)
        r = rng.choice([4, 8, 16, 64])
        # as a user's script: the base in its dtype, then get_peft_model (adapters in fp32
        # on a 16-bit base; the harness's "lora" key casts them with the base instead)
        spec["peft"] = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                        "target_modules": "all-linear",
                        "lora_dropout": rng.choice([0.0, 0.05, 0.1])}
        if adapt == "peft":
            spec["peft"] = dict(OTHER_PEFT[rng.choice(sorted(OTHER_PEFT))])
        if task == "token-cls" and "target_modules" in spec["peft"]:
            # as zoo._spec: peft adapts a token head under all-linear
            spec["peft"]["exclude_modules"] = ["classifier", "score"]
    if adapt in ("qlora", "int8"):
        # a quantized base is loaded in its compute dtype: a *-true precision's, else fp32
        compute = {"bf16-true": "bfloat16", "16-true": "float16"}.get(precision, "float32")
        if precision == "16-mixed":
            spec["precision"] = "32-true"
        spec["quantization"] = ({"load_in_4bit": True,
                                 "bnb_4bit_quant_type": rng.choice(["nf4", "fp4"]),
                                 "bnb_4bit_use_double_quant": rng.random() < 0.5,
                                 "bnb_4bit_compute_dtype": compute}
                                if adapt == "qlora" else
                                {"load_in_8bit": True, "bnb_4bit_compute_dtype": compute})
    if rng.random() < 0.3:
        spec["grad_accum_steps"] = 2 if not wide or rng.random() < 0.5 else 4
    if task == "causal-lm" and adapt == "full" and rng.random() < 0.15:
        spec["trl_loss"] = True
    sdpa = zoo._attention(model_type, task) == "sdpa"
    spec["attn_implementation"] = "sdpa" if sdpa and rng.random() < 0.7 else "eager"
    if wide:
        if spec["optimizer"] == "sgd" and rng.random() < 0.5:
            spec["optim_args"] = "momentum=0.9"
        if (task == "causal-lm" and adapt in ("full", "lora") and not spec.get("trl_loss")
                and rng.random() < 0.15):
            spec["chunked_loss"] = True  # autofit's own trainer's loss
    flag = "-trl" if spec.get("trl_loss") else "-chunked" if spec.get("chunked_loss") else ""
    spec["name"] = f"rs{seed}-{index:03d}-{model_type}-{task}-{adapt}{flag}"
    return {"size": size, "spec": spec}


def build(drawn: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The spec with its model config (``zoo.probe`` at the drawn size: the family builds
    and runs a step), or None and why not."""
    key = drawn["spec"]["name"]
    zoo.SIZES[key] = tuple(drawn["size"])
    try:
        kw, why = zoo.probe(drawn["spec"]["model_type"], drawn["spec"]["task"], key)
    finally:
        zoo.SIZES.pop(key, None)
    if kw is None:
        return None, why
    return {**drawn["spec"], "config": kw}, ""


def run_draw(seed: int, index: int, methods: list[str]) -> dict[str, Any]:
    """One row: drawn, built, measured, estimated (``zoo.run_one``)."""
    drawn = draw(seed, index)
    spec, why = build(drawn)
    if spec is None:
        return {"name": drawn["spec"]["name"], "spec": drawn["spec"], "skip": why}
    row = zoo.run_one(spec, "random", methods)
    if "measured" not in row:  # what autofit says of a step the harness could not run
        zoo._reestimate(row, spec, methods)
    return row


def _levers(spec: dict[str, Any]) -> str:
    optimizer = spec["optimizer"] + (f"({spec['optim_args']})" if spec.get("optim_args") else "")
    parts = [f"b{spec['batch']}x{spec['seq']}", spec["precision"], optimizer,
             spec["attn_implementation"]]
    if spec.get("gradient_checkpointing"):
        parts.append("gc")
    if spec.get("grad_accum_steps", 1) > 1:
        parts.append(f"ga{spec['grad_accum_steps']}")
    lo = spec.get("peft")
    if lo:
        name = {"LORA": "LoRA"}.get(lo["peft_type"], lo["peft_type"])
        name += "".join(f" {k[4:]}" for k in ("use_dora", "use_rslora") if lo.get(k))
        parts.append(name + (f" r{lo['r']}" if "r" in lo else "")
                     + (f" dropout {lo['lora_dropout']}" if "lora_dropout" in lo else ""))
    q = spec.get("quantization")
    if q and q.get("load_in_8bit"):
        parts.append(f"int8 {q['bnb_4bit_compute_dtype']}")
    elif q:
        parts.append(q["bnb_4bit_quant_type"] + ("-dq" if q["bnb_4bit_use_double_quant"] else "")
                     + f" {q['bnb_4bit_compute_dtype']}")

    if spec.get("trl_loss"):
        parts.append("trl loss")
    if spec.get("chunked_loss"):
        parts.append("chunked loss")
    cfg = spec.get("config") or {}
    hidden = next((cfg[k] for k in zoo._HIDDEN if k in cfg), None)
    if hidden:
        parts.insert(0, f"h{hidden}")
    return " ".join(parts)


def report(out: Path, data: dict[str, Any], methods: list[str]) -> None:
    rows = [r for _, r in sorted(data["rows"].items())]
    measured = [r for r in rows if "measured" in r]
    lines = ["# Lever combinations drawn at random, measured on this CPU", "",
             "`python benchmarks/random_sweep.py` (see its docstring): popular families, "
             "sizes and every lever drawn from a seeded generator, measured by "
             "`benchmarks/measure_cpu.py` and estimated by autofit. Error = (estimate - "
             "measured) / measured on the absolute peak; negative = an underestimate.", "",
             f"Draws: {len(rows)}; measured: {len(measured)}; the harness could not run: "
             f"{sum('error' in r for r in rows)}; did not build at the drawn size: "
             f"{sum('skip' in r for r in rows)}.", "",
             "| method | rows | median abs | worst abs | lowest | under -3% | target | met |",
             "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        got = zoo._summary(measured, m)  # (the zoo's targets)
        if got is None:
            continue
        t_med, t_worst = zoo.TARGETS[m]
        refused = sum(f"{m}_error" in r for r in measured)
        lines.append(f"| {m} | {got['n']}{f' (+{refused} refused)' if refused else ''} | "
                     f"{100 * got['median_abs']:.1f}% | {100 * got['max_abs']:.1f}% | "
                     f"{100 * got['min']:+.1f}% | {got['under']} | <= {100 * t_med:.0f}% / "
                     f"{100 * t_worst:.0f}%, none < -3% | {'yes' if got['met'] else 'no'} |")
    lines += ["", "## Rows", "", "| draw | levers | measured MiB | "
              + " | ".join(methods) + " |", "|---|---|---|" + "---|" * len(methods)]
    for r in measured:
        cells = [f"{100 * r[m + '_err']:+.1f}%" if m + "_err" in r
                 else str(r.get(m + "_error", ""))[:80] for m in methods]
        lines.append(f"| {r['name']} | {_levers(r['spec'])} | {r['measured'] / 2**20:.1f} | "
                     + " | ".join(cells) + " |")
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "## The harness could not run", ""]
        for r in failed:
            says = "; ".join(f"{m}: {r[m + '_says']}" for m in methods if m + "_says" in r)
            lines.append(f"- {r['name']} ({_levers(r['spec'])}): {r['error']} -- autofit {says}")
    skipped = [r for r in rows if "skip" in r]
    if skipped:
        lines += ["", "## Did not build at the drawn size", ""]
        lines += [f"- {r['name']}: {r['skip']}" for r in skipped]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first draw index")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--methods", default="analytic,simulate")
    ap.add_argument("--report", action="store_true", help="only rewrite the report")
    ap.add_argument("--reestimate", action="store_true",
                    help="estimate the measured rows again (each with its CPU's rules)")
    ap.add_argument("--list", action="store_true", help="print the draws; run nothing")
    ap.add_argument("--out", default=str(RESULTS / "random_sweep"))
    args = ap.parse_args(argv)
    out, methods = Path(args.out), args.methods.split(",")
    data = zoo._load(out.with_suffix(".json"))
    indices = range(args.start, args.start + args.draws)
    if args.list:
        for i in indices:
            d = draw(args.seed, i)
            print(d["spec"]["name"], d["size"], _levers(d["spec"]))
        return 0
    if args.reestimate:
        for name, row in sorted(data["rows"].items()):
            if "measured" in row or "error" in row:
                data["rows"][name] = zoo.reestimate(row, methods)
                print(name, "  ".join(f"{m} {100 * row[m + '_err']:+.1f}%"
                                      for m in methods if m + "_err" in row), flush=True)
        zoo._save(out.with_suffix(".json"), data)
    elif not args.report:
        todo = [i for i in indices
                if draw(args.seed, i)["spec"]["name"] not in data["rows"]]
        print(f"{len(todo)} draws to run ({args.workers} workers)", flush=True)
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            futures = {pool.submit(run_draw, args.seed, i, methods): i for i in todo}
            for n, fut in enumerate(as_completed(futures), 1):
                try:
                    row = fut.result()
                except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
                    d = draw(args.seed, futures[fut])
                    row = {"name": d["spec"]["name"], "spec": d["spec"],
                           "error": f"sweep: {type(e).__name__}: {str(e)[:300]}"}
                disk = zoo._load(out.with_suffix(".json"))
                disk["rows"][row["name"]] = row
                zoo._save(out.with_suffix(".json"), disk)
                errs = "  ".join(f"{m} {100 * row[m + '_err']:+.1f}%" for m in methods
                                 if m + "_err" in row)
                print(f"[{n}/{len(todo)}] {row['name']}: "
                      f"{errs or row.get('error') or row.get('skip')}", flush=True)
        data = zoo._load(out.with_suffix(".json"))
    report(out, data, methods)
    return 0


if __name__ == "__main__":
    sys.exit(main())
