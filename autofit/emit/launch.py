"""How a tuned run on several ranks is launched: the files beside the tuned file, and commands.

A tuned file for ``world_size > 1`` keeps the ``TrainingArguments`` fields of its
strategy (``fsdp`` + ``fsdp_config``, or ``deepspeed``) and gets, beside it:

- ``<stem>-deepspeed.json`` (ZeRO): the DeepSpeed config, its sizes ``"auto"`` for
  transformers to fill in — or, tuned with the user's own (``--deepspeed-config``, a
  ``deepspeed`` field of ``training_args``), that config with only its numeric batch
  fields set to the tuned ones (``autofit.knobs.recipe``; the user's file is never
  written); the tuned file's ``deepspeed`` field is this path;
- ``<stem>-accelerate.yaml``: an accelerate config (``accelerate launch --config_file``)
  that ``accelerate``'s own loader reads (``load_config_from_file``): ``distributed_type``
  (``FSDP``, ``DEEPSPEED``, or ``MULTI_GPU`` for DDP: accelerate's multi-process launcher,
  torchrun, also on a CPU), ``num_processes`` (every rank, all nodes), ``num_machines``,
  ``mixed_precision``, ``use_cpu``; FSDP2 as ``fsdp_config`` (``fsdp_version: 2``,
  ``fsdp_reshard_after_forward``, ``fsdp_offload_params``, ``fsdp_auto_wrap_policy:
  TRANSFORMER_BASED_WRAP``: the model's ``_no_split_modules``; with checkpointing FSDP's own,
  ``fsdp_activation_checkpointing``, which the tuned file's ``fsdp_config`` says too, its
  ``activation_checkpointing`` training argument off: the Trainer refuses both); ZeRO as
  ``deepspeed_config: {deepspeed_config_file, zero3_init_flag}``; hybrid sharding as
  ``parallelism_config`` (``dp_replicate_size`` = nodes, ``dp_shard_size`` = processes
  per node).

    >>> from autofit.config import TrainConfig
    >>> cfg = accelerate_config(TrainConfig(nproc_per_node=4, strategy="fsdp",
    ...                                     precision="bf16-mixed"))
    >>> cfg["distributed_type"], cfg["num_processes"], cfg["fsdp_config"]["fsdp_version"]
    ('FSDP', 4, 2)
    >>> launch_commands("tuned.yaml", TrainConfig(nproc_per_node=4, strategy="fsdp"))[0]
    'accelerate launch --config_file tuned-accelerate.yaml train.py'

Paths are written as the tuned file's own path was given (relative stays relative): the
run is launched from the folder autofit was run in, or the paths edited.

Known limitations:
    NB: accelerate 1.15 launches ``distributed_type: MULTI_CPU`` as a single process
    unless an MPI host file is configured (measured here: rank 0 of 1); a CPU plan's
    DDP is written as ``MULTI_GPU`` (torchrun), whose ranks the tuned file's
    ``use_cpu: true`` makes CPU ranks. On a CPU accelerate's FSDP plugin falls back to
    DDP (the ranks run ``MULTI_CPU`` with ``ACCELERATE_USE_FSDP=true``): a CPU plan's
    FSDP trains replicated when launched this way; autofit's trial shards it itself.
    NB: several nodes: each node launches the same files with its own
    ``--machine_rank`` and the first node's ``--main_process_ip``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autofit.config import TrainConfig

__all__ = ["accelerate_config", "deepspeed_path", "accelerate_path", "launch_commands",
           "launch_files", "launch_settings", "MIXED_PRECISION"]

# TrainConfig.precision -> accelerate's mixed_precision
MIXED_PRECISION = {"bf16-mixed": "bf16", "16-mixed": "fp16"}
_FSDP_RESHARD = {"fsdp": True, "fsdp-shard-grad-op": False, "hsdp": True}
_ZERO = {"zero1": 1, "zero2": 2, "zero3": 3}
MAIN_PROCESS_PORT = 29500  # torchrun's default


def deepspeed_path(path: str | Path) -> Path:
    """``tuned.yaml`` -> ``tuned-deepspeed.json`` beside it."""
    p = Path(path)
    return p.with_name(f"{p.stem}-deepspeed.json")


def accelerate_path(path: str | Path) -> Path:
    """``tuned.yaml`` -> ``tuned-accelerate.yaml`` beside it."""
    p = Path(path)
    return p.with_name(f"{p.stem}-accelerate.yaml")


def accelerate_config(config: TrainConfig, *, use_cpu: bool = False,
                      deepspeed_file: str | None = None) -> dict[str, Any]:
    """The accelerate config of ``config``'s ranks (a ``ClusterConfig`` as a dict).

    ``deepspeed_file``: the DeepSpeed JSON's path (ZeRO). FSDP wraps the layers of the
    model's ``_no_split_modules`` (accelerate reads them when no class is named).
    """
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU",
        "num_processes": config.world_size,
        "num_machines": config.nnodes,
        "machine_rank": 0,
        "mixed_precision": MIXED_PRECISION.get(config.precision, "no"),
        "use_cpu": bool(use_cpu),
        "gpu_ids": "all",
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "debug": False,
    }
    if config.nnodes > 1:
        out["main_process_port"] = MAIN_PROCESS_PORT
    strategy = config.strategy
    if strategy in _FSDP_RESHARD:
        fsdp: dict[str, Any] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": _FSDP_RESHARD[strategy],
            "fsdp_offload_params": config.offload != "none",
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
        from autofit.knobs.strategy import fsdp_checkpoints

        if fsdp_checkpoints(config):  # FSDP's own, as the tuned file's fsdp_config says
            fsdp["fsdp_activation_checkpointing"] = True
        out["distributed_type"] = "FSDP"
        out["fsdp_config"] = fsdp
        if strategy == "hsdp":
            out["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": config.nnodes,
                "parallelism_config_dp_shard_size": config.nproc_per_node,
            }
    elif strategy in _ZERO:
        out["distributed_type"] = "DEEPSPEED"
        out["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file or "deepspeed.json",
                                   "zero3_init_flag": _ZERO[strategy] == 3}
        # the DeepSpeed file says the precision ("auto": the TrainingArguments' bf16 / fp16);
        # accelerate refuses mixed_precision beside a deepspeed_config_file
        out.pop("mixed_precision")
    elif config.world_size == 1:
        out["distributed_type"] = "NO"  # one process (a regional compile's launch file)
    if config.torch_compile_regional:
        # no TrainingArguments field carries it: accelerate launch sets the environment the
        # Trainer's TorchDynamoPlugin reads (ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION)
        out["dynamo_config"] = {"dynamo_backend": "INDUCTOR",
                                "dynamo_mode": config.torch_compile_mode or "default",
                                "dynamo_use_regional_compilation": True}
    return out


def launch_commands(path: str | Path, config: TrainConfig, script: str = "train.py") -> list[str]:
    """The commands that launch ``script`` (which loads the tuned file) on ``config``'s ranks:
    ``accelerate launch`` with the accelerate config, then the equivalent ``torchrun`` (one
    process: ``python``), with the environment a regional compile needs."""
    acc = accelerate_path(path)
    cmds = [f"accelerate launch --config_file {acc} {script}"]
    env = ("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=true "
           if config.torch_compile_regional else "")
    if config.world_size == 1:
        cmds.append(f"{env}python {script}")
    elif config.nnodes > 1:
        cmds[0] = (f"accelerate launch --config_file {acc} --machine_rank $NODE_RANK "
                   f"--main_process_ip $MAIN_ADDR {script}")
        cmds.append(f"{env}torchrun --nnodes {config.nnodes} --nproc-per-node "
                    f"{config.nproc_per_node} --node-rank $NODE_RANK --master-addr $MAIN_ADDR "
                    f"--master-port {MAIN_PROCESS_PORT} {script}")
    elif config.strategy not in _ZERO:  # torchrun alone: DDP and FSDP come from the file
        cmds.append(f"{env}torchrun --nproc-per-node {config.nproc_per_node} {script}")
    return cmds


def launch_files(path: str | Path, config: TrainConfig,
                 args: dict[str, object]) -> tuple[dict[str, Any], dict[Path, str], dict[str, Any]]:
    """What a tuned file at ``path`` writes beside it for ``config``'s ranks.

    Returns ``args`` (its ``deepspeed`` dict replaced by the JSON's path), the files to
    write (path -> text) and the metadata that names them (``launch``: files and
    commands). Nothing for a single rank, unless it compiles regionally (no
    ``TrainingArguments`` field says so: the accelerate config does).
    """
    import yaml

    if config.world_size <= 1 and not config.torch_compile_regional:
        return args, {}, {}
    args = dict(args)
    files: dict[Path, str] = {}
    ds_file = None
    if isinstance(args.get("deepspeed"), dict):
        ds = deepspeed_path(path)
        files[ds] = json.dumps(args["deepspeed"], indent=2) + "\n"
        ds_file = str(ds)
        args["deepspeed"] = ds_file
    acc = accelerate_path(path)
    cfg = accelerate_config(config, use_cpu=bool(args.get("use_cpu")), deepspeed_file=ds_file)
    what = (f"{config.world_size} ranks ({config.strategy}"
            + (f", offload {config.offload}" if config.offload != "none" else "") + ")"
            if config.world_size > 1 else "one process")
    if "dynamo_config" in cfg:
        what += ", regional torch.compile"
    header = [f"# accelerate config written by autofit for {Path(path).name}: {what}",
              f"#   {launch_commands(path, config)[0]}"]
    if config.nnodes > 1:
        header.append("#   on every node: its --machine_rank and the first node's "
                      "--main_process_ip")
    files[acc] = "\n".join(header) + "\n" + yaml.safe_dump(cfg, sort_keys=False)
    meta = {"launch": {"accelerate_config": str(acc), "deepspeed_config": ds_file,
                       "commands": launch_commands(path, config)}}
    return args, files, meta


def launch_settings(path: str | Path) -> dict[str, int] | None:
    """What the accelerate config beside a tuned file launches, ``{nproc_per_node, nnodes,
    regional}`` (None when there is none; ``regional``: its ``dynamo_config`` compiles each
    block apart, 1 or 0); a launch file that is not one accelerate could run is bad input."""
    from autofit.errors import BadInputError
    from autofit.knobs.recipe import dynamo_of

    side = accelerate_path(path)
    if not side.is_file():
        return None
    import yaml

    fix = f"fix it or delete {side.name} (autofit tune -o writes it again)"
    try:
        d = yaml.safe_load(side.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError, OSError):
        raise BadInputError(f"{side}: not a readable accelerate config; {fix}") from None
    d = d if isinstance(d, dict) else {}
    procs, machines = d.get("num_processes", 1), d.get("num_machines", 1)
    for name, v in (("num_processes", procs), ("num_machines", machines)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
            raise BadInputError(f"{side}: {name} must be a positive whole number, got {v!r}; "
                                f"{fix}")
    if procs % machines:
        raise BadInputError(f"{side}: num_processes {procs} is not a multiple of num_machines "
                            f"{machines} (every node runs as many); {fix}")
    compiled = dynamo_of(str(side), d.get("dynamo_config"))
    return {"nproc_per_node": procs // machines, "nnodes": machines,
            "regional": int(bool(compiled and compiled[0] and compiled[2]))}
