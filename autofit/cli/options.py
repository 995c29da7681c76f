"""Options the subcommands share: the model, one training configuration, adapters.

    p = subparsers.add_parser("estimate")
    add_model_options(p)                  # MODEL --batch-size --seq-len --precision ...
    config = train_config(p.parse_args([...]))
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from autofit.knobs import KNOBS

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_DOES_NOT_FIT", "EXIT_TRIAL_FAILED",
           "add_model_options",
           "add_adapter_options", "add_peft_option", "add_quant_options", "quant_spec",
           "model_kwargs", "train_config", "tokenizer_for",
           "add_file_subject_options", "FileSubject", "file_subject", "add_config_options",
           "add_rank_options", "rank_kwargs", "add_block_size_option", "add_recipe_options",
           "recipe_kwargs", "add_trainer_option"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 0, 1, 2, 3
# a trial that neither fitted nor ran out of memory: a timeout, a crash, a killed process
EXIT_TRIAL_FAILED = 4


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options that describe the model and one training configuration."""
    p.add_argument("model", help="hub id, local directory, config.json path or bundled name")
    p.add_argument("--batch-size", type=int, required=True, help="micro batch size per device")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sample (default with --dataset: its longest sample)")
    add_config_options(p)  # with --nproc-per-node / --nnodes
    add_recipe_options(p)
    add_adapter_options(p)
    p.add_argument("--task", default=None, help="causal-lm, masked-lm, seq2seq, seq-cls or token-cls")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cpu:8GiB, cuda, cuda:N or a card name (H100-80GB, ...)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_config_options(p: argparse.ArgumentParser) -> None:
    """One training configuration besides the micro batch: accumulation, each knob's option
    (``--precision``, ``--gradient-checkpointing``, ``--optim``, ...) and ``--optim-args``."""
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    for k in KNOBS:
        k.add_option(p)
    p.add_argument("--optim-args", default=None, help='e.g. "momentum=0.9"')
    add_compile_mode_option(p)
    add_rank_options(p)
    add_trainer_option(p)


def add_compile_mode_option(p: argparse.ArgumentParser) -> None:
    """``--torch-compile-mode MODE``: TrainingArguments' ``torch_compile_mode`` (implies
    ``--torch-compile``, as the field turns compiling on)."""
    from autofit.config import COMPILE_MODES

    p.add_argument("--torch-compile-mode", choices=COMPILE_MODES, default=None,
                   help="torch.compile's mode (implies --torch-compile); reduce-overhead and "
                        "max-autotune capture CUDA graphs: refused for a CUDA card")
    p.add_argument("--torch-compile-regional", action="store_true", default=False,
                   help="compile each decoder block apart, the head and loss eager "
                        "(accelerate's dynamo_use_regional_compilation; implies "
                        "--torch-compile)")


def add_trainer_option(p: argparse.ArgumentParser, default: str = "plain") -> None:
    """``--trainer plain|autofit|trl``: what will run the configuration (``autofit.knobs.trainer``);
    the chunked loss runs only in ``autofit`` (``--chunked-loss`` alone implies it)."""
    from autofit.knobs.trainer import TRAINERS

    p.add_argument("--trainer", choices=TRAINERS, default=None,
                   help="what trains: plain (a transformers.Trainer built from the file), "
                        "autofit (autofit.ChunkedLossTrainer: the chunked loss) or trl "
                        f"(trl.SFTTrainer); default: {default}")


def add_rank_options(p: argparse.ArgumentParser) -> None:
    """``--nproc-per-node N --nnodes M``: the run's ranks, as torchrun counts them (with the
    knobs' ``--strategy`` / ``--offload``); estimates are per rank, trials run every rank."""
    p.add_argument("--nproc-per-node", type=_positive, default=None, metavar="N",
                   help="processes (devices) per node, as torchrun --nproc-per-node (default 1); "
                        "estimates are per rank")
    p.add_argument("--nnodes", type=_positive, default=None, metavar="M",
                   help="nodes, as torchrun --nnodes (default 1); a trial runs every rank here")


def add_recipe_options(p: argparse.ArgumentParser) -> None:
    """``--deepspeed-config FILE`` / ``--accelerate-config FILE``: the user's own launch
    recipe (``autofit.knobs.recipe``), estimated and tried instead of autofit's."""
    p.add_argument("--deepspeed-config", default=None, metavar="FILE",
                   help="your DeepSpeed JSON (ds_config.json): its ZeRO stage, offload, sizes, "
                        "precision and optimizer are what is estimated")
    p.add_argument("--accelerate-config", default=None, metavar="FILE",
                   help="your accelerate config YAML: its distributed_type, num_processes / "
                        "num_machines, FSDP or DeepSpeed settings and mixed_precision")


def recipe_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``deepspeed_config`` / ``accelerate_config`` from parsed options (those given)."""
    return {k: v for k in ("deepspeed_config", "accelerate_config")
            if (v := getattr(args, k, None)) is not None}


def rank_kwargs(args: argparse.Namespace) -> dict[str, int]:
    """``nproc_per_node`` / ``nnodes`` from parsed options (those given)."""
    return {k: v for k in ("nproc_per_node", "nnodes")
            if (v := getattr(args, k, None)) is not None}


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def add_adapter_options(p: argparse.ArgumentParser) -> None:
    """Attention implementation, LoRA and a quantized base, for a model given by name."""
    p.add_argument("--attn-implementation", choices=["eager", "sdpa"], default=None)
    p.add_argument("--lora-r", type=int, default=None, help="add a LoRA adapter of this rank")
    p.add_argument("--lora-alpha", type=int, default=None)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="module names, or all-linear (default)")
    add_peft_option(p)
    add_quant_options(p)


def add_quant_options(p: argparse.ArgumentParser) -> None:
    """How the base is quantized (bitsandbytes; ``autofit.probe.quant``): the shorthands,
    their 4-bit settings, or a whole ``BitsAndBytesConfig`` as JSON."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--load-in-4bit", action="store_true",
                   help="4-bit base (QLoRA: nf4, computing in bf16 unless set below)")
    g.add_argument("--load-in-8bit", action="store_true",
                   help="8-bit base (LLM.int8, fp32 unless --bnb-4bit-compute-dtype)")
    p.add_argument("--bnb-4bit-quant-type", choices=["nf4", "fp4"], default=None)
    p.add_argument("--bnb-4bit-compute-dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="the dtype the base is loaded in and computes in")
    p.add_argument("--bnb-4bit-use-double-quant", action="store_true",
                   help="quantize the 4-bit absmax again (8-bit + fp32 per 256)")
    p.add_argument("--quantization-config", default=None, metavar="FILE|JSON",
                   help="a BitsAndBytesConfig as JSON: a file (a model's config.json too) or "
                        "inline, e.g. '{\"load_in_4bit\": true, \"bnb_4bit_quant_type\": "
                        "\"nf4\"}'")


def quant_spec(args: argparse.Namespace) -> Any:
    """The ``QuantSpec`` the quantization options ask for, or None (a bad combination is a
    ``BadInputError``: one line, exit 2)."""
    from autofit.probe.quant import resolve

    dtypes = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    dtype = getattr(args, "bnb_4bit_compute_dtype", None)
    return resolve(load_in_4bit=getattr(args, "load_in_4bit", False),
                   load_in_8bit=getattr(args, "load_in_8bit", False),
                   quantization_config=getattr(args, "quantization_config", None),
                   quant_type=getattr(args, "bnb_4bit_quant_type", None),
                   compute_dtype=dtypes.get(dtype, dtype),
                   double_quant=getattr(args, "bnb_4bit_use_double_quant", False))


def add_peft_option(p: argparse.ArgumentParser) -> None:
    """``--peft-config FILE|JSON``: any PEFT method (``autofit.probe.peft``)."""
    p.add_argument("--peft-config", default=None, metavar="FILE|JSON",
                   help="any PEFT method: an adapter_config.json (file or its directory) or "
                        "inline JSON with peft_type, e.g. '{\"peft_type\": \"IA3\"}'")


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The model-building keyword arguments of the API from parsed options."""
    from autofit.probe.model import LoraSpec

    lora = None
    if args.lora_r is not None or args.lora_target_modules or args.lora_alpha is not None:
        targets = args.lora_target_modules or ["all-linear"]
        r = args.lora_r if args.lora_r is not None else 8
        lora = LoraSpec(
            r=r,
            alpha=args.lora_alpha if args.lora_alpha is not None else 2 * r,
            target_modules="all-linear" if targets == ["all-linear"] else tuple(targets),
            dropout=args.lora_dropout,
        )
    peft_config = getattr(args, "peft_config", None)
    quant = quant_spec(args)
    if quant is not None and lora is None and peft_config is None:
        lora = LoraSpec()  # QLoRA: a frozen quantized base trains through adapters
    return dict(
        task=args.task,
        attn_implementation=args.attn_implementation,
        lora=lora,
        peft_config=peft_config,
        quantization_config=quant,
    )


def train_config(args: argparse.Namespace):
    from autofit.config import TrainConfig

    knobs = {k.name: k.option_value(args) for k in KNOBS}
    mode = getattr(args, "torch_compile_mode", None)
    regional = bool(getattr(args, "torch_compile_regional", False))
    if mode is not None or regional:  # the mode turns compiling on, as TrainingArguments does
        knobs["torch_compile"] = True
    return TrainConfig(
        micro_batch_size=args.batch_size,
        grad_accum_steps=args.grad_accum,
        optim_args=args.optim_args,
        seq_len=args.seq_len,
        torch_compile_mode=mode,
        torch_compile_regional=regional,
        **rank_kwargs(args),
        **knobs,
    )


def tokenizer_for(args: argparse.Namespace, data: list[object]) -> Any:
    """The tokenizer a dataset of text needs (``--tokenizer``, else the model's), or None."""
    from autofit.errors import BadInputError

    # text to tokenize: no input_ids, and a column of text or of words (samples with
    # neither are the data probe's to refuse, with its own message)
    needs = (bool(data) and isinstance(data[0], dict) and "input_ids" not in data[0]
             and any(isinstance(v, str) or (isinstance(v, list) and v and isinstance(v[0], str))
                     for v in data[0].values()))
    if not needs and args.tokenizer is None:
        return None
    from transformers import AutoTokenizer

    name = args.tokenizer or args.model
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - hub / file errors come in many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInputError(
            f"the dataset has text but no tokenizer could be loaded from {name!r} ({first}); "
            "pass --tokenizer DIR or give input_ids"
        ) from None


def add_block_size_option(p: argparse.ArgumentParser) -> None:
    """``--block-size N``: the samples packed into N-token blocks, as the transformers
    language-modeling examples' ``group_texts`` (``autofit.probe.packing``)."""
    p.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="pack the dataset into N-token blocks as the transformers examples' "
                        "group_texts (concatenate, cut, drop the remainder)")


def add_file_subject_options(p: argparse.ArgumentParser) -> None:
    """What a configuration file trains, when the file does not say (a plain
    TrainingArguments file) or to override what a tuned file says."""
    p.add_argument("--device", default=None,
                   help="default: the file's device if present here, else auto")
    p.add_argument("--model", default=None, help="the model (overrides the file's)")
    p.add_argument("--dataset", default=None,
                   help=".json/.jsonl file, save_to_disk directory or bundled name")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens of the longest sample, without --dataset (default: the file's)")
    p.add_argument("--max-seq-len", type=int, default=None, help="truncate samples to this length")
    p.add_argument("--task", default=None, help="causal-lm, masked-lm, seq2seq, seq-cls or token-cls")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for a dataset with text (default: the model's)")
    add_block_size_option(p)  # default: the file's


@dataclass(frozen=True)
class FileSubject:
    """The run a configuration file describes: model, data (or its longest length), device."""

    model: Any
    dataset: Any
    seq_len: int | None
    device: str
    device_reason: str
    task: str | None
    max_seq_len: int | None
    seq_len_source: str
    tokenizer: Any = None  # for a dataset of text
    block_size: int | None = None  # the samples packed into blocks of this many tokens
    packing: str | None = None  # how (autofit.probe.packing.STRATEGIES); None: group_texts
    notes: tuple[str, ...] = ()  # what was read from the data and the file's script keys


def file_subject(args: argparse.Namespace, meta: dict[str, object],
                 source: Any = None) -> FileSubject:
    """Resolve ``add_file_subject_options`` against a file's autofit metadata (may be empty)
    and, for a mixed arguments file (``autofit.emit.args_file.ArgsFile``), its own model,
    data, tokenizer and block-size keys: the command line first, then the file's keys (what
    the script runs), then the metadata (a tuned file's packing comes from its metadata, a
    mixed args file's ``block_size`` — the transformers examples' data argument — when the
    metadata says nothing).

    Raises:
        BadInputError: no model, or neither a dataset nor a sequence length.
    """
    from autofit.cli.datasets import load_dataset_ref
    from autofit.errors import BadInputError

    model = args.model or getattr(source, "model", None) or meta.get("model")
    if not model:
        raise BadInputError(f"{args.config} names no model (a plain TrainingArguments file?): "
                            "give --model")
    dataset = None
    if args.dataset:
        dataset = load_dataset_ref(args.dataset)
    elif getattr(source, "mixture", None) and args.seq_len is None:
        dataset = source.load_mixture()  # a TRL file's datasets, as trl sft loads them
    elif getattr(source, "dataset", None) and args.seq_len is None:
        try:
            dataset = load_dataset_ref(source.dataset)
        except BadInputError:
            if source.dataset_key == "train_file" or not meta.get("seq_len"):
                raise BadInputError(f"{args.config}: its {source.dataset_key} "
                                    f"{source.dataset!r} is not a local file, folder or "
                                    "bundled dataset: give --dataset or --seq-len") from None
    seq_len = args.seq_len if args.seq_len is not None else (
        None if dataset is not None else meta.get("seq_len"))
    if dataset is None and seq_len is None:
        raise BadInputError(f"{args.config} has no sequence length: give --dataset or --seq-len")
    if args.device:
        device, why = args.device, f"device {args.device}: as given"
    else:
        device, why = _default_device(meta)
    # packed as the tuned file records (a mixed args file's block_size too), unless given
    block_size = getattr(args, "block_size", None)
    packing = None
    script = script_lengths(_file_keys(source))
    if block_size is None and dataset is not None and meta.get("block_size") is not None:
        block_size, packing = meta["block_size"], meta.get("packing")
    elif block_size is None and dataset is not None:
        block_size = script.block_size
    max_seq_len = args.max_seq_len or (
        (meta.get("max_seq_len") or script.max_seq_len) if block_size is None else None)
    notes: list[str] = []
    task = args.task or meta.get("task")
    if task is None and (found := data_task(dataset)) is not None:
        task, why_task = found
        notes.append(why_task)
    if script.note and (block_size, max_seq_len) == (script.block_size, script.max_seq_len):
        notes.append(script.note)
    if dataset is not None and script.pad and block_size is None and max_seq_len:
        dataset = padded_samples(dataset, max_seq_len)  # every batch that long
    tokenizer = None
    if dataset is not None:
        named = getattr(args, "tokenizer", None)
        if named is None and isinstance(dataset[0], dict) and "input_ids" not in dataset[0]:
            named = _file_keys(source).get("tokenizer_name")  # the script's own
        tokenizer = tokenizer_for(argparse.Namespace(tokenizer=named, model=model), dataset)
    return FileSubject(model=model, dataset=dataset, seq_len=seq_len, device=device,
                       device_reason=why, task=task,
                       max_seq_len=max_seq_len,
                       seq_len_source="as given" if args.seq_len is not None else "the file's",
                       tokenizer=tokenizer, block_size=block_size, packing=packing,
                       notes=tuple(notes))


@dataclass(frozen=True)
class ScriptLengths:
    """What a transformers example script's data arguments (an args file's keys) make of the
    samples' lengths: truncation (``run_ner.py``, ``run_glue.py``: ``max_seq_length``, every
    batch padded to it with ``pad_to_max_length``) or blocks (``run_clm.py``'s
    ``block_size``; ``run_mlm.py``'s ``max_seq_length`` unless ``line_by_line``)."""

    max_seq_len: int | None = None
    block_size: int | None = None
    pad: bool = False  # every sample padded to max_seq_len
    note: str | None = None


def script_lengths(keys: dict[str, Any]) -> ScriptLengths:
    """``ScriptLengths`` of an args file's keys (empty when they say nothing).

        >>> script_lengths({"max_seq_length": 128, "pad_to_max_length": True}).pad
        True
        >>> script_lengths({"max_seq_length": 128, "mlm_probability": 0.15}).block_size
        128
    """
    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    block, msl = keys.get("block_size"), keys.get("max_seq_length")
    if count(block):
        return ScriptLengths(block_size=block, note=(
            f"block size {block}: the file's block_size (the script packs its text into "
            "blocks of that many tokens)"))
    if not count(msl):
        return ScriptLengths()
    if ("mlm_probability" in keys or "line_by_line" in keys) and keys.get("line_by_line") is not True:
        return ScriptLengths(block_size=msl, note=(
            f"block size {msl}: the file's max_seq_length (run_mlm.py groups its text into "
            "blocks of that many tokens unless line_by_line)"))
    pad = keys.get("pad_to_max_length") is True
    return ScriptLengths(max_seq_len=msl, pad=pad, note=(
        f"samples truncated at {msl} tokens: the file's max_seq_length (as run_ner.py / "
        "run_glue.py tokenize)" + (", every batch padded to it: pad_to_max_length" if pad
                                    else "")))


def padded_samples(dataset: Any, length: int) -> list[dict[str, list[int]]]:
    """``dataset`` as the script with ``pad_to_max_length`` feeds it: as many samples, each
    ``length`` tokens (the values do not change memory)."""
    row = {"input_ids": [1] * length, "attention_mask": [1] * length}
    return [row] * len(dataset)


def data_task(dataset: Any) -> tuple[str, str] | None:
    """("token-cls", why) when ``dataset`` is words with a label per word (CoNLL, as
    ``run_ner.py`` trains ``AutoModelForTokenClassification`` on it); else None."""
    from autofit.probe.data import labelled_words

    col = labelled_words(dataset) if dataset is not None else None
    if col is None:
        return None
    return "token-cls", (f"task token-cls: the data is words with a label per word ({col!r}, "
                         "as run_ner.py trains a token classifier on it); give --task to "
                         "say otherwise")


def _file_keys(source: Any) -> dict[str, Any]:
    """Every key of the file: an ``ArgsFile``'s ``keys``, or ``source`` itself when it is a
    mapping of them (None: no file keys)."""
    if isinstance(source, dict):
        return source
    keys = getattr(source, "keys", None)
    return keys if isinstance(keys, dict) else {}


def _default_device(meta: dict[str, object]) -> tuple[str, str]:
    """The device of a file's run: the file's when present here, else auto (with why)."""
    name = meta.get("device")
    if name:
        from autofit.errors import UnknownDeviceError
        from autofit.probe.device import resolve_device

        try:
            if resolve_device(name).present:
                return name, f"device {name}: the file's"
        except UnknownDeviceError:
            pass
        return "auto", f"device auto: the file's {name} is not present here"
    return "auto", "device auto: the file names none"
