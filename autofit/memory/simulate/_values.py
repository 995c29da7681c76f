"""The values the simulation knows: its own batch's token ids, and what is computed from
them alone.

Fake tensors have shapes, not values, so a step whose shapes depend on values cannot be
followed on them. Where those values come from the batch, though, the simulation made
them: ``make_batch`` draws real token ids (as the harness does: random, seeded, the
end-of-sequence token closing each sample of an encoder-decoder classifier) and gives the
fake ids their real values. An op whose tensor arguments all carry values runs on the
values too (a mask ``input_ids == eos``, its sums, lengths: small tensors), so that

- an op whose output's shape depends on values (``nonzero``, ``unique_consecutive``) gets
  its real shape: BART's classifier checks that every sample ends with one ``</s>``
  (``unique_consecutive`` of the counts) and pools the hidden state there
  (``hidden_states[eos_mask]``, the mask's ``nonzero``); both methods refused the eight
  encoder-decoder classifiers that do it;
- indexing a tensor without values by a boolean mask with values takes the mask's real
  positions (the same output as the boolean index, whose shape depends on them);
- a value read into Python (``.item()``, an ``if`` on a tensor) is the real one.

Nothing here touches a weight: a tensor made from a weight has no values, and an op on
it runs on its fake tensors only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

if TYPE_CHECKING:  # pragma: no cover
    from torch._ops import OpOverload

__all__ = ["with_values", "values_of", "on_values", "real_index", "real_item", "faked",
           "made_from_nothing", "forget"]

# at most this many elements get values (the batch's ids are B x T; what is derived from
# them is as small): an op on larger tensors runs on its fake tensors only
_MAX_NUMEL = 1 << 22
# ops whose output's values their arguments fix, and a real tensor lifted into the fake mode
_FACTORIES = frozenset({torch.ops.aten.ones.default, torch.ops.aten.zeros.default,
                        torch.ops.aten.full.default, torch.ops.aten.arange.default,
                        torch.ops.aten.arange.start, torch.ops.aten.arange.start_step,
                        torch.ops.aten.scalar_tensor.default})
_LIFTS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})


def with_values(fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``fake``, carrying ``real``'s values."""
    fake._autofit_values = real  # type: ignore[attr-defined]
    return fake


def values_of(x: object) -> torch.Tensor | None:
    """The real values of a simulated tensor, None for one without (or not a tensor, or
    whose storage an op wrote without values since: ``forget``)."""
    v = getattr(x, "_autofit_values", None) if isinstance(x, torch.Tensor) else None
    if v is None or getattr(x.untyped_storage(), "_autofit_stale", False):  # type: ignore[union-attr]
        return None
    return v


def forget(func: OpOverload, args: tuple, kwargs: dict) -> None:
    """The values of what ``func`` writes in place are no longer known (it ran on fake
    tensors only): its storage's, so that no view of it answers with the old ones (a zeros
    mask filled from the weights through a slice)."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(t, torch.Tensor):
                t.untyped_storage()._autofit_stale = True  # type: ignore[attr-defined]


def _real(x: object) -> object:
    if isinstance(x, torch.Tensor):
        v = values_of(x)
        if v is None:
            raise LookupError
        return v
    return x


def made_from_nothing(func: OpOverload, args: tuple, out: object) -> bool:
    """Whether ``func`` makes a small tensor whose values its arguments fix (``ones``,
    ``arange``: Longformer's all-ones attention mask, whose ``> 1`` picks the global
    tokens by ``nonzero``; ``torch.tensor`` of a number, a real tensor lifted in)."""
    if not isinstance(out, torch.Tensor) or out.numel() > _MAX_NUMEL:
        return False
    if func in _LIFTS:
        return isinstance(args[0], torch.Tensor) and not _is_fake(args[0])
    return func in _FACTORIES


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def on_values(func: OpOverload, args: tuple, kwargs: dict, *, factory: bool = False
              ) -> object:
    """``func`` run on the real values of its tensor arguments (a ``factory`` on none), on
    the CPU; None where one of them has none (or none is a tensor), the output is large,
    or the op does not run so."""
    if factory and func in _LIFTS:  # a real tensor lifted in: its own values
        with _disable_current_modes():
            return args[0].clone()
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    if (not tensors and not factory) or any(values_of(t) is None for t in tensors):
        return None
    try:
        real_args, real_kwargs = tree_map(_real, (args, kwargs))
    except LookupError:
        return None
    if "device" in real_kwargs:  # (the values live on the CPU, whatever the target)
        real_kwargs = {**real_kwargs, "device": torch.device("cpu")}
    try:
        with _disable_current_modes():
            out = func(*real_args, **real_kwargs)
    except Exception:  # noqa: BLE001 - no values then; the fake op stands as it is
        return None
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    return out if all(o.numel() <= _MAX_NUMEL for o in outs) else None


def faked(real: object, like: tuple) -> Any:
    """Fake tensors of ``real``'s (a tensor, or a tuple of them) in the fake mode of the
    fake tensors among ``like``, each carrying its values."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([a for a in tree_flatten(like)[0] if isinstance(a, torch.Tensor)])

    def one(t: object) -> object:
        return with_values(mode.from_tensor(t), t) if isinstance(t, torch.Tensor) else t

    return tree_map(one, real)


def real_index(args: tuple) -> tuple | None:
    """``aten.index.Tensor``'s arguments with each boolean index that carries values (on a
    tensor without them) replaced by the long indices of its positions, as torch's own
    boolean indexing does; None where there is none to replace."""
    self, indices = args[0], args[1]
    if values_of(self) is not None:
        return None
    new: list[Any] = []
    replaced = False
    for ix in indices:
        v = values_of(ix)
        if v is not None and v.dtype == torch.bool:
            with _disable_current_modes():
                real = tuple(v.nonzero().unbind(1))
            positions = faked(real, (self,))
            new.extend(positions)
            replaced = True
        else:
            new.append(ix)
    return (self, new, *args[2:]) if replaced else None


def real_item(real: torch.Tensor) -> bool | int | float:
    """The Python number of a one-element real tensor, read outside the fake mode."""
    with _disable_current_modes():
        return real.item()
