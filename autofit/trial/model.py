"""A model given by reference, and how a trial gives it real weights.

``ModelRef`` is what travels to a trial child instead of a pickled module: the
child rebuilds the model itself. ``materialize`` builds it with
``autofit.probe.model.build_model`` (meta device, LoRA applied), then
``to_empty(device)`` and the model's own initialisation (``init_weights``, which
in transformers 5 also recomputes non-persistent buffers such as rotary
``inv_freq``), so no second copy of the weights is ever made.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ModelRef", "materialize"]


@dataclass(frozen=True)
class ModelRef:
    """A model by name or path, with what ``build_model`` needs to rebuild it."""

    ref: str
    task: str | None = None
    attn_implementation: str | None = None
    lora: Any = None  # LoraSpec | dict | None

    def build_meta(self) -> tuple[torch.nn.Module, str]:
        from autofit.probe.model import build_model

        return build_model(
            self.ref, task=self.task, attn_implementation=self.attn_implementation, lora=self.lora
        )


def materialize(ref: ModelRef, device: torch.device) -> torch.nn.Module:
    """Build ``ref`` with initialised weights on ``device``."""
    module, _ = ref.build_meta()
    module.to_empty(device=device)
    with torch.no_grad():
        for m in module.modules():  # torch layers (incl. LoRA's nn.Linear) first
            reset = getattr(m, "reset_parameters", None)
            if callable(reset) and not hasattr(m, "config"):
                with contextlib.suppress(RuntimeError, TypeError, NotImplementedError):
                    reset()
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        init = getattr(base, "init_weights", None)
        if callable(init):
            init()
        for m in module.modules():  # LoRA: B = 0, A = kaiming, as peft initialises
            reset_lora = getattr(m, "reset_lora_parameters", None)
            if callable(reset_lora) and hasattr(m, "lora_A"):
                for name in list(getattr(m, "lora_A", {}).keys()):
                    with contextlib.suppress(RuntimeError, TypeError, ValueError):
                        reset_lora(name, True)
    return module
