"""Stages 0 and 1 of ``autofit()``: the samples as the script feeds them, then the device,
the model built and described, and the data's lengths (``Probed``).

    >>> from autofit.stages.probed import Probed   # what probe() returns; the stages read it
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.config import ModelSpec, one_process_strategy
from autofit.errors import BadInputError, fix
from autofit.knobs.trl_loss import is_sft_config
from autofit.probe.device import DeviceInfo, resolve_device
from autofit.probe.quant import check_precision
from autofit.stages.options import TuneOptions

if TYPE_CHECKING:
    import torch

    from autofit.probe.data import DataInfo
    from autofit.probe.model import ModelInfo
    from autofit.probe.packing import ScriptData

__all__ = ["Probed", "script_data", "probe"]


@dataclass(frozen=True)
class Probed:
    """What the probe stage found: the model as given and as built, its task and
    description, the data's lengths and the device; the model's spec resolved for that
    device, and the samples as the script feeds them (``ScriptData``)."""

    model: Any
    module: torch.nn.Module
    task: str
    info: ModelInfo
    data: DataInfo
    device: DeviceInfo
    seq_len: int  # the worst-case (longest) sample after truncation
    spec: ModelSpec | None = None  # None: the model as given, nothing else asked of it
    seen: ScriptData | None = None  # the samples as the script feeds them

    @property
    def name(self) -> str:
        return self.model if isinstance(self.model, str) else self.info.name

    @property
    def model_spec(self) -> ModelSpec:
        return self.spec if self.spec is not None else ModelSpec(self.model)

    @property
    def dataset(self) -> Any:
        """The samples trials are fed (packed when the script packs them)."""
        return self.seen.dataset if self.seen is not None else None

    @property
    def max_seq_len(self) -> int | None:
        """The samples' truncation (None when packed or not truncated)."""
        return self.seen.max_seq_len if self.seen is not None else None


def script_data(dataset: object, max_seq_len: int | None, options: TuneOptions,
                reasons: list[str]) -> ScriptData:
    """Stage 0: the samples as the script feeds them (``block_size=`` packing, an
    SFTConfig's ``max_length`` / ``packing``; ``autofit.probe.packing.ScriptData``)."""
    from autofit.probe.packing import as_script_sees

    args = options.training_args
    seen = as_script_sees(dataset, block_size=options.block_size, max_seq_len=max_seq_len,
                          sft=args if is_sft_config(args) else None,
                          tokenizer=options.tokenizer, text_column=options.text_column)
    reasons += seen.reasons
    return seen


def probe(spec: ModelSpec, seen: ScriptData, device: str | DeviceInfo, options: TuneOptions,
          reasons: list[str], warm_trials: bool = False) -> Probed:
    """Stage 1: resolve the device, build and describe the model, measure the data's lengths.

    ``seen``: the samples as the script feeds them (``script_data``). ``warm_trials``:
    trials will run (a tune): the trial server starts now, on the other core, while this
    process builds the model and reads the data."""
    from autofit.errors import NoTrainableParametersError
    from autofit.probe.data import probe_data
    from autofit.probe.model import build_model, describe, token_limits
    from autofit.trial.model import for_device

    dev = _device_with_ranks(resolve_device(device), options, reasons)
    if warm_trials:
        from autofit.trial.runner import warm_up

        warm_up(dev, options.isolation)  # its imports overlap the probing
    spec = for_device(spec, dev)  # a 4-bit base computes in fp16 without bf16
    model = spec.ref
    module, task = build_model(model, task=spec.task,
                               attn_implementation=spec.attn_implementation,
                               lora=spec.lora, quantization_config=spec.quant)
    info = describe(module, task=task, name=model if isinstance(model, str) else None)
    precisions = options.asked("precision")
    for p in [precisions] if isinstance(precisions, str) else (precisions or ()):
        check_precision(info.quant, info.dtype, p)
    if info.quant is not None:
        reasons.append(f"base quantized: {info.quant.describe()} (bitsandbytes); the base "
                       "is loaded in its compute dtype and never cast")
    if info.trainable_params == 0:
        raise NoTrainableParametersError(
            f"{info.name} has no trainable parameter; unfreeze some or add LoRA "
            f"({fix('--lora-r 8', 'lora=' + repr({'r': 8}))})")
    vocab, positions = token_limits(module)  # the data is checked against them
    if seen.block_size is not None:
        from autofit.probe.packing import check_block_size

        check_block_size(seen.block_size, max_positions=positions, name=seen.source)
    max_seq_len = seen.max_seq_len
    data = probe_data(seen.dataset, max_seq_len=max_seq_len, tokenizer=options.tokenizer,
                      text_column=options.text_column, vocab_size=vocab,
                      max_positions=positions)
    reasons.append(f"sequence length {data.length_max}: the longest sample"
                   + (f" after truncation at {max_seq_len}" if data.num_truncated else "")
                   + f" (p50 {data.length_p50}, p99 {data.length_p99})")
    return Probed(model, module, task, info, data, dev, data.length_max, spec, seen)


def _device_with_ranks(dev: DeviceInfo, options: TuneOptions, reasons: list[str]) -> DeviceInfo:
    """The device with the run's ranks (``nproc_per_node`` x ``nnodes``; ``world_size`` alone
    is that many processes on one node); each rank is a device like ``dev``."""
    nproc, nnodes = options.nproc_per_node, options.nnodes
    world = options.world_size
    if nproc is None and nnodes is None and world is None:
        one_process_strategy(options.asked("strategy"), 1)
        return dev
    nnodes = int(nnodes or 1)
    nproc = int(nproc) if nproc is not None else (
        max(1, int(world) // nnodes) if world is not None else 1)
    if world is not None and int(world) != nproc * nnodes:
        raise BadInputError(f"world_size {world} is not nproc_per_node x nnodes = {nproc} x "
                            f"{nnodes}; give " + fix("--nproc-per-node and --nnodes",
                                                     "nproc_per_node and nnodes") + " alone")
    one_process_strategy(options.asked("strategy"), nproc * nnodes)
    from autofit.probe.device import check_ranks_per_node

    check_ranks_per_node(nproc, dev, "nproc_per_node")
    if nproc * nnodes > 1:
        where = f"{nnodes} nodes x {nproc}" if nnodes > 1 else f"{nproc} processes"
        reasons.append(f"{nproc * nnodes} ranks ({where}), each on a {dev.name}: estimates are "
                       "per rank; trials run every rank (torchrun on this machine)"
                       if dev.present else
                       f"{nproc * nnodes} ranks ({where}), each on a {dev.name}: estimates are "
                       "per rank")
    return dataclasses.replace(dev, nproc_per_node=nproc, nnodes=nnodes)
