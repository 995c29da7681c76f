"""The levers' terms of the closed form: activation offloading's note, and the
activations a ``torch_compile`` step does not keep. The chunked loss's buffers and
torch.compile's saving are their knobs' rules (``autofit.knobs.chunked_loss``,
``autofit.knobs.compile``), asked here with what only the estimators know (the block
family, the element size)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.config import TrainConfig
from autofit.knobs.chunked_loss import chunked_loss_bytes, loss_chunk_rows
from autofit.knobs.compile import compiled_saving_parts
from autofit.memory.analytic._activations import _family
from autofit.memory.analytic._states import _bytes

if TYPE_CHECKING:  # pragma: no cover
    from autofit.probe.device import DeviceInfo
    from autofit.probe.model import ModelInfo

__all__ = ["chunked_loss_bytes", "loss_chunk_rows", "offload_note", "compile_saving_bytes"]


def offload_note(host: int, tensors: int) -> str:
    """The note of an estimate with activation offloading: what lives in host memory."""
    from autofit.probe.device import format_bytes

    return (f"activation offloading: {format_bytes(host)} of pinned host memory holds the "
            f"{tensors} inputs the checkpointed blocks save (host_bytes); backward copies "
            "them back one block at a time")
def compile_saving_bytes(info: ModelInfo, config: TrainConfig, seq_len: int,
                         device: DeviceInfo | None = None) -> int:
    """Bytes of activations a ``torch_compile`` step does not keep at its backward peak,
    against the eager step's on ``device`` (None: the CPU's rule), 0 without
    ``torch_compile`` (see ``autofit.knobs.compile`` for the rule and its limits). With
    gradient checkpointing only the block recomputed at a time gains (the checkpointed
    inputs are kept either way). With the chunked loss nothing: ``ChunkedLossTrainer``'s
    loss runs the backbone itself, uncompiled.

        >>> from autofit.probe.model import probe_model
        >>> info = probe_model("tiny-llama")
        >>> compile_saving_bytes(info, TrainConfig(torch_compile=True), 256) > 0
        True
        >>> compile_saving_bytes(info, TrainConfig(), 256)
        0
    """
    return sum(_compile_parts(info, config, seq_len, device))


def _compile_parts(info: ModelInfo, config: TrainConfig, seq_len: int,
                   device: DeviceInfo | None) -> tuple[int, int]:
    """(blocks, the rest) of ``compile_saving_bytes``: the knob's rule
    (``autofit.knobs.compile.compiled_saving_parts``) at the model's block family and the
    configuration's activation element size."""
    if not config.torch_compile or config.chunked_loss or not info.is_transformer:
        return 0, 0
    return compiled_saving_parts(info, config, seq_len, family=_family(info),
                                 element=_bytes(config.precision_spec.compute_dtype),
                                 cuda=device is not None and device.allocator == "cuda")
