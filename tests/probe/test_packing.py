"""Packing as the training scripts pack: transformers' group_texts, TRL's strategies."""

import random
from itertools import chain

import pytest

from autofit.errors import AutofitError, BadInputError
from autofit.probe.data import probe_data
from autofit.probe.packing import as_script_sees, check_block_size, pack_dataset, pack_ids


def _reference_group_texts(examples, block_size):
    # transformers/examples/pytorch/language-modeling/run_clm.py, group_texts (verbatim but
    # for block_size, a closure there)
    # Concatenate all texts.
    concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}  # noqa: SIM118
    total_length = len(concatenated_examples[list(examples.keys())[0]])
    # We drop the small remainder, and if the total_length < block_size  we exclude this batch
    # and return an empty dict.
    total_length = (total_length // block_size) * block_size
    # Split by chunks of max_len.
    result = {
        k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
        for k, t in concatenated_examples.items()
    }
    result["labels"] = result["input_ids"].copy()
    return result


def _ids(n, seed=0, longest=40):
    rng = random.Random(seed)
    return [[rng.randint(1, 500) for _ in range(rng.randint(1, longest))] for _ in range(n)]


@pytest.mark.parametrize("n,block", [(7, 16), (7, 5), (2500, 64)])
def test_group_texts_matches_the_examples_reference(n, block):
    datasets = pytest.importorskip("datasets")
    ids = _ids(n)
    ds = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r)
                                                                          for r in ids]})
    # run_clm.py: tokenized_datasets.map(group_texts, batched=True) (1000 samples a batch)
    ref = ds.map(_reference_group_texts, batched=True, fn_kwargs={"block_size": block})
    assert pack_ids(ids, block) == ref["input_ids"]


def test_packed_data_has_every_length_the_block():
    ids = _ids(7)
    total = sum(map(len, ids))
    packed = pack_dataset([{"input_ids": r} for r in ids], 16)
    info = probe_data(packed.samples)
    assert info.num_samples == total // 16 and set(info.lengths) == {16}
    assert info.length_max == 16 and info.worst_case_batch_shape == (1, 16)
    assert packed.reason().startswith(f"samples packed into 16-token blocks ({total // 16} "
                                      "samples of 16 ")


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_trl_strategies_match_trl(strategy):
    pytest.importorskip("trl")
    import datasets
    from trl import pack_dataset as trl_pack

    ids = _ids(1500, seed=3)
    ref = trl_pack(datasets.Dataset.from_dict({"input_ids": ids}), 32, strategy)
    assert [len(r) for r in pack_ids(ids, 32, strategy)] == [len(r) for r in ref["input_ids"]]


@pytest.mark.parametrize("bad", [0, -3, True, 1.5, "128", None])
def test_bad_block_sizes_are_refused(bad):
    with pytest.raises(BadInputError, match="positive integer"):
        check_block_size(bad)


def test_block_sizes_past_the_positions_or_the_data_are_refused():
    with pytest.raises(BadInputError, match="1024 learned positions"):
        check_block_size(2048, max_positions=1024)
    with pytest.raises(BadInputError, match="whole dataset's 6 tokens") as e:
        pack_dataset([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5, 6]}], 7)
    assert isinstance(e.value, AutofitError) and len(str(e.value).splitlines()) == 1
    with pytest.raises(BadInputError, match="not both"):
        as_script_sees([{"input_ids": [1, 2]}], block_size=2, max_seq_len=2)


class _Sft:  # the SFTConfig fields the data depends on (trl need not be imported)
    def __init__(self, **kw):
        self.max_length, self.packing, self.packing_strategy = 8, False, "bfd"
        self.eos_token = None
        self.__dict__.update(kw)


def test_an_sft_config_truncates_or_packs_as_sft_trainer():
    data = [{"input_ids": r} for r in _ids(50, longest=20)]
    seen = as_script_sees(data, sft=_Sft())
    assert seen.max_seq_len == 8 and seen.block_size is None
    assert "truncated at 8 tokens: SFTConfig.max_length" in seen.reasons[0]
    seen = as_script_sees(data, sft=_Sft(packing=True))
    assert seen.block_size == 8 and seen.meta == {"block_size": 8, "packing": "bfd"}
    assert max(len(s["input_ids"]) for s in seen.dataset) == 8
    assert "packing_strategy='bfd'" in seen.reasons[0]
    seen = as_script_sees(data, sft=_Sft(packing=True, packing_strategy="wrapped"))
    assert seen.meta == {"block_size": 8, "packing": "wrapped"}
    # an explicit truncation wins over the SFTConfig's
    assert as_script_sees(data, sft=_Sft(), max_seq_len=4).max_seq_len == 4


def test_sft_texts_end_in_the_eos_token_as_sft_trainer_adds_it():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(10)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    data = [{"text": "w1 w2 w3"}, {"text": "w4<eos>"}]  # the second already ends in it
    seen = as_script_sees(data, sft=_Sft(max_length=3), tokenizer=tok)
    assert [s["input_ids"] for s in seen.dataset] == [[3, 4, 5, 1], [6, 1]]
    assert seen.max_seq_len == 3 and "(each text ending in '<eos>')" in seen.reasons[0]
    seen = as_script_sees(data, sft=_Sft(max_length=4, packing=True), tokenizer=tok)
    assert [s["input_ids"] for s in seen.dataset] == [[3, 4, 5, 1], [6, 1]]
