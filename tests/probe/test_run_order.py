"""The run order: the padded length of every micro batch, as a real Trainer feeds them."""

import random

import pytest

from autofit.errors import BadInputError
from autofit.probe.run import eval_order, run_order


def _data(n=50, seed=1):
    rng = random.Random(seed)
    return [{"input_ids": list(range(1, rng.randint(5, 100)))} for _ in range(n)]


def _trainer_lengths(data, **args):
    """The padded lengths a real Trainer.train() collates, in order (a spying collator)."""
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    seen = []
    multiple = args.pop("pad_to_multiple_of", None)

    def collate(rows):
        w = max(len(r["input_ids"]) for r in rows)
        if multiple:
            w = -(-w // multiple) * multiple
        seen.append(w)
        ids = torch.zeros(len(rows), w, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        return {"input_ids": ids, "labels": ids.clone()}

    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=128,
                               n_positions=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg)
    ta = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], save_strategy="no",
                           logging_strategy="no", disable_tqdm=True, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=ta, train_dataset=data, data_collator=collate).train()
    return seen


@pytest.mark.parametrize("args,ahead", [
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=2,
          seed=123), 0),
    (dict(per_device_train_batch_size=3, max_steps=20, seed=5, data_seed=11,
          pad_to_multiple_of=8), 1),
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, max_steps=9, seed=1,
          dataloader_drop_last=True), 1),
    (dict(per_device_train_batch_size=5, num_train_epochs=1,
          train_sampling_strategy="sequential"), 0),
], ids=["two-epochs-accum", "max-steps-data-seed-multiple", "drop-last-accum", "sequential"])
def test_same_padded_lengths_as_a_real_trainer(args, ahead, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = _data()
    real = _trainer_lengths(data, **dict(args))
    order = run_order(
        [len(r["input_ids"]) for r in data], micro_batch_size=args["per_device_train_batch_size"],
        grad_accum_steps=args.get("gradient_accumulation_steps", 1),
        epochs=args.get("num_train_epochs", 3.0), max_steps=args.get("max_steps"),
        seed=args.get("seed", 42), data_seed=args.get("data_seed"),
        sampling=args.get("train_sampling_strategy", "random"),
        drop_last=args.get("dataloader_drop_last", False),
        pad_to_multiple_of=args.get("pad_to_multiple_of"))
    # accelerate's loader collates one batch ahead (to know the epoch's end): a run that
    # stops inside an epoch collates one batch it never trains on (it stays on the host)
    assert list(order.lengths) == real[:len(order)] and order.exact
    assert len(real) - len(order) == ahead and len(order) >= 10


def test_group_by_length_is_the_same_distribution_not_the_same_sequence():
    lengths = [len(r["input_ids"]) for r in _data(80)]
    order = run_order(lengths, micro_batch_size=4, grad_accum_steps=2, sampling="group_by_length")
    assert not order.exact and "global generator" in order.note
    assert order.lengths[0] == max(lengths)  # the longest batch first, as the sampler does
    assert sorted(order.distinct())[-1][1] == max(lengths) and len(order) == 20
    # within a megabatch the lengths descend (sorted by length)
    assert order.lengths[1] <= order.lengths[0]


def test_truncation_sizes_and_eval():
    order = run_order([5, 300, 7], micro_batch_size=2, sampling="sequential", max_seq_len=128,
                      pad_to_multiple_of=64)
    assert order.lengths == (128, 64) and order.sizes == (2, 1) and order.steps == (1, 1)
    # 5 micro batches per epoch in steps of 2: the epoch's last step has one
    acc = run_order([1] * 10, micro_batch_size=2, grad_accum_steps=2, epochs=2,
                    sampling="sequential")
    assert acc.steps == (2, 2, 1, 2, 2, 1) and sum(acc.steps) == len(acc)
    ev = eval_order([3, 9, 4, 20, 1], eval_batch_size=2)
    assert ev.lengths == (9, 20, 1) and ev.sizes == (2, 2, 1)
    assert ev.distinct()[0] == (2, 20)


@pytest.mark.parametrize("kw,needle", [
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(micro_batch_size=2, sampling="shuffled"), "unknown sampling"),
    (dict(micro_batch_size=2, epochs=0), "epochs"),
    (dict(micro_batch_size=8, drop_last=True), "no full micro batch"),
])
def test_bad_arguments(kw, needle):
    with pytest.raises(BadInputError, match=needle):
        run_order([3, 4, 5], **kw)
    with pytest.raises(BadInputError, match="no training samples"):
        run_order([], micro_batch_size=1)


def test_the_shapes_a_run_adds_to_its_longest_step_and_padding_free_batches():
    """On a CPU in 16-bit every micro-batch shape keeps its oneDNN kernels: the run's shapes
    besides the trial's longest count, less those a trial replayed. SFTTrainer's "bfd"
    packing runs each micro batch padding-free, one row of its tokens: the shapes are the
    batches' token counts (TRL's sft.py packed at 256: 22.5 MiB of kernels counted by
    (micro batch, padded length), 81 by token counts; the run measured 929 MiB, 881 then
    945 promised)."""
    from autofit.probe.run import run_order

    o = run_order([5, 9, 3, 7, 2, 8], micro_batch_size=2, sampling="sequential")
    assert o.lengths == (9, 7, 8) and o.tokens == (14, 10, 10)
    assert o.other_shapes() == (2, 0)  # (2, 7), (2, 8) besides the longest (2, 9)
    assert o.other_shapes(ran=2) == (2, 1)  # the replay ran (2, 7) too
    assert o.other_shapes(padding_free=True) == (2, 0)  # rows of 14 and 10 tokens
    # full rows padded alike are one shape, padding-free they are as many as their sums
    full = run_order([256, 250, 256, 241, 256, 256], micro_batch_size=2, sampling="sequential")
    assert full.other_shapes() == (0, 0) and full.other_shapes(padding_free=True) == (3, 0)
    # truncation counts in the tokens as in the lengths
    cut = run_order([300, 100], micro_batch_size=2, max_seq_len=256)
    assert cut.lengths == (256,) and cut.tokens == (356,)


def test_sfttrainers_bfd_packing_is_padding_free_and_wrapped_is_not():
    from autofit.probe.packing import as_script_sees

    rows = [{"input_ids": list(range(1, n))} for n in (40, 90, 130, 60, 200, 30) * 4]
    bfd = as_script_sees(rows, sft={"max_length": 128, "packing": True})
    wrapped = as_script_sees(rows, sft={"max_length": 128, "packing": True,
                                        "packing_strategy": "wrapped"})
    assert bfd.padding_free and not wrapped.padding_free
    assert not as_script_sees(rows, block_size=128).padding_free  # a plain Trainer pads
