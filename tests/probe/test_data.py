"""Worst-case batches: the longest samples after the collator, with labels."""

from __future__ import annotations

import random

import pytest
import torch

from autofit.errors import BadInputError, EmptyDatasetError
from autofit.probe.data import DataInfo, probe_data, random_batch, worst_case_batch


def skewed_lengths(n: int = 200, seed: int = 0) -> list[int]:
    """Mostly short samples (5-20 tokens) and a few long ones (100-300)."""
    rng = random.Random(seed)
    lengths = [rng.randint(5, 20) for _ in range(n)]
    for i, length in zip(rng.sample(range(n), 5), (300, 250, 180, 120, 100), strict=True):
        lengths[i] = length
    return lengths


def samples(lengths: list[int]) -> list[dict[str, list[int]]]:
    return [{"input_ids": [(i * 7 + j) % 97 + 3 for j in range(n)]} for i, n in enumerate(lengths)]


def test_skewed_lengths_pick_the_longest_and_truncate():
    lengths = skewed_lengths()
    data = samples(lengths)
    batch = worst_case_batch(data, 4, max_seq_len=128)
    assert batch["input_ids"].shape == (4, 128)
    # the four longest: 300, 250, 180 truncated to 128, and 120 (8 pads)
    assert batch["attention_mask"].sum(dim=1).tolist() == [128, 128, 128, 120]
    real = batch["attention_mask"] == 1
    assert torch.equal(batch["labels"][real], batch["input_ids"][real])
    assert (batch["labels"][~real] == -100).all()
    # no later batch of 4 can be larger
    longest4 = sorted((min(n, 128) for n in lengths), reverse=True)[:4]
    assert int(batch["attention_mask"].sum()) == sum(longest4)


def test_padding_to_longest_in_batch_with_ignored_labels():
    lengths = skewed_lengths()
    batch = worst_case_batch(samples(lengths), 6)  # no truncation: 300, 250, 180, 120, 100, 20
    assert batch["input_ids"].shape == (6, 300)
    rows = batch["attention_mask"].sum(dim=1).tolist()
    assert rows == [300, 250, 180, 120, 100, max(n for n in lengths if n <= 20)]
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    assert (batch["labels"][batch["attention_mask"] == 1] >= 0).all()


def test_data_info_percentiles():
    lengths = skewed_lengths()
    info = probe_data(samples(lengths), 8, max_seq_len=128)
    assert isinstance(info, DataInfo)
    assert info.num_samples == 200
    assert info.length_max == 128 and info.untruncated_max == 300
    assert info.num_truncated == 2 + 1  # 300, 250, 180 are over 128
    assert info.length_p50 <= 20 and info.length_p90 <= 20
    assert info.worst_case_batch_shape == (8, 128)
    assert info.batch_shape(2) == (2, 128)
    assert info.columns == ("input_ids",)


def test_hf_dataset_tokenized():
    datasets = pytest.importorskip("datasets")
    lengths = skewed_lengths(60)
    ds = datasets.Dataset.from_list(samples(lengths))
    batch = worst_case_batch(ds, 3, max_seq_len=200)
    assert batch["input_ids"].shape == (3, 200)
    assert (
        batch["attention_mask"].sum(dim=1).tolist()
        == sorted((min(n, 200) for n in lengths), reverse=True)[:3]
    )
    assert probe_data(ds).length_max == max(lengths)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1}
    for i in range(50):
        vocab[f"w{i}"] = i + 2
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def test_hf_dataset_text_column_with_tokenizer():
    datasets = pytest.importorskip("datasets")
    texts = [" ".join(f"w{j % 50}" for j in range(n)) for n in skewed_lengths(40)]
    ds = datasets.Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(40)]})
    tok = _tokenizer()
    batch = worst_case_batch(ds, 2, max_seq_len=64, tokenizer=tok)
    assert batch["input_ids"].shape == (2, 64)
    info = probe_data(ds, tokenizer=tok, max_seq_len=64)
    assert info.text_column == "text" and info.length_max == 64
    cls = worst_case_batch(ds, 2, tokenizer=tok, task="seq-cls")
    assert cls["labels"].shape == (2,)
    # token classification: a label per token (class 0 without per-token labels), the
    # padding ignored
    per_token = worst_case_batch(ds, 2, max_seq_len=64, tokenizer=tok, task="token-cls")
    assert per_token["labels"].shape == per_token["input_ids"].shape
    assert set(per_token["labels"].unique().tolist()) <= {0, -100}
    with pytest.raises(BadInputError, match="tokenizer"):
        worst_case_batch(ds, 2)


def test_torch_dataset_and_plain_lists():
    lengths = [3, 9, 4, 7]

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return len(lengths)

        def __getitem__(self, i):
            return {"input_ids": torch.arange(lengths[i]) + 5, "labels": torch.arange(lengths[i])}

    batch = worst_case_batch(Tokens(), 2)
    assert batch["input_ids"].shape == (2, 9)
    assert batch["labels"][1, 7:].tolist() == [-100, -100]  # the sample's own labels, padded
    plain = worst_case_batch([[1, 2, 3], [4, 5, 6, 7, 8]], 1)  # lists of token ids
    assert plain["input_ids"].tolist() == [[4, 5, 6, 7, 8]]


def test_fewer_samples_than_the_batch_repeat_the_longest():
    batch = worst_case_batch(samples([2, 5]), 4)
    assert batch["input_ids"].shape == (4, 5)
    assert batch["attention_mask"].sum(dim=1).tolist() == [5, 2, 5, 2]


def test_custom_collator_gets_labels():
    def collate(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = [f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features]
        mask = [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}

    batch = worst_case_batch(samples([4, 10, 6]), 2, collator=collate)
    assert batch["input_ids"].shape == (2, 10)
    assert (batch["labels"][1, 6:] == -100).all()


def test_bad_input():
    with pytest.raises(EmptyDatasetError):
        worst_case_batch([], 2)
    datasets = pytest.importorskip("datasets")
    with pytest.raises(EmptyDatasetError):
        probe_data(datasets.Dataset.from_dict({"input_ids": []}))
    with pytest.raises(BadInputError):
        worst_case_batch(samples([3]), 0)
    with pytest.raises(BadInputError):
        worst_case_batch([{"foo": 1}], 1)
    with pytest.raises(BadInputError):
        worst_case_batch(samples([3]), 1, task="nonsense")


def test_random_batch_is_reproducible_and_leaves_the_global_rng():
    state = torch.get_rng_state()
    a = random_batch(2, 16, vocab_size=100, task="causal-lm")
    b = random_batch(2, 16, vocab_size=100, task="causal-lm")
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], a["input_ids"])
    assert torch.equal(state, torch.get_rng_state())
    assert random_batch(3, 8, vocab_size=100, task="seq-cls")["labels"].shape == (3,)
    tok = random_batch(3, 8, vocab_size=100, task="token-cls", num_labels=9)["labels"]
    assert tok.shape == (3, 8) and int(tok.min()) >= 0 and int(tok.max()) < 9


# -- issue 11: every sample checked, one line naming the first bad sample and the fix ------
def _one_line_error(call) -> str:
    with pytest.raises(BadInputError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(("bad dataset", "bad batch")), msg
    return msg


@pytest.mark.parametrize("ids, needle", [
    ([5, 99999], "sample 1 has token ids at or above the model's vocabulary size 1000 (id 99999)"),
    ([5, -3], "sample 1 has a negative token id (id -3)"),
    (["a", "b"], "sample 1 has input_ids that are not integer token ids (got str 'a')"),
    ("hello world", "sample 1 has input_ids that are not integer token ids (got str 'hello world')"),
    ([1.5, 2.0], "sample 1 has input_ids that are not integer token ids (got float 1.5)"),
    ([[1, 2]], "not integer token ids (got list [1, 2])"),
    (None, "not integer token ids (got NoneType None)"),
    ([], "sample 1 has no tokens: drop empty samples"),
])
def test_bad_token_ids_name_the_sample_and_the_fix(ids, needle):
    data = [{"input_ids": [1, 2, 3]}, {"input_ids": ids}, {"input_ids": [4]}]
    assert needle in _one_line_error(lambda: probe_data(data, vocab_size=1000))


def test_samples_longer_than_learned_positions_say_how_to_truncate():
    data = samples([10, 300, 40, 500])
    msg = _one_line_error(lambda: probe_data(data, max_positions=256))
    assert ("2 samples are longer than the model's 256 learned positions (first: sample 1, "
            "300 tokens)" in msg
            and "truncate with max_seq_len=256" in msg)  # Python names the keyword
    msg = _one_line_error(lambda: probe_data(data, max_seq_len=400, max_positions=256))
    assert "after truncation at 400" in msg
    assert probe_data(data, max_seq_len=256, max_positions=256).length_max == 256  # truncated: ok
    assert probe_data(data).length_max == 500  # no limit given (rotary positions): ok


def test_every_problem_at_once_in_one_line():
    data = [{"input_ids": []}, {"input_ids": [1, 5000]}, {"input_ids": ["x"]},
            {"input_ids": [1] * 600}, {"text": "no ids"}]
    msg = _one_line_error(lambda: probe_data(data, vocab_size=1000, max_positions=512))
    for part in ("sample 0 has no tokens", "sample 1 has token ids at or above",
                 "sample 2 has input_ids that are not integer", "sample 3 is longer",
                 "sample 4 has no input_ids"):
        assert part in msg, (part, msg)


def test_worst_case_batch_refuses_unreadable_ids():
    # the trial's batch path: strings used to raise a raw ValueError from int()
    assert "not integer token ids" in _one_line_error(
        lambda: worst_case_batch([{"input_ids": ["a"]}], 1))
    good = probe_data([{"input_ids": torch.tensor([1, 2, 3])}], vocab_size=4, max_positions=3)
    assert good.length_max == 3  # tensors, the largest id and the full length are fine


def test_text_column_ids_checked_against_the_vocabulary():
    tok = _tokenizer()
    data = [{"text": "w10 w11 w12"}, {"text": "w1 w2"}]
    info = probe_data(data, tokenizer=tok, vocab_size=tok.vocab_size)
    assert info.length_max == 3
    msg = _one_line_error(lambda: probe_data(data, tokenizer=tok, vocab_size=10))
    assert "sample 0 has token ids at or above the model's vocabulary size 10 (id 14)" in msg


def test_check_batch():
    from autofit.probe.data import check_batch

    ok = {"input_ids": torch.tensor([[1, 2], [3, 0]])}
    check_batch(ok, vocab_size=4, max_positions=2)
    assert "row 1 has token id 7" in _one_line_error(
        lambda: check_batch({"input_ids": torch.tensor([[1, 2], [7, 0]])}, vocab_size=4))
    assert "negative" in _one_line_error(
        lambda: check_batch({"input_ids": torch.tensor([[1, -2]])}, vocab_size=4))
    assert "seq_len=2 (--seq-len 2)" in _one_line_error(
        lambda: check_batch({"input_ids": torch.ones(1, 3, dtype=torch.long)}, max_positions=2))
    with pytest.raises(BadInputError, match="integer token ids"):
        check_batch({"input_ids": torch.ones(1, 3)})
    with pytest.raises(BadInputError, match="empty"):
        check_batch({"input_ids": torch.ones(1, 0, dtype=torch.long)})


def test_hf_dataset_bad_ids_found_by_the_arrow_path():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(samples([4, 9, 6]) + [{"input_ids": [1, 2000]}])
    assert probe_data(ds, vocab_size=2001).num_samples == 4
    assert "sample 3 has token ids" in _one_line_error(lambda: probe_data(ds, vocab_size=2000))


def test_words_with_a_label_each_are_tokenized_as_pre_split_words():
    """CoNLL's samples (``tokens`` + ``ner_tags``, as run_ner.py reads them): the words are
    tokenized with ``is_split_into_words`` (the unknown word is one [UNK], not dropped) and
    the batch has a label per token for a token classifier."""
    from autofit.probe.data import labelled_words

    data = [{"tokens": ["w1", "w2", "zz"], "ner_tags": ["O", "O", "B-PER"]},
            {"tokens": ["w3"] * 7, "ner_tags": ["O"] * 7}]
    assert labelled_words(data) == "ner_tags"
    batch = worst_case_batch(data, 2, tokenizer=_tokenizer(), task="token-cls")
    assert batch["input_ids"].shape == (2, 7) and batch["labels"].shape == (2, 7)
    assert batch["input_ids"][1, :3].tolist() == [3, 4, 1]  # w1 w2 [UNK]
    assert probe_data(data, tokenizer=_tokenizer(), max_seq_len=5).length_max == 5
    # not token classification: a label per sample, or per-word lists of another length
    assert labelled_words([{"tokens": ["w1", "w2"], "label": 1}]) is None
    assert labelled_words([{"tokens": ["w1", "w2"], "tags": ["O"]}]) is None
    assert labelled_words([{"text": "w1 w2", "tags": ["O", "O"]}]) is None
    # ids in a column called tokens are not words: one line, as for no text column
    with pytest.raises(BadInputError, match="neither input_ids nor a text column"):
        probe_data([{"tokens": [1, 2, 3]}], tokenizer=_tokenizer())


def test_words_through_a_byte_level_bpe_without_add_prefix_space():
    """A GPT-2 / RoBERTa tokenizer loaded without ``add_prefix_space=True`` (run_ner.py loads
    it with; transformers before 5 refuses pre-split words without it): the lengths are
    still those of the script's tokenizer, each word after a space."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["alpha beta gamma delta"] * 20, vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>"])
    plain = GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")
    spaced = GPT2TokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                               add_prefix_space=True)
    words = ["alpha", "beta", "gamma", "delta", "beta"]
    want = len(spaced(words, is_split_into_words=True)["input_ids"])
    data = [{"tokens": words, "ner_tags": ["O"] * 5}]
    assert probe_data(data, tokenizer=plain).length_max == want
