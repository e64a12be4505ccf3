"""Tokenizers: a trained or user-provided SentencePiece model, or raw UTF-8 bytes."""

import hashlib
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import sentencepiece as spm

from postnorm.data.errors import DataError


class Tokenizer(Protocol):
    """What the pipeline needs from a tokenizer."""

    @property
    def name(self) -> str:
        """Stable identity of the vocabulary; caches derived from token ids are keyed by it."""
        ...

    @property
    def model_path(self) -> str | None:
        """The model file, if any."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> np.ndarray:
        """int32 token ids of `text`, without EOS."""
        ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, with EOS = 256."""

    name = "byte"
    model_path = None
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids_arr = np.asarray(ids)
        return ids_arr[ids_arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model; EOS is the model's own eos id."""

    def __init__(self, model_proto: bytes, *, model_path: str):
        self._sp = spm.SentencePieceProcessor()
        self._sp.LoadFromSerializedProto(model_proto)
        self.name = "spm_" + hashlib.sha256(model_proto).hexdigest()[:16]
        self.model_path = model_path
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise DataError(
                f"SentencePiece model {model_path} has no EOS piece (eos_id=-1); retrain it with "
                "eos_id set, or leave data.tokenizer_path empty to train one."
            )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._sp.decode([int(i) for i in ids])


def read_sentencepiece(path: str | os.PathLike, *, what: str, fix: str) -> SentencePieceTokenizer:
    """Loads a SentencePiece .model file; DataError naming `what`, the file and `fix` if not."""
    try:
        with open(path, "rb") as f:
            model_proto = f.read()
    except OSError as e:
        raise DataError(f"{what}: cannot read {path!s} ({e.strerror}). {fix}") from e
    try:
        return SentencePieceTokenizer(model_proto, model_path=os.fspath(path))
    except RuntimeError as e:
        raise DataError(f"{what}: {path!s} is not a valid SentencePiece model ({e}). {fix}") from e


def read_user_sentencepiece(tokenizer_path: str) -> SentencePieceTokenizer:
    """The model named by data.tokenizer_path (`~` expanded)."""
    return read_sentencepiece(
        os.path.expanduser(tokenizer_path),
        what="data.tokenizer_path",
        fix="Point data.tokenizer_path at a readable SentencePiece .model file, or set it to '' "
        "to train one on the training split.",
    )
