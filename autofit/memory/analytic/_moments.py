"""The fits of ``autofit.memory.analytic.derived``: values at the four probe shapes as
``F + B*(s + a*T + b*T^2)`` (``_solve``), and where the probes run the same events, each
event's values fitted on its own, the highest of those moments taken at the step's shape
(the forward's, the top block's backward's, a block backward's); and what one probe
leaves and makes (``_AtShape``)."""

from __future__ import annotations

from typing import Any, NamedTuple

# (micro batch, tokens) of the four forwards: three lengths fix a quadratic per sample,
# the second batch size separates what every micro batch shares. Not a micro batch of 1:
# AXK2's sparse-attention indexer peaks elsewhere for one sample (its classifier's
# forward transient fitted from 1 and 2 was 10 MiB at 4 x 128 tokens, 51 MiB simulated).
SHAPES = ((2, 32), (2, 64), (2, 128), (4, 32))


class _AtShape(NamedTuple):
    """What one forward and backward at one of ``SHAPES`` leaves and makes, bytes, weights
    excluded; per stack: an encoder-decoder's encoder, then its decoder."""

    per_block: list[float]  # alive at the loss, per block of each stack (its kinds' mean)
    largest: list[float]  # ... the largest kind's, per stack (checkpointing recomputes it)
    block_forward: list[float]  # per stack, a block forward's highest point above its start
    total: int  # alive at the loss in all
    # the forward's transient, its share and what it keeps in all (_forward_transient)
    transient: tuple[int, float, int]
    # the forward's events, and at each one the transient, the share of what backward
    # keeps made by then, and the bytes of it made outside the blocks (_forward_transient)
    moments: tuple[str, list[int], list[float], list[int]]
    block_backward: list[int]  # per stack, a block backward's scratch (_block_backward)
    # per stack, its kept blocks' backward events and at each the scratch (_block_backward)
    block_moments: list[tuple[str, list[int]]]
    # per stack, the forward runs of a block (1; a looped model's blocks run twice: Dory)
    runs: list[float]
    # the top block's backward on, at its highest above what was alive at the loss, and its
    # moments (_top_backward)
    top_backward: int
    top_moments: tuple[str, list[int]]
    half_matmuls: int  # the 16-bit matmuls of distinct shapes (StorageRecorder.half_matmuls)
    # the step's oneDNN primitives and whether a 16-bit flash attention ran
    # (StorageRecorder.half_primitives, half_attention)
    half_step: tuple[int, bool]
    # per stack, the hidden states a block takes in (its first kind's, last run):
    # what checkpointing keeps of each block (Longformer pads them to its attention
    # window: 4x the step's tokens at 128)
    block_input: list[float]
    # what the layers below the blocks keep through the blocks' backward (_kept.below_kept)
    below_kept: int
    # the gradients outside the blocks alive at the first stack's block's backward
    # (an encoder-decoder's encoder block: _kept.grads_outside)
    grads_outside: int
    # the largest log-softmax's element size, 0 without one (StorageRecorder.log_softmax):
    # the loss's backward makes its gradients in that dtype
    loss_elem: int = 0


# where a moment's transient is compared with the others': micro batches and lengths
# (tokens) far past the four shapes, as a user's step takes them
_GRID_B = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_GRID_T = tuple(2 ** k for k in range(4, 18))


def _transient_moments(at: list[_AtShape], shapes: tuple[tuple[int, int], ...] = SHAPES
                       ) -> list[dict[str, float]] | None:
    """The forward's transient as the highest of several fitted moments: each moment of
    the forward (an event, the same one at every shape) makes a transient of the form
    ``F + B*(s + a*T + b*T^2)`` that the four shapes determine exactly, and the forward's
    is the highest of them at the step's shape. One fit of the highest point at each shape
    mixes moments: phi-1.5 on a 4-bit base peaks inside a layer's dequantized weight
    (a constant) at 32 tokens and at the loss at 128, and that fit's T^2 term put a
    1,044-token step 2.6 GB high. Kept: the moments highest (their transient and the
    activations made by then) somewhere on a grid of shapes (``_GRID_B`` x ``_GRID_T``),
    each with the share of the activations made by then (the largest at the four
    shapes). None where the forwards differ in their events
    (another path at another shape): one fit of the highest points then."""
    import numpy as np

    if len({a.moments[0] for a in at}) != 1 or not at[0].moments[1]:
        return None

    def at_shape(fit: dict, B: int, T: int) -> Any:
        return np.maximum(B * (fit["s"] + fit["a"] * T + fit["b"] * T * T), 0.0) \
            + np.maximum(fit["F"], 0.0)

    fit = _solve([np.asarray(a.moments[1], dtype=np.float64) for a in at], shapes)
    share = np.max([a.moments[2] for a in at], axis=0)
    # what backward keeps made by each moment, bytes, fitted (its share of all it keeps
    # changes with the shape: Pegasus-X's block-padded encoder is 0.77 of it at 2 x 32
    # tokens, less at 4 x 128, where the largest share put its LoRA step 10% over)
    kept = _solve([np.asarray(a.moments[2], dtype=np.float64) * a.transient[2] for a in at],
                  shapes)
    # ... of it made outside the blocks (checkpointing keeps the blocks' inputs only)
    base = (_solve([np.asarray(a.moments[3], dtype=np.float64) for a in at], shapes)
            if all(len(a.moments) > 3 for a in at) else None)
    # a moment's height: its transient and what backward keeps made by then
    highest = sorted({int((at_shape(fit, B, T) + at_shape(kept, B, T)).argmax())
                      for B in _GRID_B for T in _GRID_T})
    return [{**_form({k: float(v[i]) for k, v in fit.items()}), "share": float(share[i]),
             "kept": _signed_form({k: float(v[i]) for k, v in kept.items()}),
             **({"kept_base": _signed_form({k: float(v[i]) for k, v in base.items()})}
                if base is not None else {})}
            for i in highest]


def _top_moments(at: list[_AtShape], shapes: tuple[tuple[int, int], ...] = SHAPES
                 ) -> list[dict[str, float]] | None:
    """The top block's backward on (``_top_backward``) as the highest of its moments, each
    fitted on its own (signed: the head's backward frees more than it makes) and kept where
    it is the highest somewhere on the grid of shapes, as ``_transient_moments`` does for
    the forward. None where the backwards differ in their events."""
    return _event_moments([a.top_moments for a in at], shapes)


def _event_moments(per_shape: list[tuple[str, list[int]]],
                   shapes: tuple[tuple[int, int], ...] = SHAPES
                   ) -> list[dict[str, float]] | None:
    """Values at the same events at each of ``shapes`` (per shape: the events' kinds, the
    values) as the highest of their moments: each event's values fitted on their own
    (signed) and kept where it is the highest somewhere on the grid of shapes. None where
    the events differ from one shape to another, or there are none."""
    import numpy as np

    if len({kinds for kinds, _ in per_shape}) != 1 or not per_shape[0][1]:
        return None
    fit = _solve([np.asarray(values, dtype=np.float64) for _, values in per_shape], shapes)
    highest = sorted({int((fit["F"] + B * (fit["s"] + fit["a"] * T + fit["b"] * T * T))
                          .argmax()) for B in _GRID_B for T in _GRID_T})
    return [_signed_form({k: float(v[i]) for k, v in fit.items()}) for i in highest]


def _solve(values: list[float], shapes: tuple[tuple[int, int], ...] = SHAPES
           ) -> dict[str, float]:
    """``F, s, a, b`` of ``F + B*(s + a*T + b*T^2)`` from the values at ``shapes``."""
    (b1, t1), (_, t2), (_, t3), (b2, _) = shapes
    v11, v12, v13, v21 = values
    p1 = (v21 - v11) / (b2 - b1)  # one sample at T1
    fixed = v11 - b1 * p1
    p2, p3 = (v12 - fixed) / b1, (v13 - fixed) / b1
    # p(T) = s + a*T + b*T^2 through (t1, p1), (t2, p2), (t3, p3)
    d12 = (p2 - p1) / (t2 - t1)
    d23 = (p3 - p2) / (t3 - t2)
    b = (d23 - d12) / (t3 - t1)
    a = d12 - b * (t1 + t2)
    s = p1 - a * t1 - b * t1 * t1
    return {"F": fixed, "s": s, "a": a, "b": b}


def _add_moments(coef: dict[str, object], at: list[_AtShape], roles: tuple[str | None, ...],
                 shapes: tuple[tuple[int, int], ...]) -> None:
    """Put into ``coef`` the moments told apart where the probes run the same events: the
    forward's (``_transient_moments``), the top backward's and, per stack, a block
    backward's."""
    if (moments := _transient_moments(at, shapes)) is not None:
        coef["forward_moments"] = moments
    if (moments := _top_moments(at, shapes)) is not None:
        coef["top_backward_moments"] = moments
    for k, role in enumerate(roles):  # a block backward's scratch, moment by moment
        if (moments := _event_moments([a.block_moments[k] for a in at], shapes)) is not None:
            coef["block_backward_decoder_moments" if role == "decoder"
                 else "block_backward_moments"] = moments


def _form(fit: dict[str, float]) -> dict[str, float]:
    """A fitted ``F + B*(s + a*T + b*T^2)`` in the coefficients' names (F never below 0)."""
    return {**_signed_form(fit), "F": max(fit["F"], 0.0)}


def _signed_form(fit: dict[str, float]) -> dict[str, float]:
    """``_form`` of a difference, which may be below 0 (its constant too)."""
    return {"c0": fit["a"], "T": fit["b"], "s": fit["s"], "F": fit["F"]}
