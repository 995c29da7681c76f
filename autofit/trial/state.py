"""Leave the user's model and the RNGs exactly as they were.

A trial in this process either runs on the user's module itself (``ModelSnapshot``
taken before, restored in a ``finally``) or on a copy (``working_copy``); which one
is ``trial.py``'s choice (see ``needs_copy``):

- in place, when every tensor already lives on the trial's device in the dtype the
  precision trains in. The device then holds exactly what the real run holds (one
  set of weights); the values are saved on the *host* (a CPU clone of parameters
  and buffers) and copied back afterwards, so the parameter objects, their storages
  and every reference the user holds stay valid. The host copy costs host RAM the
  size of the weights, never device memory: this is the right choice for a big
  model that only just fits on its GPU.
- on a copy, when the weights must be moved or cast (``*-true`` precisions, a model
  on another device): the copy is made tensor by tensor straight into the target
  device and dtype from a meta skeleton (``copy.deepcopy`` with a memo), so no
  second full-size copy is made anywhere on the way. The original keeps living
  where it was (on the same accelerator it is counted in ``excluded_bytes``).

``ModelSnapshot`` restores: parameter and buffer values, ``requires_grad`` flags,
existing ``.grad`` tensors (detached during the trial, given back by identity),
every module attribute (``training``, ``gradient_checkpointing``, hook dicts,
``_require_grads_hook`` ...), the ``config`` objects' fields (``use_cache``), and
bitsandbytes' ``GlobalOptimManager`` registrations. ``RngSnapshot`` restores the
torch CPU / CUDA, numpy and ``random`` generators.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["ModelSnapshot", "RngSnapshot", "needs_copy", "working_copy"]

_SKIP = ("_parameters", "_buffers", "_modules")


def _is_dict(v: object) -> bool:
    return type(v) in (dict, OrderedDict)


class ModelSnapshot:
    """Everything a training step can change on a module, to put back afterwards."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = [
            (p, p.detach().to("cpu", copy=True), p.requires_grad, p.grad)
            for p in _unique(model.parameters())
        ]
        self.buffers = [(b, b.detach().to("cpu", copy=True)) for b in _unique(model.buffers())]
        self.modules = []
        for m in model.modules():
            attrs = {}
            for k, v in m.__dict__.items():
                attrs[k] = (v, copy.copy(v)) if (k in _SKIP or _is_dict(v)) else (v, None)
            self.modules.append((m, attrs))
        self.configs = []
        seen = set()
        for m in model.modules():
            c = getattr(m, "config", None)
            if c is not None and hasattr(c, "__dict__") and id(c) not in seen:
                seen.add(id(c))
                self.configs.append((c, dict(c.__dict__)))
        self.bnb = _bnb_manager_state()
        # The trial's backward must not accumulate into the user's gradients.
        for p, _, _, _ in self.params:
            p.grad = None

    def restore(self) -> None:
        """Put every value, flag and attribute back (idempotent)."""
        with torch.no_grad():
            for p, saved, requires_grad, grad in self.params:
                if p.dtype == saved.dtype and p.shape == saved.shape:
                    p.copy_(saved)
                else:  # NB: only if the step replaced .data (no known optimizer does)
                    p.data = saved.to(p.device)
                p.requires_grad_(requires_grad)
                p.grad = grad
            for b, saved in self.buffers:
                if b.dtype == saved.dtype and b.shape == saved.shape:
                    b.copy_(saved)
                else:
                    b.data = saved.to(b.device)
        for m, attrs in self.modules:
            d = m.__dict__
            for k in [k for k in d if k not in attrs]:
                del d[k]
            for k, (obj, saved) in attrs.items():
                if saved is not None and _is_dict(obj):
                    obj.clear()  # keep the dict's identity: hook handles refer to it
                    obj.update(saved)
                d[k] = obj
        for c, fields in self.configs:
            d = c.__dict__
            for k in [k for k in d if k not in fields]:
                del d[k]
            d.update(fields)
        _restore_bnb_manager(self.bnb)


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _bnb_manager_state() -> dict[str, Any] | None:
    import sys

    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return None
    try:
        manager = bnb.optim.GlobalOptimManager.get_instance()
    except Exception:  # noqa: BLE001 - an old or broken bitsandbytes: nothing to restore
        return None
    return {k: copy.copy(v) for k, v in manager.__dict__.items()}


def _restore_bnb_manager(state: dict[str, object] | None) -> None:
    import sys

    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return
    try:
        manager = bnb.optim.GlobalOptimManager.get_instance()
    except Exception:  # noqa: BLE001
        return
    if state is None:  # bitsandbytes was imported by the trial: reset what it registered
        manager.initialize()
        return
    manager.__dict__.clear()
    manager.__dict__.update(state)


class RngSnapshot:
    """The torch (CPU and CUDA), numpy and ``random`` generator states."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.torch = torch.get_rng_state()
        # a CUDA trial initialises CUDA anyway: take its generators first
        use_cuda = torch.cuda.is_available() and (
            torch.cuda.is_initialized() or (device is not None and device.type == "cuda")
        )
        self.cuda = torch.cuda.get_rng_state_all() if use_cuda else None
        self.python = random.getstate()
        try:
            import numpy as np

            self.numpy = np.random.get_state()
        except ImportError:  # pragma: no cover
            self.numpy = None

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy as np

            np.random.set_state(self.numpy)


def needs_copy(
    model: torch.nn.Module, device: torch.device, param_dtype: torch.dtype | None
) -> bool:
    """True when the trial cannot run on ``model`` in place (it must be moved or cast)."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            return True
        if t.device.type != device.type or (
            device.index is not None and t.device.index not in (None, device.index)
        ):
            return True
        quantized = type(t).__name__ in {"Params4bit", "Int8Params"}  # bnb: never cast
        cast = param_dtype is not None and t.is_floating_point() and t.dtype != param_dtype
        if cast and not quantized:
            return True
    return False


def working_copy(
    model: torch.nn.Module, device: torch.device, param_dtype: torch.dtype | None
) -> torch.nn.Module:
    """A copy of ``model`` on ``device`` with floating tensors in ``param_dtype``.

    Built from a skeleton whose tensors are meta (no copy), then filled one tensor
    at a time straight into the target device and dtype.
    """
    memo: dict[int, Any] = {}
    sources: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p in _unique(model.parameters()):
        stub = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        memo[id(p)] = stub
        sources.append((stub, p))
    for b in _unique(model.buffers()):
        stub = torch.empty_like(b, device="meta")
        memo[id(b)] = stub
        sources.append((stub, b))
    work = copy.deepcopy(model, memo)
    real: dict[int, torch.Tensor] = {}  # stub id -> tensor on the device (ties stay tied)
    with torch.no_grad():
        for stub, src in sources:
            floating = param_dtype is not None and src.is_floating_point()
            t = src.detach().to(
                device=device, dtype=param_dtype if floating else src.dtype, copy=True
            )
            if isinstance(stub, torch.nn.Parameter):
                t = torch.nn.Parameter(t, requires_grad=stub.requires_grad)
            real[id(stub)] = t
    for m in work.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None and id(t) in real:
                    table[name] = real[id(t)]
    return work
