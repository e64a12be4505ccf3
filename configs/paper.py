"""The paper's setup: 48 layers, d=512, d_ff=1536, 4 heads, n=2048, C4 with a 32k vocab.

Point ``data.data_dir`` at a TFDS data_dir holding ``c4/en/3.0.1`` in array_record format
(docs/C4.md; a local disk or a mounted bucket) and ``data.tokenizer_path`` at a SentencePiece
model (e.g. the T5 32k vocab):

    python main.py --config configs/paper.py:data.data_dir=/mnt/tfds,\
data.tokenizer_path=/path/spm32k.model --workdir runs/paper

What is the paper's and what is ours: the paper states the depth, the width, the heads, d_ff,
RMSNorm, SwiGLU, causal attention, C4 and n=2048 (``PAPER``, below). Everything else is our
choice (``OURS``): the vocabulary and tokenizer, tied embeddings (which give ~180M parameters;
untied: ~196M), the optimizer and its learning rate, warmup, schedule and clipping, the batch,
the number of steps and the diagnostics' schedule. The lr x warmup sweep over our choices is
``configs/sweeps/paper.py``.

Variants: ``post``, ``pre``; ``runlocal``, which keeps the width and placement but shrinks
depth, length and batch to train a few steps on a CPU against the embedded corpus; ``width12``
(12 layers, n=512, batch 8 on the embedded corpus), the CPU performance target; and ``width48``,
the paper's depth and width at n=128 and batch 8 with the default config's training recipe
(lr 1e-3, warmup 20, no clipping, 300 steps) on the embedded corpus: the question whether Post-Norm
collapses at the paper's width, answerable on a CPU (docs/RESULTS.md). The CPU variants choose
their attention kernel with ``model.attention=auto`` (the C++ CPU kernel where a compiler
builds it).
"""

import ml_collections

from configs import default
from postnorm.config import apply_arg, base_config

# The paper's own setup.
PAPER = {"model.n_layers": 48, "model.d_model": 512, "model.n_heads": 4, "model.d_ff": 1536,
         "data.source": "c4", "data.seq_len": 2048}
# Our choices where the paper states none.
OURS = {
    "model.tie_embeddings": True,
    "data.tokenizer_path": "spm_t5_32k.model",
    "data.vocab_size": 32128,  # the T5 vocabulary; used by --mode=params without the file
    "data.batch_size": 64, "data.lfreq_sample_docs": 20000,
    "opt.lr": 3e-4, "opt.warmup_steps": 2000, "opt.clip_norm": 1.0,
    "train.steps": 100_000, "train.log_every": 50, "train.eval_every": 2000,
    "train.eval_batches": 16, "train.ckpt_every": 2000,
    # dense early, where a transition window of tens to hundreds of steps must be resolved,
    # sparse later (postnorm.diagnostics.schedule)
    "diag.every": 500, "diag.dense_every": 50, "diag.dense_until": 10_000,
}
# How it is computed, not what: runs everywhere; on CPU the C++ kernel (cpu) is faster, on GPU
# cudnn with bfloat16.
COMPUTE = {"model.attention": "blocked", "model.attention_block": 128, "model.remat": "dots"}


def paper_config() -> ml_collections.ConfigDict:
    c = base_config()
    for path, value in {**PAPER, **OURS, **COMPUTE}.items():
        section, field = path.split(".")
        c[section][field] = value
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


def _width48(c: ml_collections.ConfigDict) -> None:
    """The paper's depth and width at n=128, batch 8, with the default config's training recipe
    (``postnorm/config/fields.py``), logged and diagnosed as the default config is."""
    _on_cpu(c, n_layers=48, seq_len=128, batch_size=8)
    recipe = base_config()
    for section, fields in (("opt", ("lr", "warmup_steps", "clip_norm")),
                            ("train", ("steps", "log_every", "eval_every", "eval_batches",
                                       "ckpt_every"))):
        for field in fields:
            c[section][field] = recipe[section][field]
    c.diag.update(recipe.diag)
    c.model.remat = "none"  # its activations fit in memory at n=128, batch 8


VARIANTS = {**default.VARIANTS, "runlocal": _runlocal, "width12": _width12,
            "width48": _width48}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return apply_arg(paper_config(), arg, VARIANTS)
