"""What checkpointing keeps beside a recomputed block, as the derivation's probe step
sees it (``derived._forward_saved``): the hidden states each block takes in, what stays
below the blocks through their backward, and the gradients outside the blocks made by an
encoder's backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autofit.memory.breakdown import Component

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from autofit.memory.simulate._recorder import Record, StorageRecorder


def first_of_stacks(stacks: list[tuple], values: list[int]) -> list[float]:
    """Per stack, ``values``' entry of its first kept block."""
    firsts, at = [], 0
    for kept, _, _ in stacks:
        firsts.append(float(values[at]))
        at += len(kept)
    return firsts


def hidden_in(args: tuple, kwargs: dict, rec: StorageRecorder
              ) -> tuple[int, int, frozenset[int]]:
    """The hidden states a block is called with, its bytes and the id of its storage's
    record (0: none): its first positional argument (a tensor, or the first floating one
    of a tuple), else its ``hidden_states`` keyword, else its first floating tensor
    keyword; and the ids of the records of the other tensors it takes (masks, position
    embeddings, an encoder's output: the same for every block, which checkpointing keeps
    until the first block's backward)."""
    import torch

    lead = args[0] if args else None
    if isinstance(lead, (tuple, list)):  # (hidden states, residual, ...): the first
        lead = next((t for t in lead if isinstance(t, torch.Tensor)
                     and t.is_floating_point()), None)
    first = lead if isinstance(lead, torch.Tensor) else kwargs.get("hidden_states")
    if not isinstance(first, torch.Tensor):
        first = next((v for v in kwargs.values()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    others = set()
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor) and t is not first \
                    and (r := rec.record_of(t)) is not None:
                others.add(id(r))
    if not isinstance(first, torch.Tensor):
        return 0, 0, frozenset(others)
    r = rec.record_of(first)
    hidden = id(r) if r is not None else 0
    return (int(first.numel() * first.element_size()), hidden,
            frozenset(others - {hidden}))


def below_kept(log: list[tuple[str, Record, str]], start: int, at: int, grads: set[int],
               hidden: int, others: frozenset[int]) -> int:
    """Bytes made before the log's index ``start`` (the first block's forward) and alive
    at ``at`` (its backward's start), or taken by the first block (``others``: the
    checkpoint keeps them), weights, the parameters' gradients and the ``hidden`` record
    (the first block's input: with checkpointing, kept as its input) apart: what stays
    below the blocks through the blocks' backward with checkpointing (BERT's embedding
    norm's input, its dropout's mask; an eager attention's 4-D mask). Checkpointing
    recomputes every block beside them (Longformer's classifier: 8.1 of its 153 MiB).
    0 where ``at`` is not known (no block backward hook fired)."""
    if at <= 0:
        return 0
    made: dict[int, int] = {}
    for i, (kind, r, _) in enumerate(log[:at]):
        if kind == "alloc":
            if i < start and r.category != Component.WEIGHTS and id(r) not in grads \
                    and id(r) != hidden:
                made[id(r)] = r.size
        elif id(r) not in others:  # (what the first block takes, its checkpoint keeps)
            made.pop(id(r), None)
    return sum(made.values())


def grads_outside(log: list[tuple[str, Record, str]], at: int, rec: StorageRecorder,
                  model: torch.nn.Module, blocks: list[torch.nn.Module]) -> int:
    """Bytes of the gradients of the parameters outside ``blocks`` (``rec``'s records of
    them) alive at the log's index ``at`` (the first stack's block's backward: an encoder-decoder's encoder block):
    the decoder's own parameters' by then, not a shared embedding's, which autograd gives
    its gradient once both its uses are done (LED). 0 where ``at`` is not known."""
    if at <= 0:
        return 0
    inside = {id(p) for blk in blocks for p in blk.parameters()}
    ids = {id(r) for p in model.parameters() if p.grad is not None and id(p) not in inside
           and (r := rec.record_of(p.grad)) is not None}
    made: dict[int, int] = {}
    for kind, r, _ in log[:at]:
        if id(r) in ids:
            if kind == "alloc":
                made[id(r)] = r.size
            else:
                made.pop(id(r), None)
    return sum(made.values())
