"""A handful of the zoo's families (``benchmarks/zoo.py``), each guarding a path of the
memory model, against the peaks the independent harness measured for them (committed in
``benchmarks/results/zoo.json``): the analytic estimate never more than 3% below, at most
10% above (the zoo's targets for the analytic method).

- ``afmoe``: a mixture-of-experts model in fp32 (transformers' ``grouped_mm`` experts,
  whose meta kernel takes bf16 only: the estimate was an internal error);
- ``bert`` with LoRA on every linear layer (fitted BERT rows: 4.9% under);
- ``opt``, ``gptj`` (GPT-2's fitted coefficients: 14.9% and 7.8% over);
- ``gemma2`` (eager, soft-capped attention; llama's fitted coefficients: 22.8% under);
- ``ibert`` (its own buffers, 12 MiB of quantization state: 8.8% under without them);
- ``pegasus_x``, ``mt5`` and LoRA on ``bart``: encoder-decoders take coefficients derived
  per stack (T5's fitted ones: 31.6% and 9.1% under; LoRA was refused);
- ``ctrl``'s classifier with LoRA: a step that peaks in its forward (without a forward
  candidate 9.2% under);
- ``glm_moe_dsa``: trainable weights no gradient reaches (the sparse-attention indexer:
  no gradient, no optimizer state; 54.8% over when counted);
- 8-bit AdamW on ``qwen3`` and bf16-mixed with checkpointing on a medium ``opt`` (the levers
  an outside harness found 11-15% and 13% over);
- ``convbert`` and ``mobilebert`` as masked LMs: heads that project from a width other than
  the hidden size (the CPU libraries' buffer for a 768 x vocabulary head: 3.9% under);
- ``mobilebert``'s masked LM with 8-bit AdamW on an AMD EPYC: its head multiplies by a
  stacked weight, not a linear layer, so its weight gradient is a (hidden, rows) @ (rows,
  vocabulary) product, whose MKL buffer outgrows the forward's at 4 x 128 tokens
  (``_cpu_cache._amd_product``: 3.9% under analytic, 3.4% simulated without it);
- ``deberta``: disentangled attention keeps its position scores (BERT's fitted
  coefficients: 3.3% under);
- ``bart`` as a masked LM: an encoder-decoder read as one encoder ("no transformer blocks");
- ``kimi_linear`` with LoRA: its linear-attention block's backward makes 1.5 GiB of scratch
  beyond a standard block's rule, on the first block, whose backward hook ends at once
  (21.6-22.2% under);
- ``qwen3_next`` in bf16-mixed with checkpointing: a hybrid whose linear-attention block keeps
  ten times its full-attention block, and whose forward reaches 21% above what it keeps;
  checkpointing recomputes the largest block, not their mean (27% under);
- ``qwen3_next``'s causal LM with LoRA: its forward peaks at other moments at other shapes
  (at 4 x 32 in the first block's recurrence, at the others at the loss): each shape's
  transient is fitted beside the share the estimate uses (21.1% over);
- ``qwen3_next``'s classifier in fp32: its forward peaks in the first, linear-attention
  block's chunked recurrence, at ~0.7 of what the forward keeps (with all of it 19.4% over);
- ``t5`` as a token classifier: its encoder alone under an encoder-decoder's config (read
  as encoder + decoder pairs, 66% over);
- ``neomme`` (NeoBERT) with 8-bit AdamW: 1.7M trainable elements the loss never reaches,
  taken off at the cheapest state, not pro rata (its embedding's states are 32-bit under the
  Trainer: 3.5% under).
- ``gpt_neox``'s token classifier with LoRA: the top block's backward as derived (what the
  head's backward freed, the block's scratch), not the standard block's rule on top of all
  activations (13.1% over);
- ``albert``'s token classifier: one shared layer run twice, whose backward starts twice;
  the top backward's moments fitted one by one (one fit of the highest points: 3.4% under).
- ``electra``'s and ``gpt_neo``'s classifiers in fp32: their blocks as derived, not BERT's
  and GPT-2's fitted coefficients (ELECTRA's embeddings are narrower than its blocks and
  projected; GPT-Neo's blocks keep other tensors: 8.3% and 8.6% over);
- ``t5``'s classifier in bf16 with checkpointing: T5's fitted pair recomputes its decoder
  block beside the gradients made by then, and its encoder block beside the rest (the
  decoder's share beside all gradients: 11.3% and 13.6% over);
- ``fuyu`` with LoRA: a composite config whose widths are its text model's (its blocks
  were not recognised: the analytic estimate refused);
- ``lara_mini`` (and, slow, ``bailing_hybrid``) at the medium size, 256 tokens: coefficients
  derived at lengths scaled to the step's, not extrapolated from 128 tokens (12.4% and
  47-59% over, where memory is not a quadratic in the length);
- ``openai-gpt``: no block's full backward hook fires (its blocks return a list: the
  derivation was an internal error); its classifier's block backward starts where the
  block's output gets its gradient (the standard block's rule in its place: 3.1% under);
- ``pegasus_x`` with LoRA: a forward moment inside its block-padded encoder stands beside
  a smaller share of the activations at 4 x 128 tokens than at the probe shapes (with the
  probe shapes' largest share 10.1% over);
- ``dory`` in bf16 with checkpointing at the medium size: a looped model whose blocks each run
  twice in a forward; the earlier runs' activations were fitted into the base, outside the
  blocks, where checkpointing does not shrink them (22.8% over);
- 8-bit AdamW on ``camembert`` (its tied head, registered before the embeddings, names the
  embedding's weight: the Trainer's 32-bit states for embeddings go by the module, 10.9%
  under as a linear's), on ``ergo`` (a dense first block below a mixture-of-experts one: its
  32768-wide feed-forward's backward beside its own gradients, 5.2% under without them) and
  on ``glm_moe_dsa`` (the optimizer skips the indexer no gradient reaches, its largest
  tensors: their CPU scratch put it 31.9% over);
- ``umt5``'s classifier at the medium size in bf16 with checkpointing (derived now that its
  end-of-sequence pooling is followed): its top decoder block, then its top encoder block,
  recomputed each beside the gradients made by then and reaching its own stack's highest
  point (the larger block beside every gradient: 12.8% over);
- ``ergo`` in bf16 with checkpointing: its dense first block's backward peaks at another
  moment at 512 tokens (its squared ReLU's three (N, 32768) temporaries) than at the probe
  shapes (its weight's 16-bit gradient): each moment fitted on its own (3.9% under with one
  fit of the highest points).
- ``longformer``'s classifier in bf16 with checkpointing: its blocks take hidden states
  padded to its attention window (512 at 128 tokens) and a 4-D mask, which the checkpoints
  keep beside every recompute with the embeddings' saved tensors (derived: ``block_input``,
  ``below_kept``; 11.2% under with one residual stream per block and neither), and its
  kernels copy inside (``_cpu_kernels``);
- ``led`` in bf16 with checkpointing: its shared embedding gets its gradient only when both
  its uses are done, after the encoder's backward, so the encoder's top block is recomputed
  beside the decoder's gradients alone (derived: ``encoder_grads_outside``; 9.8% over with
  every gradient but the encoder blocks' beside it).

and, by simulation (no estimate below -3%, at most 5% above):

- ``m2m_100`` (LayerDrop: on fake tensors every layer was skipped, 42% under);
- ``fnet`` (blocks not recognised: the CPU libraries' caches of its linear layers, 9% under);
- ``rwkv`` (its per-token recurrence: 7,300 autograd nodes, whose host memory is no tensor:
  5.5% under; the heap's holes between the small tensors it keeps and frees in turn, which
  posix_memalign's padding keeps a same-size tensor out of: 3.3% under at the medium size
  without it; bounds of its two rows still outside the targets in ``SIMULATED_BOUNDS``);
- ``deepseek_v3``'s classifier (low-rank attention, 256 -> 1536 -> 768: the libraries' buffers
  of the block's own linear layers; 3.8% under);
- ``electra``'s token classifier in bf16 with checkpointing, measured on an AMD EPYC: the
  CPU libraries' 16-bit state counted per oneDNN primitive the step ran, beside what the
  process keeps once (overhead; the harness's warm-up makes it before its baseline: 8.8%
  over with it in the step);
- ``mamba`` (its scan reads one position of a tensor per step: 128 gradients meet at that
  tensor, which autograd sums in place and the fake step summed into a new one each
  time: 7.6% over).
- ``gpt_neox``'s token classifier with LoRA on an AMD EPYC and ``olmo``'s classifier with
  LoRA and ``glm4``'s in bf16 with checkpointing on a Xeon: what the CPU libraries keep
  from a process's first step (MKL's fp32 state, oneDNN's first 16-bit matmul's) is
  overhead, not the step's (the harness's warm-up makes it before its baseline: 6.3%,
  6.2% and 5.8% over with it in the step);
- ``bert``'s classifier in bf16 with checkpointing on a Xeon: its 16-bit library state
  counted per oneDNN primitive the step ran, which tells its math attention from a flash
  one (per weight shape: 5.7% over);
- ``fuyu`` with LoRA: its text model's blocks (not recognised, the CPU libraries' rule took
  its LM head for a feed-forward: 5.0% over);
- ``longformer``'s classifier in bf16 with checkpointing: what CPU kernels copy inside and
  free before they return (``_cpu_kernels``: its sliding-window chunks, overlapping views,
  copied contiguous for oneDNN's 16-bit ``bmm``, 12 MiB each; fp32 copies of 16-bit inputs
  added to the fp32 residual stream: 4.2% under without them).

Each row is estimated with the rule of the instruction set it was measured on (the CPU
math libraries' caches differ by it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
ROWS = ["zoo-afmoe-causal-lm-s-fp32", "zoo-bert-causal-lm-s-lora", "zoo-opt-causal-lm-s-fp32",
        "zoo-gptj-causal-lm-s-fp32", "zoo-gemma2-causal-lm-s-lora", "zoo-ibert-masked-lm-s-fp32",
        "zoo-pegasus_x-seq2seq-s-fp32", "zoo-mt5-seq2seq-s-fp32", "zoo-bart-seq2seq-s-lora",
        "zoo-ctrl-seq-cls-s-lora", "zoo-glm_moe_dsa-causal-lm-s-fp32",
        "zoo-qwen3-causal-lm-s-adamw8", "zoo-opt-causal-lm-m-bf16-ckpt",
        "zoo-convbert-masked-lm-s-lora", "zoo-mobilebert-masked-lm-s-lora",
        "zoo-mobilebert-masked-lm-s-adamw8",
        "zoo-deberta-masked-lm-s-fp32", "zoo-bart-masked-lm-s-fp32",
        "zoo-kimi_linear-causal-lm-s-lora", "zoo-qwen3_next-causal-lm-s-bf16-ckpt",
        "zoo-neomme-masked-lm-s-adamw8", "zoo-qwen3_next-seq-cls-s-fp32",
        "zoo-qwen3_next-causal-lm-s-lora",
        "zoo-t5-token-cls-s-fp32", "zoo-t5-seq-cls-s-bf16-ckpt", "zoo-t5-seq-cls-m-bf16-ckpt",
        "zoo-electra-seq-cls-m-fp32", "zoo-gpt_neo-seq-cls-s-fp32", "zoo-fuyu-causal-lm-s-lora",
        "zoo-gpt_neox-token-cls-s-lora", "zoo-albert-token-cls-s-fp32",
        "zoo-pegasus_x-seq2seq-s-lora", "zoo-lara_mini-causal-lm-m-lora",
        "zoo-openai-gpt-causal-lm-s-fp32", "zoo-dory-causal-lm-m-bf16-ckpt",
        "zoo-camembert-causal-lm-s-adamw8", "zoo-ergo-causal-lm-s-adamw8",
        "zoo-glm_moe_dsa-causal-lm-s-adamw8", "zoo-ergo-causal-lm-s-bf16-ckpt",
        "zoo-openai-gpt-seq-cls-s-adamw8", "zoo-umt5-seq-cls-m-bf16-ckpt",
        "zoo-longformer-seq-cls-s-bf16-ckpt", "zoo-led-seq2seq-s-bf16-ckpt",
        # (25 s: its chunked linear attention's probes at 64-256 tokens)
        pytest.param("zoo-bailing_hybrid-causal-lm-m-fp32", marks=pytest.mark.slow)]
SIMULATED = ["zoo-m2m_100-seq2seq-s-fp32", "zoo-fnet-masked-lm-s-fp32",
             "zoo-mobilebert-masked-lm-s-adamw8",
             # a checkpointed per-position recurrence measured within the targets: estimated
             # (RWKV's is refused: test_a_checkpointed_recurrence_on_a_cpu_is_refused)
             "zoo-mamba-causal-lm-s-bf16-ckpt",
             # (30 s: its 128-step recurrence; the graph's host bytes are also guarded by
             # tests/memory/test_sim_branches.py and the single-rank golden cases)
             pytest.param("zoo-rwkv-causal-lm-s-lora", marks=pytest.mark.slow),
             "zoo-deepseek_v3-seq-cls-s-lora", "zoo-mamba-causal-lm-s-fp32",
             "zoo-electra-token-cls-s-bf16-ckpt", "zoo-gpt_neox-token-cls-s-lora",
             "zoo-olmo-seq-cls-s-lora", "zoo-glm4-seq-cls-s-bf16-ckpt",
             "zoo-bert-seq-cls-s-bf16-ckpt", "zoo-fuyu-causal-lm-s-lora",
             "zoo-longformer-seq-cls-s-bf16-ckpt"]


def _rows() -> dict[str, dict]:
    return json.loads((BENCH / "results" / "zoo.json").read_text())["rows"]


def _error(name: str, method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> float:
    return _estimated(name, method, tmp_path, monkeypatch)[0]


def _estimated(name: str, method: str, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> tuple[float, tuple[str, ...]]:
    """A row's estimate: its error against the measured peak, and its notes."""
    row = _rows()[name]
    monkeypatch.setattr("autofit.probe.device.cpu_capability", lambda: row.get("cpu", "AVX2"))
    # the maker too (rows from before it was recorded: the Intel host's)
    monkeypatch.setattr("autofit.probe.device.cpu_vendor", lambda: row.get("vendor") or "Intel")
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("accuracy", None)
    from accuracy import _estimate

    est, _ = _estimate(row["spec"], method, tmp_path)
    return (est.peak_allocated_bytes - row["measured"]) / row["measured"], est.notes


# rows known to be more than 10% over, each with its bound and why (never a lower bound);
# none since T5's classifier's recompute moments (``_pair_moments``)
OVER: dict[str, float] = {}


@pytest.mark.parametrize("name", ROWS)
def test_a_zoo_family_is_estimated_within_its_measurement(name, tmp_path, monkeypatch):
    err = _error(name, "analytic", tmp_path, monkeypatch)
    top = OVER.get(name, 0.10)
    assert -0.03 <= err <= top, f"{name}: analytic {100 * err:+.1f}% of the measured peak"


# rows simulated outside -3%..+5%, each with its bounds and why. RWKV's CPU recurrence
# makes tens of thousands of small tensors and autograd nodes: the allocator model follows
# glibc on its tensors (its real allocations replayed: within 1.6%), and what is off is the
# host side. With LoRA the CPU libraries' rule adds 4 MiB the process did not show (its
# stream is 1.4% over the real one). In bf16 with checkpointing (4.8% and 11.9% under) it
# is refused: ``test_a_checkpointed_recurrence_on_a_cpu_is_refused``.
SIMULATED_BOUNDS: dict[str, tuple[float, float]] = {
    "zoo-rwkv-causal-lm-s-lora": (-0.03, 0.065),
}


@pytest.mark.parametrize("name", SIMULATED)
def test_a_zoo_family_is_simulated_within_its_measurement(name, tmp_path, monkeypatch):
    err, notes = _estimated(name, "simulate", tmp_path, monkeypatch)
    low, high = SIMULATED_BOUNDS.get(name, (-0.03, 0.05))
    assert low <= err <= high, f"{name}: simulate {100 * err:+.1f}% of the measured peak"


def test_a_checkpointed_recurrence_on_a_cpu_is_refused(tmp_path, monkeypatch):
    """RWKV's CPU kernel runs its recurrence token by token: checkpointed, a block is
    thousands of autograd nodes whose host memory the zoo measured 4.8% and 11.9% above
    the simulated step. The simulation refuses it in one line that says what to do."""
    from autofit.errors import UnmodelledStepError

    with pytest.raises(UnmodelledStepError) as e:
        _estimated("zoo-rwkv-causal-lm-s-bf16-ckpt", "simulate", tmp_path, monkeypatch)
    line = str(e.value)
    assert "\n" not in line and "recurrence" in line and "gradient_checkpointing=False" in line


def test_a_family_neither_method_can_follow_is_refused_in_one_line(tmp_path, monkeypatch):
    """The privacy filter's mixture of experts routes by ``nonzero`` of its router's
    choices, which come from its weights: fake tensors have no values there, so the
    simulation refuses, and so does the analytic estimate, whose coefficients come from
    the same forward."""
    from autofit.errors import ValueDependentShapeError

    for method in ("simulate", "analytic"):
        with pytest.raises(ValueDependentShapeError) as e:
            _error("zoo-openai_privacy_filter-token-cls-s-fp32", method, tmp_path, monkeypatch)
        line = str(e.value)
        assert "\n" not in line and "nonzero" in line and "measure" in line
        if method == "analytic":
            assert "neither estimate" in line


@pytest.mark.parametrize("name", ["zoo-bart-seq-cls-s-fp32", "zoo-t5-seq-cls-s-lora",
                                  "zoo-led-seq2seq-s-fp32", "zoo-deberta-seq-cls-s-fp32"])
def test_a_step_whose_shapes_follow_the_batch_is_estimated(name, tmp_path, monkeypatch):
    """Shapes that depend on the batch's values, which the simulation made itself, are
    followed on those values (``autofit.memory.simulate._values``): BART's classifier
    checks that every sample ends with one ``</s>`` (``unique_consecutive``) and pools
    there (a boolean index: ``nonzero``); T5's classifier the same; LED's and Longformer's
    global attention is ``nonzero`` of ``mask > 1`` on an all-ones mask they make; DeBERTa
    the same of its relative positions. Both methods refused these eight encoder-decoder
    classifiers and five more families; now within the zoo's targets."""
    for method, (low, high) in (("simulate", (-0.03, 0.05)), ("analytic", (-0.03, 0.10))):
        err = _error(name, method, tmp_path, monkeypatch)
        assert low <= err <= high, f"{name}: {method} {100 * err:+.1f}%"


def test_a_step_that_trains_only_with_checkpointing_is_refused_by_the_analytic_method(
        tmp_path, monkeypatch):
    """xLSTM's step (transformers') modifies in place a tensor its backward needs, unless
    its blocks are checkpointed: the analytic coefficients, derived from a step without
    checkpointing, cannot be, and it says so in one line (it was torch's RuntimeError);
    the simulation of the checkpointed step follows it (within 2% of the harness)."""
    from autofit.errors import BadInputError

    with pytest.raises(BadInputError) as e:
        _error("zoo-xlstm-causal-lm-s-bf16-ckpt", "analytic", tmp_path, monkeypatch)
    line = str(e.value)
    assert "\n" not in line and "in place" in line and "simulate" in line
    err = _error("zoo-xlstm-causal-lm-s-bf16-ckpt", "simulate", tmp_path, monkeypatch)
    assert -0.03 <= err <= 0.05
