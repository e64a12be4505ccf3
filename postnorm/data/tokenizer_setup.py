"""Choosing, training and caching the tokenizer for a prepared dataset."""

import time
from pathlib import Path

import ml_collections
from absl import logging

from postnorm.data import spm_training
from postnorm.data.errors import DataError
from postnorm.data.sources import PreparedSource
from postnorm.data.tokenizers import (
    ByteTokenizer,
    Tokenizer,
    read_sentencepiece,
    read_user_sentencepiece,
)
from postnorm.files import FileWriteError, write_bytes_atomic


def trained_model_path(source: PreparedSource, vocab_size: int) -> Path:
    """Cache location of the SentencePiece model trained on `source`."""
    return Path(source.path) / f"tokenizer_spm_{vocab_size}.model"


def _train(source: PreparedSource, vocab_size: int, path: Path) -> None:
    start = time.perf_counter()
    sentences = spm_training.training_sentences(source.texts("train"))
    model_proto = spm_training.train_sentencepiece(sentences, vocab_size)
    try:
        write_bytes_atomic(path, model_proto)
    except FileWriteError as err:
        raise DataError(f"the trained tokenizer cannot be stored at {path} "
                        f"({err.__cause__}): make that folder writable, or give a "
                        "SentencePiece model as data.tokenizer_path") from err
    logging.info(
        "Trained SentencePiece (vocab %d) on %d lines (%d chars) in %.1f s -> %s",
        vocab_size, len(sentences), sum(map(len, sentences)), time.perf_counter() - start, path,
    )


def get_tokenizer(cfg: ml_collections.ConfigDict, source: PreparedSource) -> Tokenizer:
    """Byte tokenizer, the user's SentencePiece model, or one trained once on the train split."""
    if cfg.tokenizer == "byte":
        tokenizer = ByteTokenizer()
    elif cfg.tokenizer_path:
        tokenizer = read_user_sentencepiece(cfg.tokenizer_path)
        if tokenizer.vocab_size != cfg.vocab_size:
            logging.warning(
                "data.vocab_size=%d is unused: %s has %d pieces, which the model must use.",
                cfg.vocab_size, cfg.tokenizer_path, tokenizer.vocab_size,
            )
    else:
        path = trained_model_path(source, cfg.vocab_size)
        if not path.exists():
            _train(source, cfg.vocab_size, path)
        tokenizer = read_sentencepiece(
            path, what="Cached tokenizer", fix=f"Delete {path} to train it again."
        )
    logging.info(
        "Tokenizer %s from %s: vocab %d, eos id %d",
        tokenizer.name, tokenizer.model_path, tokenizer.vocab_size, tokenizer.eos_id,
    )
    return tokenizer
