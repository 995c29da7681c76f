"""autofit.guard: an OOM inside a micro step is absorbed by splitting it, with the same math.

The OOM is planted: a hook raises the CPU allocator's own error when a batch holds more
than ``limit`` samples — in forward (nothing accumulated yet) or in backward (after the
head and the upper layers' gradients were accumulated). The yardstick is a run that never
sees an OOM: the same samples trained at the split size (micro batch / k, accumulation x k),
which the Trainer weights by ``num_items_in_batch`` exactly as the guarded run must.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from autofit import guard  # noqa: E402
from autofit.errors import BadInputError  # noqa: E402
from autofit.trial.guard import read_record  # noqa: E402

OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes"


def _model(seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def _data(n: int = 32, length: int = 12, long_every: int = 0):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(1, 96, (length,), generator=g)
        labels = ids.clone()
        labels[: i % 5] = -100  # prompts: items differ between samples
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _trainer(model, tmp_path, micro: int, accum: int, steps: int = 3, name: str = "run",
             eval_data=None):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(str(tmp_path / name), per_device_train_batch_size=micro,
                             gradient_accumulation_steps=accum, max_steps=steps,
                             learning_rate=1e-2, use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=1, seed=3,
                             per_device_eval_batch_size=8, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=_data(), eval_dataset=eval_data)


def _plant(model, limit: int, where: str):
    """Raise the CPU allocator's OOM when a batch has more than ``limit`` samples."""
    layer0 = model.model.layers[0]

    def forward_hook(module, args, kwargs, out):
        hidden = out[0] if isinstance(out, tuple) else out
        if hidden.shape[0] > limit:
            if where == "forward":
                raise RuntimeError(OOM)
            if hidden.requires_grad:  # backward: after the upper layers' gradients
                def boom(grad):
                    raise RuntimeError(OOM)
                hidden.register_hook(boom)
        return out

    return layer0.register_forward_hook(forward_hook, with_kwargs=True)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _same_weights(a, b, rel=1e-5):
    """Every parameter within ``rel`` of the other, relative to its norm (summation order
    differs between the runs: an element near zero may differ in its last bits)."""
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        diff = (p.detach() - pb[name].detach()).norm() / pb[name].detach().norm()
        assert diff <= rel, f"{name}: {diff:.2e}"


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_split_run_equals_a_run_at_the_split_size(tmp_path, where):
    ref_model = _model()
    ref = _trainer(ref_model, tmp_path, micro=4, accum=4, name="ref")
    ref.train()

    model = _model()
    hook = _plant(model, limit=4, where=where)
    trainer = guard(_trainer(model, tmp_path, micro=8, accum=2, name="guarded"), echo=False)
    trainer.train()
    hook.remove()

    rescues = trainer.autofit_guard.rescues
    assert rescues, "the planted OOM was never hit"
    assert rescues[0].batch_shape == (8, 12) and rescues[0].k == 2 and rescues[0].kind == "train"
    assert len(rescues) == 1  # the split persists: later batches start at k = 2
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-5)
    _same_weights(model, ref_model)
    # the record beside the run: one JSON line per rescue
    assert [r.batch_shape for r in read_record(tmp_path / "guarded" / "autofit-guard.jsonl")] \
        == [(8, 12)]


def test_trl_sft_trainer_split_equals_a_run_at_the_split_size(tmp_path):
    """TRL's SFTTrainer (its own compute_loss, collator and metrics): guarded, an OOM in
    backward is split and the run equals an SFTTrainer run at the split size."""
    pytest.importorskip("trl")
    import datasets
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 96)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>", eos_token="<eos>")
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": torch.randint(2, 96, (8 + i % 7,), generator=g).tolist()}
            for i in range(32)]  # lengths 8..14: the collator pads each batch its own way

    def run(micro, accum, name, limit=None):
        model = _model()
        model.config.pad_token_id, model.config.eos_token_id = 0, 1
        hook = _plant(model, limit=limit, where="backward") if limit else None
        args = SFTConfig(str(tmp_path / name), per_device_train_batch_size=micro,
                         gradient_accumulation_steps=accum, max_steps=3, learning_rate=1e-2,
                         use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                         seed=3, disable_tqdm=True, bf16=False, max_length=32)
        trainer = SFTTrainer(model=model, args=args,
                             train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer)
        if limit:
            guard(trainer, echo=False)
        trainer.train()
        if hook:
            hook.remove()
        return trainer, model

    ref, ref_model = run(4, 4, "ref")
    trainer, model = run(8, 2, "guarded", limit=4)
    rescues = trainer.autofit_guard.rescues
    assert len(rescues) == 1 and rescues[0].k == 2 and rescues[0].batch_shape[0] == 8
    assert len(_losses(trainer)) == 3
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-5)
    _same_weights(model, ref_model)


def test_without_num_items_the_pieces_are_weighted_as_the_mean(tmp_path):
    """A loss that is a mean over the micro batch: the pieces' means, weighted by their label
    items, equal the unsplit micro batch's (the Trainer of an unguarded, OOM-free run)."""
    ref_model = _model()
    ref = _trainer(ref_model, tmp_path, micro=8, accum=1, name="ref")
    ref.model_accepts_loss_kwargs = False  # the Trainer passes no num_items_in_batch then
    ref.train()

    model = _model()
    hook = _plant(model, limit=3, where="backward")
    trainer = guard(_trainer(model, tmp_path, micro=8, accum=1, name="guarded"), echo=False)
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    hook.remove()
    assert trainer.autofit_guard.rescues[0].k == 2  # 8 -> 4+4 -> 2+2+2+2 (3 fit)
    assert _losses(trainer) == pytest.approx(_losses(ref), rel=1e-5)
    _same_weights(model, ref_model)


def test_no_oom_changes_nothing(tmp_path):
    ref_model, model = _model(), _model()
    ref = _trainer(ref_model, tmp_path, micro=8, accum=2, name="ref")
    ref.train()
    trainer = guard(_trainer(model, tmp_path, micro=8, accum=2, name="guarded"), echo=False)
    trainer.train()
    assert trainer.autofit_guard.rescues == []
    assert _losses(trainer) == _losses(ref)  # bitwise: the same calls
    assert not (tmp_path / "guarded" / "autofit-guard.jsonl").exists()


def test_eval_batch_is_split_and_metrics_equal(tmp_path):
    data = _data(16)
    ref = _trainer(_model(), tmp_path, micro=8, accum=1, name="ref", eval_data=data)
    expected = ref.evaluate()
    model = _model()
    hook = _plant(model, limit=2, where="forward")
    trainer = guard(_trainer(model, tmp_path, micro=8, accum=1, name="g", eval_data=data),
                    echo=False)
    got = trainer.evaluate()
    hook.remove()
    assert [r.kind for r in trainer.autofit_guard.rescues][:1] == ["eval"]
    assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6)


def test_a_single_sample_that_does_not_fit_is_raised_with_a_note(tmp_path):
    model = _model()
    hook = _plant(model, limit=0, where="forward")  # nothing fits
    trainer = guard(_trainer(model, tmp_path, micro=2, accum=1, name="g"), echo=False)
    with pytest.raises(RuntimeError, match="can't allocate") as info:
        trainer.train()
    hook.remove()
    assert any("cannot be split further" in n for n in getattr(info.value, "__notes__", []))


def test_the_split_is_retried_upward(tmp_path):
    model = _model()
    hook = _plant(model, limit=4, where="forward")
    trainer = guard(_trainer(model, tmp_path, micro=8, accum=1, steps=4, name="g"),
                    retry_after=1, echo=False)
    trainer.train()
    hook.remove()
    # every other step retries k = 1, runs out of memory again and splits: 2 of 4 steps
    assert [r.step for r in trainer.autofit_guard.rescues] == [0, 2]


def test_a_non_oom_error_passes_through(tmp_path):
    model = _model()

    def bad(module, args):
        raise ValueError("not memory")

    model.model.layers[0].register_forward_pre_hook(bad)
    trainer = guard(_trainer(model, tmp_path, micro=4, accum=1, name="g"), echo=False)
    with pytest.raises(ValueError, match="not memory"):
        trainer.train()
    assert trainer.autofit_guard.rescues == []


def test_rescue_line_on_stderr(tmp_path, capsys):
    model = _model()
    hook = _plant(model, limit=4, where="forward")
    trainer = guard(_trainer(model, tmp_path, micro=8, accum=1, steps=1, name="g"))
    trainer.train()
    hook.remove()
    err = capsys.readouterr().err
    assert "autofit.guard: out of memory at step 0 in a training micro step of 8 x 12" in err
    assert "the batch now runs in 2 pieces" in err
    line = json.loads((tmp_path / "g" / "autofit-guard.jsonl").read_text().splitlines()[0])
    assert line["k"] == 2 and line["batch_shape"] == [8, 12]


def test_bad_input(tmp_path):
    with pytest.raises(BadInputError, match="transformers.Trainer"):
        guard(object())
    trainer = _trainer(_model(), tmp_path, micro=2, accum=1)
    with pytest.raises(BadInputError, match="retry_after"):
        guard(trainer, retry_after=0)
    guard(trainer, echo=False)
    with pytest.raises(BadInputError, match="guarded already"):
        guard(trainer)


@pytest.mark.parametrize("engine", ["is_fsdp_enabled", "is_deepspeed_enabled"])
def test_sharded_engines_refused(tmp_path, engine):
    """FSDP and DeepSpeed gather weights inside forward and backward: a rank that splits
    would run more collectives than the others, so guard refuses them (DDP is guarded:
    tests/test_guard_ranks.py)."""
    trainer = _trainer(_model(), tmp_path, micro=2, accum=1)
    setattr(trainer, engine, True)
    with pytest.raises(BadInputError, match="plain data parallelism \\(DDP\\) only"):
        guard(trainer)


def test_check_reads_the_record_a_guarded_run_left_beside_the_tuned_file(tmp_path, capsys):
    """`autofit run --guard` writes the rescues beside the tuned file: the next `check` of
    that file says it fits only with the guard (exit 3), and names the batch."""
    from dataclasses import asdict

    from autofit.cli import main
    from autofit.emit import write_config
    from autofit.trial.guard import Rescue, record_beside

    tuned = write_config(tmp_path / "tuned.yaml", {"per_device_train_batch_size": 2},
                         {"model": "tiny-gpt2", "seq_len": 32, "device": "cpu"})
    args = ["check", str(tuned), "--device", "cpu", "--no-trial", "--no-cache", "--json"]
    assert main(args) == 0
    capsys.readouterr()
    rescue = Rescue(kind="train", step=7, batch_shape=(2, 512), piece=2, k=2,
                    peak_bytes=None, device="cpu", error="out of memory", time=0.0)
    other = Rescue(kind="train", step=9, batch_shape=(4, 64), piece=4, k=2,  # another batch
                   peak_bytes=None, device="cpu", error="out of memory", time=0.0)
    record_beside(tuned).write_text(json.dumps(asdict(rescue)) + "\n"
                                    + json.dumps(asdict(other)) + "\n")
    assert main(args) == 3
    out = json.loads(capsys.readouterr().out)
    problem = out["problems"][-1]
    assert "fits only with autofit.guard" in problem and "2 x 512" in problem
    assert "1 time(s)" in problem  # the micro batch of 4 is not this file's


def test_a_retune_learns_from_the_record_a_guarded_run_left(tmp_path, capsys):
    """`autofit tune -o FILE` over a file whose guarded run needed rescues: micro batches of
    the rescued size and more are not tried, and the reasons say why (issue 24 item 2);
    a record about another model is not evidence."""
    from dataclasses import asdict

    from autofit.cli import main
    from autofit.emit import write_config
    from autofit.trial.guard import Rescue, record_beside

    argv = ["tune", "tiny-gpt2", "--dataset", "tiny-samples", "--device", "A100-80GB",
            "--target-batch-size", "16", "--json", "-o", str(tmp_path / "tuned.yaml")]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)["config"]["micro_batch_size"]
    assert first == 16  # the whole target fits a planned A100 at once
    rescue = Rescue(kind="train", step=3000, batch_shape=(16, 256), piece=16, k=2,
                    peak_bytes=None, device="cuda:0", error="CUDA out of memory", time=0.0)
    record_beside(tmp_path / "tuned.yaml").write_text(json.dumps(asdict(rescue)) + "\n")
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["micro_batch_size"] == 8  # the largest divisor of 16 below 16
    assert any("micro batches of 16 and more not tried" in r and "step 3000" in r
               and "tuned-guard.jsonl" in r for r in out["reasons"])
    # (in Python: autofit(..., guard_record=record_beside("tuned.yaml")), what the CLI passes)
    # the file replaced was tuned for another model: its run says nothing about this one
    write_config(tmp_path / "other.yaml", {"per_device_train_batch_size": 16},
                 {"model": "tiny-llama", "seq_len": 256, "device": "A100-80GB"})
    record_beside(tmp_path / "other.yaml").write_text(json.dumps(asdict(rescue)) + "\n")
    argv[-1] = str(tmp_path / "other.yaml")
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["config"]["micro_batch_size"] == 16


def test_ddp_buckets_go_out_in_order_as_their_gradients_become_final(monkeypatch):
    """``_Buckets`` (the guard's overlapped gradient average under DDP), on a one-process
    gloo group: buckets in reverse parameter order, each sent once its parameters are all
    final and every earlier one was sent; ``finish`` sends the rest; a failed rank's
    ``finish_void`` sends the same sizes, in the same order, from one buffer."""
    import torch.distributed as dist

    from autofit.trial.guard import _Buckets

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _model()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params[:-1]:  # the last (the head) gives no gradient on this rank
            p.grad = torch.full_like(p, 2.0)
        sizes: list[int] = []
        real = dist.all_reduce

        def spy(tensor, *args, **kwargs):
            sizes.append(tensor.numel() * tensor.element_size())
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", spy)
        b = _Buckets(model, 1, 8 * 1024, 2)
        assert [p for bucket in b.buckets for p in bucket] == params[::-1]
        big = [p for p in params if p.numel() * 4 >= 8 * 1024]  # the embedding and the head
        assert big and all(len(b.buckets[b.bucket_of[id(p)]]) == 1 for p in big)
        b.armed = True
        b.ready(params[-2])  # the second bucket's first parameter: the first is not ready
        assert b.sent == 0
        for p in b.buckets[0]:
            b.ready(p)
        assert b.sent == 1 and sizes == [b.kinds[0][0] * 4]
        b.finish()
        assert b.sent == len(b.buckets) and not b.outstanding
        assert params[-1].grad is None  # no rank gave it a gradient: it stays None
        assert all(bool((p.grad == 2.0).all()) for p in params[:-1])  # the mean over 1 rank
        sent = list(sizes)
        sizes.clear()
        _Buckets(model, 1, 8 * 1024, 1).finish_void("cpu")
        assert sizes == sent  # what the others' collectives expect, in their order
    finally:
        dist.destroy_process_group()


def test_a_rescue_line_reaches_stderr_once(tmp_path):
    """The guard logs each rescue and echoes it on stderr, unless the log reaches stderr
    already: with no logging configured, logging's last resort prints it (every line came
    twice, as under TRL's sft.py); with a script's stderr handler, that handler does; a log
    that goes to a file only gets the echo."""
    import logging
    import sys

    from autofit.trial.guard import _logged_to_stderr

    log = logging.getLogger("autofit.test-echo")
    log.propagate = False
    try:
        assert _logged_to_stderr(log, logging.WARNING)  # no handler: the last resort prints
        stream = logging.StreamHandler(sys.stderr)
        log.addHandler(stream)
        assert _logged_to_stderr(log, logging.WARNING)
        stream.setLevel(logging.ERROR)  # it would not print a warning
        assert not _logged_to_stderr(log, logging.WARNING)
        log.removeHandler(stream)
        to_file = logging.FileHandler(tmp_path / "log.txt")
        log.addHandler(to_file)
        assert not _logged_to_stderr(log, logging.WARNING)  # a file only: echo
        log.removeHandler(to_file)
        to_file.close()
        log.setLevel(logging.ERROR)  # a warning is not logged at all: echo
        assert not _logged_to_stderr(log, logging.WARNING)
    finally:
        log.handlers.clear()
        log.setLevel(logging.NOTSET)
        log.propagate = True


def test_a_shorter_batch_keeps_the_tokens_per_piece_that_ran():
    """A split set at one length applies to shorter batches by the tokens per piece that
    ran, not as a whole batch that runs out of memory again at every new length."""
    from autofit.trial.guard import _Guard

    g = _Guard.__new__(_Guard)
    g.k, g.length = 8, 117
    assert g.k_for((32, 117)) == 8 and g.k_for((32, 200)) == 8  # at least as long: the split
    assert g.k_for((32, 108)) == 8  # 7.4 -> 8: pieces of 4 x 108 tokens
    assert g.k_for((32, 58)) == 4 and g.k_for((32, 20)) == 2 and g.k_for((32, 10)) == 1
    assert g.k_for((3, 117)) == 3  # never more pieces than rows
    g.k = 1
    assert g.k_for((32, 500)) == 1  # no split in force


def test_on_several_ranks_a_shorter_batch_runs_whole():
    """The ranks' agreement on the overlapped gradient buckets is tested for a shorter batch
    that runs whole; a rank's own proportional split, unlike its peer's, crashed the gloo
    run (tests/test_guard_ranks.py, 1 time in 4)."""
    from types import SimpleNamespace

    from autofit.trial.guard import _Guard

    g = _Guard.__new__(_Guard)
    g.k, g.length, g.ranks = 2, 12, SimpleNamespace()
    assert g.k_for((8, 12)) == 2 and g.k_for((8, 11)) == 1
    g.ranks = None
    assert g.k_for((8, 11)) == 2
