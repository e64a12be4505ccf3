"""Documents of the embedded corpus and of local text files, with their train/validation split.

The embedded corpus is the Python source (code, docstrings and comments) of a fixed list of
pure-Python distributions pinned in the repository's requirements.txt. Pure-Python wheels ship
the same files on every platform, so the corpus is fixed by the pins. One document per file.
"""

import dataclasses
import glob
import hashlib
import importlib.metadata
import os
import re
from collections.abc import Sequence
from pathlib import Path

from absl import logging

from postnorm.data.errors import DataError

# Pure-Python ("Root-Is-Purelib") distributions whose .py files make up the embedded corpus.
EMBEDDED_DISTRIBUTIONS = (
    "absl-py",
    "clu",
    "etils",
    "flax",
    "jax",
    "ml_collections",
    "optax",
    "orbax-checkpoint",
    "tensorboardX",
    "tensorflow-datasets",
)
# Each distribution contributes its .py files in sorted path order up to this many bytes, which
# keeps jax and tensorflow-datasets from dominating and bounds the corpus at ~20 MB.
MAX_BYTES_PER_DISTRIBUTION = 6_000_000
VALIDATION_FRACTION = 0.02
REQUIREMENTS_PATH = Path(__file__).resolve().parents[2] / "requirements.txt"


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: `key` is its stable relative path, `text` its full content."""

    key: str
    text: str


def normalize_name(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_pins(path: Path = REQUIREMENTS_PATH) -> dict[str, str]:
    """`name==version` pins of a requirements file, keyed by normalized name."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+).*", line)
        if match:
            pins[normalize_name(match[1])] = match[2]
    return pins


def embedded_versions() -> dict[str, dict[str, str | None]]:
    """Installed and pinned (None if unpinned) version of each embedded-corpus distribution."""
    pins = requirement_pins() if REQUIREMENTS_PATH.exists() else {}
    return {
        name: {
            "installed": importlib.metadata.version(name),
            "pinned": pins.get(normalize_name(name)),
        }
        for name in EMBEDDED_DISTRIBUTIONS
    }


def warn_unpinned(versions: dict[str, dict[str, str | None]]) -> None:
    """Logs a warning for each distribution whose installed version differs from its pin: the
    corpus, and so its fingerprint, then differ from the one the pins define."""
    for name, v in versions.items():
        if v["installed"] != v["pinned"]:
            logging.warning(
                "Embedded corpus: %s %s is installed but %s pins %s; the corpus fingerprint "
                "will differ from the pinned one.",
                name, v["installed"], REQUIREMENTS_PATH, v["pinned"],
            )


def embedded_documents() -> list[Document]:
    """The embedded corpus: one document per selected .py file, keyed `<distribution>/<path>`."""
    documents = []
    for name in EMBEDDED_DISTRIBUTIONS:
        dist = importlib.metadata.distribution(name)
        files = sorted((f for f in dist.files or () if f.suffix == ".py"), key=str)
        total_bytes = 0
        for file in files:
            data = Path(file.locate()).read_bytes()
            if total_bytes + len(data) > MAX_BYTES_PER_DISTRIBUTION:
                break
            total_bytes += len(data)
            documents.append(Document(f"{name}/{file}", data.decode("utf-8", errors="replace")))
    return documents


def text_file_paths(pattern: str) -> list[str]:
    """Sorted absolute paths of the regular files matching a (recursive) glob."""
    matches = glob.glob(os.path.expanduser(pattern), recursive=True)
    return sorted(os.path.abspath(p) for p in matches if os.path.isfile(p))


def file_set_id(paths: Sequence[str]) -> str:
    """Short hash of a file set (paths, sizes and modification times)."""
    h = hashlib.sha256()
    for path in paths:
        stat = os.stat(path)
        h.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _read_utf8(path: str) -> str:
    """The text of `path`; DataError naming the file (and byte) unless it is readable UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise DataError(f"{path} (matched by data.text_files) cannot be read ({err}): make it "
                        "readable or narrow the data.text_files glob") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path} (matched by data.text_files) is not UTF-8 text: byte {err.start} "
            f"(0x{err.object[err.start]:02x}) cannot be decoded. Narrow the data.text_files glob "
            "to text files, or convert this one to UTF-8 (e.g. iconv -f latin1 -t utf-8)."
        ) from None


def text_file_documents(paths: Sequence[str]) -> list[Document]:
    """One document per file, keyed by its path relative to the files' common directory."""
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    return [Document(os.path.relpath(p, root), _read_utf8(p)) for p in paths]


def _split_hash(key: str) -> float:
    """Uniform number in [0, 1) determined by a document key."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 2**64


def split_documents(documents: Sequence[Document]) -> dict[str, list[Document]]:
    """Deterministic train/validation split by key hash (~2% validation).

    With at least two documents each split gets at least one: if no key hashes below
    VALIDATION_FRACTION, the document with the smallest hash goes to validation; if every key
    does, the one with the largest hash goes to training.
    """
    hashes = [_split_hash(d.key) for d in documents]
    is_val = [h < VALIDATION_FRACTION for h in hashes]
    if len(documents) >= 2:
        if not any(is_val):
            is_val[min(range(len(documents)), key=hashes.__getitem__)] = True
        elif all(is_val):
            is_val[max(range(len(documents)), key=hashes.__getitem__)] = False
    return {
        "train": [d for d, v in zip(documents, is_val, strict=True) if not v],
        "validation": [d for d, v in zip(documents, is_val, strict=True) if v],
    }


def corpus_fingerprint(documents: Sequence[Document]) -> str:
    """sha256 over all (key, text) pairs in key order."""
    h = hashlib.sha256()
    for doc in sorted(documents, key=lambda d: d.key):
        key, text = doc.key.encode(), doc.text.encode()
        h.update(b"%d:%s%d:%s" % (len(key), key, len(text), text))
    return h.hexdigest()
