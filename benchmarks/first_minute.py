"""The first minute: what a new user waits for, side by side in one run (issue 22's targets).

    python benchmarks/first_minute.py                  # every case, the default repeats
    python benchmarks/first_minute.py --cases check-cached estimate-70b --repeats 3
    python benchmarks/first_minute.py --skip-llama     # the long case left out
    git worktree add /tmp/prev <rev> && python benchmarks/first_minute.py --baseline /tmp/prev
    python benchmarks/first_minute.py --cases check-cached --plan tuned.yaml

Each case runs ``python -m autofit ...`` from this checkout in a fresh process (as a user
types it) and records its wall time, its CPU time (user + sys of the process and its
children: what the machine's load does not inflate) and the 1-minute load average
before and after. Cases and their targets (issue 22):

- ``quickstart``: README's quick start ``autofit tune tiny-gpt2 --dataset tiny-samples
  --device cpu:1GiB --target-batch-size 16`` with a fresh cache (<= 60 s);
- ``quickstart-plain``: the same with ``--no-chunked-loss`` (the default once the plain
  Trainer is the default: the chunked loss not searched);
- ``check-cached``: ``autofit check`` of the quick start's file, the second time (the first
  fills the cache; <= 3 s);
- ``estimate-70b``: ``autofit estimate meta-llama/Llama-3.1-70B`` analytic, from the bundled
  config on the meta device, no download (<= 10 s);
- ``llama``: a 4-layer llama (hidden 256, vocab 32000) on 2000 samples of 16-96 tokens, every
  97th of 384, ``--device cpu:3GiB --target-batch-size 64`` (<= 240 s).

Medians over ``--repeats`` where a repeat is cheap (the check and the estimate); the tuning
cases run once each by default (minutes on a loaded machine). Results go to
``benchmarks/results/first_minute.json`` and ``.md``.

Known limitations:
    NB: the machine is shared; the load average is reported with every timing and the CPU
    time beside the wall time, which is what to compare across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TARGETS = {"quickstart": 60.0, "quickstart-plain": 60.0, "check-cached": 3.0,
           "estimate-70b": 10.0, "llama": 240.0}
QUICK = ["tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", "cpu:1GiB",
         "--target-batch-size", "16"]


def _cpu_capability() -> str:
    """torch's vector ISA here (AVX2, AVX512, ...): half precision is native only with
    AVX512-BF16 / AMX, and ~40x slower than fp32 without."""
    out = subprocess.run([sys.executable, "-c", "import torch; "
                          "print(torch.backends.cpu.get_cpu_capability())"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(argv: list[str], env: dict[str, str], timeout: float, root: Path = ROOT) -> dict:
    """One ``python -m autofit`` run of the checkout at ``root``: wall, CPU (children),
    load, exit code."""
    load0 = os.getloadavg()[0]
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    env = {**env, "PYTHONPATH": str(root)}
    try:
        r = subprocess.run([sys.executable, "-m", "autofit", *argv], cwd=root, env=env,
                           capture_output=True, text=True, timeout=timeout)
        code, tail = r.returncode, (r.stderr or r.stdout).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        code, tail = None, [f"timed out after {timeout:.0f} s"]
    return {"wall_s": round(time.perf_counter() - t0, 2),
            "cpu_s": round(_children_cpu() - cpu0, 2),
            "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
            "exit": code, "last_line": tail[0][:200] if tail else ""}


def llama_case(tmp: Path) -> list[str]:
    """The issue's 4-layer llama: a local config and a JSONL of 2000 token-id samples."""
    model = tmp / "llama4"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
        "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 512,
        "tie_word_embeddings": False}))
    rng = random.Random(0)
    data = tmp / "llama4.jsonl"
    with data.open("w") as f:
        for i in range(2000):
            n = 384 if i % 97 == 0 else rng.randint(16, 96)
            f.write(json.dumps({"input_ids": [rng.randrange(32000) for _ in range(n)]}) + "\n")
    return ["tune", str(model), "--dataset", str(data), "--device", "cpu:3GiB",
            "--target-batch-size", "64"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--repeats", type=int, default=3, help="for the cheap cases")
    ap.add_argument("--tune-repeats", type=int, default=1)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=str(RESULTS / "first_minute"))
    ap.add_argument("--plan", help="check-cached: check this tuned file (default: the quick "
                                   "start's, made first when the quick start is not run)")
    ap.add_argument("--baseline-cases", nargs="+", choices=list(TARGETS),
                    help="with --baseline: the cases run beside it (default: every case)")
    ap.add_argument("--baseline", type=Path, help="a checkout of the previous release (e.g. "
                    "`git worktree add /tmp/prev <rev>`): each run of a case is followed by "
                    "the same run there, and the table gives their ratio")
    args = ap.parse_args()
    cases = [c for c in args.cases if not (args.skip_llama and c == "llama")]
    tmp = Path(tempfile.mkdtemp(prefix="first-minute-"))
    env = {**os.environ, "AUTOFIT_CACHE_DIR": str(tmp / "cache")}
    rows: dict[str, dict] = {}

    def run(name: str, argv: list[str], repeats: int, fresh_cache: bool) -> None:
        runs, base = [], []
        for i in range(repeats):
            for root, into, tag in ((ROOT, runs, ""), (args.baseline, base, "b")):
                if root is None or (tag and args.baseline_cases
                                    and name not in args.baseline_cases):
                    continue
                e = ({**env, "AUTOFIT_CACHE_DIR": str(tmp / f"cache-{name}-{i}{tag}")}
                     if fresh_cache else {**env, "AUTOFIT_CACHE_DIR": str(tmp / f"cache{tag}")})
                into.append(timed(argv, e, args.timeout, root))
                print(f"{name} #{i + 1}{' (baseline)' if tag else ''}: {into[-1]}", flush=True)
        rows[name] = {"argv": ["python", "-m", "autofit", *argv], "runs": runs,
                      **_medians(runs), "target_s": TARGETS[name]}
        if base:
            rows[name]["baseline"] = {"runs": base, **_medians(base)}

    quick_out = tmp / "tuned.yaml"
    out = Path(args.out)
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpus": os.cpu_count(), "cpu_capability": _cpu_capability(),
            "python": sys.version.split()[0], "commit": _commit(ROOT),
            "baseline": _commit(args.baseline) if args.baseline else None}
    # the cheap cases first; the results are written after every case (a long one may be
    # stopped and what ran is kept)
    for name in ("estimate-70b", "quickstart-plain", "quickstart", "check-cached", "llama"):
        if name not in cases:
            continue
        if name == "estimate-70b":
            run(name, ["estimate", "meta-llama/Llama-3.1-70B", "--batch-size", "1",
                       "--seq-len", "4096", "--device", "H100-80GB"], args.repeats, False)
        elif name == "quickstart-plain":
            run(name, [*QUICK, "--no-chunked-loss", "-o", str(tmp / "plain.yaml")],
                args.tune_repeats, True)
        elif name == "quickstart":
            run(name, [*QUICK, "-o", str(quick_out)], args.tune_repeats, True)
        elif name == "check-cached":
            plan = Path(args.plan) if args.plan else (
                quick_out if quick_out.exists() else tmp / "plain.yaml")
            if not plan.exists():  # the file to check
                timed([*QUICK, "--no-chunked-loss", "-o", str(plan)], env, args.timeout)
            check = ["check", str(plan), "--model", "tiny-gpt2", "--dataset", "tiny-samples",
                     "--device", "cpu:1GiB"]
            for root, tag in ((ROOT, ""), (args.baseline, "b")):  # the first fills the cache
                if root is not None:
                    timed(check, {**env, "AUTOFIT_CACHE_DIR": str(tmp / f"cache{tag}")},
                          args.timeout, root)
            run(name, check, args.repeats, False)
        else:
            run(name, [*llama_case(tmp), "-o", str(tmp / "llama.yaml")], args.tune_repeats,
                True)
        write(out, meta, rows)


def _commit(root: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True).stdout.strip()


def _medians(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["exit"] in (0, 3)]  # 3: "does not fit" is an answer
    return {"median_wall_s": statistics.median(r["wall_s"] for r in ok) if ok else None,
            "median_cpu_s": statistics.median(r["cpu_s"] for r in ok) if ok else None}


def write(out: Path, meta: dict, rows: dict) -> None:
    """``out``.json (every run) and ``out``.md (the table)."""
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cases": rows}, indent=2))
    base = meta.get("baseline")
    lines = [f"# First minute ({meta['when']}, commit {meta['commit']}, {meta['cpus']} CPUs, "
             f"{meta.get('cpu_capability', '?')})",
             "", "`python benchmarks/first_minute.py` — wall and CPU seconds, the 1-minute load "
             "average before / after each run (the machine is shared)"
             + (f"; each run followed by the same run of the previous release ({base}), their "
                "ratio in the last column" if base else "") + ".", "",
             "| case | target | median wall s | median CPU s | runs (wall s @ load) | met |"
             + (f" {base} median wall s | ratio (this / {base}) |" if base else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if base else "")]
    for name, r in rows.items():
        runs = ", ".join(f"{x['wall_s']}@{x['load_before']}" + ("" if x["exit"] == 0 else
                                                                 f" (exit {x['exit']})")
                         for x in r["runs"])
        met = "" if r["median_wall_s"] is None else (
            "yes" if r["median_wall_s"] <= r["target_s"] else "no")
        line = (f"| {name} | <= {r['target_s']:g} s | {r['median_wall_s']} | "
                f"{r['median_cpu_s']} | {runs} | {met} |")
        if base:
            b = r.get("baseline", {}).get("median_wall_s")
            ratio = f"{r['median_wall_s'] / b:.2f}" if b and r["median_wall_s"] else ""
            if b is None and r.get("baseline", {}).get("runs"):
                # no run of the baseline finished: say how each ended
                b = ", ".join(x["last_line"] if x["exit"] is None else f"exit {x['exit']}"
                              for x in r["baseline"]["runs"])
                ratio = "< " + ", ".join(f"{r['median_wall_s'] / x['wall_s']:.2f}"
                                         for x in r["baseline"]["runs"]
                                         if r["median_wall_s"])
            line += f" {b} | {ratio} |"
        lines.append(line)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
