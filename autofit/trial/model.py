"""A model given by reference, and how a trial gives it real weights.

``ModelRef`` is what travels to a trial child instead of a pickled module: the
child rebuilds the model itself. ``materialize`` builds the base with
``autofit.probe.model.build_model`` (meta device), then ``to_empty(device)`` and the
model's own initialisation (``init_weights``, which in transformers 5 also
recomputes non-persistent buffers such as rotary ``inv_freq``), so no second copy of
the weights is ever made; a PEFT adapter is then put on it by peft, as a user's
script does.
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
    lora: Any = None  # an adapter request: LoraSpec | dict | PeftConfig | path (probe.model)

    def build_meta(self, *, adapter: bool = True) -> tuple[torch.nn.Module, str]:
        from autofit.probe.model import build_model

        return build_model(self.ref, task=self.task, attn_implementation=self.attn_implementation,
                           lora=self.lora if adapter else None)


def materialize(ref: ModelRef, device: torch.device) -> torch.nn.Module:
    """Build ``ref`` with initialised weights on ``device``: the base on the meta device,
    given memory there and initialised, then the adapter put on it by peft itself (its
    own initialisation, on the device: index buffers and projections have real values)."""
    module, task = ref.build_meta(adapter=False)
    module.to_empty(device=device)
    with torch.no_grad():
        for m in module.modules():  # torch layers first
            reset = getattr(m, "reset_parameters", None)
            if callable(reset) and not hasattr(m, "config"):
                with contextlib.suppress(RuntimeError, TypeError, NotImplementedError):
                    reset()
        init = getattr(module, "init_weights", None)
        if callable(init):
            init()
    if ref.lora is not None:
        from autofit.probe.model import _peft_config
        from autofit.probe.peft import apply_peft

        module = apply_peft(module, _peft_config(ref.lora, task), meta=False)
    return module
