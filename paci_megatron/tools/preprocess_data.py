"""Turn text into a Megatron-Core indexed dataset (``PREFIX_text_document.bin`` / ``.idx``).

    python -m paci_megatron.tools.preprocess_data --input FILE [FILE ...] --output-prefix PREFIX \\
        --tokenizer-model SPM.model [--vocab-size N] [--append-eod] [--workers 1]

Inputs
    * ``*.jsonl`` / ``*.json``: one JSON object per line; its ``text`` field (``--json-key``) is one
      document, as in Megatron-LM's ``tools/preprocess_data.py``. Blank lines are skipped;
      a document whose text is empty or whitespace only is skipped.
    * any other file: plain UTF-8 text. Paragraphs are runs of lines separated by blank lines;
      consecutive paragraphs are packed, in file order, into documents of at least
      ``--min-document-chars`` characters (default 1000, ~350 tokens with a 2000-piece model;
      the last document of a file may be shorter; 0 makes every paragraph its own document).
      Inside a document the paragraphs are joined by one blank line and line breaks are kept
      (runs of blank lines become one; trailing spaces stay). Megatron's GPTDataset
      shuffles *documents* and splits train/valid/test by document, so documents should be
      neither tiny (Shakespeare's speeches would be shuffled into an incoherent order) nor few
      (the 969,30,1 split needs more than 500 of them, or its test split is empty:
      tinyshakespeare gives about 1000).

Tokenizer
    If ``--tokenizer-model`` does not exist, a SentencePiece BPE model with ``--vocab-size``
    pieces (default 2000) is trained on the inputs and written there (and a ``.vocab`` listing
    next to it). Training is deterministic (one thread, all input, fixed order) and keeps the
    text exactly: identity normalisation, spaces kept, ``"\\n"`` its own piece (detokenised
    samples keep their line breaks) and byte fallback (characters the model never saw become
    UTF-8 byte pieces, so any text round-trips; this costs 256 of the pieces, so the vocabulary
    must exceed 256 + the distinct characters). Ids: unk 0, bos 1, eos 2 (the end-of-document
    token), no pad.
    If the model exists it is loaded; ``--vocab-size`` must then match it (or be left out).

Output
    ``PREFIX_text_document.bin`` / ``.idx`` written with Megatron-Core's ``IndexedDatasetBuilder``
    (one sequence per document; token dtype uint16 below 65500 ids, else int32, as Megatron
    chooses); each document ends with the EOD id unless ``--no-append-eod``. The pair is written
    under temporary names and renamed at the end, so a failed run leaves no half-written
    dataset. The flags to train on it are printed last.

Errors in the arguments or the inputs (missing or empty input, a JSON line without ``text``,
an output directory that does not exist, a ``--vocab-size`` the model contradicts) are reported
argparse-style on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import sys
import time
from typing import Iterator, List, Optional

DEFAULT_VOCAB_SIZE = 2000
DEFAULT_MIN_DOCUMENT_CHARS = 1000
_JSON_SUFFIXES = (".jsonl", ".json")
_TRAIN_CHUNK_CHARS = 8192  # longest sentence handed to the SentencePiece trainer
_TRAIN_MAX_CHARS = 200_000_000  # above this, train on an evenly spaced subset of paragraphs
_ENCODE_BATCH = 256  # documents per round trip to the worker processes


class InputError(Exception):
    """A problem with the user's input files; reported through ``parser.error`` (exit 2)."""


# --------------------------------------------------------------------------------------------
# Reading documents
# --------------------------------------------------------------------------------------------


def is_json_input(path: str) -> bool:
    return path.lower().endswith(_JSON_SUFFIXES)


def _json_documents(path: str, key: str) -> Iterator[str]:
    with open(path, "r", encoding="utf-8") as stream:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"--input {path}, line {lineno}: not valid JSON ({err.msg})")
            if not isinstance(record, dict) or key not in record:
                raise InputError(
                    f"--input {path}, line {lineno}: no {key!r} field (each line must be a JSON "
                    f"object with the document in {key!r}; see --json-key)")
            text = record[key]
            if not isinstance(text, str):
                raise InputError(f"--input {path}, line {lineno}: {key!r} is a "
                                 f"{type(text).__name__}, not a string")
            if text.strip():
                yield text


def _paragraphs(path: str) -> Iterator[str]:
    lines: List[str] = []
    with open(path, "r", encoding="utf-8") as stream:
        for line in stream:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _text_documents(path: str, min_chars: int) -> Iterator[str]:
    packed: List[str] = []
    size = 0
    for paragraph in _paragraphs(path):
        packed.append(paragraph)
        size += len(paragraph) + 2
        if size >= min_chars:
            yield "\n\n".join(packed)
            packed, size = [], 0
    if packed:
        yield "\n\n".join(packed)


def iter_documents(path: str, json_key: str = "text",
                   min_document_chars: int = DEFAULT_MIN_DOCUMENT_CHARS) -> Iterator[str]:
    """The documents of one input file (see the module docstring); raises :class:`InputError`."""
    source = (_json_documents(path, json_key) if is_json_input(path)
              else _text_documents(path, min_document_chars))
    count = 0
    try:
        for document in source:
            count += 1
            yield document
    except UnicodeDecodeError as err:
        raise InputError(f"--input {path}: not UTF-8 text ({err.reason} at byte {err.start})")
    except OSError as err:
        raise InputError(f"--input {path}: cannot be read ({err.strerror or err})")
    if count == 0:
        what = f"no non-empty {json_key!r} field" if is_json_input(path) else "no text"
        raise InputError(f"--input {path} is empty ({what})")


def iter_all_documents(paths: List[str], json_key: str, min_document_chars: int) -> Iterator[str]:
    for path in paths:
        yield from iter_documents(path, json_key, min_document_chars)


# --------------------------------------------------------------------------------------------
# SentencePiece
# --------------------------------------------------------------------------------------------


def _training_sentences(paths: List[str], json_key: str, min_document_chars: int) -> List[str]:
    sentences: List[str] = []
    total = 0
    for document in iter_all_documents(paths, json_key, min_document_chars):
        for paragraph in re.split(r"\n[ \t]*\n", document):
            if not paragraph.strip():
                continue
            for start in range(0, len(paragraph), _TRAIN_CHUNK_CHARS):
                chunk = paragraph[start:start + _TRAIN_CHUNK_CHARS]
                sentences.append(chunk)
                total += len(chunk)
    if total > _TRAIN_MAX_CHARS:  # deterministic, evenly spaced subset
        stride = -(-total // _TRAIN_MAX_CHARS)
        sentences = sentences[::stride]
    return sentences


def train_sentencepiece(sentences: List[str], vocab_size: int, model_type: str = "bpe") -> bytes:
    """Train a SentencePiece model on ``sentences``; returns the serialized model."""
    import sentencepiece

    buffer = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=buffer,
        vocab_size=int(vocab_size),
        model_type=model_type,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["\n"],
        byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        max_sentence_length=1 << 16,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    return buffer.getvalue()


def _vocab_path(model_path: str) -> str:
    stem = model_path[:-len(".model")] if model_path.endswith(".model") else model_path
    return stem + ".vocab"


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as stream:
        stream.write(data)
    os.replace(tmp, path)


def _write_vocab(processor, path: str) -> None:
    lines = []
    for i in range(processor.get_piece_size()):
        piece = processor.id_to_piece(i).replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"{piece.replace(chr(9), chr(92) + 't')}\t{processor.get_score(i):g}\n")
    _write_atomically(path, "".join(lines).encode("utf-8"))


_VOCAB_TOO_HIGH = re.compile(
    r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
_VOCAB_TOO_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def _explain_training_error(err: Exception, vocab_size: int) -> str:
    message = str(err)
    high = _VOCAB_TOO_HIGH.search(message)
    if high:
        return (f"--vocab-size {vocab_size} is too large for this input: SentencePiece can make at "
                f"most {high.group(2)} pieces from it; pass --vocab-size {high.group(2)} or less "
                f"(or more text)")
    low = _VOCAB_TOO_LOW.search(message)
    if low:
        return (f"--vocab-size {vocab_size} is too small: this input needs at least "
                f"{low.group(2)} pieces (its distinct characters, 256 byte-fallback pieces and "
                f"4 special ones); pass a larger --vocab-size")
    return f"training the SentencePiece model failed: {message.strip().splitlines()[-1]}"


# --------------------------------------------------------------------------------------------
# Encoding (optionally in worker processes)
# --------------------------------------------------------------------------------------------

_WORKER_PROCESSOR = None


def _init_worker(model_path: str) -> None:
    import sentencepiece

    global _WORKER_PROCESSOR
    _WORKER_PROCESSOR = sentencepiece.SentencePieceProcessor(model_file=model_path)


def _encode_batch(documents: List[str]) -> List[List[int]]:
    return _WORKER_PROCESSOR.encode(documents)


def _batches(documents: Iterator[str], size: int) -> Iterator[List[str]]:
    batch: List[str] = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _positive(flag: str, allow_zero: bool = False):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer (got {text!r})") from None
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else ">= 1"
            raise argparse.ArgumentTypeError(f"{flag} must be {bound} (got {value})")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m paci_megatron.tools.preprocess_data",
        description="Tokenize text or JSONL files with SentencePiece (training the model if it "
                    "does not exist yet) into a Megatron-Core indexed dataset "
                    "PREFIX_text_document.bin/.idx for --data-path.",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="plain-text files, or JSONL files (*.jsonl, *.json) with a 'text' "
                             "field per line")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="writes PREFIX_text_document.bin and .idx (the directory must exist)")
    parser.add_argument("--tokenizer-model", required=True, metavar="SPM.model",
                        help="SentencePiece model; trained on the inputs and written here if it "
                             "does not exist")
    parser.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                        choices=["SentencePieceTokenizer", "GPTSentencePieceTokenizer"],
                        help="only SentencePiece is supported (default: %(default)s)")
    parser.add_argument("--vocab-size", type=_positive("--vocab-size"), default=None, metavar="N",
                        help=f"pieces of a newly trained model (default {DEFAULT_VOCAB_SIZE}); "
                             f"with an existing model it must match it")
    parser.add_argument("--spm-model-type", choices=["bpe", "unigram"], default="bpe",
                        help="SentencePiece algorithm for a newly trained model (default bpe; "
                             "bpe is deterministic and fast)")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="end every document with the EOD (SentencePiece eos) id "
                             "(default: on)")
    parser.add_argument("--json-key", default="text", metavar="KEY",
                        help="field holding the document in JSONL inputs (default: text)")
    parser.add_argument("--min-document-chars", type=_positive("--min-document-chars", True),
                        default=DEFAULT_MIN_DOCUMENT_CHARS, metavar="N",
                        help="plain text: pack paragraphs into documents of at least this many "
                             "characters; 0 = one document per paragraph (default %(default)s)")
    parser.add_argument("--workers", type=_positive("--workers"), default=1, metavar="N",
                        help="tokenizer processes (default 1)")
    return parser


def _check_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for path in args.input:
        if not os.path.exists(path):
            parser.error(f"--input {path}: no such file")
        if not os.path.isfile(path):
            parser.error(f"--input {path}: not a regular file")
        if not os.access(path, os.R_OK):
            parser.error(f"--input {path}: not readable")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if os.path.basename(args.output_prefix) == "" or args.output_prefix.endswith(os.sep):
        parser.error(f"--output-prefix {args.output_prefix}: needs a file name part, e.g. "
                     f"{os.path.join(args.output_prefix, 'corpus')}")
    if not os.path.isdir(out_dir):
        parser.error(f"--output-prefix {args.output_prefix}: directory {out_dir} does not exist")
    if not os.access(out_dir, os.W_OK):
        parser.error(f"--output-prefix {args.output_prefix}: directory {out_dir} is not writable")
    if os.path.isdir(args.tokenizer_model):
        parser.error(f"--tokenizer-model {args.tokenizer_model} is a directory, not a .model file")
    if not os.path.exists(args.tokenizer_model):
        model_dir = os.path.dirname(os.path.abspath(args.tokenizer_model))
        if not os.path.isdir(model_dir):
            parser.error(f"--tokenizer-model {args.tokenizer_model}: directory {model_dir} does "
                         f"not exist (the model would be trained and written there)")


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_paths(parser, args)
    t_start = time.time()

    import sentencepiece

    model_path = args.tokenizer_model
    trained = False
    if os.path.exists(model_path):
        try:
            processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
        except Exception as err:
            parser.error(f"--tokenizer-model {model_path}: not a readable SentencePiece model "
                         f"({err})")
        pieces = processor.get_piece_size()
        if args.vocab_size is not None and args.vocab_size != pieces:
            parser.error(f"--vocab-size {args.vocab_size} contradicts --tokenizer-model "
                         f"{model_path}, which has {pieces} pieces: pass --vocab-size {pieces} "
                         f"or leave it out (or choose a new --tokenizer-model path to train one)")
    else:
        vocab_size = args.vocab_size or DEFAULT_VOCAB_SIZE
        try:
            sentences = _training_sentences(args.input, args.json_key, args.min_document_chars)
        except InputError as err:
            parser.error(str(err))
        t_train = time.time()
        try:
            model_bytes = train_sentencepiece(sentences, vocab_size, args.spm_model_type)
        except RuntimeError as err:
            parser.error(_explain_training_error(err, vocab_size))
        del sentences
        _write_atomically(model_path, model_bytes)
        processor = sentencepiece.SentencePieceProcessor(model_proto=model_bytes)
        _write_vocab(processor, _vocab_path(model_path))
        trained = True
        print(f"trained a SentencePiece {args.spm_model_type} model with "
              f"{processor.get_piece_size()} pieces in {time.time() - t_train:.1f} s: "
              f"{model_path} (+ {_vocab_path(model_path)})")

    vocab_size = processor.get_piece_size()
    eod = processor.eos_id()
    if args.append_eod and eod < 0:
        parser.error(f"--tokenizer-model {model_path} has no end-of-sentence piece (eos_id is -1), "
                     f"so there is no EOD token to append; use a model with one or "
                     f"--no-append-eod")

    # Megatron imports are slow (seconds); they come after every cheap check.
    import warnings

    import numpy

    with warnings.catch_warnings():  # megatron.core's notes about Transformer Engine and Apex
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from ..mcore.data import indexed_dataset_builder

    doc_prefix = f"{args.output_prefix}_{args.json_key}_document"
    tag = f".tmp-{os.getpid()}"
    bin_tmp, idx_tmp = doc_prefix + ".bin" + tag, doc_prefix + ".idx" + tag
    n_docs = n_tokens = 0
    pool = None
    try:
        builder, dtype = indexed_dataset_builder(bin_tmp, vocab_size)
        if args.workers > 1:
            import multiprocessing

            pool = multiprocessing.Pool(args.workers, initializer=_init_worker,
                                        initargs=(os.path.abspath(model_path),))
        documents = iter_all_documents(args.input, args.json_key, args.min_document_chars)
        for batch in _batches(documents, _ENCODE_BATCH * max(1, args.workers)):
            if pool is not None:
                step = -(-len(batch) // args.workers)
                parts = [batch[i:i + step] for i in range(0, len(batch), step)]
                encoded = [ids for part in pool.map(_encode_batch, parts) for ids in part]
            else:
                encoded = processor.encode(batch)
            for ids in encoded:
                if args.append_eod:
                    ids = list(ids) + [eod]
                if not ids:
                    continue
                array = numpy.asarray(ids, dtype=dtype)
                builder.add_document(array, [array.size])
                n_docs += 1
                n_tokens += array.size
        builder.finalize(idx_tmp)
        if n_docs == 0:
            raise InputError("the inputs hold no text to tokenize")
        os.replace(bin_tmp, doc_prefix + ".bin")
        os.replace(idx_tmp, doc_prefix + ".idx")
    except InputError as err:
        parser.error(str(err))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        for path in (bin_tmp, idx_tmp):
            if os.path.exists(path):
                os.remove(path)

    # GPTDataset caches its sample indices in PREFIX/cache/ when no cache path is given: stale
    # after the data changes, so drop them with the old data.
    stale_cache = os.path.join(doc_prefix, "cache")
    if os.path.isdir(stale_cache):
        shutil.rmtree(stale_cache)
        try:
            os.rmdir(doc_prefix)
        except OSError:
            pass
        print(f"removed the GPTDataset index cache of the previous data: {stale_cache}")

    bin_mb = os.path.getsize(doc_prefix + ".bin") / 1e6
    eod_note = f", EOD id {eod} ending each" if args.append_eod else ", no EOD"
    print(f"{'trained and ' if trained else ''}tokenized {len(args.input)} input file(s) in "
          f"{time.time() - t_start:.1f} s: {n_docs} documents{eod_note}, {n_tokens} tokens")
    print(f"wrote {doc_prefix}.bin ({bin_mb:.2f} MB, {numpy.dtype(dtype).name} tokens) and "
          f"{doc_prefix}.idx")
    print("train on it with:")
    print(f"  --data-path {os.path.abspath(doc_prefix)} --tokenizer-type {args.tokenizer_type} "
          f"--tokenizer-model {os.path.abspath(model_path)} --vocab-size {vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
