"""grain pipelines: documents -> process shard -> shuffle/repeat -> tokens + EOS -> packed batches.

Training examples are windows of seq_len + 1 consecutive tokens of the concatenated document
stream (each document followed by EOS); inputs = window[:-1], targets = window[1:].
"""

import functools
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from postnorm.data.errors import DataError
from postnorm.data.packing import PackIterDataset
from postnorm.data.sources import TEXT_FEATURE
from postnorm.data.tokenizers import Tokenizer

# Threads that read and tokenize documents ahead of the packer.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=64)


def tokenize_document(record: dict[str, Any], tokenizer: Tokenizer) -> np.ndarray:
    """int32 ids of a record's text followed by EOS."""
    ids = tokenizer.encode(record[TEXT_FEATURE].decode("utf-8"))
    return np.append(ids, tokenizer.eos_id).astype(np.int32)


def shift_window(window: np.ndarray) -> dict[str, np.ndarray]:
    """Next-token prediction pair of a packed window."""
    return {"inputs": window[:-1], "targets": window[1:]}


def process_shard(
    records: Sequence[Any], process_index: int, process_count: int
) -> grain.MapDataset:
    """Documents process_index, process_index + process_count, ... of `records`."""
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} is not in [0, {process_count}).")
    if len(records) < process_count:
        raise DataError(
            f"A split with {len(records)} documents cannot be sharded over {process_count} "
            "processes; use more documents."
        )
    return grain.MapDataset.source(records)[process_index::process_count]


def _packed_batches(
    docs: grain.MapDataset, tokenizer: Tokenizer, *, seq_len: int, batch_size: int
) -> grain.IterDataset:
    tokens = docs.map(functools.partial(tokenize_document, tokenizer=tokenizer))
    windows = PackIterDataset(tokens.to_iter_dataset(READ_OPTIONS), window_len=seq_len + 1)
    return windows.map(shift_window).batch(batch_size, drop_remainder=True)


def train_dataset(
    records: Sequence[Any],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
) -> grain.IterDataset:
    """Infinite training batches; the shard is reshuffled every epoch (seed + epoch)."""
    docs = process_shard(records, process_index, process_count).shuffle(seed=seed).repeat()
    return _packed_batches(docs, tokenizer, seq_len=seq_len, batch_size=batch_size)


def eval_dataset(
    records: Sequence[Any],
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    process_index: int,
    process_count: int,
) -> grain.IterDataset:
    """One pass over the shard in index order, packed like training; partial batches dropped."""
    docs = process_shard(records, process_index, process_count)
    return _packed_batches(docs, tokenizer, seq_len=seq_len, batch_size=batch_size)
