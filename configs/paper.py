"""The paper's setup: 48 layers, d=512, d_ff=1536, 4 heads, n=2048, C4 with a 32k vocab.

Point ``data.data_dir`` at a TFDS data_dir holding ``c4/en/3.0.1`` in array_record format
(docs/C4.md; a local disk or a mounted bucket) and ``data.tokenizer_path`` at a SentencePiece
model (e.g. the T5 32k vocab):

    python main.py --config configs/paper.py:data.data_dir=/mnt/tfds,\
data.tokenizer_path=/path/spm32k.model --workdir runs/paper

Embeddings are tied, which gives the ~180M parameters of the paper (untied: ~196M).
Variants: ``post``, ``pre``; ``runlocal``, which keeps the width and placement but shrinks
depth, length and batch to train a few steps on a CPU against the embedded corpus; and
``width12`` (12 layers, n=512, batch 8 on the embedded corpus), the CPU performance target;
both CPU variants choose their attention kernel with ``model.attention=auto`` (the C++ CPU kernel
where a compiler builds it).
"""

import ml_collections

from configs import default
from postnorm.config import apply_arg, base_config


def paper_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model.n_layers = 48
    c.model.d_model = 512
    c.model.n_heads = 4
    c.model.d_ff = 1536
    c.model.tie_embeddings = True
    # runs everywhere; on CPU the C++ kernel (cpu) is faster, on GPU cudnn with bfloat16
    c.model.attention = "blocked"
    c.model.attention_block = 128
    c.model.remat = "dots"

    c.data.source = "c4"
    c.data.seq_len = 2048
    c.data.batch_size = 64
    c.data.tokenizer_path = "spm_t5_32k.model"
    c.data.vocab_size = 32128  # the T5 vocabulary; used by --mode=params without the file
    c.data.lfreq_sample_docs = 20000

    c.opt.lr = 3e-4
    c.opt.warmup_steps = 2000
    c.opt.clip_norm = 1.0

    c.train.steps = 100_000
    c.train.log_every = 50
    c.train.eval_every = 2000
    c.train.eval_batches = 16
    c.train.ckpt_every = 2000
    c.diag.every = 500
    return c


def _on_cpu(c: ml_collections.ConfigDict, *, n_layers: int, seq_len: int,
            batch_size: int) -> None:
    """The paper's width, shrunk in depth, length and batch, on the embedded corpus, with the
    attention kernel ``auto`` chooses on the CPU (docs/PERFORMANCE.md)."""
    c.model.n_layers = n_layers
    c.model.attention = "auto"
    c.data.source = "embedded"
    c.data.tokenizer_path = ""
    c.data.vocab_size = 8192
    c.data.lfreq_sample_docs = 0
    c.data.seq_len = seq_len
    c.data.batch_size = batch_size


def _runlocal(c: ml_collections.ConfigDict) -> None:
    _on_cpu(c, n_layers=4, seq_len=128, batch_size=4)
    c.opt.warmup_steps = 2
    c.train.steps = 5
    c.train.log_every = 1
    c.train.eval_every = 5
    c.train.eval_batches = 1
    c.train.ckpt_every = 5
    c.diag.every = 2


def _width12(c: ml_collections.ConfigDict) -> None:
    """The CPU performance target: 12 layers, n=512, batch 8."""
    _on_cpu(c, n_layers=12, seq_len=512, batch_size=8)


VARIANTS = {**default.VARIANTS, "runlocal": _runlocal, "width12": _width12}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return apply_arg(paper_config(), arg, VARIANTS)
