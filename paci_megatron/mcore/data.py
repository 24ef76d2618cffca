"""Real training data for GPT: tokenizers, indexed-dataset checks, Megatron ``GPTDataset`` splits
and a Megatron-style micro-batch iterator.

* :func:`build_tokenizer` gives a small tokenizer object with the attributes Megatron-Core's
  datasets read (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``) plus ``tokenize`` and
  ``detokenize``. Two kinds: ``SentencePieceTokenizer`` (a local ``.model`` file, no network)
  and ``NullTokenizer`` (Megatron-LM's meaning: ``--vocab-size N`` gives ids ``0..N-1`` and the
  EOD id ``N``, so ``vocab_size == N + 1``).
* :func:`check_indexed_dataset` validates a ``PREFIX.bin`` / ``PREFIX.idx`` pair written by
  ``python -m paci_megatron.tools.preprocess_data`` (or Megatron-LM's ``tools/preprocess_data.py``)
  by reading the index header and arrays only; errors name ``--data-path``.
* :func:`build_gpt_datasets` builds the train/valid/test ``GPTDataset`` (or ``MockGPTDataset``)
  with ``BlendedMegatronDatasetBuilder``. It is collective when torch.distributed is
  initialised: call it on every rank (the builder places barriers on the default group).
* :func:`gpt_batches` walks a dataset in index order the way Megatron-LM's
  ``MegatronPretrainingSampler`` does and yields the dicts ``build.gpt_forward_step`` reads.
"""

from __future__ import annotations

import os
import re
import struct
from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType

from . import compat

__all__ = [
    "SUPPORTED_TOKENIZERS",
    "SentencePieceTokenizer",
    "NullTokenizer",
    "build_tokenizer",
    "indexed_dataset_builder",
    "check_indexed_dataset",
    "build_gpt_datasets",
    "GPTBatches",
    "gpt_batches",
]


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` file as a Megatron GPT tokenizer.

    The end-of-document id (``eod``) is the model's ``</s>`` (eos) id; the model must have one.
    ``pad`` is the model's pad id (``-1`` when it has none, which Megatron's datasets treat as
    "no pad token"). No ids are added on top of the model's pieces: ``vocab_size`` is exactly
    the model's piece count.
    """

    def __init__(self, model_path: str):
        import sentencepiece  # optional dependency: only needed for real text data

        self.model_path = os.path.abspath(model_path)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=self.model_path)
        self._vocab_size = int(self._sp.get_piece_size())
        self._eod = int(self._sp.eos_id())
        if self._eod < 0:
            raise ValueError(
                f"--tokenizer-model {model_path}: the SentencePiece model has no end-of-sentence "
                f"piece (eos_id is -1), so there is no end-of-document token; train it with "
                f"eos_id >= 0 (python -m paci_megatron.tools.preprocess_data does)"
            )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def bos(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad(self) -> int:
        return int(self._sp.pad_id())

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        """What Megatron's dataset descriptions (and their cache hashes) record of the tokenizer."""
        return OrderedDict(
            [("class", type(self).__name__), ("tokenizer_model", self.model_path),
             ("vocab_size", self._vocab_size)]
        )

    def tokenize(self, text: str) -> List[int]:
        return list(self._sp.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return (f"SentencePieceTokenizer(model={self.model_path!r}, vocab_size={self._vocab_size}, "
                f"eod={self._eod})")


class NullTokenizer:
    """Megatron-LM's ``NullTokenizer``: text is a whitespace-separated list of integer ids.

    With ``--vocab-size N``, as the installed megatron-core's own NullTokenizer counts (so that
    a checkpoint's embedding has the rows Megatron-LM gives it): through 0.17 the ids
    ``0..N-1`` are data and ``N`` is the end-of-document id, so ``vocab_size`` is ``N + 1``;
    from 0.18 on ``vocab_size`` is ``N`` and the end-of-document id ``N - 1``.
    """

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1 (got {vocab_size})")
        self._vocab_size_without_eod = int(vocab_size)
        self._added = 1 if compat.null_tokenizer_adds_eod() else 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + self._added

    @property
    def eod(self) -> int:
        return self.vocab_size - 1

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def pad(self) -> int:
        return -1

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        return OrderedDict([("class", type(self).__name__),
                            ("vocab_size", self._vocab_size_without_eod)])

    def tokenize(self, text: str) -> List[int]:
        return [int(tok) for tok in text.split()]

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


_SENTENCEPIECE_NAMES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer")
SUPPORTED_TOKENIZERS = _SENTENCEPIECE_NAMES + ("NullTokenizer",)


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
):
    """The tokenizer for ``--tokenizer-type`` (Megatron-LM names).

    ``SentencePieceTokenizer`` (alias ``GPTSentencePieceTokenizer``) loads ``tokenizer_model``;
    ``vocab_size``, when given, must equal the model's piece count. ``NullTokenizer`` needs
    ``vocab_size`` (its ``vocab_size`` attribute is then ``vocab_size + 1``: see
    :class:`NullTokenizer`). Raises ``ValueError`` naming the flag at fault.
    """
    if tokenizer_type in _SENTENCEPIECE_NAMES:
        if not tokenizer_model:
            raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model "
                             f"(a SentencePiece .model file)")
        if not os.path.isfile(tokenizer_model):
            raise ValueError(
                f"--tokenizer-model {tokenizer_model}: no such file (create one with python -m "
                f"paci_megatron.preprocess_data --tokenizer-model {tokenizer_model} ...)"
            )
        try:
            tokenizer = SentencePieceTokenizer(tokenizer_model)
        except ValueError:
            raise
        except Exception as err:  # sentencepiece raises RuntimeError/OSError on a bad file
            raise ValueError(
                f"--tokenizer-model {tokenizer_model}: not a readable SentencePiece model "
                f"({type(err).__name__}: {err})"
            ) from None
        if vocab_size is not None and int(vocab_size) != tokenizer.vocab_size:
            raise ValueError(
                f"--vocab-size {vocab_size} does not match --tokenizer-model {tokenizer_model}, "
                f"which has {tokenizer.vocab_size} pieces: pass --vocab-size "
                f"{tokenizer.vocab_size} or leave it out"
            )
        return tokenizer
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(
        f"--tokenizer-type {tokenizer_type!r} is not supported here; choose one of "
        f"{', '.join(SUPPORTED_TOKENIZERS)}"
    )


def indexed_dataset_builder(bin_path: str, vocab_size: int):
    """Megatron's indexed-dataset writer, and the token dtype it uses for this vocabulary."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab_size)
    return IndexedDatasetBuilder(bin_path, dtype=dtype), dtype


# --------------------------------------------------------------------------------------------
# Indexed dataset checks (header and index arrays only; never the whole .bin)
# --------------------------------------------------------------------------------------------

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_FIXED = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


def _data_path_error(prefix: str, what: str) -> ValueError:
    return ValueError(f"--data-path {prefix}: {what}")


def _missing_hint(prefix: str) -> str:
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            return f" (give the prefix without {suffix!r}: --data-path {prefix[:-4]})"
    if os.path.isfile(prefix + "_text_document.idx"):
        return f" (did you mean --data-path {prefix}_text_document?)"
    return (" (write the pair with python -m paci_megatron.tools.preprocess_data --output-prefix P, "
            "then pass --data-path P_text_document)")


def check_indexed_dataset(prefix: str) -> Dict[str, object]:
    """Validate the Megatron indexed dataset ``prefix.bin`` + ``prefix.idx``.

    Checks that both files exist, that the index has the right magic, version and dtype, that its
    size matches the sequence and document counts it declares, that the sequence pointers and
    document boundaries are consistent, and that ``prefix.bin`` is exactly as long as the index
    says. Reads only the index (memory-mapped), so it is cheap and needs no torch.distributed.

    Returns ``{"num_sequences", "num_documents", "num_tokens", "dtype"}``; raises ``ValueError``
    naming ``--data-path`` otherwise.
    """
    info, _ = _check_indexed_dataset(str(prefix))
    return info


def _check_indexed_dataset(prefix: str):
    """:func:`check_indexed_dataset`, also returning the per-sequence token counts (int64)."""
    bin_path, idx_path = prefix + ".bin", prefix + ".idx"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise _data_path_error(prefix, f"{path} does not exist{_missing_hint(prefix)}")

    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as stream:
        head = stream.read(_IDX_FIXED)
    if len(head) < 9 or head[:9] != _IDX_MAGIC:
        raise _data_path_error(
            prefix, f"{idx_path} is not a Megatron indexed-dataset index (bad header)")
    if len(head) < _IDX_FIXED:
        raise _data_path_error(prefix, f"{idx_path} is truncated ({idx_size} bytes)")
    version, = struct.unpack("<Q", head[9:17])
    if version != 1:
        raise _data_path_error(prefix, f"{idx_path} has index version {version}, expected 1")
    code = head[17]
    try:
        dtype = DType.dtype_from_code(code)
    except ValueError:
        raise _data_path_error(
            prefix, f"{idx_path} has an unknown token dtype code {code}") from None
    n_seq, n_doc = struct.unpack("<QQ", head[18:34])
    plain = _IDX_FIXED + 12 * n_seq + 8 * n_doc
    if idx_size not in (plain, plain + n_seq):  # + one int8 mode per sequence if multimodal
        state = "truncated" if idx_size < plain else "corrupt"
        raise _data_path_error(
            prefix,
            f"{idx_path} is {state}: it declares {n_seq} sequences and {n_doc} document "
            f"boundaries ({plain} bytes) but has {idx_size} bytes",
        )
    if n_seq == 0:
        raise _data_path_error(prefix, f"{idx_path} holds no sequences (an empty dataset)")

    mapped = numpy.memmap(idx_path, mode="r", dtype=numpy.uint8)
    try:
        offset = _IDX_FIXED
        lengths = numpy.frombuffer(mapped, dtype=numpy.int32, count=n_seq, offset=offset)
        offset += 4 * n_seq
        pointers = numpy.frombuffer(mapped, dtype=numpy.int64, count=n_seq, offset=offset)
        offset += 8 * n_seq
        doc_idx = numpy.frombuffer(mapped, dtype=numpy.int64, count=n_doc, offset=offset)

        itemsize = numpy.dtype(dtype).itemsize
        if (lengths < 0).any():
            raise _data_path_error(prefix, f"{idx_path} is corrupt (negative sequence lengths)")
        sizes = lengths.astype(numpy.int64) * itemsize
        expected_ptr = numpy.zeros(n_seq, dtype=numpy.int64)
        numpy.cumsum(sizes[:-1], out=expected_ptr[1:])
        if not numpy.array_equal(pointers, expected_ptr):
            raise _data_path_error(
                prefix, f"{idx_path} is corrupt (sequence pointers do not match the lengths)")
        if (n_doc < 2 or doc_idx[0] != 0 or doc_idx[-1] != n_seq
                or (numpy.diff(doc_idx) < 0).any()):
            raise _data_path_error(
                prefix, f"{idx_path} is corrupt (document boundaries are not 0..{n_seq})")
        seq_tokens = lengths.astype(numpy.int64)  # a copy: outlives the memory map
        n_tokens = int(seq_tokens.sum())
    finally:
        del mapped

    bin_size = os.path.getsize(bin_path)
    want = n_tokens * itemsize
    if bin_size != want:
        state = "truncated" if bin_size < want else "larger than its index says (mismatched pair?)"
        raise _data_path_error(
            prefix,
            f"{bin_path} is {state}: {prefix}.idx describes {n_tokens} {numpy.dtype(dtype).name} "
            f"tokens ({want} bytes) but the file has {bin_size} bytes; regenerate the pair",
        )
    info = {
        "num_sequences": int(n_seq),
        "num_documents": int(n_doc - 1),
        "num_tokens": n_tokens,
        "dtype": numpy.dtype(dtype).name,
    }
    return info, seq_tokens


# --------------------------------------------------------------------------------------------
# GPT datasets
# --------------------------------------------------------------------------------------------


def _split_ranges(split: str, n: int) -> List[Optional[Tuple[int, int]]]:
    """The [begin, end) document ranges Megatron's builder gives each split of ``n`` sequences."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    ranges: List[Optional[Tuple[int, int]]] = []
    for bookends in matrix:
        if bookends is None:
            ranges.append(None)
        else:
            ranges.append((int(round(bookends[0] * n)), int(round(bookends[1] * n))))
    return ranges


def _check_split(split: str) -> None:
    """Megatron's --split: up to three comma- (or slash-) separated weights, not all zero."""
    try:
        ok = bool(re.fullmatch(r"\s*[.0-9]+(\s*[,/]\s*[.0-9]+){0,2}\s*", split or "")) and sum(
            float(w) for w in re.findall(r"[.0-9]+", split)) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--split {split!r}: expected up to three non-negative weights for "
                         f"train,valid,test, e.g. 969,30,1")


def build_gpt_datasets(
    data_path: Union[str, Sequence[str], None],
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    train_samples: Optional[int],
    valid_samples: Optional[int],
    test_samples: Optional[int],
    mock: bool = False,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    path_to_cache: Optional[str] = None,
):
    """Megatron ``GPTDataset`` splits ``(train, valid, test)`` for ``data_path``.

    ``data_path`` is one indexed-dataset prefix (or a list of prefixes, blended in proportion to
    their sizes). ``split`` is Megatron's ``--split`` string ("969,30,1"); a split with weight 0
    comes back as ``None``. ``*_samples`` is the number of samples each split must provide
    (``None``: one epoch); the dataset repeats (reshuffled) epochs to reach it. ``mock=True``
    returns ``MockGPTDataset`` splits instead and ignores ``data_path``.

    Collective when torch.distributed is initialised: every rank must call it (global rank 0
    builds first, then the others; the index cache goes next to the data, under
    ``PREFIX/cache/``, unless ``path_to_cache`` is given). ``is_built_on_rank`` (default: every
    rank) may return False on ranks that need no data; they get ``None``s.
    """
    if seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1 (got {seq_length})")
    if tokenizer is None or getattr(tokenizer, "eod", None) is None:
        raise ValueError("build_gpt_datasets needs a tokenizer with an eod id (build_tokenizer)")

    _check_split(split)

    blend = None
    if not mock:
        if not data_path:
            raise ValueError("--data-path is required unless --mock-data is given")
        prefixes = [data_path] if isinstance(data_path, str) else [str(p) for p in data_path]
        for prefix in prefixes:
            # Megatron-Core loops forever on a split without tokens: refuse it here.
            _, seq_tokens = _check_indexed_dataset(prefix)
            n = len(seq_tokens)
            for name, rng in zip(("train", "valid", "test"), _split_ranges(split, n)):
                if rng is not None and int(seq_tokens[rng[0]:rng[1]].sum()) == 0:
                    raise ValueError(
                        f"--split {split} leaves the {name} split of --data-path {prefix} "
                        f"without tokens (documents {rng[0]}..{rng[1]} of {n}); use more (or "
                        f"smaller) documents or give {name} weight 0 in --split"
                    )
        blend = (prefixes, None)

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=path_to_cache,
        mmap_bin_files=True,
    )
    cls = MockGPTDataset if mock else GPTDataset
    built_on_rank = is_built_on_rank if is_built_on_rank is not None else (lambda: True)
    train, valid, test = BlendedMegatronDatasetBuilder(
        cls, [train_samples, valid_samples, test_samples], built_on_rank, config
    ).build()
    return train, valid, test


# --------------------------------------------------------------------------------------------
# Micro-batches
# --------------------------------------------------------------------------------------------


class GPTBatches:
    """Infinite iterator of GPT micro-batches, ordered like Megatron's pretraining sampler.

    Step ``k`` (the k-th ``next``) on data-parallel rank ``r`` stacks the samples
    ``start + k * mbs * dp + r * mbs + i`` for ``i < mbs``, taken modulo ``len(dataset)`` (so the
    order repeats exactly, epoch after epoch). ``consumed_samples`` counts the samples all DP
    ranks together have consumed, ``start_sample`` included: saving it and passing it back as
    ``start_sample`` resumes the stream exactly (Megatron-LM's ``consumed_train_samples``).
    """

    def __init__(self, dataset, micro_batch_size: int, start_sample: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, device=None):
        if dataset is None:
            raise ValueError("gpt_batches needs a dataset (got None: was it built on this rank?)")
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1 (got {micro_batch_size})")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad data-parallel rank {dp_rank} of {dp_size}")
        if start_sample < 0:
            raise ValueError(f"start_sample must be >= 0 (got {start_sample})")
        self.dataset = dataset
        self.num_samples = len(dataset)
        if self.num_samples < 1:
            raise ValueError("the dataset has no samples")
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.consumed_samples = int(start_sample)
        if device is None:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.device = device

    def __iter__(self) -> "GPTBatches":
        return self

    def sample_indices(self) -> List[int]:
        """The dataset indices the next micro-batch of this rank will hold."""
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        return [(first + i) % self.num_samples for i in range(self.micro_batch_size)]

    def __next__(self) -> Dict[str, Optional[torch.Tensor]]:
        samples = [self.dataset[idx] for idx in self.sample_indices()]
        self.consumed_samples += self.micro_batch_size * self.dp_size

        def stack(key, dtype):
            return to_device(torch.stack([s[key] for s in samples]).to(dtype=dtype), self.device)

        return {
            "tokens": stack("tokens", torch.long),
            "labels": stack("labels", torch.long),
            "loss_mask": stack("loss_mask", torch.float),
            "attention_mask": None,
            "position_ids": stack("position_ids", torch.long),
        }


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A host batch on ``device`` without holding the host: from pinned memory, asynchronous
    (a copy from pageable memory waits for the device's stream first)."""
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def gpt_batches(dataset, micro_batch_size: int, start_sample: int = 0, dp_rank: int = 0,
                dp_size: int = 1, device=None) -> GPTBatches:
    """See :class:`GPTBatches`; ``batches.consumed_samples`` is the position to checkpoint."""
    return GPTBatches(dataset, micro_batch_size, start_sample, dp_rank, dp_size, device)
