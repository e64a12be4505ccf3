"""TFDS builders that prepare text corpora as array_record: the embedded corpus and text files.

Both store one example per document with features `text` and `key` (the document's relative
path), split train/validation by key hash, and record the corpus sha256 fingerprint, its size
and provenance in the dataset metadata (metadata.json beside the prepared shards).
"""

import abc
import dataclasses
import hashlib
import json
import types
from collections.abc import Iterator, Sequence
from pathlib import Path

import tensorflow_datasets as tfds

from postnorm.data import corpus

FILE_FORMAT = "array_record"


class _CorpusBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Prepares `documents()` as train/validation splits."""

    # Bump when the document or split logic changes, so prepared datasets are rebuilt.
    VERSION = tfds.core.Version("1.0.0")
    DESCRIPTION = ""
    # No dataset code directory: nothing is downloaded, so there are no URL checksums to find.
    code_path = None

    @abc.abstractmethod
    def documents(self) -> tuple[list[corpus.Document], dict]:
        """The corpus documents and provenance metadata to record."""

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.DESCRIPTION,
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "key": tfds.features.Text()}
            ),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        del dl_manager  # Nothing is downloaded.
        documents, provenance = self.documents()
        splits = corpus.split_documents(documents)
        self.info.metadata.update(
            fingerprint=corpus.corpus_fingerprint(documents),
            corpus_bytes=sum(len(d.text.encode("utf-8")) for d in documents),
            num_documents={name: len(docs) for name, docs in splits.items()},
            **provenance,
        )
        return {name: self._generate_examples(docs) for name, docs in splits.items()}

    def _generate_examples(self, documents: Sequence[corpus.Document]) -> Iterator:
        for doc in documents:
            yield doc.key, {"text": doc.text, "key": doc.key}


class EmbeddedCorpus(_CorpusBuilder, skip_registration=True):
    """Python sources of the pinned pure-Python distributions listed in `corpus`."""

    name = "postnorm_embedded"
    DESCRIPTION = (
        "The .py files (code, docstrings, comments) of "
        + ", ".join(corpus.EMBEDDED_DISTRIBUTIONS)
        + f", at most {corpus.MAX_BYTES_PER_DISTRIBUTION} bytes per distribution in sorted "
        "path order; one document per file."
    )

    def documents(self) -> tuple[list[corpus.Document], dict]:
        return corpus.embedded_documents(), {"distributions": corpus.embedded_versions()}


class TextFilesCorpus(_CorpusBuilder, skip_registration=True):
    """Local text files, one document per file."""

    name = "postnorm_text_files"
    DESCRIPTION = "Local text files; one document per file."

    def __init__(self, *, paths: Sequence[str], **kwargs):
        self.paths = tuple(paths)
        super().__init__(**kwargs)

    def documents(self) -> tuple[list[corpus.Document], dict]:
        return corpus.text_file_documents(self.paths), {"paths": list(self.paths)}


def embedded_config() -> tfds.core.BuilderConfig:
    """The embedded corpus's config. Its name hashes the installed versions and the corpus
    definition, so a different install or selection never reuses another corpus."""
    versions = corpus.embedded_versions()
    corpus.warn_unpinned(versions)
    definition = {
        "installed": {name: v["installed"] for name, v in versions.items()},
        "max_bytes_per_distribution": corpus.MAX_BYTES_PER_DISTRIBUTION,
        "validation_fraction": corpus.VALIDATION_FRACTION,
    }
    digest = hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()[:12]
    return tfds.core.BuilderConfig(name=f"dists_{digest}")


def text_files_config(paths: Sequence[str]) -> tfds.core.BuilderConfig:
    """A file set's config; its name hashes the paths, sizes and mtimes."""
    return tfds.core.BuilderConfig(name=f"files_{corpus.file_set_id(paths)}")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """An embedded or text-files corpus chosen by the config: its builder class and config."""

    builder_class: type[_CorpusBuilder]
    config: tfds.core.BuilderConfig
    paths: tuple[str, ...] = ()  # the text files

    def prepared_dir(self, data_dir: str) -> Path:
        """Where it is prepared under ``data_dir``."""
        return (Path(data_dir) / self.builder_class.name / self.config.name
                / str(_CorpusBuilder.VERSION))

    def builder(self, data_dir: str) -> _CorpusBuilder:
        """Its builder over ``data_dir`` (reading what is prepared there), of a subclass that
        lists the config, which tfds otherwise logs as a custom one on every load."""
        kwargs = {"paths": self.paths} if self.builder_class is TextFilesCorpus else {}
        listed = types.new_class(self.builder_class.__name__, (self.builder_class,),
                                 {"skip_registration": True},
                                 lambda ns: ns.update(name=self.builder_class.name,
                                                      BUILDER_CONFIGS=[self.config]))
        return listed(data_dir=data_dir, config=self.config.name, file_format=FILE_FORMAT,
                      **kwargs)


def choose_corpus(source: str, text_files: str) -> Corpus:
    """The corpus of ``data.source`` ('embedded' or 'text_files', with its glob)."""
    if source == "embedded":
        return Corpus(EmbeddedCorpus, embedded_config())
    paths = tuple(corpus.text_file_paths(text_files))
    return Corpus(TextFilesCorpus, text_files_config(paths), paths)
