"""The torch.compile knob: the Trainer's ``TrainingArguments(torch_compile=True)``.

    >>> args = {}; TORCH_COMPILE.emit(type("C", (), {"torch_compile": True})(), args)
    >>> args
    {'torch_compile': True}
    >>> TORCH_COMPILE.defaults(None)[0]  # searched only when asked
    (False,)

With ``torch_compile=True`` the Trainer (through accelerate's ``TorchDynamoPlugin``)
wraps the prepared model last, ``torch.compile(model, backend="inductor")``: the
forward is traced by dynamo, its backward built by AOTAutograd, and inductor fuses
chains of elementwise ops into single kernels.

It changes no math (the same ops; fused kernels round differently only in the last
bits), but it is searched only when asked (``autofit(..., torch_compile=[False,
True])``, ``autofit tune --torch-compile``): compilation costs minutes before the
first step, a model with graph breaks gains little, and a custom or unusual model may
not compile at all. When nothing fits, it is offered with its estimated peak.

**Its memory rule** (``compiled_saving_parts`` below, asked by
``autofit.memory.analytic.compile_saving_bytes``; both estimators take it off the eager
step), read off the tensors eager and compiled steps save
(``saved_tensors_hooks`` on small llama and GPT-2 models) and checked against measured
CPU peaks of compiled steps (``benchmarks/measure_cpu.py`` with ``"torch_compile":
true``; ``benchmarks/results/accuracy.md``, ``*-compile``). AOTAutograd's min-cut
partitioner (inductor's default) saves for backward what is costly to recompute
(matmul and attention inputs and outputs, norm statistics) and recomputes pointwise
chains inside the backward's fused kernels, so, per block and token:

* llama-like (gated MLP, RMSNorm, rotary): ``act(gate) * up`` (down_proj's input) is
  not kept (-i elements; not with relu), nor are the norms' and the rotary embedding's
  outputs, while the key/value heads are kept repeated to all heads: -2 kv elements net;
* GPT-2-like (LayerNorm, ungated MLP): by the MLP's activation (``benchmarks/
  compile_saved.py``): gelu_new's Python ops -3 i elements, gelu_fast -6 i, quick_gelu
  -1 i, a one-op GELU nothing, relu a bool mask more;
* the blocks' part only for the model types measured to save at least it
  (``_BLOCKS_CHECKED``, ``compile_saved.py --zoo``: 26 families; StableLM not), another's
  blocks as eager;
* on the CPU every dropout keeps a bool mask (1 byte) instead of eager's noise in the
  activation dtype: its hidden-sized dropouts, attention's (heads x T per token), the
  embeddings' (on a CUDA target nothing: eager dropout keeps a bool mask there too);
* the compiled graph materialises the causal mask, (B, 1, T, T) in the compute dtype,
  once per step, which eager SDPA gets as ``is_causal`` (on a long sequence and a narrow
  model compiling costs memory);
* the loss: eager keeps the fp32 log-softmax and makes two fp32 (B, T, V) gradients at
  the start of backward; the compiled graph fuses the upcast, the log-softmax and their
  backward. How many fp32 (B, T, V) buffers fewer are alive at the backward peak was
  measured, not derived: llama 0 in fp32 (its compiled backward still holds two), 1.75
  in bf16-mixed (it keeps the bf16 logits instead of the fp32 log-softmax), 1.65 in
  bf16-true (its 16-bit logits' upcast fused too); GPT-2 1 in fp32, 2.05 with autocast
  and 2.2 in bf16-true; another model type the least of the two; Gemma 2's soft-capped
  logits 0.9 more in bf16-true.

Regional compilation (accelerate's ``compile_regions``: an accelerate config's
``dynamo_use_regional_compilation``, or its environment ``REGIONAL_ENV``, which the Trainer's
TorchDynamoPlugin reads; ``TrainConfig.torch_compile_regional``) compiles each repeated block
apart and runs the rest eagerly: its blocks save what a whole compile's do, and what a
compiled block keeps fewer beyond the blocks' rule (``_REGIONAL_BLOCKS_MORE``, measured by
depth on llama and GPT-2); the loss, the causal mask and the embeddings' dropout are eager's.
Estimated as a whole compile it was 12-32% under (the loss's fp32 buffers a whole compile
fuses); the regional rows of ``benchmarks/results/accuracy.md`` are +0.2..+3.2%.

With gradient checkpointing only the block being recomputed gains. The simulator
takes the saving off every forward and backward event of its replayed eager step (so
a peak in the optimizer step stays where it was). Tracing the compiled graph itself on
fake tensors (dynamo and AOTAutograd's partitioner under the simulator's
``FakeTensorMode``) was not attempted: it would pay graph capture and partitioning,
most of the compile time (tens of seconds to minutes here), per candidate, where a
simulated step takes seconds.

Known limitations (what the rule does not model):
    * graph breaks: a model that breaks the graph (unsupported Python, data-dependent
      control flow) saves more, as eager does between the graphs; the rule assumes one
      graph per forward (transformers' decoders compile without a break);
    * dynamic shapes: a new sequence length or batch size recompiles (once with
      symbolic shapes, then up to dynamo's cache limit); the memory of that
      compilation, and of compiled code kept for every shape, is not counted;
    * compile-time memory: the compiler's own host memory (tens to hundreds of MiB
      for a large model, in the process and in its compile workers) is not device
      memory and is excluded, as trials exclude the warm-up step that compiles;
    * CUDA graphs (``torch_compile_mode="reduce-overhead"``) keep a private memory pool
      of the graph's static buffers: not modelled; autofit emits the default mode;
    * on a CUDA target the rule is the one measured on the CPU less its dropout masks
      (same partitioner; inductor's Triton kernels may choose other fusions, and CUDA's
      fused SDPA kernels keep no (T, T) tensors in either mode): not measured on a GPU;
    * block families without a measured rule (BERT, T5, ...) are estimated as eager;
    * with the chunked loss nothing is saved: ``ChunkedLossTrainer``'s loss runs the
      backbone itself, past the compiled wrapper; with TRL's fused LM head
      (``loss_impl="trl"``) compiled whole nothing either: its tiled loss makes no full
      logits to fuse, and its compiled step peaked 2.2-2.8% above the eager one
      (``llama-b4s256*-trl-compile``), where the rule took 14% off: estimated as eager plus
      half an fp32 tile (``_TRL_COMPILED_TILES``), from those two rows only; compiled by
      regions, the blocks' part as any regional compile (the fused head runs eagerly);
    * the whole-run replay (``estimate(..., dataset=...)``) replays the eager step's
      allocations.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import TYPE_CHECKING

from autofit.errors import MissingDependencyError, fix
from autofit.knobs.base import OnOffKnob, installed

if TYPE_CHECKING:
    from autofit.config import TrainConfig
    from autofit.knobs.base import Costs
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo

__all__ = ["TORCH_COMPILE", "TorchCompileKnob", "FIELD", "compiled_saving_parts",
           "check_compile_mode", "CUDA_GRAPH_MODES", "REGIONAL_ENV", "regional_from_env",
           "compile_asked", "compile_recipe"]

FIELD = "torch_compile"
# what ``accelerate launch --dynamo_use_regional_compilation`` (or an accelerate config's
# ``dynamo_config: {dynamo_use_regional_compilation: true}``) sets, and the Trainer's
# TorchDynamoPlugin reads: compile each repeated block apart (accelerate's compile_regions)
REGIONAL_ENV = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"


def compile_asked(base_args: dict[str, object] | None, reasons: list[str]
                  ) -> list[bool] | None:
    """The compile knob's values when the user's training_args compile (``torch_compile``,
    or a backend or mode, which turn it on): with and without, where the knob alone
    searches without only (it was turned off unseen); None otherwise (its defaults)."""
    if base_args is None or not TORCH_COMPILE.read(base_args):
        return None
    reasons.append("torch.compile: your training_args compile (torch_compile); searched with "
                   "and without, the trials deciding whether compiling pays")
    return [False, True]


def compile_recipe(base_args: dict[str, object] | None, recipe: object,
                   reasons: list[str]) -> tuple[str | None, bool]:
    """``(mode, regional)`` of the compiled candidates, the user's: the mode from their
    training_args' ``torch_compile_mode`` or the launch recipe's ``dynamo_mode`` (estimated,
    tried and written as given; CUDA graphs' modes refused on a card); regional from the
    recipe's ``dynamo_use_regional_compilation``, else the environment ``accelerate launch``
    sets (as the Trainer reads it: said in a reason line)."""
    mode = ((base_args or {}).get("torch_compile_mode")
            or getattr(recipe, "torch_compile_mode", None))
    said = getattr(recipe, "torch_compile_regional", None)
    regional = said if said is not None else regional_from_env()
    if regional and said is None:
        reasons.append(f"regional torch.compile: {REGIONAL_ENV} is set (accelerate launch "
                       "--dynamo_use_regional_compilation), as the Trainer reads it: compiled "
                       "candidates compile each block apart, the head and the loss eager")
    return (str(mode) if mode else None), bool(regional)


def regional_from_env() -> bool:
    """Whether this process's environment asks accelerate for regional compilation, as
    ``TorchDynamoPlugin.__post_init__`` reads it (``str_to_bool``: y, yes, t, true, on, 1)."""
    return os.environ.get(REGIONAL_ENV, "").strip().lower() in ("y", "yes", "t", "true", "on",
                                                                "1")
# the fields that also turn it on in TrainingArguments.__post_init__ (backend, mode)
_ALSO = ("torch_compile_backend", "torch_compile_mode")



# torch.compile (inductor, default partitioner): per block and token, the elements eager
# autograd saves for backward that the compiled step does not, as a linear function of the
# block's widths (h: hidden, kv: key/value width, i: intermediate), per block family. Read
# off the tensors each step saves (saved_tensors_hooks around eager and compiled steps of
# small llama and GPT-2 models) and checked against measured peaks
# (benchmarks/measure_cpu.py, "torch_compile"):
# * llama: the gated MLP's product silu(gate) * up (down_proj's input) is recomputed (-i),
#   and of the attention's inputs only the (B, H, T, d) tensors SDPA's backward reads are
#   kept: -2 kv net (the key/value heads are kept repeated to all heads, but the norms'
#   and rotary embedding's hidden-sized outputs are recomputed); the graph materialises
#   the causal mask once, (B, 1, T, T) in the compute dtype, which eager SDPA gets as
#   ``is_causal`` (``mask``: elements per token and key position, once per step);
# * gpt2: the MLP keeps its fc output and c_proj's input compiled; what eager keeps besides
#   depends on the activation (``_MLP_FUSED``).
# The MLP's activation, measured for each (benchmarks/compile_saved.py: the bytes the eager
# and compiled steps save for backward, per block and token, at two depths and widths):
# GPT-2's gelu_new is written out in Python ops, each keeping a (B, T, i) tensor (-3i);
# gelu_fast -6i, quick_gelu -1i; a one-op gelu / gelu_pytorch_tanh keeps the same two
# tensors either way (0), and relu's compiled step keeps a bool mask more (+1 byte per
# unit); a gated MLP's act(gate) * up is recomputed with silu and the GELUs (-i), not with
# relu (0). An activation not measured: no saving and relu's extra mask (the safe side).
# Dropout: on the CPU eager keeps each dropout's noise in the activation dtype (its
# ``_dropout`` path) where the compiled step keeps a bool mask (1 byte): its hidden-sized
# dropouts, attention's heads x T per token, the embeddings'. On a CUDA target nothing: eager
# dropout there is ``native_dropout``, which keeps a bool mask already, and the fused SDPA
# kernels drop out inside (no (T, T) tensor in either step).
# The loss: eager keeps the fp32 log-softmax and makes two fp32 (B, T, V) gradients at the
# start of backward; the compiled graph fuses the upcast, the log-softmax and the loss's
# backward. ``loss`` / ``loss_mixed`` / ``loss_half``: how many fp32 (B, T, V) buffers
# fewer are alive at the backward peak with fp32 logits, with autocast, with 16-bit weights
# (bf16-true, 16-true: 16-bit logits, upcast by the loss), each measured: llama 0 in fp32
# (the compiled backward still holds two), 1.75 in bf16-mixed (it keeps the bf16 logits,
# and its fused backward ~0.8 fp32 buffer), 1.69 in bf16-true (at 4 x 256 and 2 x 512
# alike; 1.65 taken); GPT-2 1 in fp32, 2.08 with autocast (2.05 taken; its compiled step
# peaks at the end of the forward, beside the Trainer's fp32 copy of the logits: with the
# 1.5 fitted before on a step that peaks in the optimizer it was 9.6% over), 2.21 in
# bf16-true (2.2 taken). With the fp32 coefficient for bf16-true (as before) both
# families' compiled steps were 30-33% over.
# A model type of a family's block structure but not the family's own (Qwen2, Mistral,
# OPT, ...) takes the least loss coefficient of any family; the blocks' rule is applied to
# the model types whose compiled blocks were measured to save at least what it takes off
# (``_BLOCKS_CHECKED``: benchmarks/compile_saved.py --zoo, results/compile_saved_zoo.md),
# another's blocks are estimated as eager (StableLM's saved half of what the llama rule
# takes off: 1024 B a block and token over at the zoo's small size).
# NB: families without a measured rule (BERT, T5, ...) get no saving (the eager estimate,
# on the safe side).
_COMPILE_FUSED: dict[str, dict[str, float]] = {
    "llama": {"h": 0.0, "kv": 2.0, "mask": 1.0, "loss": 0.0, "loss_mixed": 1.75,
              "loss_half": 1.65},
    "gpt2": {"h": 0.0, "kv": 0.0, "mask": 0.0, "loss": 1.0, "loss_mixed": 2.05,
             "loss_half": 2.2},
}
# model types whose eager loss keeps more that the compiled step fuses, in fp32 (B, T, V)
# buffers, where measured: Gemma 2's final logit soft-capping (tanh of the logits / 30, x 30:
# ~2 buffers in the logits' dtype; with 16-bit weights 0.95 measured, 0.9 taken: its compiled
# bf16-true step was 26% over without it, gemma2-b4s256-bf16t-compile)
_LOSS_FUSED_MORE: dict[str, dict[str, float]] = {"gemma2": {"loss_half": 0.9}}
_BLOCKS_CHECKED = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
    "gpt_neox", "opt", "falcon", "starcoder2", "olmo", "olmo2", "granite", "cohere", "gptj",
    "bloom", "gpt2", "gpt_bigcode", "codegen", "smollm3", "glm", "mixtral", "qwen3_moe"})
# per block family and MLP activation: (B, T, i) elements eager keeps that the compiled step
# does not (the rule's ``i``), and bytes per intermediate unit the compiled step keeps more
_MLP_FUSED: dict[str, dict[str, tuple[float, int]]] = {
    "llama": {"silu": (1.0, 0), "swish": (1.0, 0), "gelu": (1.0, 0),
              "gelu_pytorch_tanh": (1.0, 0), "relu": (0.0, 0)},
    "gpt2": {"gelu_new": (3.0, 0), "gelu_fast": (6.0, 0), "quick_gelu": (1.0, 0),
             "gelu": (0.0, 0), "gelu_pytorch_tanh": (0.0, 0), "relu": (0.0, 1)},
}
_MLP_UNMEASURED = (0.0, 1)  # another activation: no saving, a bool mask more
# fp32 (rows, cols) tiles of TRL's fused loss (``autofit.knobs.trl_loss``) a compiled TRL step
# holds above the eager one at its backward peak (measured 0.31 in bf16-mixed, 0.46 in fp32,
# llama 4 x 256: one 1024 x 32000 tile; ``llama-b4s256*-trl-compile``); nothing else taken off
_TRL_COMPILED_TILES = 0.5
# accelerate's regional compilation (each block compiled apart, the head and the loss eager):
# bytes per token, block and hidden unit its blocks keep fewer than the blocks' rule above
# takes off, by precision (the loss coefficients' keys), measured on the CPU by depth (the
# peak saving of a regional step over eager at 8 and at 4 blocks, 4 x 256, hidden 512, less
# the rule's; a little under each measurement): llama fp32 5.7-6.2, bf16-mixed 15.0,
# bf16-true 7.0; GPT-2 bf16-mixed 30.8, bf16-true 7.6, fp32 3.4 (from its 8-block row alone,
# whose eager estimate is 0.7% under). The saved tensors say the same (compile_saved.py: a
# compiled llama block keeps 2i + 2kv elements fewer a token where the rule takes i + 2kv):
# a whole compile's loss coefficients were measured beside the same rule, so they hold the
# rest of a whole compile's saving (checked by depth: llama compiled whole at 2, 4 and 8
# blocks in bf16-true +0.0%, +0.4%, +0.9%; a shallow model with a large vocabulary, where
# the loss part weighs most, is not under); a regional compile has no loss fusion to hold it.
# Another model type: the blocks' rule alone (on the safe side). Rows: accuracy.md,
# *-compile-regional, llamaL4-*, gpt2L4-*, llamaL2-*.
_REGIONAL_BLOCKS_MORE: dict[str, dict[str, float]] = {
    "llama": {"loss": 5.5, "loss_mixed": 14.5, "loss_half": 6.5},
    "gpt2": {"loss": 3.0, "loss_mixed": 30.0, "loss_half": 7.0},
}


def compiled_saving_parts(info: ModelInfo, config: TrainConfig, seq_len: int, *, family: str,
                          element: int, cuda: bool = False) -> tuple[int, int]:
    """torch.compile's memory rule: (blocks, the rest) of the activation bytes a compiled
    step does not keep at its backward peak, for a model of block ``family`` whose saved
    activations have ``element`` bytes each, on a CUDA target (``cuda``) or the CPU: what
    the blocks' saved activations lose (one block with checkpointing), and the masks and
    loss buffers outside them (a family without a measured rule: nothing, the eager
    estimate)."""
    c = _COMPILE_FUSED.get(family)
    if c is None:
        return 0, 0
    e = element  # element size of the saved activations
    # a dropout's bool mask instead of the CPU's noise in the activation dtype (CUDA's eager
    # dropout keeps a bool mask too)
    mask = 0 if cuda else e - 1
    spec = config.precision_spec
    key = ("loss_mixed" if spec.autocast
           else "loss_half" if spec.param_dtype != "float32" else "loss")
    # accelerate's compile_regions: only the blocks are compiled graphs; the embeddings'
    # dropout, the head and the loss run eagerly (their buffers as eager), and the causal
    # mask is built eagerly (None for SDPA: is_causal), not materialised by a trace; its
    # blocks keep what the rule takes off and ``_REGIONAL_BLOCKS_MORE`` fewer
    regional = config.torch_compile_regional
    regional_more = (_REGIONAL_BLOCKS_MORE.get(info.model_type, {}).get(key, 0.0)
                     if regional else 0.0)
    per_layer = []
    for b in _blocks(info):
        kv = b.num_kv_heads * b.head_dim
        mlp, more = _MLP_FUSED[family].get(b.activation.lower(), _MLP_UNMEASURED)
        el = c["h"] * b.hidden_size + c["kv"] * kv + mlp * b.intermediate_size
        if info.model_type not in _BLOCKS_CHECKED:
            el, more = 0.0, _MLP_UNMEASURED[1]  # as eager (a bool mask more: the safe side)
        masks = (b.num_dropouts * b.hidden_size
                 + (b.num_heads * seq_len if b.attention_dropout > 0 else 0))
        per_layer.append((max(el, 0.0) * e + mask * masks - more * b.intermediate_size
                          + regional_more * b.hidden_size, b.count))
    if not per_layer:
        return 0, 0
    tokens = config.micro_batch_size * seq_len
    # the blocks: one recomputed at a time with checkpointing
    blocks = int(tokens * (max(x for x, _ in per_layer) if config.gradient_checkpointing
                           else sum(x * n for x, n in per_layer)))
    if regional:  # TRL's fused head too runs eagerly there (llama-b4s256-bf16m-trl-...)
        return blocks, 0
    causal_mask = tokens * seq_len * c["mask"] * e  # kept by the compiled step, not by eager
    if config.loss_impl == "trl":
        # TRL's fused LM head compiled whole: no full logits to fuse, and its compiled
        # backward peaked above the eager step's (llama 4 x 256: +39 MiB in bf16-mixed, +58
        # MiB in fp32, where the whole-compile rule took 14% off): estimated as eager plus
        # half an fp32 tile and the whole graph's mask
        from autofit.knobs.trl_loss import TOKEN_TILE, VOCAB_TILE

        tile = min(tokens, TOKEN_TILE) * min(info.vocab_size or 0, VOCAB_TILE) * 4
        return 0, -int(_TRL_COMPILED_TILES * tile + causal_mask)
    # the embeddings' dropout (outside the blocks): its mask too
    base = tokens * mask * (info.hidden_size or 0) * (info.embedding_dropout > 0) - causal_mask
    lm = info.lm_logits
    # the loss's coefficient was measured on the family's own model type; another of its
    # structure gets the least any measured family saves (OPT, of GPT-2's block structure:
    # 11.7% under with GPT-2's 2.2 in bf16-true, +0.8% with llama's 1.65)
    loss = (c[key] if info.model_type == family
            else min(f[key] for f in _COMPILE_FUSED.values()))
    loss += _LOSS_FUSED_MORE.get(info.model_type, {}).get(key, 0.0)
    base += loss * tokens * (info.vocab_size if lm else 0) * 4  # fp32 (B, T, V) buffers
    return blocks, int(base)


def _blocks(info: ModelInfo) -> list:
    """The blocks the rule counts (an encoder-decoder's encoder blocks)."""
    return [b for b in info.blocks if not (info.is_encoder_decoder and b.role != "encoder")]


class TorchCompileKnob(OnOffKnob):
    name = "torch_compile"
    title = "comp"  # the candidates table: 4 columns wide
    fields = (FIELD, *_ALSO)
    saving = None  # it saves memory, but it is tried only when asked (suggested instead)
    calibrates_apart = True  # the saved activations differ with and without it
    option = "torch-compile"
    help_on = ("also try torch.compile (TrainingArguments torch_compile=True); trials "
               "compile first and time the compiled steps")
    help_off = "never compile (the default)"
    help_one = "run the step through torch.compile (inductor), as torch_compile=True does"

    def defaults(self, device: DeviceInfo) -> tuple[tuple[bool, ...], str | None]:
        return (False,), None  # searched only when asked (--torch-compile)

    def check(self, device: DeviceInfo, value: bool, run: bool = True) -> None:
        """Raise ``MissingDependencyError`` when this machine cannot compile for a present
        ``device``: inductor builds C++ kernels on the CPU (a C++ compiler: ``$CXX`` or
        g++ / clang++) and Triton kernels on a GPU (``triton``). A plan for an absent
        device, or an estimate (``run=False``), is not checked here."""
        if not run or not value or device is None or not getattr(device, "present", False):
            return
        if device.kind == "cpu":
            cxx = os.environ.get("CXX") or "g++"
            if not any(shutil.which(c) for c in (cxx, "g++", "clang++")):
                raise MissingDependencyError(
                    "torch.compile on the CPU needs a C++ compiler (g++ or clang++, or $CXX), "
                    "which was not found: install one or drop "
                    + fix("--torch-compile", "torch_compile=True"))
        elif device.kind == "cuda" and not installed("triton"):
            raise MissingDependencyError(
                "torch.compile on a GPU needs triton, which is not installed: pip install "
                "triton, or drop " + fix("--torch-compile", "torch_compile=True"))

    def suggest(self, device: DeviceInfo) -> tuple[bool, ...]:
        return (True,)  # offered when nothing fits, with its estimated peak

    def describe(self, value: bool) -> str:
        return "torch.compile" if value else "not compiled"

    def short(self, value: bool) -> str:
        return "yes" if value else "no"

    def note(self, value: bool) -> str | None:
        if not value:
            return None
        return ("torch.compile: the first step compiles (minutes on a large model); a new "
                "sequence length recompiles once with dynamic shapes")

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_mutually_exclusive_group()
        # asked for: both values searched (trials decide whether compiling pays)
        g.add_argument(f"--{self.option}", dest=self.name, action="store_const",
                       const=[False, True], help=self.help_on)
        g.add_argument(f"--no-{self.option}", dest=self.name, action="store_const",
                       const=False, help=self.help_off)

    def flag(self, value: bool) -> str:
        return f"--{self.option}" if value else f"--no-{self.option}"

    def reason(self, config: TrainConfig, costs: Costs) -> str | None:
        """What a chosen torch.compile's rule takes off the eager step."""
        if not config.torch_compile:
            return None
        from autofit.probe.device import format_bytes as _gib

        n = costs.compile_saving_bytes(config)
        what = f"~{_gib(n)} fewer" if n >= 0 else f"~{_gib(-n)} more"
        how = ("regional torch.compile (each block apart, the loss eager)"
               if config.torch_compile_regional else "torch.compile")
        return (f"{how}: {what} activations than eager at micro batch "
                f"{config.micro_batch_size}, estimated (fused pointwise chains: "
                "autofit.knobs.compile)")

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        if getattr(config, self.name, False):
            args[FIELD] = True
            mode = getattr(config, "torch_compile_mode", None)
            if mode is not None:
                args["torch_compile_mode"] = mode
        else:
            # a backend or a mode would turn compilation back on (TrainingArguments)
            for f in (FIELD, *_ALSO):
                args.pop(f, None)

    def read(self, args: dict[str, object]) -> bool:
        return bool(args.get(FIELD) or any(args.get(f) for f in _ALSO))


TORCH_COMPILE = TorchCompileKnob()

# the modes that capture CUDA graphs on a CUDA card (inductor's cudagraph trees): their
# private memory pool (every captured graph's static inputs, outputs and intermediates,
# kept between steps) is not modelled
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile_mode(config: TrainConfig, device: DeviceInfo) -> None:
    """Refuse, in one line, a compile mode whose memory the estimates do not model on
    ``device``: CUDA graphs' private pool on a CUDA card. On a CPU a mode captures no CUDA
    graph and is estimated as the default mode (measured 3.1-3.3% above it on a small
    llama, ``reduce-overhead`` and ``max-autotune`` alike: the estimate 1.4-1.6% over;
    ``llamas-b4s256-compile*`` in ``benchmarks/results/accuracy.md``)."""
    mode = config.torch_compile_mode
    if config.torch_compile and mode in CUDA_GRAPH_MODES and device.allocator == "cuda":
        from autofit.errors import UnmodelledStepError

        raise UnmodelledStepError(
            f"torch_compile_mode={mode!r} captures CUDA graphs, whose private memory pool "
            "autofit does not model (an estimate would be low); use "
            + fix("--torch-compile-mode max-autotune-no-cudagraphs",
                  "torch_compile_mode='max-autotune-no-cudagraphs'")
            + " or the default mode, or measure it on the card (autofit measure)")
