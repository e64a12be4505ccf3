"""Every config field, declared once: default (sized for a laptop CPU), help, rule, whether a
resume may change it, and the schema version that added it; a method's options together.

``schema.base_config`` builds the config from these, ``identity`` derives the fields a resume
may change and those each version added, ``postnorm.train.validate`` applies each rule.
"""

from postnorm.config.checks import (
    Check,
    Field,
    Method,
    boolean,
    is_int,
    number,
    one_of,
    one_of_code,
    positive_int,
    text,
)

SECTIONS = ("model", "data", "opt", "train", "diag", "monitor", "runtime", "mesh")
# Sections a resume may change whole, any field of them (how the same model is laid out over the
# devices); their fields are declared ``resumable``.
RESUMABLE_SECTIONS = ("mesh",)

# The schema versions after the first, oldest first: a field's ``added`` names the one that added
# it, with a default that computes what runs recorded before it computed.
VERSIONS = {
    "methods": "the residual/norm arrangements and the architectural methods against collapse",
    "training_methods": "the training-time methods: objective terms, gradient repair, SGD, the "
                        "early warning",
    "dense_diag": "the diagnostic step's dense early phase",
    "placement_two_way": "the adaptive placement's two-way signal (the default keeps the one-way "
                         "signal of the runs recorded before it) and its fixed per-sublayer "
                         "profile",
}

UNIT = number("in [0, 1)")
UNIT_CLOSED = number("in [0, 1]")
UNIT_OPEN_LOW = number("in (0, 1]")
POSITIVE = number("a number > 0")
NONNEGATIVE = number("a number >= 0")

RUN = (
    # the data pipeline's shuffle seeds (seed + epoch) must fit in 32 bits
    Field("seed", 0, "seeds the parameters and the data order",
          Check(lambda v: is_int(v) and 0 <= v < 2**31, "an integer in [0, 2**31)")),
)

MODEL = (
    Field("model.n_layers", 48, "layers", positive_int),
    Field("model.d_model", 64, "width of the residual stream", positive_int),
    Field("model.n_heads", 4, "attention heads", positive_int),
    Field("model.d_ff", 192, "width of the FFN's hidden layer", positive_int),
    Field("model.norm", "post",
          "a residual/norm arrangement of postnorm.model.placements: post | pre | deepnorm | "
          "mixln | sandwich | periln | b2t | adaptive | admin (docs/METHODS.md; admin profiles "
          "its skip weights on the run's first training batch)", one_of_code),
)

# positions, init and how the model is computed; after the methods' model.* options in the config
MODEL_DETAILS = (
    Field("model.positions", "rope", "rope | learned | none", one_of_code),
    Field("model.init", "torch_default",
          "torch_default | normal_0.02 | lecun_normal | xavier (uniform) | xavier_normal "
          "(DeepNet's)", one_of_code),
    Field("model.tie_embeddings", False, "the output projection is the embedding's transpose",
          boolean),
    Field("model.norm_eps", 1e-6, "epsilon of every norm", UNIT),
    Field("model.rope_base", 10000.0, "RoPE's frequency base", number("a number > 1")),
    Field("model.dtype", "float32", "float32 | bfloat16 (compute dtype; params stay float32)",
          one_of_code),
    Field("model.attention", "auto",
          "auto | einsum | blocked | xla | cudnn | cpu (cudnn: GPU, bfloat16 only; cpu: the C++ "
          "CPU kernel, float32, compiled on first use with the system's C++ compiler; auto: "
          "resolved once when the run is built, to the fastest kernel that can run there, and "
          "recorded)", one_of_code, resumable=True),
    Field("model.attention_block", 32, "query rows per block of the blocked kernel",
          positive_int, resumable=True),
    Field("model.remat", "full",
          "none | dots | dots_no_batch | full (what backward keeps per layer)", one_of_code,
          resumable=True),
    Field("model.scan_unroll", 1,
          "layers per iteration of the scanned layer loop; n_layers unrolls it: with remat=none "
          "a faster CPU step, but a longer compile (docs/PERFORMANCE.md)", positive_int,
          resumable=True),
)

# checked by postnorm.data.check_data_config (data.batch_size also against the mesh)
DATA = (
    Field("data.source", "embedded", "embedded | c4 | text_files", None),
    Field("data.data_dir", "~/tensorflow_datasets", "where prepared data is stored", None,
          resumable=True),
    Field("data.text_files", "", "a glob of text files, one document each (source=text_files)",
          None),
    Field("data.c4_version", "3.0.1", "the TFDS version of c4/en (source=c4)", None),
    Field("data.seq_len", 128, "tokens per sequence", None),
    Field("data.batch_size", 16, "sequences per step: global, over all processes and devices",
          positive_int),
    Field("data.tokenizer", "sentencepiece", "sentencepiece | byte", None),
    Field("data.vocab_size", 8192, "the sentencepiece vocabulary trained on the data", None),
    Field("data.tokenizer_path", "", "a trained sentencepiece model to use instead", None),
    Field("data.lfreq_sample_docs", 0,
          "documents sampled for the unigram frequencies (0: all)", None),
)

OPT = (
    Field("opt.optimizer", "adamw",
          "adamw | sgd (SGD with momentum opt.momentum: the control for methods that act on the "
          "gradient's scale, which Adam's normalisation cancels)", one_of_code,
          added="training_methods"),
    Field("opt.momentum", 0.9, "opt.optimizer=sgd: the momentum", UNIT,
          added="training_methods"),
    Field("opt.lr", 1e-3, "the peak learning rate", POSITIVE),
    Field("opt.schedule", "cosine", "cosine | constant (both after linear warmup)",
          one_of("cosine", "constant")),
    Field("opt.warmup_steps", 20, "steps of linear warmup", number("an integer >= 0")),
    Field("opt.min_lr_ratio", 0.1, "cosine: the final learning rate / opt.lr", UNIT_CLOSED),
    Field("opt.b1", 0.9, "Adam's beta1", UNIT),
    Field("opt.b2", 0.95, "Adam's beta2", UNIT),
    Field("opt.eps", 1e-8, "Adam's epsilon", POSITIVE),
    Field("opt.weight_decay", 0.1, "decoupled weight decay", NONNEGATIVE),
    Field("opt.decay_norms_and_embeddings", False,
          "weight decay also on the norms' gains and the embeddings", boolean),
    Field("opt.clip_norm", 0.0, "global-norm clipping; 0 disables",
          number("a number >= 0 (0 disables clipping)")),
)

TRAIN = (
    Field("train.steps", 300, "training steps", positive_int),
    Field("train.log_every", 10, "steps between logged metrics", positive_int, resumable=True),
    Field("train.eval_every", 100, "steps between evaluations", positive_int, resumable=True),
    Field("train.eval_batches", 4, "batches per evaluation", positive_int),
    Field("train.ckpt_every", 100, "steps between checkpoints", positive_int, resumable=True),
    Field("train.keep_ckpts", 3, "checkpoints kept", positive_int, resumable=True),
    Field("train.nonfinite", "abort",
          "abort | skip | rollback: a step with a NaN/Inf loss or gradient", one_of_code,
          resumable=True),
    Field("train.rollback_lr_factor", 0.5, "rollback: the learning rate is multiplied by this",
          number("a number in (0, 1)"), resumable=True),
    Field("train.max_rollbacks", 3, "rollback: after this many, stop as abort does",
          positive_int, resumable=True),
)

DIAG = (
    # diag_step (per-layer statistics) runs at step 1, every `every` steps, and every
    # `dense_every` steps up to step `dense_until` (postnorm.diagnostics.schedule)
    Field("diag.every", 10, "steps between diagnostic steps", positive_int, resumable=True),
    Field("diag.dense_every", 10, "steps between diagnostic steps up to dense_until",
          positive_int, resumable=True, added="dense_diag"),
    Field("diag.dense_until", 0, "the last step of the dense phase (0: no dense phase)",
          number("an integer >= 0 (0: no dense phase)"), resumable=True, added="dense_diag"),
)

RUNTIME = (
    Field("runtime.allocator", "auto",
          "auto | system | tcmalloc: tcmalloc (preloaded by re-executing the command) keeps "
          "XLA's per-call temporaries mapped; auto uses it when the library is installed",
          one_of_code, resumable=True),
    Field("runtime.log_level", "warning",
          "debug | info | warning | error: the level from which other libraries' log records "
          "(orbax's saves, tfds, JAX, clu) reach the console; the project's own lines always do "
          "(postnorm.runtime.console)", one_of_code, resumable=True),
    Field("runtime.compilation_cache_dir", "",
          "a directory for JAX's persistent compilation cache (e.g. ~/.cache/postnorm/jax): runs "
          "whose programs an earlier run compiled load them; '' leaves JAX's setting (none "
          "unless JAX_COMPILATION_CACHE_DIR is set)", text("a directory path, or '' for no cache"),
          resumable=True),
    Field("runtime.xla_options", "xla_cpu_copy_insertion_use_region_analysis=true",
          "XLA compile options for every program, name=value separated by spaces "
          "(postnorm/runtime/xla_options.py); a resume may change them, so put options that "
          "change the arithmetic (fast math) only in a new run. The default lets copy insertion "
          "drop copies around the scanned layer loop: the same numbers, a faster CPU step "
          "(docs/PERFORMANCE.md). '' is XLA's defaults",
          text("a string of XLA compile options (name=value, separated by spaces), or '' for "
               "XLA's defaults"), resumable=True),
)

MESH = (
    Field("mesh.data", -1, "devices along the data axis; -1: all devices not used by fsdp and "
          "tensor", Check(lambda v: is_int(v) and (v >= 1 or v == -1),
                           "an integer >= 1, or -1 to use every remaining device"),
          resumable=True),
    Field("mesh.fsdp", 1, "devices the parameters are sharded over", positive_int,
          resumable=True),
    Field("mesh.tensor", 1, "devices the heads and the FFN are split over", positive_int,
          resumable=True),
)

METHODS = {
    "mixln": Method("Mix-LN: the first layers Post-Norm, the rest Pre-Norm", ("model",), (
        Field("model.mixln_post_fraction", 0.25,
              "model.norm=mixln: the first ceil(fraction * n_layers) layers are Post",
              UNIT_CLOSED, added="methods"),
    )),
    "adaptive": Method(
        "model.norm=adaptive: each sublayer mixes Post- and Pre-Norm by its Post share lambda. "
        "With train.placement_controller, at every diagnostic step (diag.every) lambda of each "
        "sublayer whose signal alarms drops by placement_rate_down and every other lambda rises "
        "by placement_rate_up (postnorm.train.placement_control); else it stays (a fixed "
        "profile)", ("model", "train"), (
            Field("model.adaptive_initial_mix", 1.0,
                  "every sublayer's lambda at init (1: Post-Norm, 0: Pre-Norm)", UNIT_CLOSED,
                  added="methods"),
            Field("model.adaptive_profile", "",
                  "lambda per sublayer at init, one value in [0, 1] per sublayer separated by "
                  "spaces, layer by layer, attention then FFN (2 n_layers values: a run's "
                  "final_post_mix, flattened; postnorm.model.placements.profile_text); '' uses "
                  "adaptive_initial_mix",
                  text("a text of numbers separated by spaces, or ''"),
                  added="placement_two_way"),
            Field("train.placement_controller", True, "lambda moves during training", boolean,
                  added="methods"),
            Field("train.placement_signal", "post_input_c",
                  "post_input_c (one way: the mean contraction c of its Post norm under "
                  "placement_c_min, or its input's tsim over placement_tsim_max; the runs "
                  "recorded before the field) | two_way (its backward gain ||dL/dX_in|| / "
                  "||dL/dX_out|| under placement_gain_min)", one_of_code,
                  added="placement_two_way"),
            Field("train.placement_c_min", 0.9, "post_input_c: alarm under this contraction",
                  UNIT_OPEN_LOW, added="methods"),
            Field("train.placement_tsim_max", 0.9, "post_input_c: alarm over this input tsim",
                  UNIT_OPEN_LOW, added="methods"),
            Field("train.placement_gain_min", 0.9, "two_way: alarm under this backward gain",
                  number("in (0, 1] (a Pre-Norm sublayer's backward gain is about 1)"),
                  added="placement_two_way"),
            Field("train.placement_rate_down", 0.25, "lambda's drop at an alarm", UNIT_CLOSED,
                  added="methods"),
            Field("train.placement_rate_up", 0.02, "lambda's rise without one", UNIT_CLOSED,
                  added="methods"),
        )),
    "b2t": Method("B2T (model.norm=b2t): the bottom-to-top connection", ("model",), (
        Field("model.b2t_rescaled_init", False, "every layer matrix drawn x n_layers^(-1/2)",
              boolean, added="methods"),
    )),
    "qk_norm": Method("QK-norm", ("model",), (
        Field("model.qk_norm", False, "RMSNorm on each head's q and k before the logits",
              boolean, added="methods"),
    )),
    "similarity_init": Method(
        "similarity-aware init: W_O's gain solved so that the mean-field recursion keeps tsim "
        "after every layer at init <= init_tsim_target, for inputs of token similarity "
        "init_tsim_input (postnorm.model.similarity_init)", ("model",), (
            Field("model.init_tsim_target", 0.0, "the bound on tsim at init; 0 disables",
                  number("in [0, 1) (0 disables the similarity-aware init)"), added="methods"),
            Field("model.init_tsim_input", 0.05, "the inputs' token similarity", UNIT,
                  added="methods"),
        )),
    "residual_budget": Method(
        "residual-norm budgeting: keep the RMSNorm contraction c >= residual_budget_c at every "
        "sublayer", ("model",), (
            Field("model.residual_budget", "none",
                  "none | scale (an in-graph branch scale) | penalty (a hinge penalty on the "
                  "objective, weighted by residual_budget_weight)", one_of_code,
                  added="methods"),
            Field("model.residual_budget_c", 0.9, "the least contraction c", UNIT_OPEN_LOW,
                  added="methods"),
            Field("model.residual_budget_weight", 1.0, "penalty: the hinge's weight",
                  NONNEGATIVE, added="methods"),
        )),
    "grad_repair": Method(
        "gradient repair: backward, the signal reaching every residual norm's input is "
        "multiplied per token by min(1/c, grad_repair_max^(1/(2 n_layers))) where c < "
        "grad_repair_threshold, so the factors over the stack multiply to at most "
        "grad_repair_max (postnorm.model.repair)", ("train",), (
            Field("train.grad_repair", False, "repair on", boolean, added="training_methods"),
            Field("train.grad_repair_max", 1e4, "the most the factors multiply to",
                  number("a number >= 1 (the most the factors may multiply to over the stack)"),
                  added="training_methods"),
            Field("train.grad_repair_threshold", 1.0, "the contraction under which it repairs",
                  number("in (0, 1] (the contraction c under which a token is repaired)"),
                  added="training_methods"),
        )),
    "z_loss": Method("the z-loss", ("opt",), (
        Field("opt.z_loss", 0.0, "weight of mean(log Z^2), Z the softmax normaliser; 0 disables",
              number("a number >= 0 (0 disables it)"), added="training_methods"),
    )),
    "frequency_loss": Method(
        "the frequency-loss regulariser: the objective is CE - diversity_weight * min(D, "
        "diversity_cap), D the position diversity of the predictions (postnorm.train.losses)",
        ("opt",), (
            Field("opt.diversity_weight", 0.0, "0 disables",
                  number("a number >= 0 (0 disables it)"), added="training_methods"),
            Field("opt.diversity_cap", 1.0, "the diversity past which it stops rewarding",
                  POSITIVE, added="training_methods"),
        )),
    "early_warning": Method(
        "the collapse early-warning monitor (postnorm.diagnostics.early_warning), at every "
        "diagnostic step, with the collapse rule's thresholds: watch when a layer's tsim reaches "
        "0.99; warn when >= half the layers have for warn_persistence diagnostic steps in a row "
        "and the loss is within warn_loss_rtol of its batches' frequency floor", ("monitor",), (
            Field("monitor.warn_persistence", 3, "diagnostic steps in a row", positive_int,
                  added="training_methods"),
            Field("monitor.warn_loss_rtol", 0.25, "the loss's relative distance to the floor",
                  POSITIVE, added="training_methods"),
            Field("monitor.action", "none",
                  "what a new warn does: none | lr_scale (the learning rate x lr_factor) | "
                  "layer_lr (the layers at tsim >= 0.99: their learning rate x layer_lr_factor) "
                  "| clip (global-norm clipping at clip_norm from then on, x clip_factor at each "
                  "later action)", one_of_code, added="training_methods"),
            Field("monitor.rollback", False, "the run first returns to its last checkpoint "
                  "before the warn (step 0 if none)", boolean, added="training_methods"),
            Field("monitor.max_actions", 3, "actions per run at most", positive_int,
                  added="training_methods"),
            Field("monitor.lr_factor", 0.5, "lr_scale's factor", UNIT_OPEN_LOW,
                  added="training_methods"),
            Field("monitor.layer_lr_factor", 0.5, "layer_lr's factor", POSITIVE,
                  added="training_methods"),
            Field("monitor.clip_norm", 1.0, "clip's first norm", POSITIVE,
                  added="training_methods"),
            Field("monitor.clip_factor", 0.5, "clip's factor at each later action",
                  UNIT_OPEN_LOW, added="training_methods"),
        )),
}


def _config_order(declared: tuple[Field, ...]) -> tuple[Field, ...]:
    """Top-level fields, then each section's in ``SECTIONS`` order, each in declared order."""
    rank = {"": 0, **{s: i + 1 for i, s in enumerate(SECTIONS)}}
    return tuple(sorted(declared, key=lambda f: rank[f.section]))  # sorted() is stable


FIELDS = _config_order((*RUN, *MODEL, *DATA, *OPT, *TRAIN, *DIAG, *RUNTIME, *MESH,
                        *(f for method in METHODS.values() for f in method.options),
                        *MODEL_DETAILS))
DEFAULTS = {f.path: f.default for f in FIELDS}
