"""`load_data`: the prepared dataset, its tokenizer and L_freq, and the batch iterators."""

import dataclasses
import itertools
import os
from collections.abc import Sequence
from typing import Any

import grain
import ml_collections
import numpy as np
from absl import logging

from postnorm.data import pipeline
from postnorm.data.config import check_data_config
from postnorm.data.errors import ShortSplitError
from postnorm.data.lfreq import get_unigram
from postnorm.data.prepare_lock import preparing
from postnorm.data.sources import prepare_source
from postnorm.data.tokenizer_setup import get_tokenizer
from postnorm.data.tokenizers import Tokenizer


@dataclasses.dataclass
class LMData:
    """A tokenized language-modelling dataset.

    Attributes:
      tokenizer: the tokenizer; use its vocab_size (not the config's) for the model.
      lfreq: unigram entropy of the training targets in nats/token (the collapse floor).
      unigram_counts: int64[vocab_size] counts of the training targets L_freq is taken over.
      fingerprint: sha256 of the dataset content.
      info: JSON-able summary for logging.
      seq_len: tokens per sequence.
      seed: default shuffle seed of `train_iterator`.
      train_records, validation_records: random-access records of the two splits.
    """

    tokenizer: Tokenizer
    lfreq: float
    unigram_counts: np.ndarray = dataclasses.field(repr=False)
    fingerprint: str
    info: dict[str, Any]
    seq_len: int
    seed: int
    train_records: Sequence[Any] = dataclasses.field(repr=False)
    validation_records: Sequence[Any] = dataclasses.field(repr=False)

    def train_iterator(
        self,
        *,
        batch_size: int,
        seed: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
    ) -> grain.DatasetIterator:
        """Infinite iterator of {'inputs', 'targets'}: int32[batch_size, seq_len] for this
        process (batch_size is per process). Checkpointable via get_state/set_state."""
        dataset = pipeline.train_dataset(
            self.train_records,
            self.tokenizer,
            seq_len=self.seq_len,
            batch_size=batch_size,
            seed=self.seed if seed is None else seed,
            process_index=process_index,
            process_count=process_count,
        )
        return iter(dataset)

    def eval_batches(
        self, *, batch_size: int, num_batches: int, process_index: int = 0, process_count: int = 1
    ) -> list[dict[str, np.ndarray]]:
        """The first `num_batches` packed batches of this process's validation shard."""
        dataset = pipeline.eval_dataset(
            self.validation_records,
            self.tokenizer,
            seq_len=self.seq_len,
            batch_size=batch_size,
            process_index=process_index,
            process_count=process_count,
        )
        batches = list(itertools.islice(dataset, num_batches))
        if len(batches) < num_batches:
            raise ShortSplitError(
                f"The validation split at {self.info['path']} gives only {len(batches)} batches "
                f"of {batch_size}x{self.seq_len} tokens on process {process_index}/"
                f"{process_count}, not {num_batches}; lower the eval batch count or size "
                "(train.eval_batches, data.batch_size) or data.seq_len, or give it more text."
            )
        return batches


def load_data(cfg: ml_collections.ConfigDict, *, seed: int = 0) -> LMData:
    """Validates `cfg`, prepares the dataset if needed, loads (or trains and caches) the
    tokenizer, computes (or reads the cached) L_freq and returns the LMData."""
    check_data_config(cfg)
    with preparing(os.path.expanduser(cfg.data_dir), "the dataset, tokenizer and L_freq",
                   create=cfg.source != "c4"):  # C4 is prepared beforehand, where it lies
        source = prepare_source(cfg)
        tokenizer = get_tokenizer(cfg, source)
        unigram = get_unigram(source, tokenizer, cfg.lfreq_sample_docs)
    lfreq = unigram.lfreq
    info = {
        **source.info,
        "tokenizer": {
            "kind": cfg.tokenizer,
            "name": tokenizer.name,
            "path": tokenizer.model_path,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
        "lfreq": lfreq,
        "seq_len": cfg.seq_len,
    }
    logging.info(
        "Data ready: %s, L_freq %.4f nats/token, fingerprint sha256:%s",
        source.path, lfreq, source.fingerprint,
    )
    return LMData(
        tokenizer=tokenizer,
        lfreq=lfreq,
        unigram_counts=unigram.counts,
        fingerprint=source.fingerprint,
        info=info,
        seq_len=cfg.seq_len,
        seed=seed,
        train_records=source.splits["train"],
        validation_records=source.splits["validation"],
    )
