"""The strategy knob: how several ranks hold the model (DDP, FSDP2, DeepSpeed ZeRO), and
the offload knob: what a sharded strategy keeps in host memory.

    >>> from autofit.config import TrainConfig
    >>> args = {}
    >>> STRATEGY.emit(TrainConfig(nproc_per_node=2, strategy="fsdp"), args)
    >>> args["fsdp"], args["fsdp_config"]["reshard_after_forward"]
    (True, True)
    >>> args = {}
    >>> STRATEGY.emit(TrainConfig(nproc_per_node=8, strategy="zero3", offload="optimizer"), args)
    >>> args["deepspeed"]["zero_optimization"]["stage"], "offload_param" in args["deepspeed"]["zero_optimization"]
    (3, False)

No strategy changes what training computes (the same gradients are averaged over the
same samples), so with more than one rank every strategy is searched and ranked by
predicted throughput, communication included: DDP where a full replica fits, sharding
where it must. With one rank the strategy is ``"ddp"`` (nothing to shard). ZeRO needs
DeepSpeed (``pip install 'autofit[deepspeed]'``) to be *tried*; a plan for cards that
are not here needs nothing.

Offloading to host memory is slow (every step moves the optimizer states, and with
``optimizer+params`` the parameters, over the host link), so it is searched only when
asked (``autofit tune --offload optimizer``) and suggested when nothing fits.

Emitted as the installed transformers reads them: FSDP2 as ``fsdp=True`` with
``fsdp_config={"version": 2, "reshard_after_forward": ..., "cpu_offload": ...}``; ZeRO as
``deepspeed=`` a DeepSpeed config dict (written as a JSON file beside a tuned file) whose
sizes are ``"auto"`` where transformers fills them in from the TrainingArguments and the
model (``HfTrainerDeepSpeedConfig``): the memory rules use the values ``"auto"`` resolves
to. Hybrid sharding (``hsdp``) needs accelerate's ``parallelism_config`` (shard within a
node, replicate across nodes), which the accelerate config file carries.

A user's own recipe (``--deepspeed-config``, ``--accelerate-config``, a file's
``deepspeed`` / ``fsdp`` fields) fixes these knobs instead of the search, and its sizes
replace the ones above: ``autofit.knobs.recipe``.

The memory rules live with the estimators (``autofit.memory``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from autofit.config import (
    OFFLOADS,
    STRATEGIES,
    normalize_offload,
    normalize_strategy,
    strategy_conflict,
)
from autofit.errors import MissingDependencyError, fix
from autofit.knobs import base

if TYPE_CHECKING:
    import os

    from autofit.config import TrainConfig
    from autofit.knobs.base import KnobValue
    from autofit.probe.device import DeviceInfo

__all__ = ["STRATEGY", "OFFLOAD", "StrategyKnob", "OffloadKnob", "ranks_of",
           "deepspeed_config", "ZERO_STAGE", "fsdp_checkpoints"]

ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}
_FSDP_RESHARD = {"fsdp": True, "fsdp-shard-grad-op": False, "hsdp": True}
_SHORT = {"ddp": "ddp", "fsdp": "fsdp", "fsdp-shard-grad-op": "fsdp no-reshard",
          "hsdp": "hsdp", "zero1": "zero-1", "zero2": "zero-2", "zero3": "zero-3"}


def ranks_of(device: object) -> tuple[int, int]:
    """``(nproc_per_node, nnodes)`` of a device (a ``DeviceInfo``; 1 x 1 for anything else)."""
    return int(getattr(device, "nproc_per_node", 1) or 1), int(getattr(device, "nnodes", 1) or 1)


def deepspeed_config(stage: int, offload: str) -> dict[str, Any]:
    """The DeepSpeed config of ZeRO ``stage`` with ``offload``, sizes left ``"auto"`` for
    transformers to fill in (batch sizes, accumulation, clipping, precision and, for
    ZeRO-3, the bucket sizes from the model's hidden size)."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                            "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto",
                     "stage3_param_persistence_threshold": "auto",
                     "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    out = {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    if offload != "none":
        # the Trainer passes its own optimizer (TrainingArguments.optim) to DeepSpeed; with
        # an offloaded optimizer DeepSpeed refuses any but its DeepSpeedCPUAdam unless told
        # (ZeRORuntimeException at deepspeed.initialize: found by a trial, DeepSpeed 0.19.8)
        out["zero_force_ds_cpu_optimizer"] = False
    return out


def fsdp_checkpoints(config: object) -> bool:
    """Whether an FSDP plan's checkpointing is FSDP's own (``fsdp_config``'s
    ``activation_checkpointing``, accelerate's ``fsdp_activation_checkpointing``) rather than
    the training argument: every FSDP plan that checkpoints, unless it offloads the
    checkpointed inputs (transformers offloads only through the training argument)."""
    return (getattr(config, "world_size", 1) > 1
            and getattr(config, "strategy", "ddp") in _FSDP_RESHARD
            and bool(getattr(config, "gradient_checkpointing", False))
            and not getattr(config, "activation_offloading", False))


class StrategyKnob:
    name = "strategy"
    title = "strategy"
    values = tuple(STRATEGIES)
    fields = ("fsdp", "fsdp_config", "deepspeed")
    saving = None  # what saves memory depends on the ranks: suggested instead
    calibrates_apart = True  # each strategy allocates its own buffers

    def normalize(self, value: object) -> str:
        return normalize_strategy(value)

    def changes_math(self, value: str) -> bool:
        return False

    def defaults(self, device: DeviceInfo) -> tuple[tuple[str, ...], str | None]:
        nproc, nnodes = ranks_of(device)
        if nproc * nnodes == 1:
            return ("ddp",), None
        names = ["ddp", "fsdp", "fsdp-shard-grad-op"] + (["hsdp"] if nnodes > 1 else [])
        zero = ["zero1", "zero2", "zero3"]
        if getattr(device, "present", False) and not base.installed("deepspeed"):
            why = ("; DeepSpeed ZeRO left out: DeepSpeed is not installed "
                   "(pip install 'autofit[deepspeed]')")
        else:
            names += zero
            why = ""
        return tuple(names), (f"strategy: {', '.join(names)} searched on {nproc * nnodes} ranks "
                              "(they change no math; ranked by predicted throughput with "
                              "communication)" + why)

    def check(self, device: DeviceInfo, value: str, run: bool = True) -> None:
        """Raise ``MissingDependencyError`` for ZeRO to run on a present device without
        DeepSpeed (an estimate, ``run=False``, needs no DeepSpeed: ZeRO is modelled)."""
        if (run and value in ZERO_STAGE and getattr(device, "present", False)
                and not base.installed("deepspeed")):
            raise MissingDependencyError(
                f"strategy {value} runs under DeepSpeed, which is not installed: pip install "
                "'autofit[deepspeed]' (or choose "
                + fix("--strategy fsdp", "strategy='fsdp'") + ")")

    def conflict(self, choice: dict[str, KnobValue]) -> str | None:
        """FSDP2 with a bitsandbytes optimizer: its update ops have no DTensor sharding rule
        (a trial on two ranks: ``NotImplementedError: Operator
        bitsandbytes.optimizer_update_32bit.default does not have a sharding strategy``)."""
        from autofit.config import OPTIMIZERS

        strategy, optimizer = choice.get("strategy", "ddp"), choice.get("optimizer")
        spec = OPTIMIZERS.get(optimizer) if optimizer is not None else None
        if strategy in _FSDP_RESHARD and spec is not None and spec.bnb:
            return (f"{optimizer} (bitsandbytes) does not run on FSDP2's sharded (DTensor) "
                    "parameters: use " + fix("--optim adamw_torch", "optimizer='adamw_torch'")
                    + " or a ZeRO strategy")
        return None

    def describe(self, value: str) -> str:
        return STRATEGIES[value].split(":")[0] if value != "ddp" else "DDP"

    def short(self, value: str) -> str:
        return _SHORT[value]

    def flag(self, value: str) -> str:
        return f"--strategy {value}"

    def suggest(self, device: DeviceInfo) -> tuple[str, ...]:
        nproc, nnodes = ranks_of(device)
        return ("zero3", "fsdp") if nproc * nnodes > 1 else ()

    def note(self, value: str) -> str | None:
        if value in ZERO_STAGE:
            return ("DeepSpeed: launch with `accelerate launch --config_file <the accelerate "
                    "config written beside the tuned file>` or `deepspeed`; the DeepSpeed JSON "
                    "is written beside the tuned file")
        if value == "hsdp":
            return ("hybrid sharding: launch with the accelerate config written beside the "
                    "tuned file (its parallelism_config shards within a node and replicates "
                    "across nodes)")
        return None

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        for f in self.fields:
            args.pop(f, None)
        strategy, offload = config.strategy, getattr(config, "offload", "none")
        if getattr(config, "world_size", 1) <= 1 or strategy == "ddp":
            return
        if strategy in _FSDP_RESHARD:
            args["fsdp"] = True
            fsdp_config: dict[str, Any] = {"version": 2,
                                           "reshard_after_forward": _FSDP_RESHARD[strategy]}
            if offload != "none":
                fsdp_config["cpu_offload"] = True
            if fsdp_checkpoints(config):
                # FSDP's own activation checkpointing, which transformers prefers under FSDP
                # (the training argument's re-gathers in backward) and which the Trainer
                # refuses beside the training argument: the checkpointing knob's field off
                from autofit.knobs.checkpointing import clear_fields

                fsdp_config["activation_checkpointing"] = True
                clear_fields(args)
            args["fsdp_config"] = fsdp_config
        else:
            args["deepspeed"] = deepspeed_config(ZERO_STAGE[strategy], offload)

    def read(self, args: dict[str, object]) -> str:
        ds = args.get("deepspeed")
        if ds:
            stage = _deepspeed_dict(ds).get("zero_optimization", {}).get("stage", 0)
            return {1: "zero1", 2: "zero2", 3: "zero3"}.get(int(stage), "ddp")
        if args.get("fsdp"):
            fsdp = args["fsdp"]
            items = fsdp.split() if isinstance(fsdp, str) else (
                [str(getattr(x, "value", x)) for x in fsdp] if isinstance(fsdp, list | tuple)
                else [])
            cfg = args.get("fsdp_config") or {}
            if "hybrid_shard" in items or "hybrid_shard_zero2" in items:
                return "hsdp"
            reshard = cfg.get("reshard_after_forward", "shard_grad_op" not in items)
            return "fsdp" if str(reshard).lower() not in ("false", "0") else "fsdp-shard-grad-op"
        return "ddp"

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--strategy", nargs="+", default=None, type=_strategy_arg,
                            help="strategies allowed on several ranks: " + ", ".join(STRATEGIES)
                                 + " (default: all that run here)")

    def from_options(self, args: argparse.Namespace) -> Any:
        return args.strategy

    def add_option(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--strategy", default="ddp", type=_strategy_arg,
                            help="how the ranks hold the model: " + ", ".join(STRATEGIES))

    def option_value(self, args: argparse.Namespace) -> str:
        return args.strategy


class OffloadKnob:
    """What a sharded strategy keeps in host memory. Written by the strategy knob (it is
    part of the FSDP / DeepSpeed config), read back here."""

    name = "offload"
    title = "offload"
    values = OFFLOADS
    fields: tuple[str, ...] = ()  # the strategy knob writes it into its own fields
    saving = None  # slow: searched only when asked, suggested when nothing fits
    calibrates_apart = True

    def normalize(self, value: object) -> str:
        return normalize_offload(value)

    def changes_math(self, value: str) -> bool:
        return False

    def defaults(self, device: DeviceInfo) -> tuple[tuple[str, ...], str | None]:
        return ("none",), None

    def check(self, device: DeviceInfo, value: str, run: bool = True) -> None:
        return None  # which strategy can offload what: conflict()

    def conflict(self, choice: dict[str, KnobValue]) -> str | None:
        return strategy_conflict(choice.get("strategy", "ddp"), choice.get("offload", "none"))

    def describe(self, value: str) -> str:
        return {"none": "no offload", "optimizer": "optimizer offloaded to host",
                "optimizer+params": "optimizer and parameters offloaded to host"}[value]

    def short(self, value: str) -> str:
        return {"none": "no", "optimizer": "opt", "optimizer+params": "opt+par"}[value]

    def flag(self, value: str) -> str:
        return f"--offload {value}"

    def suggest(self, device: DeviceInfo) -> tuple[str, ...]:
        nproc, nnodes = ranks_of(device)
        return ("optimizer", "optimizer+params") if nproc * nnodes > 1 else ()

    def note(self, value: str) -> str | None:
        if value == "none":
            return None
        return ("offload: every node needs the host memory the estimate reports (host_bytes); "
                "steps wait on the host link")

    def emit(self, config: TrainConfig, args: dict[str, object]) -> None:
        return None  # STRATEGY.emit writes it with the strategy's config

    def read(self, args: dict[str, object]) -> str:
        ds = args.get("deepspeed")
        if ds:
            zero = _deepspeed_dict(ds).get("zero_optimization", {})
            on = [k for k in ("offload_optimizer", "offload_param")
                  if (zero.get(k) or {}).get("device", "none") not in ("none", None)]
            return ("optimizer+params" if "offload_param" in on
                    else "optimizer" if on else "none")
        cfg = args.get("fsdp_config") or {}
        fsdp = args.get("fsdp")
        items = fsdp.split() if isinstance(fsdp, str) else []
        on = str(cfg.get("cpu_offload", False)).lower() in ("true", "1") or "offload" in items
        return "optimizer+params" if args.get("fsdp") and on else "none"

    def add_options(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--offload", nargs="+", default=None, type=_offload_arg,
                            help="host offload allowed: " + ", ".join(OFFLOADS)
                                 + " (default: none; slow, tried only when asked)")

    def from_options(self, args: argparse.Namespace) -> Any:
        return args.offload

    def add_option(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--offload", default="none", type=_offload_arg,
                            help="what a sharded strategy keeps in host memory: "
                                 + ", ".join(OFFLOADS))

    def option_value(self, args: argparse.Namespace) -> str:
        return args.offload


def _deepspeed_dict(ds: dict[str, object] | str | os.PathLike[str]) -> dict[str, Any]:
    """A DeepSpeed config given as a dict, a JSON string or a path to a JSON file."""
    import json
    from pathlib import Path

    if isinstance(ds, dict):
        return ds
    text = str(ds)
    if text.lstrip().startswith("{"):
        return json.loads(text)
    path = Path(text)
    return json.loads(path.read_text()) if path.is_file() else {}


def _strategy_arg(text: str) -> str:
    from autofit.errors import InvalidConfigError

    try:
        return normalize_strategy(text)
    except InvalidConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _offload_arg(text: str) -> str:
    from autofit.errors import InvalidConfigError

    try:
        return normalize_offload(text)
    except InvalidConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


STRATEGY = StrategyKnob()
OFFLOAD = OffloadKnob()
