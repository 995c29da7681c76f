"""autofit.guard on two processes (DDP, gloo, CPU): a spike on one rank only.

Both ranks run one script under ``torch.distributed.run``: first a plain DDP Trainer run (the
yardstick), then the same run guarded, with an OOM planted on rank 0 alone for micro
batches of more than 4 samples from optimizer step 1 on. The guarded run must finish (no
rank left in a collective), rank 0 must have split, rank 1 must have taken the same split
(the ranks agree), and losses and weights must equal the yardstick's. A rank that cannot
go on (a single sample that does not fit) must take the other down with it, not hang it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = textwrap.dedent(r'''
    import json, os, sys
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
    import autofit

    out, limit, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from autofit.trial.guard import _Ranks
    _Ranks.BUCKET_BYTES = 4096  # many buckets: some go out before the backward's end
    rank = int(os.environ["RANK"])
    OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes"

    def model():
        cfg = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2,
                                   max_position_embeddings=64)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg)

    def data():
        g = torch.Generator().manual_seed(1)
        rows = []
        for i in range(64):
            ids = torch.randint(1, 96, (12,), generator=g)
            labels = ids.clone()
            labels[: i % 5] = -100
            rows.append({"input_ids": ids, "labels": labels})
        return rows

    def trainer(m, name):
        args = TrainingArguments(os.path.join(out, name), per_device_train_batch_size=8,
                                 gradient_accumulation_steps=2, max_steps=3,
                                 learning_rate=1e-2, use_cpu=True, report_to=[],
                                 save_strategy="no", logging_steps=1, seed=3,
                                 disable_tqdm=True)
        return Trainer(model=m, args=args, train_dataset=data())

    ref_model = model()
    ref = trainer(ref_model, "ref")
    ref.train()

    m = model()
    t = autofit.guard(trainer(m, "guarded"), echo=False)

    def spike(module, args, kwargs, result):
        hidden = result[0] if isinstance(result, tuple) else result
        if rank == 0 and t.state.global_step >= 1 and hidden.shape[0] > limit:
            if where == "forward":
                raise RuntimeError(OOM)
            if hidden.requires_grad:  # backward: after the upper layers' buckets went out
                def boom(grad):
                    raise RuntimeError(OOM)
                hidden.register_hook(boom)
        return result

    m.model.layers[0].register_forward_hook(spike, with_kwargs=True)
    t.train()
    diff = max(float((p.detach() - q.detach()).norm() / q.detach().norm())
               for p, q in zip(m.parameters(), ref_model.parameters()))
    losses = lambda tr: [h["loss"] for h in tr.state.log_history if "loss" in h]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rescues": [r.batch_shape for r in t.autofit_guard.rescues],
                   "k": t.autofit_guard.k, "losses": losses(t), "ref_losses": losses(ref),
                   "weight_diff": diff}, f)
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, limit: int, where: str = "forward",
            timeout: float = 240.0) -> subprocess.CompletedProcess:
    script = tmp_path / "spike.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("AUTOFIT_GUARD_RECORD", None)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
         str(script), str(tmp_path), str(limit), where],
        env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_spike_on_one_rank_splits_both_and_keeps_the_math(tmp_path, where):
    """In forward or in backward (after the upper layers' gradients were accumulated):
    rank 0 splits, rank 1 takes the split at the window's end, every gradient bucket is
    sent by both in the same order, and the math is the unguarded DDP run's."""
    proc = _launch(tmp_path, limit=4, where=where)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["rescues"] == [[8, 12]]  # rank 0 ran out of memory once, then ran split
    assert r1["rescues"] == []  # rank 1 never did ...
    assert r0["k"] == r1["k"] == 2  # ... and took the same split (the ranks agree)
    for r in (r0, r1):
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
        assert r["weight_diff"] <= 1e-5
    # the record of the rescue, beside rank 0's run
    lines = (tmp_path / "guarded" / "autofit-guard.jsonl").read_text().splitlines()
    assert [json.loads(line)["batch_shape"] for line in lines] == [[8, 12]]


@pytest.mark.slow
def test_a_rank_that_cannot_go_on_stops_the_other(tmp_path):
    """Rank 0 cannot fit even one sample: both ranks stop (exit non-zero), none hangs."""
    proc = _launch(tmp_path, limit=0)
    assert proc.returncode != 0
    assert "a single sample of 12 tokens does not fit" in proc.stderr
    assert "rank 0 stopped inside a micro step" in proc.stderr
