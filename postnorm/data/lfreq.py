"""L_freq: the unigram entropy of the training targets, the loss of a model that ignores context.

A language model whose representations have collapsed can only predict the marginal token
distribution, so its cross-entropy floors at L_freq = -sum_v p(v) log p(v) (nats/token), with
p the frequency of v among the training target tokens (the document tokens plus one EOS per
document, as in the packed stream).

On one batch, the same model's loss is the batch's **frequency floor**, the mean of -log p(y)
over its targets. Its mean over batches is L_freq, but one batch of the default corpus scatters
around it by more than the collapse rule's tolerance (``experiments/batch_floors.py``,
results/figures/batch_floors/table.md), so a collapsed run's loss is compared with the floor of
the batches it was measured on.
"""

import dataclasses
import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from absl import logging

from postnorm.data.sources import PreparedSource
from postnorm.data.tokenizers import Tokenizer
from postnorm.files import FileWriteError, write_json_atomic
from postnorm.theory import unigram_entropy

_ENCODE_CHUNK_DOCS = 256


def target_token_counts(texts: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """int64[vocab_size] counts of the tokens of `texts`, each followed by EOS."""
    counts = np.zeros((tokenizer.vocab_size,), np.int64)
    chunk: list[str] = []

    def flush() -> None:
        ids = tokenizer.encode_batch(chunk)
        counts[:] += np.bincount(np.concatenate(ids), minlength=tokenizer.vocab_size)
        counts[tokenizer.eos_id] += len(chunk)
        chunk.clear()

    for text in texts:
        chunk.append(text)
        if len(chunk) == _ENCODE_CHUNK_DOCS:
            flush()
    if chunk:
        flush()
    return counts


def frequency_floor(targets: np.ndarray, counts_V: np.ndarray) -> float:
    """Mean -log p(y) over ``targets`` under p proportional to ``counts_V``: the loss of the
    context-free unigram prediction. A token absent from the counts (possible when L_freq uses
    a document sample) is scored as if it had half a count, so the floor stays finite."""
    neg_log_p_V = np.log(counts_V.sum()) - np.log(np.maximum(counts_V, 0.5))
    return float(neg_log_p_V[np.asarray(targets)].mean())


@dataclasses.dataclass(frozen=True)
class Unigram:
    """The training targets' unigram counts and their entropy L_freq (nats/token)."""

    lfreq: float
    counts: np.ndarray


def cache_path(source: PreparedSource, tokenizer: Tokenizer, sample_docs: int) -> Path:
    """The JSON cache of L_freq for this dataset, tokenizer and document sample."""
    return Path(source.path) / f"lfreq_{tokenizer.name}_{sample_docs or 'all'}.json"


def _read_cache(path: Path) -> dict | None:
    """The cached counts, or None when there is no usable cache (a damaged one is computed
    again and replaced)."""
    if not path.exists():
        return None
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached, dict) and {"fingerprint", "lfreq", "counts"} <= cached.keys():
            return cached
        problem = "lacks fields"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        problem = f"is unreadable ({err})"
    logging.warning("The L_freq cache %s %s: computing it again", path, problem)
    return None


def get_unigram(source: PreparedSource, tokenizer: Tokenizer, sample_docs: int = 0) -> Unigram:
    """Counts and L_freq over the first `sample_docs` training documents (0: all), cached as
    JSON."""
    path = cache_path(source, tokenizer, sample_docs)
    cached = _read_cache(path)
    if cached is not None and cached["fingerprint"] == source.fingerprint:
        return Unigram(cached["lfreq"], np.asarray(cached["counts"], np.int64))
    num_train = len(source.splits["train"])
    num_docs = min(sample_docs, num_train) if sample_docs else num_train
    start = time.perf_counter()
    counts = target_token_counts(source.texts("train", num_docs), tokenizer)
    lfreq = unigram_entropy(counts)
    try:
        write_json_atomic(
            path,
            {
                "lfreq": lfreq,
                "num_docs": num_docs,
                "num_tokens": int(counts.sum()),
                "tokenizer": tokenizer.name,
                "fingerprint": source.fingerprint,
                "counts": counts.tolist(),
            },
        )
    except FileWriteError as err:  # a read-only dataset folder: the cache only saves time
        logging.warning("L_freq could not be cached at %s (%s): it is computed again at the "
                        "next start", path, err)
    logging.info(
        "L_freq = %.4f nats/token from %d tokens of %d training docs (%.1f s) -> %s",
        lfreq, counts.sum(), num_docs, time.perf_counter() - start, path,
    )
    return Unigram(lfreq, counts)
