"""Real data: preprocess_data (text and JSONL into indexed datasets, SentencePiece trained on the
fly), the indexed-dataset checks, tokenizers, Megatron GPTDataset splits and the micro-batch
iterator (order, DP sharding, resume), also under torchrun with two ranks.

All outputs go under pytest's tmp_path; the tinyshakespeare corpus is read in place.
"""

import json
import os
import random
import re
import sys
import textwrap

import pytest

from launch import REPO, launch, parse_results, run_torchrun
from messages import error_line, names_flag

pytest.importorskip("sentencepiece")

from paci_megatron.tools import preprocess_data  # noqa: E402  (no Megatron import at module level)

SHAKESPEARE = os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt")

_WORDS = ("the king queen lord lady good sweet night day love death sword crown heart blood "
          "come go speak hear know think make give take honour noble gentle fair foul and of to "
          "my thy thou thee your our with not but for this that what shall will would").split()


def _synthetic_paragraphs(n, seed=0):
    rng = random.Random(seed)
    paragraphs = []
    for i in range(n):
        lines = [f"SPEAKER {i % 7}:"]
        for _ in range(rng.randint(1, 3)):
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 9))).capitalize()
                         + rng.choice(".,!?;"))
        paragraphs.append("\n".join(lines))
    return paragraphs


def _run_cli(argv, capsys):
    """preprocess_data.main in this process; returns (exit code, stdout, stderr)."""
    try:
        code = preprocess_data.main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def data_module():
    from paci_megatron.mcore import data

    return data


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    """600 short paragraphs, one document each, with a 400-piece model trained on them."""
    root = tmp_path_factory.mktemp("small")
    paragraphs = _synthetic_paragraphs(600)
    text_path = root / "plays.txt"
    text_path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    prefix, model = root / "plays", root / "spm.model"
    code = preprocess_data.main([
        "--input", str(text_path), "--output-prefix", str(prefix), "--tokenizer-model",
        str(model), "--vocab-size", "400", "--min-document-chars", "0"])
    assert code == 0
    return dict(root=root, text=text_path, paragraphs=paragraphs,
                prefix=str(prefix) + "_text_document", model=str(model))


# --------------------------------------------------------------------------------------------
# preprocess_data
# --------------------------------------------------------------------------------------------


def test_text_preprocessing_roundtrip(small_dataset, data_module):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, model = small_dataset["prefix"], small_dataset["model"]
    assert os.path.isfile(model) and os.path.isfile(model[:-len(".model")] + ".vocab")
    tokenizer = data_module.build_tokenizer("SentencePieceTokenizer", model)
    assert tokenizer.vocab_size == 400 and tokenizer.eod == 2
    info = data_module.check_indexed_dataset(prefix)
    assert info["num_documents"] == 600 and info["dtype"] == "uint16"
    dataset = IndexedDataset(prefix)
    for i in (0, 1, 299, 599):
        ids = dataset[i].tolist()
        assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
        assert tokenizer.detokenize(ids[:-1]) == small_dataset["paragraphs"][i]  # exact, "\n" kept


def test_paragraph_packing_into_documents():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.txt")
        with open(path, "w") as f:
            f.write("a b\nc\n\n\n  \nd e f\n\ng\n")
        assert list(preprocess_data.iter_documents(path, min_document_chars=0)) == [
            "a b\nc", "d e f", "g"]
        assert list(preprocess_data.iter_documents(path, min_document_chars=8)) == [
            "a b\nc\n\nd e f", "g"]
        assert list(preprocess_data.iter_documents(path, min_document_chars=10 ** 6)) == [
            "a b\nc\n\nd e f\n\ng"]


def test_training_is_deterministic_and_model_is_reused(small_dataset, tmp_path, capsys):
    model2 = tmp_path / "again.model"
    code, out, _ = _run_cli(["--input", small_dataset["text"], "--output-prefix",
                             tmp_path / "again", "--tokenizer-model", model2, "--vocab-size",
                             400, "--min-document-chars", 0], capsys)
    assert code == 0 and "trained a SentencePiece" in out
    assert model2.read_bytes() == open(small_dataset["model"], "rb").read()
    # an existing model is loaded, not retrained; the dataset is byte-identical
    code, out, _ = _run_cli(["--input", small_dataset["text"], "--output-prefix",
                             tmp_path / "reuse", "--tokenizer-model", small_dataset["model"],
                             "--min-document-chars", 0, "--workers", 2], capsys)
    assert code == 0 and "trained" not in out
    for suffix in (".bin", ".idx"):
        assert (tmp_path / ("reuse_text_document" + suffix)).read_bytes() == \
            open(small_dataset["prefix"] + suffix, "rb").read()


def test_jsonl_input(small_dataset, tmp_path, capsys, data_module):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = [f"Document {i}: " + p for i, p in enumerate(small_dataset["paragraphs"][:40])]
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    lines.insert(5, "")  # blank lines are skipped
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, out, err = _run_cli(["--input", path, "--output-prefix", tmp_path / "docs",
                               "--tokenizer-model", small_dataset["model"], "--append-eod"],
                              capsys)
    assert code == 0, err
    prefix = str(tmp_path / "docs_text_document")
    assert data_module.check_indexed_dataset(prefix)["num_documents"] == 40
    tokenizer = data_module.build_tokenizer("SentencePieceTokenizer", small_dataset["model"])
    dataset = IndexedDataset(prefix)
    assert [tokenizer.detokenize(dataset[i][:-1].tolist()) for i in range(40)] == texts


def test_cli_prints_training_flags(small_dataset, tmp_path):
    """The real command line (python -m), JSONL input: exit 0, the flags to train with."""
    path = tmp_path / "d.json"
    path.write_text("".join(json.dumps({"text": p}) + "\n"
                            for p in small_dataset["paragraphs"][:20]))
    proc = launch(
        [sys.executable, "-m", "paci_megatron.tools.preprocess_data", "--input", str(path),
         "--output-prefix", str(tmp_path / "cli"), "--tokenizer-model", small_dataset["model"],
         "--vocab-size", "400", "--workers", "1"],
        cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    expected = (f"--data-path {tmp_path / 'cli_text_document'} --tokenizer-type "
                f"SentencePieceTokenizer --tokenizer-model {small_dataset['model']} "
                f"--vocab-size 400")
    assert expected in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["missing_input", "empty_input", "blank_input", "json_no_text",
                                  "json_not_json", "no_output_dir", "vocab_contradicts",
                                  "vocab_too_large"])
def test_cli_errors(case, small_dataset, tmp_path, capsys):
    model = small_dataset["model"]
    text = small_dataset["text"]
    new_model = tmp_path / "new.model"
    out_prefix = tmp_path / "out"
    flag = {"missing_input": "--input", "empty_input": "--input", "blank_input": "--input",
            "json_no_text": "--input", "json_not_json": "--input",
            "no_output_dir": "--output-prefix", "vocab_contradicts": "--vocab-size",
            "vocab_too_large": "--vocab-size"}[case]
    extra = []
    if case == "missing_input":
        text = tmp_path / "nope.txt"
    elif case == "empty_input":
        text = tmp_path / "empty.txt"
        text.write_text("")
    elif case == "blank_input":  # existing model: the error comes while encoding
        text = tmp_path / "blank.jsonl"
        text.write_text('\n{"text": "  "}\n')
        new_model = model
    elif case == "json_no_text":
        text = tmp_path / "bad.jsonl"
        text.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    elif case == "json_not_json":
        text = tmp_path / "bad.json"
        text.write_text('{"text": "fine"}\nnot json at all\n')
    elif case == "no_output_dir":
        out_prefix = tmp_path / "no" / "such" / "dir" / "out"
    elif case == "vocab_contradicts":
        new_model, extra = model, ["--vocab-size", 1234]
    elif case == "vocab_too_large":
        extra = ["--vocab-size", 100000]
    code, out, err = _run_cli(["--input", text, "--output-prefix", out_prefix,
                               "--tokenizer-model", new_model, *extra], capsys)
    assert code == 2
    message = error_line(err)  # not the usage text, which names every flag
    assert names_flag(message, flag) and "Traceback" not in err, err
    if case == "json_no_text":
        assert "line 2" in message and "'text'" in message
    leftovers = [p for p in os.listdir(tmp_path) if p.startswith("out")]
    assert leftovers == []  # nothing half-written


def test_cli_error_exit_code_without_traceback(tmp_path):
    proc = launch(
        [sys.executable, "-m", "paci_megatron.tools.preprocess_data", "--input",
         str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "x"),
         "--tokenizer-model", str(tmp_path / "m.model")],
        cwd=REPO, timeout=60)
    assert proc.returncode == 2
    message = error_line(proc.stderr)
    assert names_flag(message, "--input") and "no such file" in message
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------------------------
# Checks: corrupt datasets, tokenizers
# --------------------------------------------------------------------------------------------


def _copy_pair(src_prefix, dst_prefix):
    for suffix in (".bin", ".idx"):
        with open(src_prefix + suffix, "rb") as src, open(dst_prefix + suffix, "wb") as dst:
            dst.write(src.read())


@pytest.mark.parametrize("damage", ["truncated_bin", "longer_bin", "missing_idx", "missing_bin",
                                    "garbage_idx", "truncated_idx", "empty_idx"])
def test_corrupt_datasets_are_rejected(damage, small_dataset, tmp_path, data_module):
    prefix = str(tmp_path / "copy_text_document")
    _copy_pair(small_dataset["prefix"], prefix)
    data_module.check_indexed_dataset(prefix)  # the intact copy passes
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    if damage == "truncated_bin":
        os.truncate(bin_path, os.path.getsize(bin_path) - 10)
    elif damage == "longer_bin":
        with open(bin_path, "ab") as f:
            f.write(b"\0\0")
    elif damage == "missing_idx":
        os.remove(idx_path)
    elif damage == "missing_bin":
        os.remove(bin_path)
    elif damage == "garbage_idx":
        with open(idx_path, "wb") as f:
            f.write(bytes(random.Random(0).randrange(256) for _ in range(4000)))
    elif damage == "truncated_idx":
        os.truncate(idx_path, os.path.getsize(idx_path) - 8)
    elif damage == "empty_idx":
        open(idx_path, "wb").close()
    with pytest.raises(ValueError, match="--data-path") as err:
        data_module.check_indexed_dataset(prefix)
    message = str(err.value)
    expected = {"truncated_bin": "truncated", "longer_bin": "larger",
                "missing_idx": "does not exist", "missing_bin": "does not exist",
                "garbage_idx": "bad header", "truncated_idx": "truncated",
                "empty_idx": "bad header"}[damage]
    assert expected in message
    with pytest.raises(ValueError, match="--data-path"):  # also before any Megatron dataset code
        data_module.build_gpt_datasets(prefix, "1,0,0", 32, 1, _null(data_module), 10, None, None)


def _null(data_module):
    return data_module.build_tokenizer("NullTokenizer", vocab_size=300)


def test_data_path_hints(small_dataset, data_module):
    base = small_dataset["prefix"][:-len("_text_document")]
    with pytest.raises(ValueError, match="did you mean --data-path .*_text_document"):
        data_module.check_indexed_dataset(base)
    with pytest.raises(ValueError, match="without '.bin'"):
        data_module.check_indexed_dataset(small_dataset["prefix"] + ".bin")


def test_tokenizer_errors_and_null_tokenizer(small_dataset, tmp_path, data_module):
    with pytest.raises(ValueError, match="--tokenizer-model .*no such file"):
        data_module.build_tokenizer("SentencePieceTokenizer", str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="--tokenizer-model"):
        data_module.build_tokenizer("SentencePieceTokenizer", None)
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="--tokenizer-model .*not a readable"):
        data_module.build_tokenizer("SentencePieceTokenizer", str(junk))
    with pytest.raises(ValueError, match="--vocab-size 999 does not match"):
        data_module.build_tokenizer("SentencePieceTokenizer", small_dataset["model"], 999)
    with pytest.raises(ValueError, match="--tokenizer-type 'GPT2BPETokenizer'"):
        data_module.build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="--vocab-size"):
        data_module.build_tokenizer("NullTokenizer")
    null = _null(data_module)
    assert (null.vocab_size, null.eod) == (301, 300)  # Megatron-LM's NullTokenizer convention
    assert null.tokenize("3 1 4") == [3, 1, 4] and null.detokenize([1, 5]) == "1 5"


def test_empty_split_is_refused(small_dataset, data_module):
    tokenizer = data_module.build_tokenizer("SentencePieceTokenizer", small_dataset["model"])
    # 600 documents: a test weight of 1/2000 rounds to no document (Megatron would loop forever)
    with pytest.raises(ValueError, match="--split 1999,0,1 leaves the test split"):
        data_module.build_gpt_datasets(small_dataset["prefix"], "1999,0,1", 32, 1, tokenizer,
                                       10, None, 1)
    for bad in ("abc", "0,0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="--split"):
            data_module.build_gpt_datasets(small_dataset["prefix"], bad, 32, 1, tokenizer, 10,
                                           1, 1)


# --------------------------------------------------------------------------------------------
# GPTDataset and batches
# --------------------------------------------------------------------------------------------


class _IndexDataset:
    """Stand-in dataset: sample i is a row of i's."""

    def __init__(self, n, seq=4):
        self.n, self.seq = n, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        row = torch.full((self.seq,), i, dtype=torch.long)
        return {"tokens": row, "labels": row + 1, "loss_mask": torch.ones(self.seq),
                "position_ids": torch.arange(self.seq)}


def _ids(batch):
    return batch["tokens"][:, 0].tolist()


def test_gpt_batches_order_sharding_and_resume(data_module):
    dataset = _IndexDataset(50)
    mbs, dp, steps = 3, 2, 12
    ranks = [data_module.gpt_batches(dataset, mbs, dp_rank=r, dp_size=dp) for r in range(dp)]
    per_rank = [[_ids(next(it)) for _ in range(steps)] for it in ranks]
    for step in range(steps):
        a, b = per_rank[0][step], per_rank[1][step]
        assert not set(a) & set(b)  # disjoint within a step
        base = step * mbs * dp
        assert a + b == [(base + i) % 50 for i in range(mbs * dp)]  # Megatron's sampler order
    # every rank counts the global position; resuming from it continues exactly
    assert ranks[0].consumed_samples == ranks[1].consumed_samples == steps * mbs * dp
    for r in range(dp):
        whole = data_module.gpt_batches(dataset, mbs, dp_rank=r, dp_size=dp)
        first = [_ids(next(whole)) for _ in range(5)]
        resumed = data_module.gpt_batches(dataset, mbs, start_sample=whole.consumed_samples,
                                          dp_rank=r, dp_size=dp)
        assert first == per_rank[r][:5]
        assert [_ids(next(resumed)) for _ in range(steps - 5)] == per_rank[r][5:]
    batch = next(ranks[0])
    assert batch["attention_mask"] is None
    assert set(batch) == {"tokens", "labels", "loss_mask", "attention_mask", "position_ids"}


def test_gpt_dataset_batches_from_preprocessed_data(small_dataset, data_module):
    import torch

    tokenizer = data_module.build_tokenizer("SentencePieceTokenizer", small_dataset["model"])
    train, valid, test = data_module.build_gpt_datasets(
        small_dataset["prefix"], "90,8,2", 32, 1234, tokenizer, 100, 20, 5)
    assert len(train) >= 100 and len(valid) >= 20 and len(test) >= 5
    batches = data_module.gpt_batches(train, 4, start_sample=8, dp_rank=1, dp_size=2)
    batch = next(batches)
    assert batch["tokens"].shape == (4, 32) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["tokens"][0], train[12]["tokens"])
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert batches.consumed_samples == 16
    text = tokenizer.detokenize(batch["tokens"][0].tolist())
    assert "SPEAKER" in text or any(w in text.lower() for w in _WORDS)
    # the same seed builds the same datasets again (from the cache next to the data)
    again = data_module.build_gpt_datasets(
        small_dataset["prefix"], "90,8,2", 32, 1234, tokenizer, 100, 20, 5)[0]
    assert torch.equal(again[37]["tokens"], train[37]["tokens"])


def test_rewriting_a_dataset_drops_its_index_cache(small_dataset, tmp_path, capsys, data_module):
    prefix = str(tmp_path / "re_text_document")
    _copy_pair(small_dataset["prefix"], prefix)
    tokenizer = data_module.build_tokenizer("SentencePieceTokenizer", small_dataset["model"])
    data_module.build_gpt_datasets(prefix, "90,8,2", 32, 1, tokenizer, 10, 2, 2)
    assert os.path.isdir(os.path.join(prefix, "cache"))  # Megatron's cache next to the data
    code, out, _ = _run_cli(["--input", small_dataset["text"], "--output-prefix",
                             tmp_path / "re", "--tokenizer-model", small_dataset["model"]],
                            capsys)
    assert code == 0 and "removed the GPTDataset index cache" in out
    assert not os.path.exists(os.path.join(prefix, "cache"))


def test_mock_gpt_datasets(data_module):
    train, valid, test = data_module.build_gpt_datasets(
        None, "969,30,1", 16, 1, _null(data_module), 20, 4, 4, mock=True)
    assert type(train).__name__ == "MockGPTDataset"
    batch = next(data_module.gpt_batches(train, 2))
    assert batch["tokens"].shape == (2, 16) and int(batch["tokens"].max()) < 301


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    if not os.path.isfile(SHAKESPEARE):
        pytest.skip(f"tinyshakespeare corpus not found at {os.path.normpath(SHAKESPEARE)} "
                    f"(the shared data folder next to the repo)")
    root = tmp_path_factory.mktemp("shakespeare")
    code = preprocess_data.main(["--input", SHAKESPEARE, "--output-prefix", str(root / "shake"),
                                 "--tokenizer-model", str(root / "spm.model")])
    assert code == 0
    return dict(prefix=str(root / "shake_text_document"), model=str(root / "spm.model"))


def test_tinyshakespeare(shakespeare, data_module):
    tokenizer = data_module.build_tokenizer("SentencePieceTokenizer", shakespeare["model"], 2000)
    info = data_module.check_indexed_dataset(shakespeare["prefix"])
    assert 500 < info["num_documents"] < 2000 and 300_000 < info["num_tokens"] < 500_000
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    documents = IndexedDataset(shakespeare["prefix"])  # keep it: its __del__ unmaps the samples
    first = tokenizer.detokenize(documents[0][:-1].tolist())
    with open(SHAKESPEARE, encoding="utf-8") as f:
        assert f.read().startswith(first)  # lossless, line breaks and all
    assert first.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")

    train, valid, test = data_module.build_gpt_datasets(
        shakespeare["prefix"], "969,30,1", 128, 1234, tokenizer, 64, 8, 2)
    assert len(train) >= 64 and len(valid) >= 8 and len(test) >= 2
    batch = next(data_module.gpt_batches(train, 4))
    for row in batch["tokens"]:
        text = tokenizer.detokenize(row.tolist())
        assert "\n" in text and len(text) > 200
        assert re.search(r"^[A-Z][A-Za-z ]+:$", text, re.M)  # a speaker line
        words = re.findall(r"[a-z']+", text.lower())
        assert sum(w in {"the", "and", "i", "to", "of", "my", "you", "a", "that", "thou"}
                   for w in words) >= 5


# --------------------------------------------------------------------------------------------
# Two ranks under torchrun
# --------------------------------------------------------------------------------------------

_DIST_WORKER = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    from paci_megatron.mcore import data

    prefix, model = sys.argv[1], sys.argv[2]
    tokenizer = data.build_tokenizer("SentencePieceTokenizer", model)
    train, valid, test = data.build_gpt_datasets(prefix, "90,8,2", 32, 7, tokenizer, 200, 20, 4)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = data.gpt_batches(train, 2, start_sample=6, dp_rank=rank, dp_size=world)
    firsts = []
    for _ in range(3):
        batch = next(batches)
        firsts.append([int(row.sum()) for row in batch["tokens"]])
    digest = hashlib.md5(b"".join(train[i]["tokens"].numpy().tobytes()
                                  for i in range(len(train)))).hexdigest()
    print("RESULT " + json.dumps(dict(rank=rank, sizes=[len(train), len(valid), len(test)],
                                      digest=digest, sums=firsts,
                                      consumed=batches.consumed_samples)), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.dist
def test_two_ranks_build_the_same_datasets(small_dataset, tmp_path, data_module):
    worker = tmp_path / "worker.py"
    worker.write_text(_DIST_WORKER)
    prefix = str(tmp_path / "dist_text_document")
    _copy_pair(small_dataset["prefix"], prefix)  # fresh: no index cache yet
    _, out, _ = run_torchrun(str(worker), [prefix, small_dataset["model"]], nproc=2, timeout=150)
    results = sorted(parse_results(out), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["digest"] == results[1]["digest"]
    assert results[0]["sizes"] == results[1]["sizes"]
    assert results[0]["consumed"] == results[1]["consumed"] == 6 + 3 * 2 * 2
    # rank r at step k holds samples 6 + 4k + 2r + {0, 1}: same as one process computes
    tokenizer = data_module.build_tokenizer("SentencePieceTokenizer", small_dataset["model"])
    train = data_module.build_gpt_datasets(prefix, "90,8,2", 32, 7, tokenizer, 200, 20, 4)[0]
    for r in (0, 1):
        expected = [[int(train[6 + 4 * k + 2 * r + i]["tokens"].sum()) for i in (0, 1)]
                    for k in range(3)]
        assert results[r]["sums"] == expected
