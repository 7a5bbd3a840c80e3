"""Fine-tuning data from local `datasets` directories and data files (json, jsonl, parquet,
arrow), with split selection and column mapping; the input/output format with a real tokenizer."""

import json

import pytest
from text_data import train_tokenizer, write_jsonl

from megatron_bridge.data.builders import SampleCounts
from megatron_bridge.data.finetuning import build_finetuning_datasets
from megatron_bridge.data.hf_local import DataSourceError, SplitSpec, open_local, select_split
from megatron_bridge.training.config import FinetuningDatasetConfig
from megatron_bridge.runtime.tokenizers.tokenizer import HuggingFaceTokenizer

datasets = pytest.importorskip("datasets")

ROWS = [{"question": f"What does the cat see {i}?", "answer": f"The map {i}.", "id": i} for i in range(50)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return HuggingFaceTokenizer(train_tokenizer(tmp_path_factory.mktemp("tok")))


def build(root, tok, **kw):
    data = FinetuningDatasetConfig(dataset_root=str(root), seq_length=64, num_workers=0, column_mapping={"input": "question", "output": "answer"}, **kw)
    data.finalize()
    return build_finetuning_datasets(data, tok, SampleCounts(train=1, valid=1, test=1))


def prompts(dataset, tok):
    out = []
    for ids, flags in dataset.samples:
        prompt = [i for i, f in zip(ids.tolist(), flags.tolist()) if not f]
        out.append(tok.detokenize(prompt))
    return out


def test_split_specs():
    assert SplitSpec.parse("train[:90%]").bounds(50) == (0, 45)
    assert SplitSpec.parse("train[90%:]").bounds(50) == (45, 50)
    assert SplitSpec.parse("test[-10:]").bounds(50) == (40, 50)
    assert SplitSpec.parse("dev").canonical_name() == "validation"
    with pytest.raises(DataSourceError, match=r"split 'train\[:9' is not a split name with an optional slice"):
        SplitSpec.parse("train[:9")


def test_a_saved_datasetdict_with_column_mapping_and_the_loss_on_answers(tmp_path, tok):
    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": ds.select(range(40)), "validation": ds.select(range(40, 45)), "test": ds.select(range(45, 50))}).save_to_disk(str(tmp_path / "saved"))
    train, valid, test = build(tmp_path / "saved", tok)
    assert (len(train.samples), len(valid.samples), len(test.samples)) == (40, 5, 5)
    assert prompts(test, tok)[0] == "What does the cat see 45?"
    ids, flags = train.samples[0]
    answer = tok.tokenize("The map 0.") + [tok.eod]
    assert ids.tolist() == tok.tokenize("What does the cat see 0?") + answer
    assert flags.tolist() == [0] * (len(ids) - len(answer)) + [1] * len(answer)  # the loss covers the answer and EOD


def test_data_files_by_split_name_and_format(tmp_path, tok):
    ds = datasets.Dataset.from_list(ROWS)
    ds.select(range(30)).to_parquet(str(tmp_path / "train-00000.parquet"))
    ds.select(range(30, 40)).to_parquet(str(tmp_path / "train-00001.parquet"))
    with open(tmp_path / "validation.json", "w") as f:  # a JSON array
        json.dump(ROWS[40:45], f)
    arrow = datasets.Dataset.from_list(ROWS[45:])
    arrow.save_to_disk(str(tmp_path / "tmp_saved"))
    (tmp_path / "tmp_saved" / "data-00000-of-00001.arrow").rename(tmp_path / "test.arrow")
    splits = open_local(str(tmp_path))
    assert {k: len(v.files) for k, v in splits.items()} == {"train": 2, "validation": 1, "test": 1}
    train, valid, test = build(tmp_path, tok)
    assert (len(train.samples), len(valid.samples), len(test.samples)) == (40, 5, 5)
    assert prompts(train, tok)[35] == "What does the cat see 35?"
    assert prompts(test, tok)[-1] == "What does the cat see 49?"


def test_one_file_split_by_slices(tmp_path, tok):
    write_jsonl(tmp_path / "all.jsonl", ROWS)
    train, valid, test = build(tmp_path / "all.jsonl", tok, splits={"train": "train[:80%]", "valid": "train[80%:90%]", "test": "train[-5:]"})
    assert (len(train.samples), len(valid.samples), len(test.samples)) == (40, 5, 5)
    assert prompts(valid, tok) == [f"What does the cat see {i}?" for i in range(40, 45)]
    assert select_split(str(tmp_path / "all.jsonl"), "validation") is None  # one file is the train split
