"""Do autofit's one-line refusals of steps that fail whatever their memory refuse anything
that trains? Every zoo configuration the harness measured (so its step ran) is put to them.

    python benchmarks/refusal_scan.py            # writes benchmarks/results/refusal_scan.md

Three checks, over the rows of ``benchmarks/results/zoo.json`` that the independent harness
measured:

* LoRA on layers that subclass ``nn.Linear`` without computing ``x @ W.T``
  (``autofit.probe.peft.check_lora_targets``): every measured LoRA row's model is built with
  its LoRA (meta device) and must not be refused.
* A fill beyond a 16-bit dtype's range (``StepFailsError`` from the recorder): every measured
  ``*-s-bf16-ckpt`` row estimated (analytic) as measured; then the same configurations in
  ``16-mixed`` without checkpointing (simulate), which the zoo does not measure: a refusal
  there is listed with its reason, to be judged (DeBERTa's is a real failure, xLSTM's
  its own autograd error without checkpointing).

A refusal of a measured row is a false refusal: a user's working setup turned away.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _config_path(spec: dict) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model_type": spec["model_type"], **spec["config"]}, f)
    return f.name


def main() -> int:
    import accuracy

    from autofit.errors import BadInputError, StepFailsError
    from autofit.probe.model import build_model

    warnings.simplefilter("ignore")
    rows = json.loads((RESULTS / "zoo.json").read_text())["rows"]
    measured = {n: r for n, r in sorted(rows.items()) if "measured" in r}
    lora = [r for r in measured.values() if r["spec"].get("lora")]
    lora_refused = []
    for r in lora:
        # (the harness's exclude_modules of a token classifier's head: autofit's LoRA leaves
        # it out itself)
        lora_spec = {k: v for k, v in r["spec"]["lora"].items() if k != "exclude_modules"}
        try:
            build_model(_config_path(r["spec"]), task=r["spec"]["task"], lora=lora_spec)
        except BadInputError as e:
            if "x @ W.T" in str(e):
                lora_refused.append((r["name"], str(e).splitlines()[0]))
    half = [r for n, r in measured.items() if n.endswith("-s-bf16-ckpt")]
    bf16_refused, fp16_refused = [], []
    for r in half:
        for spec, method, out in ((r["spec"], "analytic", bf16_refused),
                                  ({**r["spec"], "precision": "16-mixed",
                                    "gradient_checkpointing": False}, "simulate", fp16_refused)):
            try:
                accuracy._estimate(spec, method, Path(tempfile.mkdtemp()))
            except StepFailsError as e:
                out.append((r["name"], str(e).splitlines()[0][:200]))
            except Exception:  # noqa: BLE001 - other refusals are not this check's
                pass
    lines = ["# Refusals of steps that fail whatever their memory, against measured rows", "",
             "`python benchmarks/refusal_scan.py` (see its docstring).", "",
             "| check | measured rows | refused |", "|---|---|---|",
             f"| LoRA on layers that are no plain linear | {len(lora)} | {len(lora_refused)} |",
             f"| 16-bit fill overflow, bf16-mixed + ckpt (analytic) | {len(half)} | "
             f"{len(bf16_refused)} |",
             f"| the same configurations in 16-mixed, no ckpt (simulate; not measured) | "
             f"{len(half)} | {len(fp16_refused)} |", ""]
    for title, items in (("LoRA", lora_refused), ("bf16-mixed", bf16_refused),
                         ("16-mixed", fp16_refused)):
        if items:
            lines += [f"## Refused: {title}", ""] + [f"- {n}: {why}" for n, why in items] + [""]
    (RESULTS / "refusal_scan.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
