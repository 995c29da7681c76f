"""The user's own launch recipe: a DeepSpeed config, FSDP fields, an accelerate config.

A run is launched with a recipe — ``ds_config.json``, the ``fsdp`` / ``fsdp_config``
fields of its TrainingArguments, an accelerate config YAML — and that recipe, not
autofit's default one, is what is estimated, tried and checked. ``read_recipe`` reads
them into one ``Recipe``: the strategy and offload it fixes, the precision and the
optimizer it fixes (DeepSpeed's own ``optimizer`` block), its batch numbers, its ranks,
and the ``autofit.memory.ranks.Layout`` fields of its sizes (``reduce_bucket_size``,
``stage3_param_persistence_threshold``, ``stage3_max_reuse_distance``, ...).

    >>> r = read_recipe(deepspeed={"zero_optimization": {"stage": 3,
    ...     "reduce_bucket_size": 5e8, "offload_optimizer": {"device": "cpu"}},
    ...     "zero_force_ds_cpu_optimizer": False}, source="ds_config.json")
    >>> r.strategy, r.offload, dict(r.sharding)["zero_overrides"]
    ('zero3', 'optimizer', (('reduce_bucket_size', 500000000),))
    >>> r.describe()
    'recipe: ZeRO-3 from ds_config.json (reduce_bucket_size 5e8, offload optimizer to cpu)'

What each source says (the keys as DeepSpeed 0.19, transformers 5.x and accelerate 1.15
read them):

* DeepSpeed: ``zero_optimization.stage`` (0: DDP), ``offload_optimizer`` /
  ``offload_param`` ``device`` (``cpu`` / ``nvme``: host memory either way for the
  device), the sizes above (absent: DeepSpeed's defaults; ``"auto"``: what transformers
  fills in from the hidden size), ``overlap_comm``; ``bf16`` / ``fp16`` ``enabled``
  (true fixes the precision; ``"auto"`` leaves it to the TrainingArguments);
  ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps`` /
  ``train_batch_size`` (numbers fix them: they must agree with the TrainingArguments, as
  transformers requires); ``optimizer`` (DeepSpeed builds it, one parameter group,
  instead of the Trainer's ``optim``: Adam / AdamW / Lamb fp32 states updated in place,
  ``CPUAdam`` when offloaded; a ``torch.optim`` name such as ``SGD`` with its states).
* TrainingArguments: ``deepspeed`` (a path, relative to the file, or an inline dict);
  ``fsdp`` + ``fsdp_config`` (``version`` 2, ``reshard_after_forward``, ``cpu_offload``,
  ``auto_wrap_policy`` / ``transformer_layer_cls_to_wrap``).
* accelerate: ``distributed_type`` (``FSDP``, ``DEEPSPEED``, ``MULTI_GPU`` = DDP, ``NO``),
  ``num_processes`` (every rank) and ``num_machines``, ``mixed_precision``,
  ``fsdp_config`` (``fsdp_version``, ``fsdp_reshard_after_forward``,
  ``fsdp_offload_params``, ``fsdp_auto_wrap_policy``), ``parallelism_config``
  (``dp_replicate_size`` > 1: HSDP), ``deepspeed_config`` (``deepspeed_config_file`` or
  ``zero_stage`` / ``offload_*_device``).

Whatever autofit cannot model, or DeepSpeed would refuse, is refused with one line
(``BadInputError``, exit 2): a stage other than 0-3, an offloaded optimizer with the
Trainer's optimizer and ``zero_force_ds_cpu_optimizer`` left on, fp16 and bf16 both on, FSDP1, a wrap policy other than the
transformer blocks', an FSDP ``mixed_precision_policy`` reducing in another dtype than it
gathers, an accelerate ``distributed_type`` such as ``XLA`` or ``MEGATRON_LM``.

How a recipe travels: ``estimate`` / ``measure`` / ``autofit`` take
``deepspeed_config=`` / ``accelerate_config=`` (the CLI's ``--deepspeed-config`` /
``--accelerate-config``); ``check`` and ``autofit(training_args=...)`` read the file's
own ``deepspeed`` / ``fsdp`` fields. The knobs it fixes are not searched. A tuned file
launches the user's recipe: its ``deepspeed`` field names ``<stem>-deepspeed.json``
beside it, the user's config with only its numeric batch fields set to the tuned ones
(the user's own file is never written); FSDP fields given are kept as given.

Known limitations:
    * NB: ``allgather_bucket_size``, ``stage3_prefetch_bucket_size``,
      ``stage3_max_live_parameters`` and ``contiguous_gradients: false`` are read and
      named but not estimated (``autofit.memory.simulate._zero``: no tensor of the step, or
      kept anyway after the first step).
    * NB: an ``nvme`` offload is estimated as host memory (what leaves the device).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError
from autofit.knobs.base import truthy

if TYPE_CHECKING:
    import os

    from autofit.config import TrainConfig

__all__ = ["Recipe", "read_recipe", "recipe_of_fields", "DS_OPTIMIZERS", "BATCH_KEYS", "dynamo_of",
           "fsdp_config_dict"]

# DeepSpeed's zero_optimization key -> autofit.memory.ranks.ZeroSizes field (modelled)
_ZERO_SIZES = {"reduce_bucket_size": "reduce_bucket_size",
               "stage3_param_persistence_threshold": "param_persistence_threshold",
               "stage3_max_reuse_distance": "max_reuse_distance",
               "allgather_bucket_size": "allgather_bucket_size",
               "stage3_prefetch_bucket_size": "prefetch_bucket_size",
               "stage3_max_live_parameters": "max_live_parameters"}
_ZERO_FLAGS = ("overlap_comm", "contiguous_gradients")
# DeepSpeed's optimizer "type" (lower case) -> (autofit's optimizer with the same states,
# Layout.zero_optimizer): DeepSpeed's own (updated in place) or a torch.optim class
DS_OPTIMIZERS = {
    "adam": ("adamw_torch", "deepspeed"), "adamw": ("adamw_torch", "deepspeed"),
    "lamb": ("adamw_torch", "deepspeed"), "onebitadam": ("adamw_torch", "deepspeed"),
    "zerooneadam": ("adamw_torch", "deepspeed"), "onebitlamb": ("adamw_torch", "deepspeed"),
    "muadam": ("adamw_torch", "deepspeed"), "muadamw": ("adamw_torch", "deepspeed"),
    "lion": ("lion_32bit", "deepspeed"), "adagrad": ("adagrad", "deepspeed"),
    "sgd": ("sgd", "deepspeed-torch"), "musgd": ("sgd", "deepspeed-torch"),
    "rmsprop": ("rmsprop", "deepspeed-torch"),
}
# DeepSpeed's batch keys -> the TrainingArguments field each must agree with
BATCH_KEYS = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
              "gradient_accumulation_steps": "gradient_accumulation_steps"}
_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
_WHAT = {"ddp": "DDP", "fsdp": "FSDP2", "fsdp-shard-grad-op": "FSDP2 (no reshard)",
         "hsdp": "HSDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
_ACCELERATE_TYPES = ("FSDP", "DEEPSPEED", "MULTI_GPU", "MULTI_CPU", "NO")
_WRAPS = ("TRANSFORMER_BASED_WRAP", "transformer_based_wrap")


@dataclass(frozen=True)
class Recipe:
    """What a user's launch recipe fixes (None: it does not say; autofit searches it).

    Attributes:
        source: where it was read (``ds_config.json``, ``accelerate.yaml``, ``tuned.yaml``).
        strategy, offload: ``TrainConfig``'s names.
        precision: fixed by the recipe (DeepSpeed's ``bf16.enabled: true``, accelerate's
            ``mixed_precision``); None when ``"auto"`` or not said.
        optimizer, optim_args: DeepSpeed's own optimizer, as the autofit optimizer with
            the same states (None: the Trainer's ``optim``).
        micro_batch_size, grad_accum_steps: DeepSpeed's batch numbers (None: ``"auto"``).
        nproc_per_node, nnodes: the accelerate config's ranks.
        torch_compile, torch_compile_mode, torch_compile_regional: the accelerate config's
            ``dynamo_config`` (``dynamo_backend`` INDUCTOR: compiled, its ``dynamo_mode``,
            ``dynamo_use_regional_compilation``: each repeated block compiled apart).
        gradient_checkpointing: True when FSDP's own activation checkpointing is on (an
            ``fsdp_config``'s ``activation_checkpointing``, accelerate's
            ``fsdp_activation_checkpointing``): the step checkpoints every block.
        sharding: ``Layout`` fields of its sizes (``zero_sizes``, ``zero_overrides``,
            ``zero_optimizer``), as ``estimate(sharding=)`` takes them.
        deepspeed: the DeepSpeed config as given (for trials and the tuned file).
        deepspeed_file: its path, when it came from one.
        details: what the reason line names (``reduce_bucket_size 5e8``, ...).
        notes: what is read but not estimated.
    """

    source: str
    strategy: str | None = None
    offload: str | None = None
    precision: str | None = None
    optimizer: str | None = None
    optim_args: str | None = None
    micro_batch_size: int | None = None
    grad_accum_steps: int | None = None
    nproc_per_node: int | None = None
    nnodes: int | None = None
    torch_compile: bool | None = None
    torch_compile_mode: str | None = None
    torch_compile_regional: bool | None = None
    gradient_checkpointing: bool | None = None
    sharding: tuple[tuple[str, Any], ...] = ()
    deepspeed: dict[str, Any] | None = field(default=None, compare=False)
    deepspeed_file: str | None = None
    details: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def layout_fields(self) -> dict[str, Any]:
        """The ``Layout`` fields beyond the config's (``estimate(sharding=...)``)."""
        return dict(self.sharding)

    def describe(self) -> str:
        """``recipe: ZeRO-3 from ds_config.json (reduce_bucket_size 5e8, ...)``."""
        what = _WHAT.get(self.strategy or "", "the launch") if self.strategy else "the launch"
        if self.strategy == "ddp" and (self.nproc_per_node or 1) * (self.nnodes or 1) == 1:
            what = "one rank"
        inner = ", ".join(self.details)
        return f"recipe: {what} from {self.source}" + (f" ({inner})" if inner else "")

    def lines(self, world_size: int) -> list[str]:
        """The reason lines of this recipe on ``world_size`` ranks: what it is, what is read
        but not estimated, and that one rank has nothing to shard."""
        out = [self.describe(), *self.notes]
        if world_size == 1 and self.strategy not in (None, "ddp"):
            from autofit.errors import fix

            out.append(f"one rank: {_WHAT[self.strategy]} has nothing to shard; estimated as "
                       "one process (give "
                       + fix("--nproc-per-node N or --accelerate-config",
                             "nproc_per_node= or accelerate_config=") + ")")
        return out

    def config_fields(self) -> dict[str, Any]:
        """The ``TrainConfig`` fields the recipe fixes (those it says)."""
        out: dict[str, Any] = {}
        for name in ("strategy", "offload", "precision", "optimizer", "optim_args",
                     "micro_batch_size", "grad_accum_steps", "nproc_per_node", "nnodes",
                     "torch_compile", "torch_compile_mode", "torch_compile_regional",
                     "gradient_checkpointing"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v
        if self.optimizer is not None and self.optim_args is None:
            out["optim_args"] = None
        if self.torch_compile is False:
            out["torch_compile_mode"] = None
            out["torch_compile_regional"] = False
        return out

    def apply(self, config: TrainConfig) -> TrainConfig:
        """``config`` (a ``TrainConfig``) with what the recipe fixes; the batch numbers
        must agree with the config's (else ``BadInputError`` naming both)."""
        fields = self.config_fields()
        for key, name in (("micro_batch_size", "train_micro_batch_size_per_gpu"),
                          ("grad_accum_steps", "gradient_accumulation_steps")):
            if key in fields and fields.pop(key) != getattr(config, key):
                what = "micro batch" if key == "micro_batch_size" else "accumulation"
                raise BadInputError(
                    f"{self.source}: {name} {getattr(self, key)} but the run's {what} is "
                    f"{getattr(config, key)}: make them agree (or write \"auto\" in "
                    f"{self.source})")
        if "nproc_per_node" in fields or "nnodes" in fields:
            fields.setdefault("nproc_per_node", config.nproc_per_node)
            fields.setdefault("nnodes", config.nnodes)
            fields["world_size"] = fields["nproc_per_node"] * fields["nnodes"]
        return config.replace(**fields) if fields else config

    def search_constraints(self) -> dict[str, Any]:
        """What ``autofit()`` keeps fixed: one value per knob the recipe says."""
        out: dict[str, Any] = {}
        for name in ("strategy", "offload", "precision", "optimizer", "torch_compile",
                     "gradient_checkpointing"):
            v = getattr(self, name)
            if v is not None:
                out[name] = [v]
        return out

    def deepspeed_for(self, micro_batch_size: int, grad_accum_steps: int,
                      world_size: int) -> dict[str, Any] | None:
        """The user's DeepSpeed config for a tuned run: as given, but the batch numbers it
        fixes (``"auto"`` stays ``"auto"``) set to the tuned ones."""
        if self.deepspeed is None:
            return None
        ds = copy.deepcopy(self.deepspeed)
        tuned = {"train_micro_batch_size_per_gpu": micro_batch_size,
                 "gradient_accumulation_steps": grad_accum_steps,
                 "train_batch_size": micro_batch_size * grad_accum_steps * world_size}
        for k, v in tuned.items():
            if k in ds and ds[k] != "auto":
                ds[k] = v
        return ds


def read_recipe(*, deepspeed: dict[str, object] | str | os.PathLike[str] | None = None,
                accelerate: dict[str, object] | str | os.PathLike[str] | None = None,
                fsdp_fields: dict[str, object] | None = None, source: str | None = None,
                base: str | Path | None = None) -> Recipe | None:
    """The recipe of a DeepSpeed config (a path, a JSON string or a dict), an accelerate
    config (a path or a dict) and/or TrainingArguments' ``fsdp`` / ``fsdp_config`` fields.

    ``base``: the folder a relative ``deepspeed`` path is read from (the args file's).
    None when none is given.

    Raises:
        BadInputError: an unreadable file, or a recipe autofit cannot model (one line).
    """
    acc = _accelerate(accelerate) if accelerate is not None else None
    if deepspeed is None and acc is not None and acc.get("deepspeed") is not None:
        deepspeed, base = acc["deepspeed"], acc["base"]
    recipe = None
    if deepspeed is not None:
        ds, name, path = _deepspeed_dict(deepspeed, base)
        recipe = _from_deepspeed(ds, source or name, path)
    elif fsdp_fields:
        recipe = _from_fsdp(fsdp_fields, source or "the training arguments")
    if acc is not None:
        recipe = _with_accelerate(recipe, acc)
    return recipe


def recipe_of_fields(fields: dict[str, object], source: str,
                     base: str | Path | None = None) -> Recipe | None:
    """The recipe a TrainingArguments file's ``deepspeed`` / ``fsdp`` / ``fsdp_config``
    fields carry (a relative ``deepspeed`` path read from ``base``), or None. Its batch
    numbers must agree with the file's ``per_device_train_batch_size`` /
    ``gradient_accumulation_steps``."""
    ds = fields.get("deepspeed")
    fsdp = {k: fields[k] for k in ("fsdp", "fsdp_config") if fields.get(k)}
    if not ds and not fsdp.get("fsdp"):
        return None
    recipe = read_recipe(deepspeed=ds or None, fsdp_fields=None if ds else fsdp, base=base,
                         source=None if ds and not isinstance(ds, dict) else source)
    if recipe is not None:
        check_batch(recipe, fields, source)
        if recipe.gradient_checkpointing and (truthy(fields.get("activation_checkpointing"))
                                              or truthy(fields.get("gradient_checkpointing"))):
            raise BadInputError(
                f"{source}: fsdp_config's activation_checkpointing and the "
                "activation_checkpointing training argument are both on, which the Trainer "
                "refuses; keep FSDP's (set activation_checkpointing: false)")
    return recipe


def check_batch(recipe: Recipe, fields: dict[str, object], source: str) -> None:
    """Raise when the recipe's batch numbers (or a DeepSpeed config's precision) disagree
    with ``fields`` (TrainingArguments): transformers refuses such a pair at launch."""
    if recipe.deepspeed is not None and recipe.precision is not None:
        theirs = ("bf16-mixed" if truthy(fields.get("bf16")) else
                  "16-mixed" if truthy(fields.get("fp16")) else "32-true")
        if theirs != recipe.precision:
            raise BadInputError(
                f"{recipe.source} enables {_WORD[recipe.precision]} but {source} trains in "
                f"{_WORD[theirs]} (bf16 / fp16 fields): make them agree (or write "
                f"\"enabled\": \"auto\" in {recipe.source})")
    for key, name in (("micro_batch_size", "train_micro_batch_size_per_gpu"),
                      ("grad_accum_steps", "gradient_accumulation_steps")):
        mine, field_name = getattr(recipe, key), BATCH_KEYS[name]
        theirs = fields.get(field_name, 8 if key == "micro_batch_size" else 1)
        if mine is not None and int(theirs) != mine:
            raise BadInputError(
                f"{recipe.source}: {name} {mine} but {source} says {field_name} {theirs}: "
                f"make them agree (or write \"auto\" in {recipe.source})")


# --------------------------------------------------------------------------- DeepSpeed


def _deepspeed_dict(ds: dict[str, object] | str | os.PathLike[str], base: str | Path | None
                    ) -> tuple[dict[str, Any], str, str | None]:
    """(config, its name for messages, its path) of a dict, a JSON string or a path."""
    if isinstance(ds, dict):
        return ds, "the inline deepspeed config", None
    text = str(ds)
    if text.lstrip().startswith("{"):
        return _json(text, "the inline deepspeed config"), "the inline deepspeed config", None
    path = Path(text).expanduser()
    if not path.is_absolute() and base is not None and not path.is_file():
        path = Path(base) / path
    if not path.is_file():
        raise BadInputError(f"DeepSpeed config {text}: no such file; give the path of your "
                            "ds_config.json (relative paths: from the args file's folder)")
    try:
        content = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInputError(f"DeepSpeed config {path}: cannot be read ({e})") from None
    return _json(content, str(path)), path.name, str(path)


def _json(text: str, name: str) -> dict[str, Any]:
    try:
        d = json.loads(text)
    except ValueError as e:
        raise BadInputError(f"{name} is not valid JSON ({e}); DeepSpeed reads a JSON "
                            "object such as {\"zero_optimization\": {\"stage\": 2}}") from None
    if not isinstance(d, dict):
        raise BadInputError(f"{name} holds a {type(d).__name__}, not a JSON object of "
                            "DeepSpeed settings")
    return d


def _number(v: object, key: str, name: str) -> int | None:
    """A DeepSpeed size: an int (``5e8`` is read as one), None for ``"auto"``."""
    if v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise BadInputError(f"{name}: {key} must be a number or \"auto\", got {v!r}")
    return int(v)


def _flag(v: object, key: str, name: str) -> bool | None:
    """A DeepSpeed switch: True / False, None for ``"auto"``."""
    if v == "auto":
        return None
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false"):
        return v.lower() == "true"
    raise BadInputError(f"{name}: {key} must be true, false or \"auto\", got {v!r}")


def _short(n: int) -> str:
    """``500000000`` -> ``5e8``; ``10000`` -> ``1e4``; others as digits."""
    if n >= 1000:
        e = int(math.log10(n))
        m = n / 10**e
        if m == int(m):
            return f"{int(m)}e{e}"
    return str(n)


def _from_deepspeed(ds: dict[str, object], name: str, path: str | None) -> Recipe:
    """The ``Recipe`` of a DeepSpeed config: its ZeRO stage, the sizes and flags it sets,
    its offloading, precision, batch sizes and optimizer (each read by a step below)."""
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise BadInputError(f"{name}: zero_optimization must be an object, got {zero!r}")
    stage = _ds_stage(zero, name)
    strategy = _STAGES[stage]
    details: list[str] = []
    notes: list[str] = []
    overrides = _ds_overrides(zero, stage, name, details, notes)
    offload = _ds_offload(zero, stage, name, details, notes)
    precision = _ds_precision(ds, name)
    if precision is not None:
        details.append(_WORD[precision])
    micro, accum = _ds_batch(ds, name)
    optimizer, optim_args, zero_opt = _ds_optimizer(ds, name, details)
    if (offload != "none" and optimizer is None
            and _flag(ds.get("zero_force_ds_cpu_optimizer", True),
                      "zero_force_ds_cpu_optimizer", name) is not False):
        # DeepSpeed's engine refuses the Trainer's optimizer with an offloaded one
        # (ZeRORuntimeException at deepspeed.initialize; found by a trial, DeepSpeed 0.19.8)
        raise BadInputError(f"{name}: offload_optimizer with the Trainer's optimizer stops at "
                            "deepspeed.initialize; add an \"optimizer\" block (DeepSpeed's "
                            "CPUAdam runs it) or \"zero_force_ds_cpu_optimizer\": false")
    if strategy == "ddp" and optimizer is not None:
        notes.append("stage 0 with DeepSpeed's optimizer: estimated as DDP with that optimizer")
    sharding: list[tuple[str, object]] = []
    if strategy in ("zero1", "zero2", "zero3"):
        # absent sizes are DeepSpeed's defaults; "auto" ones transformers fills in
        sharding += [("zero_sizes", "deepspeed"), ("zero_overrides", tuple(overrides)),
                     ("zero_optimizer", zero_opt)]
    return Recipe(source=name, strategy=strategy, offload=offload, precision=precision,
                  optimizer=optimizer, optim_args=optim_args, micro_batch_size=micro,
                  grad_accum_steps=accum, sharding=tuple(sharding), deepspeed=ds,
                  deepspeed_file=path, details=tuple(details), notes=tuple(notes))


def _ds_stage(zero: dict[str, object], name: str) -> int:
    """The ZeRO stage (0-3) of a ``zero_optimization`` block."""
    stage_v = zero.get("stage", 0)
    try:
        stage = int(stage_v)
        if stage != stage_v:
            raise ValueError
    except (TypeError, ValueError):
        stage = -1
    if stage not in _STAGES:
        raise BadInputError(f"{name}: unknown ZeRO stage {stage_v!r}; DeepSpeed has stages "
                            "0, 1, 2 and 3")
    return stage


def _ds_overrides(zero: dict[str, object], stage: int, name: str, details: list[str],
                  notes: list[str]) -> list[tuple[str, object]]:
    """The ZeRO sizes and flags the block sets (``(attribute, value)``; a size may be
    ``"auto"``), each described in ``details``; what is read but not modelled in ``notes``."""
    overrides: list[tuple[str, object]] = []
    unmodelled: list[str] = []
    for key, attr in _ZERO_SIZES.items():
        if key not in zero:
            continue
        v = _number(zero[key], key, name)
        overrides.append((attr, "auto" if v is None else v))
        if key.startswith("stage3") and stage != 3:
            continue
        details.append(f"{key} {'auto' if v is None else _short(v)}")
        if attr in ("allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters"):
            unmodelled.append(key)
    if unmodelled:
        notes.append(f"{', '.join(unmodelled)}: read, not estimated (no tensor of the step "
                     "they size; autofit.memory.simulate._zero)")
    for key in _ZERO_FLAGS:
        if key in zero:
            v = _flag(zero[key], key, name)
            if v is not None:
                overrides.append((key, v))
                details.append(f"{key} {str(v).lower()}")
                if key == "contiguous_gradients" and not v:
                    notes.append("contiguous_gradients false: estimated as true (DeepSpeed's "
                                 "default)")
    return overrides


def _ds_offload(zero: dict[str, object], stage: int, name: str, details: list[str],
                notes: list[str]) -> str:
    """The recipe's ``offload`` (``none``, ``optimizer``, ``optimizer+params``) of the
    block's ``offload_optimizer`` / ``offload_param``, checked against the stage."""
    offload = "none"
    where = []
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if off is None:
            continue
        if not isinstance(off, dict):
            raise BadInputError(f"{name}: {key} must be an object such as "
                                "{\"device\": \"cpu\"}, got " + repr(off))
        dev = str(off.get("device", "none")).lower()
        if dev not in ("none", "cpu", "nvme"):
            raise BadInputError(f"{name}: {key}.device must be none, cpu or nvme, got {dev!r}")
        if dev != "none":
            where.append((key, dev))
    kinds = {k for k, _ in where}
    if "offload_param" in kinds:
        if stage != 3:
            raise BadInputError(f"{name}: offload_param needs ZeRO stage 3 (the stage is "
                                f"{stage}); drop it or set \"stage\": 3")
        offload = "optimizer+params"
        if "offload_optimizer" not in kinds:
            notes.append("offload_param without offload_optimizer: estimated with both "
                         "offloaded")
    elif "offload_optimizer" in kinds:
        if stage == 0:
            raise BadInputError(f"{name}: offload_optimizer needs a ZeRO stage 1-3 (the "
                                "stage is 0)")
        offload = "optimizer"
    for key, dev in where:
        details.append(f"offload {key.split('_')[1].replace('param', 'parameters')} to {dev}")
    return offload


def _ds_batch(ds: dict[str, object], name: str) -> tuple[int | None, int | None]:
    """The config's micro batch and accumulation (None: ``auto``), checked against its
    ``train_batch_size``."""
    micro = _number(ds.get("train_micro_batch_size_per_gpu", "auto"),
                    "train_micro_batch_size_per_gpu", name)
    accum = _number(ds.get("gradient_accumulation_steps", "auto"),
                    "gradient_accumulation_steps", name)
    total = _number(ds.get("train_batch_size", "auto"), "train_batch_size", name)
    for key, v in (("train_micro_batch_size_per_gpu", micro),
                   ("gradient_accumulation_steps", accum)):
        if v is not None and v < 1:
            raise BadInputError(f"{name}: {key} must be a positive integer, got {v}")
    if micro is not None and accum is not None and total is not None and total % (micro * accum):
        raise BadInputError(f"{name}: train_batch_size {total} is not "
                            f"train_micro_batch_size_per_gpu {micro} x "
                            f"gradient_accumulation_steps {accum} x ranks; make them agree")
    return micro, accum


def _ds_precision(ds: dict[str, object], name: str) -> str | None:
    """``bf16-mixed`` / ``16-mixed`` / ``32-true`` when the config fixes it, None for auto."""
    on = {}
    for key, alias in (("bf16", "bfloat16"), ("fp16", None)):
        block = ds.get(key, ds.get(alias) if alias else None)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise BadInputError(f"{name}: {key} must be an object such as "
                                "{\"enabled\": true}, got " + repr(block))
        on[key] = _flag(block.get("enabled", False), f"{key}.enabled", name)
    if on.get("bf16") and on.get("fp16"):
        raise BadInputError(f"{name}: fp16 and bf16 are both enabled; enable one (or write "
                            "\"auto\" and choose with the TrainingArguments)")
    if on.get("bf16"):
        return "bf16-mixed"
    if on.get("fp16"):
        return "16-mixed"
    if on and all(v is False for v in on.values()) and len(on) == 2:
        return "32-true"
    return None


def _ds_optimizer(ds: dict[str, object], name: str,
                  details: list[str]) -> tuple[str | None, str | None, str]:
    """DeepSpeed's own optimizer: (autofit's optimizer with its states, optim_args,
    ``Layout.zero_optimizer``); (None, None, "torch") when the Trainer's runs."""
    block = ds.get("optimizer")
    if block is None:
        return None, None, "torch"
    kind = str(block.get("type", "")) if isinstance(block, dict) else ""
    if kind.lower() not in DS_OPTIMIZERS:
        raise BadInputError(f"{name}: optimizer type {kind or block!r} is not modelled; use "
                            "one of " + ", ".join(sorted(DS_OPTIMIZERS))
                            + " (or drop the block: the Trainer's optim runs)")
    optimizer, zero_opt = DS_OPTIMIZERS[kind.lower()]
    params = block.get("params") or {}
    optim_args = None
    if optimizer == "sgd" and float(params.get("momentum", 0) or 0) > 0:
        optim_args = f"momentum={params['momentum']}"
    if optimizer == "rmsprop" and float(params.get("momentum", 0) or 0) > 0:
        optim_args = f"momentum={params['momentum']}"
    details.append(f"DeepSpeed's {kind} optimizer"
                   + (f" ({optim_args})" if optim_args else ""))
    return optimizer, optim_args, zero_opt


# --------------------------------------------------------------------------- FSDP


def fsdp_config_dict(raw: object) -> dict[str, object]:
    """A TrainingArguments ``fsdp_config`` as a mapping (given as one, as JSON text or as
    the path of a JSON file)."""
    if isinstance(raw, str):
        raw = _json(Path(raw).read_text() if Path(raw).is_file() else raw, raw)
    return dict(raw) if isinstance(raw, dict) else {}


def _from_fsdp(fields: dict[str, object], name: str) -> Recipe:
    """TrainingArguments' ``fsdp`` + ``fsdp_config`` (keys with or without ``fsdp_``)."""
    from autofit.knobs.strategy import OFFLOAD, STRATEGY

    fsdp = fields.get("fsdp")
    cfg = {k.removeprefix("fsdp_"): v
           for k, v in fsdp_config_dict(fields.get("fsdp_config") or {}).items()}
    return _fsdp_recipe(
        name, version=cfg.get("version", 2),
        strategy=STRATEGY.read({"fsdp": fsdp, "fsdp_config": cfg}),
        offload=OFFLOAD.read({"fsdp": fsdp, "fsdp_config": cfg}),
        wrap=cfg.get("auto_wrap_policy"),
        layer_cls=cfg.get("transformer_layer_cls_to_wrap"),
        mixed=cfg.get("mixed_precision_policy"),
        checkpointing=truthy(cfg.get("activation_checkpointing", False)))


def _fsdp_recipe(name: str, *, version: object, strategy: str, offload: str, wrap: object,
                 layer_cls: object, mixed: object, hsdp: bool = False,
                 checkpointing: bool = False) -> Recipe:
    if str(version) != "2":
        raise BadInputError(f"{name}: FSDP version {version} (FSDP1) is not modelled; autofit "
                            "models FSDP2: set version 2 (fsdp_version: 2)")
    if wrap not in (None, *_WRAPS):
        raise BadInputError(f"{name}: FSDP auto_wrap_policy {wrap} is not modelled; autofit "
                            "models TRANSFORMER_BASED_WRAP (one unit per transformer block)")
    precision = _fsdp_mixed(mixed, name)
    if hsdp:
        strategy = "hsdp"
    details = []
    if strategy == "fsdp-shard-grad-op":
        details.append("reshard_after_forward false")
    if offload != "none":
        details.append("cpu_offload (parameters, gradients and optimizer states on the host)")
    if layer_cls:
        cls = layer_cls if isinstance(layer_cls, str) else ", ".join(map(str, layer_cls))
        details.append(f"wraps {cls}")
    if precision is not None:
        details.append(f"mixed_precision_policy {_WORD[precision]}")
    if checkpointing:
        details.append("FSDP's activation checkpointing (every block)")
    return Recipe(source=name, strategy=strategy, offload=offload, precision=precision,
                  gradient_checkpointing=True if checkpointing else None,
                  details=tuple(details),
                  notes=(("transformer_layer_cls_to_wrap: estimated as one unit per block "
                          "of the model's _no_split_modules"),) if layer_cls else ())


_DTYPES = {"bf16": "bf16-mixed", "bfloat16": "bf16-mixed", "fp16": "16-mixed",
           "float16": "16-mixed", "half": "16-mixed", "fp32": "32-true", "float32": "32-true"}
_WORD = {"bf16-mixed": "bf16", "16-mixed": "fp16", "32-true": "fp32"}


def _fsdp_mixed(mixed: object, name: str) -> str | None:
    """The precision an FSDP ``mixed_precision_policy`` fixes (accelerate: a dtype name, or
    ``param_dtype`` / ``reduce_dtype`` / ``buffer_dtype``); None when not given. Modelled:
    parameters gathered and gradients reduced in one dtype, as the Trainer's bf16 / fp16
    sets FSDP2's policy."""
    if mixed is None:
        return None

    def dtype(v: object) -> str | None:
        key = str(v).lower().removeprefix("torch.")
        if key not in _DTYPES:
            raise BadInputError(f"{name}: mixed_precision_policy dtype {v!r} is not modelled; "
                                "use bf16, fp16 or fp32")
        return _DTYPES[key]

    if isinstance(mixed, str):
        return dtype(mixed)
    if not isinstance(mixed, dict):
        raise BadInputError(f"{name}: mixed_precision_policy must be a dtype name or a mapping "
                            f"of param_dtype / reduce_dtype, got {mixed!r}")
    param = dtype(mixed["param_dtype"]) if mixed.get("param_dtype") else None
    reduce = dtype(mixed["reduce_dtype"]) if mixed.get("reduce_dtype") else param
    if param != reduce:
        raise BadInputError(f"{name}: mixed_precision_policy param_dtype "
                            f"{mixed.get('param_dtype')} with reduce_dtype "
                            f"{mixed.get('reduce_dtype')} is not modelled; autofit models "
                            "FSDP2 reducing in the dtype it gathers (the Trainer's bf16 / fp16)")
    return param


# --------------------------------------------------------------------------- accelerate


def _accelerate(acc: dict[str, object] | str | os.PathLike[str]) -> dict[str, Any]:
    """An accelerate config (path or dict) as what it says: its type, ranks, precision,
    FSDP fields and DeepSpeed config (a file path or inline keys)."""
    import yaml

    name, base = "the accelerate config", None
    if not isinstance(acc, dict):
        path = Path(str(acc)).expanduser()
        if not path.is_file():
            raise BadInputError(f"accelerate config {acc}: no such file; give the YAML "
                                "`accelerate config` wrote (or accelerate launch --config_file)")
        try:
            acc = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BadInputError(f"accelerate config {path}: cannot be read ({first})") from None
        name, base = path.name, path.parent
        if not isinstance(acc, dict):
            raise BadInputError(f"{path} is not a mapping of accelerate settings")
    kind = str(acc.get("distributed_type", "NO")).upper().split(".")[-1]
    if kind not in _ACCELERATE_TYPES:
        raise BadInputError(f"{name}: distributed_type {kind} is not modelled; autofit models "
                            "FSDP, DEEPSPEED, MULTI_GPU (DDP) and NO")
    nproc = None
    total = acc.get("num_processes")
    machines = int(acc.get("num_machines") or 1)
    if total is not None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise BadInputError(f"{name}: num_processes must be a positive integer, "
                                f"got {total!r}")
        if total % machines:
            raise BadInputError(f"{name}: num_processes {total} is not a multiple of "
                                f"num_machines {machines}")
        nproc = total // machines
    said = str(acc.get("mixed_precision") or "").strip().lower()
    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed", "no": "32-true"}.get(said)
    if said and precision is None:  # fp8 (TransformerEngine, torchao, MS-AMP) or unknown
        raise BadInputError(f"{name}: mixed_precision {said} is not modelled (autofit models "
                            "no, fp16 and bf16); set one of those, or measure the step on the "
                            "card (autofit measure)")
    out: dict[str, Any] = {"name": name, "base": base, "type": kind, "nproc": nproc,
                           "nnodes": machines if total is not None or machines > 1 else None,
                           "precision": precision, "deepspeed": None,
                           "compile": dynamo_of(name, acc.get("dynamo_config"))}
    if kind == "DEEPSPEED":
        dsc = acc.get("deepspeed_config") or {}
        if dsc.get("deepspeed_config_file"):
            out["deepspeed"] = dsc["deepspeed_config_file"]
        else:  # accelerate's inline keys, as its DeepSpeedPlugin turns them into a config
            zero: dict[str, Any] = {"stage": dsc.get("zero_stage", 2)}
            for key, ds_key in (("offload_optimizer_device", "offload_optimizer"),
                                ("offload_param_device", "offload_param")):
                if dsc.get(key) not in (None, "none"):
                    zero[ds_key] = {"device": dsc[key]}
            ga = dsc.get("gradient_accumulation_steps", "auto")
            out["deepspeed"] = {"zero_optimization": zero, "gradient_accumulation_steps": ga}
    elif kind == "FSDP":
        cfg = {k.removeprefix("fsdp_"): v for k, v in (acc.get("fsdp_config") or {}).items()}
        reshard = cfg.get("reshard_after_forward", True)
        par = acc.get("parallelism_config") or {}
        replicate = int(par.get("parallelism_config_dp_replicate_size",
                                par.get("dp_replicate_size", 1)) or 1)
        out["fsdp"] = dict(
            version=cfg.get("version", 1),  # accelerate's default is FSDP1
            strategy="fsdp" if truthy(reshard) or str(reshard).upper() == "FULL_SHARD"
            else "fsdp-shard-grad-op",
            offload="optimizer+params" if truthy(cfg.get("offload_params", False)) else "none",
            wrap=cfg.get("auto_wrap_policy"), layer_cls=cfg.get("transformer_layer_cls_to_wrap"),
            mixed=cfg.get("mixed_precision_policy"), hsdp=replicate > 1,
            checkpointing=truthy(cfg.get("activation_checkpointing", False)))
    return out


def dynamo_of(name: str, dynamo: object) -> tuple[bool, str | None, bool] | None:
    """(compiled, mode, regional) of an accelerate config's ``dynamo_config`` (accelerate's
    ``TorchDynamoPlugin``: ``torch.compile(model, backend=, mode=)``, or with
    ``dynamo_use_regional_compilation`` its ``compile_regions``: each repeated block
    compiled apart, the rest eager); None when it says nothing. A backend other than
    inductor is not modelled: refused in one line."""
    if not isinstance(dynamo, dict) or not dynamo:
        return None
    backend = str(dynamo.get("dynamo_backend", "NO")).upper().split(".")[-1]
    if backend == "NO":
        return False, None, False
    if backend != "INDUCTOR":
        raise BadInputError(f"{name}: dynamo_backend {backend} is not modelled; autofit "
                            "models torch.compile's inductor (or NO)")
    from autofit.config import COMPILE_MODES

    mode = dynamo.get("dynamo_mode")
    mode = None if mode in (None, "", "default") else str(mode)
    if mode is not None and mode not in COMPILE_MODES:
        raise BadInputError(f"{name}: dynamo_mode {mode!r} is not one of "
                            f"{', '.join(COMPILE_MODES)}")
    return True, mode, truthy(dynamo.get("dynamo_use_regional_compilation", False))


def _with_accelerate(recipe: Recipe | None, acc: dict[str, object]) -> Recipe:
    """``recipe`` (from a DeepSpeed file or FSDP fields, or None) with the accelerate
    config's type, ranks and precision."""
    import dataclasses

    name, kind = acc["name"], acc["type"]
    if kind == "FSDP":
        if recipe is not None and recipe.strategy not in ("fsdp", "fsdp-shard-grad-op", "hsdp"):
            raise BadInputError(f"{name} launches FSDP but {recipe.source} says "
                                f"{_WHAT.get(recipe.strategy or '', recipe.strategy)}; "
                                "give one recipe")
        recipe = recipe or _fsdp_recipe(name, **acc["fsdp"])
    elif kind in ("MULTI_GPU", "MULTI_CPU", "NO"):
        if recipe is not None and recipe.strategy != "ddp":
            raise BadInputError(f"{name} launches {kind} (DDP) but {recipe.source} says "
                                f"{_WHAT.get(recipe.strategy or '', recipe.strategy)}; "
                                "give one recipe")
        recipe = recipe or Recipe(source=name, strategy="ddp", offload="none")
    assert recipe is not None  # DEEPSPEED: read from its config above
    if (recipe.precision is not None and acc["precision"] is not None
            and acc["precision"] != recipe.precision and kind != "DEEPSPEED"):
        raise BadInputError(f"{name}: mixed_precision says {acc['precision']} but "
                            f"{recipe.source} says {recipe.precision}; make them agree")
    precision = recipe.precision or (acc["precision"] if kind != "DEEPSPEED" else None)
    nproc, nnodes = acc["nproc"], acc["nnodes"]
    details = list(recipe.details)
    if nproc is not None:
        details.insert(0, f"{nproc * (nnodes or 1)} ranks"
                       + (f" on {nnodes} nodes" if nnodes and nnodes > 1 else "")
                       + f" from {name}")
    if recipe.strategy == "hsdp" and (nnodes or 1) < 2:
        raise BadInputError(f"{name}: a replicated FSDP (parallelism_config dp_replicate_size "
                            "> 1) is modelled across nodes: set num_machines > 1")
    compiled = acc.get("compile")
    if compiled is not None:
        details.append(("regional torch.compile" if compiled[2] else "torch.compile")
                       + (f" ({compiled[1]})" if compiled[1] else "")
                       if compiled[0] else "not compiled")
    return dataclasses.replace(recipe, precision=precision, nproc_per_node=nproc,
                               nnodes=nnodes, details=tuple(details),
                               torch_compile=compiled[0] if compiled is not None else None,
                               torch_compile_mode=compiled[1] if compiled is not None else None,
                               torch_compile_regional=(compiled[2] if compiled is not None
                                                       else None))
