"""Language-modelling data: TFDS array_record corpora, tokenizers, L_freq and grain pipelines."""

from postnorm.data.config import check_batch_shape, check_data_config
from postnorm.data.errors import DataError
from postnorm.data.lm_data import LMData, load_data
from postnorm.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, Tokenizer

__all__ = [
    "ByteTokenizer",
    "DataError",
    "LMData",
    "SentencePieceTokenizer",
    "Tokenizer",
    "check_batch_shape",
    "check_data_config",
    "load_data",
]
