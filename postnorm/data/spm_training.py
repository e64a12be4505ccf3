"""Deterministic SentencePiece training on a bounded sample of training documents."""

import io
from collections.abc import Iterable

import sentencepiece as spm

from postnorm.data.errors import DataError

# Characters of training text fed to the trainer (~5 s for vocab 8192 on two cores).
TRAIN_CHAR_BUDGET = 4_000_000
# SentencePiece's default max_sentence_length; longer lines would be dropped by the trainer.
MAX_SENTENCE_BYTES = 4192
NUM_THREADS = 2
SEED = 0


def training_sentences(texts: Iterable[str], char_budget: int = TRAIN_CHAR_BUDGET) -> list[str]:
    """Non-blank lines of `texts`, in order, until `char_budget` characters are collected."""
    sentences, num_chars = [], 0
    for text in texts:
        for line in text.split("\n"):
            if line.strip() and len(line.encode("utf-8")) <= MAX_SENTENCE_BYTES:
                sentences.append(line)
                num_chars += len(line)
        if num_chars >= char_budget:
            break
    return sentences


def train_sentencepiece(sentences: list[str], vocab_size: int) -> bytes:
    """Serialized unigram SentencePiece model with byte fallback; ids unk=0, bos=1, eos=2.

    Normalization is the identity and whitespace is kept verbatim (code indentation matters),
    no dummy prefix is added (so a line start is encoded the same way inside a document as in
    training), and newline is a piece of its own. Training uses every given sentence in order
    with a fixed thread count and seed, so the model bytes are a function of the input.
    """
    if not sentences:
        raise DataError("SentencePiece training got no text: the training split is empty. Give "
                        "the data source text (data.text_files: files that are not empty), or a "
                        "trained model in data.tokenizer_path.")
    spm.set_random_generator_seed(SEED)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type="unigram",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],
            split_digits=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=MAX_SENTENCE_BYTES,
            num_threads=NUM_THREADS,
            minloglevel=1,
        )
    except RuntimeError as e:
        raise DataError(
            f"data.vocab_size={vocab_size}: SentencePiece training failed ({e}). Choose a "
            "vocab_size the training text supports, or provide data.tokenizer_path."
        ) from e
    return model.getvalue()
