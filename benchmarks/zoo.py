"""The zoo: every architecture transformers builds from a config, measured and estimated.

    python benchmarks/zoo.py --list                        # what builds offline, and why not
    python benchmarks/zoo.py --tasks causal-lm --sizes s --setups fp32 --workers 2
    python benchmarks/zoo.py --families llama,opt,bert     # a few families, every setup
    python benchmarks/zoo.py --report                      # zoo.{md,json,png} from the rows
    python benchmarks/zoo.py --families emu3 --retry-failed  # rows whose attempt failed, again

Families come from transformers' own auto mappings (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
masked LM, seq2seq LM, sequence and token classification): every ``model_type`` there is built
from ``AutoConfig.for_model`` at two small sizes (``SIZES``: the usual width, depth,
heads, feed-forward and vocabulary fields shrunk where the config has them, in the text
sub-config too) and must run one forward with labels on a 2 x 16 batch; what does not is
listed with its first error line (``--list``: no hub, no extra packages).

Each family that builds is measured under ``SETUPS`` (fp32 AdamW; bf16-mixed with
checkpointing; bitsandbytes' 8-bit AdamW; LoRA r8 on all linear layers) by the
independent harness (``benchmarks/measure_cpu.py``: one fresh child per configuration,
the kernel's high-water mark, no autofit code) and estimated by ``autofit.estimate``
with ``method="analytic"`` and ``"simulate"`` for ``device="cpu"``. The error is
``(estimate - measured) / measured`` on the absolute peak (measured + weights): a
negative error is an underestimate, an OOM waiting for a user.

Rows accumulate in ``benchmarks/results/zoo.json`` (a run skips the rows it has, so a
long sweep resumes); ``--report`` rewrites ``zoo.md`` (per method: median and worst
error, every underestimate below -3%; per family) and ``zoo.png``.

Known limitations:
    NB: tiny models: fixed costs (the math libraries' caches) are a larger share of
    the peak than at real sizes; the accuracy table (``accuracy.py``) holds the
    larger configurations. Those caches differ by CPU vendor too, not only by
    instruction set (an AMD EPYC's MKL does not pack fp32 weights as a Xeon's does;
    ``cpu_cache.py`` measures the machine at hand): a row records both, and is estimated
    with both (rows from before the maker was recorded: the Xeon's).
    NB: peft leaves a classifier's head out of ``"all-linear"`` for SEQ_CLS only; the
    token-classification LoRA rows exclude ``classifier`` / ``score`` themselves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

TASK_MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "seq-cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "token-cls": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
}
TOKEN_LABELS = 9  # token classification: CoNLL-2003's NER tags
PROBE_MAX_PARAMS = 30_000_000  # a family whose small config is larger: fields not shrunk

# size -> (hidden, layers, heads, feed-forward, vocabulary, batch, sequence)
# (peaks of tens to hundreds of MiB: at a few MiB the harness's fixed costs -- page
# rounding, autograd's bookkeeping -- are tens of percent of the peak, a noise no user
# runs into)
SIZES = {"s": (256, 2, 4, 512, 8192, 4, 128), "m": (512, 2, 8, 1024, 16384, 4, 256)}
SETUPS = {
    "fp32": {"precision": "32-true", "gradient_checkpointing": False,
             "optimizer": "adamw_torch", "lora": None},
    "bf16-ckpt": {"precision": "bf16-mixed", "gradient_checkpointing": True,
                  "optimizer": "adamw_torch", "lora": None},
    "adamw8": {"precision": "32-true", "gradient_checkpointing": False,
               "optimizer": "adamw_bnb_8bit", "lora": None},
    "lora": {"precision": "32-true", "gradient_checkpointing": False,
             "optimizer": "adamw_torch",
             "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear", "dropout": 0.0}},
}
TARGETS = {"analytic": (0.03, 0.10), "simulate": (0.02, 0.05)}  # median, worst |error|
UNDER = -0.03  # no estimate below this anywhere

_HIDDEN = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "emb_dim")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
           "decoder_layers", "num_decoder_layers", "num_encoder_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
          "decoder_attention_heads", "num_key_value_heads", "num_kv_heads", "n_kv_heads",
          "multi_query_group_num")
_FFN = ("intermediate_size", "d_ff", "n_inner", "ffn_dim", "encoder_ffn_dim",
        "decoder_ffn_dim", "ffn_hidden_size", "moe_intermediate_size",
        "shared_expert_intermediate_size")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
              "seq_length")


def families(tasks: list[str]) -> list[tuple[str, str]]:
    """(model_type, task) of every family transformers maps to ``tasks``."""
    from transformers.models.auto import modeling_auto

    out = []
    for task in tasks:
        names = getattr(modeling_auto, TASK_MAPPINGS[task])
        out += [(mt, task) for mt in sorted(names)]
    return out


_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
              "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")


def _settable(cfg: Any, name: str) -> bool:
    """Whether ``name`` is a field of ``cfg``, not a read-only property (Mamba's and
    Jamba's ``layer_types``, Falcon's ``head_dim`` are computed)."""
    prop = getattr(type(cfg), name, None)
    return not (isinstance(prop, property) and prop.fset is None)


def _fewer(types: list[Any], layers: int) -> list[Any]:
    """``layers`` of the layer kinds ``types``, every kind kept (a hybrid's attention layer
    too: Qwen3.5's first two layers are linear attention, with no cache of their own)."""
    kinds = list(dict.fromkeys(types))
    out = kinds[:layers]
    for t in types:
        if len(out) >= layers:
            break
        out.append(t)
    return out


def shrink(config: Any, size: str) -> dict[str, Any]:
    """The ``AutoConfig.for_model`` keyword arguments that make ``config`` small: each field
    the config has, in ``text_config`` too."""
    hidden, layers, heads, ffn, vocab, _, seq = SIZES[size]

    def fields(cfg: Any) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        for names, value in ((_HIDDEN, hidden), (_LAYERS, layers), (_HEADS, heads),
                             (_FFN, ffn)):
            for name in names:
                if isinstance(getattr(cfg, name, None), int):
                    kw[name] = value
        if isinstance(getattr(cfg, "head_dim", None), int):
            kw["head_dim"] = hidden // heads
        if isinstance(getattr(cfg, "d_kv", None), int):
            kw["d_kv"] = hidden // heads
        if isinstance(getattr(cfg, "vocab_size", None), int):
            kw["vocab_size"] = vocab
        for name in _POSITIONS:
            if isinstance(getattr(cfg, name, None), int):
                kw[name] = max(2 * seq, 128)
        if isinstance(getattr(cfg, "num_local_experts", None), int):
            kw["num_local_experts"] = min(cfg.num_local_experts, 4)
        if isinstance(getattr(cfg, "num_experts", None), int) and cfg.num_experts > 4:
            kw["num_experts"] = 4
        if isinstance(getattr(cfg, "num_experts_per_tok", None), int):
            kw["num_experts_per_tok"] = min(cfg.num_experts_per_tok, 2)
        if isinstance(getattr(cfg, "layer_types", None), list) and _settable(cfg, "layer_types"):
            kw["layer_types"] = _fewer(cfg.layer_types, layers)
        if isinstance(getattr(cfg, "attention_types", None), list):  # GPT-Neo: [[kinds, n]]
            kinds = cfg.attention_types[0][0]
            kw["attention_types"] = [[kinds, max(layers // len(kinds), 1)]]
        for i, name in enumerate(_TOKEN_IDS):  # a special token past the smaller vocabulary
            tid = getattr(cfg, name, None)
            if isinstance(tid, int) and tid >= vocab:
                kw[name] = vocab - 1 - i
        if cfg.is_encoder_decoder and getattr(cfg, "decoder_start_token_id", None) is None:
            kw["decoder_start_token_id"] = kw.get("pad_token_id", getattr(cfg, "pad_token_id",
                                                                          None)) or 0
        return {k: v for k, v in kw.items() if _settable(cfg, k)}

    kw = fields(config)
    text = getattr(config, "text_config", None)
    if text is not None and hasattr(text, "to_dict"):
        kw["text_config"] = {**{k: v for k, v in text.to_dict().items()
                                if k in ("model_type",)}, **fields(text)}
    return kw


def _attention(model_type: str, task: str) -> str:
    """``sdpa`` where the family's model class runs it, else ``eager`` (BLOOM, Gemma 2,
    BigBird: transformers refuses sdpa for them), as ``from_pretrained`` picks."""
    import transformers
    from transformers.models.auto import modeling_auto

    name = getattr(modeling_auto, TASK_MAPPINGS[task]).get(model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", False) else "eager"


def _spec(model_type: str, task: str, size: str, setup: str,
          config: dict[str, Any]) -> dict[str, Any]:
    *_, batch, seq = SIZES[size]
    spec = {"name": f"zoo-{model_type}-{task}-{size}-{setup}", "model_type": model_type,
            "config": config, "task": task, "batch": batch, "seq": seq,
            "attn_implementation": _attention(model_type, task), **SETUPS[setup],
            "optim_args": None}
    if task == "token-cls" and spec["lora"] is not None:
        # peft leaves a classifier's head out of "all-linear" for SEQ_CLS only; for
        # TOKEN_CLS the head gets an adapter and then cannot be trained whole
        # (modules_to_save: TypeError), so a user excludes it, as autofit does
        spec["lora"] = {**spec["lora"], "exclude_modules": ["classifier", "score"]}
    return spec


def probe(model_type: str, task: str, size: str) -> tuple[dict[str, Any] | None, str]:
    """The small config's keyword arguments and "" when the family builds and runs one
    forward with labels; else None and the first line of why not."""
    import torch
    import transformers
    from measure_cpu import TASK_CLASSES, _make_batch

    if task not in TASK_CLASSES:
        return None, f"task {task}: not planned by autofit"
    try:
        base = transformers.AutoConfig.for_model(model_type)
        kw = shrink(base, size)
        if task == "token-cls":
            kw["num_labels"] = TOKEN_LABELS  # the spec carries it: harness and estimate alike
        config = transformers.AutoConfig.for_model(model_type, **kw)
        if task == "seq-cls":
            config.num_labels = 2
            if getattr(config, "pad_token_id", None) is None:
                config.pad_token_id = 0
        cls = getattr(transformers, TASK_CLASSES[task])
        with torch.device("meta"):  # counted first: a field not shrunk may make it huge
            params = sum(p.numel() for p in cls.from_config(config).parameters())
        if params > PROBE_MAX_PARAMS:
            return None, f"{params / 1e6:.0f}M parameters at the small size (fields not shrunk)"
        torch.manual_seed(0)
        model = cls.from_config(config)
        batch = _make_batch({"task": task}, getattr(config, "text_config", None) or config, 2, 16)
        out = model(**batch)
        if getattr(out, "loss", None) is None:
            return None, "no loss from labels"
        out.loss.backward()
        return kw, ""
    except Exception as e:  # noqa: BLE001 - the reason is the result
        line = f"{type(e).__name__}: {e}".strip().splitlines()[0]
        return None, line[:200]


def _estimate(spec: dict[str, Any], method: str, tmp: Path) -> tuple[int, str, float]:
    from accuracy import _estimate as estimate

    est, secs = estimate(spec, method, tmp)
    return int(est.peak_allocated_bytes), str(est.peak_phase), secs


def run_one(spec: dict[str, Any], setup: str, methods: list[str]) -> dict[str, Any]:
    """Measure ``spec`` (a child of the harness) and estimate it: one zoo row."""
    from measure_cpu import measure

    from autofit.probe.device import cpu_capability, cpu_vendor

    row: dict[str, Any] = {"name": spec["name"], "spec": spec, "setup": setup,
                           # the math libraries' caches differ by both (MKL packs fp32
                           # weights on a Xeon, not on an AMD EPYC: cpu_cache.py)
                           "cpu": cpu_capability(), "vendor": cpu_vendor()}
    try:
        m = measure(spec)
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        row["error"] = f"measure: {str(e).strip().splitlines()[-1][:300]}"
        return row
    truth = m["peak_bytes"] + m["weights_bytes"]
    row["measured"] = truth
    with tempfile.TemporaryDirectory() as d:
        for method in methods:
            try:
                est, phase, secs = _estimate(spec, method, Path(d))
            except Exception as e:  # noqa: BLE001 - refused or failed: the row says which
                row[f"{method}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                continue
            row[method] = est
            row[f"{method}_err"] = (est - truth) / truth
            row[f"{method}_phase"] = phase
            row[f"{method}_s"] = round(secs, 2)
    return row


def reestimate(row: dict[str, Any], methods: list[str]) -> dict[str, Any]:
    """``row``'s estimates made again against its measurement (after a change to the model
    of memory: the harness's numbers do not change)."""
    from accuracy import cpu_rules_of

    # estimated with the rules of the instruction set and the maker it was measured on
    with cpu_rules_of(_row_cpu(row), row.get("vendor")):
        _reestimate(row, row["spec"], methods)
    return row


def _reestimate(row: dict[str, Any], spec: dict[str, Any], methods: list[str]) -> None:
    if "measured" not in row:  # the harness's step failed: what autofit says of it
        with tempfile.TemporaryDirectory() as d:
            for method in methods:
                try:
                    est, _, _ = _estimate(spec, method, Path(d))
                    row[f"{method}_says"] = f"estimates {est / 2**20:.1f} MiB"
                except Exception as e:  # noqa: BLE001 - the refusal is the answer
                    row[f"{method}_says"] = (f"{type(e).__name__}: "
                                             f"{str(e).splitlines()[0][:300]}")
        return
    with tempfile.TemporaryDirectory() as d:
        for method in methods:
            for k in (method, f"{method}_err", f"{method}_phase", f"{method}_s",
                      f"{method}_error"):
                row.pop(k, None)
            try:
                est, phase, secs = _estimate(spec, method, Path(d))
            except Exception as e:  # noqa: BLE001
                row[f"{method}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                continue
            row[method] = est
            row[f"{method}_err"] = (est - row["measured"]) / row["measured"]
            row[f"{method}_phase"] = phase
            row[f"{method}_s"] = round(secs, 2)


def _load(path: Path) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {"built": {}, "rows": {}}


def _save(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="causal-lm,masked-lm,seq2seq,seq-cls,token-cls")
    ap.add_argument("--families", default=None, help="comma-separated model types")
    ap.add_argument("--sizes", default="s,m")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--methods", default="analytic,simulate")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="at most this many new rows")
    ap.add_argument("--list", action="store_true", help="probe what builds; measure nothing")
    ap.add_argument("--report", action="store_true", help="only rewrite zoo.md / zoo.png")
    ap.add_argument("--reestimate", action="store_true",
                    help="estimate the measured rows again (of --families, --tasks, "
                         "--sizes and --setups), each "
                         "with its instruction set's rule; measure nothing")
    ap.add_argument("--failed", action="store_true",
                    help="with --reestimate: only the rows the harness could not measure "
                         "(what autofit says of each)")
    ap.add_argument("--vendor", default=None,
                    help="with --reestimate: only the rows measured on this CPU maker (AMD; "
                         "none: the rows from before the maker was recorded)")
    ap.add_argument("--retry-failed", action="store_true",
                    help="measure again the rows whose last attempt failed (a harness or "
                         "library fixed since), not only new rows")
    ap.add_argument("--remeasure", type=int, default=0, metavar="N",
                    help="measure N more times the rows (of --families, --tasks, --sizes "
                         "and --setups, measured on this CPU) that either method "
                         "misses its targets on; each keeps every draw and the highest")
    ap.add_argument("--out", default=str(RESULTS / "zoo"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    data = _load(out.with_suffix(".json"))
    if args.report:
        report(out, data)
        return 0
    if args.remeasure:
        from autofit.probe.device import cpu_capability, cpu_vendor

        # (drawn on the machine it was measured on: its instruction set and maker)
        chosen = set(_selected(data, args))
        todo = [(name, row) for name, row in sorted(data["rows"].items())
                if name in chosen and _outside(row) and _row_cpu(row) == cpu_capability()
                and row.get("vendor") == cpu_vendor()]
        remeasure(out, todo, args.remeasure, args.workers)
        report(out, _load(out.with_suffix(".json")))
        return 0
    if args.reestimate:
        done: dict[str, Any] = {}
        chosen = set(_selected(data, args))
        todo = [(name, row) for name, row in sorted(data["rows"].items()) if name in chosen
                and (args.vendor is None or (row.get("vendor") or "none") == args.vendor)]
        for n, (name, row) in enumerate(todo, 1):
            done[name] = reestimate(row, args.methods.split(","))
            print(f"[{n}/{len(todo)}]", name,
                  "  ".join(f"{m} {100 * row[m + '_err']:+.1f}%" if m + "_err" in row
                            else f"{m} {row.get(m + '_error', row.get(m + '_says'))}"
                            for m in args.methods.split(",")), flush=True)
            if n % 10 == 0 or n == len(todo):
                # only the rows re-estimated here: another process may be at the others
                disk = _load(out.with_suffix(".json"))
                disk["rows"].update(done)
                _save(out.with_suffix(".json"), disk)
        report(out, _load(out.with_suffix(".json")))
        return 0
    tasks = args.tasks.split(",")
    wanted = set(args.families.split(",")) if args.families else None
    sizes = args.sizes.split(",")
    pairs = [(mt, t) for mt, t in families(tasks)
             if wanted is None or mt in wanted]
    # 1. what builds (cached in the JSON: a family's probe is the same every run)
    for i, (mt, task) in enumerate(pairs, 1):
        for size in sizes:
            key = f"{mt}|{task}|{size}"
            if key in data["built"]:
                continue
            kw, why = probe(mt, task, size)
            data["built"][key] = {"config": kw, "skip": why}
            print(f"[{i}/{len(pairs)}] {key}: {'builds' if kw is not None else why}", flush=True)
        _save(out.with_suffix(".json"), data)
    if args.list:
        report(out, data)
        return 0
    # 2. measure and estimate what builds, rows not already there
    from autofit.probe.device import cpu_capability

    here = cpu_capability()
    methods = args.methods.split(",")
    todo = []
    for mt, task in pairs:
        for size in sizes:
            b = data["built"].get(f"{mt}|{task}|{size}")
            if not b or b["config"] is None:
                continue
            for setup in args.setups.split(","):
                spec = _spec(mt, task, size, setup, b["config"])
                old = data["rows"].get(spec["name"])
                if _row_cpu(old) != here or (args.retry_failed and "error" in (old or {})):
                    todo.append((spec, setup))  # new, or measured on another instruction set
    todo = todo[: args.limit] if args.limit else todo
    print(f"{len(todo)} rows to measure ({args.workers} workers)", flush=True)
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = {pool.submit(run_one, spec, setup, methods): spec for spec, setup in todo}
        for n, fut in enumerate(as_completed(futures), 1):
            spec = futures[fut]
            try:
                row = fut.result()
            except Exception:  # noqa: BLE001
                row = {"name": spec["name"], "spec": spec,
                       "error": traceback.format_exc().splitlines()[-1][:300]}
            data["rows"][row["name"]] = row
            # what another process (a re-estimate) wrote meanwhile is kept: only this row
            # is ours to write
            disk = _load(out.with_suffix(".json"))
            disk["rows"][row["name"]] = row
            disk["built"] = {**disk.get("built", {}), **data["built"]}
            _save(out.with_suffix(".json"), disk)
            data = disk
            errs = "  ".join(f"{m} {100 * row[m + '_err']:+.1f}%" for m in methods
                             if m + "_err" in row)
            print(f"[{n}/{len(todo)} {time.time() - t0:.0f}s] {row['name']}: "
                  f"{row.get('error') or errs}", flush=True)
    report(out, data)
    return 0


def _selected(data: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The measured rows (``args.failed``: the failed ones) of ``args.families`` (all where
    None), ``args.tasks``, ``args.sizes`` and ``args.setups``."""
    fams = set(args.families.split(",")) if args.families else None
    tasks, setups = set(args.tasks.split(",")), set(args.setups.split(","))
    failed = getattr(args, "failed", False)
    return [name for name, row in sorted(data["rows"].items())
            if ("error" in row if failed else "measured" in row)
            and (fams is None or row["spec"]["model_type"] in fams)
            and row["spec"]["task"] in tasks and row.get("setup") in setups
            and any(name.endswith(f"-{row['spec']['task']}-{size}-{row.get('setup')}")
                    for size in args.sizes.split(","))]


def _outside(row: dict[str, Any]) -> bool:
    """Whether either method misses its targets on ``row``: under ``UNDER``, or further
    than its worst."""
    return any(f"{m}_err" in row and (row[f"{m}_err"] < UNDER or abs(row[f"{m}_err"]) > worst)
               for m, (_, worst) in TARGETS.items())


def _draw(spec: dict[str, Any]) -> int:
    """One more measurement of ``spec``'s peak (a child of the harness), weights included."""
    from measure_cpu import measure

    m = measure(spec)
    return int(m["peak_bytes"] + m["weights_bytes"])


def remeasure(out: Path, todo: list[tuple[str, dict[str, Any]]], draws: int,
              workers: int) -> None:
    """Measure each row of ``todo`` ``draws`` more times: it keeps every draw
    (``measured_draws``, the first its sweep's) and the highest as its peak, its errors
    against that. One step's peak is not one number on every row: MarkupLM's classifier
    with 8-bit AdamW draws 119.5 or 129.5 MiB from one fresh process to the next, and the
    higher is a peak a user's run reaches. Only rows a method misses its targets on are
    drawn again (a draw costs a fresh process); an underestimate can only grow so."""
    if not todo:
        print("no row outside the targets", flush=True)
        return
    print(f"{len(todo)} rows x {draws} draws ({workers} workers)", flush=True)
    drawn: dict[str, list[int]] = {name: [] for name, _ in todo}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(_draw, row["spec"]): name
                   for name, row in todo for _ in range(draws)}
        for fut in as_completed(futures):
            try:
                drawn[futures[fut]].append(fut.result())
            except Exception as e:  # noqa: BLE001 - the row keeps its draws so far
                print(f"{futures[fut]}: {type(e).__name__}: {e}", flush=True)
    disk = _load(out.with_suffix(".json"))
    for name, row in todo:
        row = disk["rows"][name]
        first = row.get("measured_draws") or [row["measured"]]
        row["measured_draws"] = first + drawn[name]
        row["measured"] = max(row["measured_draws"])
        for m in TARGETS:
            if m in row:
                row[f"{m}_err"] = (row[m] - row["measured"]) / row["measured"]
        mib = [round(d / 2**20, 1) for d in row["measured_draws"]]
        print(name, "draws (MiB):", mib, "  ".join(f"{m} {100 * row[m + '_err']:+.1f}%"
                                                   for m in TARGETS if m + "_err" in row),
              flush=True)
    _save(out.with_suffix(".json"), disk)


def _row_machine(row: dict[str, Any]) -> str:
    """What a row's table groups it by: its instruction set, and its CPU's maker where it
    was recorded (rows from before it was: the instruction set alone)."""
    vendor = row.get("vendor")
    return f"{_row_cpu(row)} {vendor}" if vendor else str(_row_cpu(row))


def _row_cpu(row: dict[str, Any] | None) -> str | None:
    """The instruction set a row was measured on (the rows before it was recorded: AVX2)."""
    return None if row is None else row.get("cpu", "AVX2")


def _summary(rows: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    errs = [r[f"{method}_err"] for r in rows if f"{method}_err" in r]
    if not errs:
        return None
    med, worst = TARGETS[method]
    mags = [abs(e) for e in errs]
    under = [e for e in errs if e < UNDER]
    return {"n": len(errs), "median_abs": statistics.median(mags), "max_abs": max(mags),
            "under": len(under), "min": min(errs),
            "met": statistics.median(mags) <= med and max(mags) <= worst and not under}


def report(out: Path, data: dict[str, Any]) -> None:
    """zoo.md and zoo.png from the rows of zoo.json."""
    rows = [r for r in data["rows"].values() if "measured" in r]
    methods = [m for m in TARGETS if any(f"{m}_err" in r for r in rows)]
    lines = ["# The zoo: every family transformers builds, measured on this CPU", "",
             "`python benchmarks/zoo.py` (see its docstring). Error = (estimate - measured) / "
             "measured, absolute peak (weights included); negative = an underestimate.", ""]
    lines += ["Rows carry the instruction set they were measured on (the CPU math libraries' "
              "caches differ by it; rows from before it was recorded: AVX2); each is estimated "
              "with that instruction set's rule. Rows measured since the CPU's maker was "
              "recorded carry it too (an AMD EPYC's MKL does not pack fp32 weights as a "
              "Xeon's does, so its caches are smaller than the AVX512 rule, fitted on rows measured before the maker was recorded, most likely on a Xeon: their MKL packed fp32 weights).",
              ""]
    lines += ["| method | CPU | rows | median abs | worst abs | lowest | under -3% | target | met |",
              "|---|---|---|---|---|---|---|---|---|"]
    cpus = sorted({_row_machine(r) for r in rows})
    for m, cpu in [(m, c) for m in methods for c in [*cpus, "all"]]:
        s = _summary([r for r in rows if cpu in ("all", _row_machine(r))], m)
        if s is None:
            continue
        med, worst = TARGETS[m]
        lines.append(f"| {m} | {cpu} | {s['n']} | {100 * s['median_abs']:.1f}% | "
                     f"{100 * s['max_abs']:.1f}% | {100 * s['min']:+.1f}% | {s['under']} | "
                     f"<= {100 * med:g}% / {100 * worst:g}%, none < {100 * UNDER:g}% | "
                     f"{'yes' if s['met'] else 'no'} |")
    built = data.get("built", {})
    ok = sum(1 for b in built.values() if b["config"] is not None)
    lines += ["", f"Families x tasks x sizes probed: {len(built)}; built and ran: {ok}; "
              f"rows measured: {len(rows)}; rows that failed: "
              f"{sum(1 for r in data['rows'].values() if 'error' in r)}.", ""]
    # per family: the worst error of each method, with its side
    lines += ["## Per family (worst error of each method over its rows)", "",
              "| family | task | CPU | rows | " + " | ".join(methods) + " |",
              "|---|---|---|---|" + "---|" * len(methods)]
    by: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["spec"]["model_type"], r["spec"]["task"], _row_machine(r)), []).append(r)
    for (mt, task, cpu), rs in sorted(by.items()):
        cells = []
        for m in methods:
            errs = [(r[f"{m}_err"], r["name"]) for r in rs if f"{m}_err" in r]
            refused = [r for r in rs if f"{m}_error" in r]
            if errs:
                e = max(errs, key=lambda x: abs(x[0]))[0]
                cells.append(f"{100 * e:+.1f}%" + (" **under**" if e < UNDER else ""))
            else:
                cells.append("refused" if refused else "-")
        lines.append(f"| {mt} | {task} | {cpu} | {len(rs)} | " + " | ".join(cells) + " |")
    again = sorted((r for r in rows if len(r.get("measured_draws", [])) > 1),
                   key=lambda r: r["name"])
    if again:  # (zoo.py --remeasure N: the rows a method missed its targets on)
        lines += ["", "## Rows measured more than once", "",
                  "Each keeps the highest of its draws (fresh processes): a peak a run "
                  "reaches. Draws in MiB, the sweep's first.", "",
                  "| row | draws | spread | " + " | ".join(methods) + " |",
                  "|---|---|---|" + "---|" * len(methods)]
        for r in again:
            d = r["measured_draws"]
            lines.append(f"| {r['name']} | {', '.join(f'{x / 2**20:.1f}' for x in d)} | "
                         f"{100 * (max(d) - min(d)) / min(d):.1f}% | " + " | ".join(
                             f"{100 * r[m + '_err']:+.1f}%" if m + "_err" in r else "-"
                             for m in methods) + " |")
    failed = [r for r in data["rows"].values() if "error" in r]
    if failed:
        lines += ["", "## Rows the harness could not measure", "",
                  "The step fails in the harness (transformers' or peft's own code, as in a "
                  "user's run); what autofit answers for the same configuration "
                  "(`--reestimate --failed`): a refusal in one line is right, an estimate "
                  "is not.", ""]
        for r in sorted(failed, key=lambda r: r["name"]):
            says = "; ".join(f"{m}: {r[m + '_says']}" for m in methods if m + "_says" in r)
            lines.append(f"- {r['name']}: {r['error']}" + (f" — autofit {says}" if says else ""))
    skipped = sorted((k, b["skip"]) for k, b in built.items() if b["config"] is None)
    if skipped:
        lines += ["", "## Families that do not build offline at the small sizes", ""]
        lines += [f"- {k.replace('|', ' / ')}: {why}" for k, why in skipped]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    _plot(out.with_suffix(".png"), rows, methods)


def _plot(path: Path, rows: list[dict[str, Any]], methods: list[str]) -> None:
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    setups = list(SETUPS)
    for i, m in enumerate(methods):
        xs = [setups.index(r.get("setup", "fp32")) for r in rows if f"{m}_err" in r]
        ys = [100 * r[f"{m}_err"] for r in rows if f"{m}_err" in r]
        ax.scatter([x + 0.2 * (i - 0.5) for x in xs], ys, s=10, alpha=0.6, label=m)
    ax.axhline(100 * UNDER, color="red", lw=0.8, ls="--", label="-3% (an OOM below)")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xticks(range(len(setups)), setups)
    ax.set_ylabel("estimate error, % of measured peak")
    ax.set_title("autofit's CPU estimates across transformers' families (zoo.py)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
