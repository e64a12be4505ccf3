"""The config schema: every field the trainer reads, with its default (sized for a laptop CPU)."""

import difflib

import ml_collections

from postnorm.config.identity import config_data, flatten_fields
from postnorm.errors import UserError

SECTIONS = ("model", "data", "opt", "train", "diag", "monitor", "runtime", "mesh")


class ConfigError(UserError, ValueError):
    """An invalid config field; the message names the field and the allowed values."""


def base_config() -> ml_collections.ConfigDict:
    """Every field the trainer reads, with CPU-sized defaults."""
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.n_layers = 48
    c.model.d_model = 64
    c.model.n_heads = 4
    c.model.d_ff = 192
    # a residual/norm arrangement of postnorm.model.placements: post | pre | deepnorm | mixln |
    # sandwich | periln | b2t | adaptive | admin (docs/METHODS.md; admin profiles its skip
    # weights on the run's first training batch)
    c.model.norm = "post"
    c.model.mixln_post_fraction = 0.25  # mixln: the first ceil(fraction * n_layers) are Post
    # adaptive: every sublayer's Post-Norm share lambda at init (1: Post-Norm, 0: Pre-Norm); with
    # train.placement_controller it then moves, else it stays (a fixed profile)
    c.model.adaptive_initial_mix = 1.0
    # adaptive: lambda per sublayer at init, one value in [0, 1] per sublayer separated by
    # spaces, layer by layer, attention then FFN (2 n_layers values: a run's final_post_mix,
    # flattened; postnorm.model.placements.profile_text); '' uses adaptive_initial_mix
    c.model.adaptive_profile = ""
    c.model.b2t_rescaled_init = False  # b2t: every layer matrix drawn x n_layers^(-1/2)
    c.model.qk_norm = False  # RMSNorm on each head's q and k before the logits
    # similarity-aware init: W_O's gain solved so that the mean-field recursion keeps tsim after
    # every layer at init <= this target, for inputs of token similarity init_tsim_input
    # (postnorm.model.similarity_init); 0 disables
    c.model.init_tsim_target = 0.0
    c.model.init_tsim_input = 0.05
    # residual-norm budgeting: keep the RMSNorm contraction c >= residual_budget_c at every
    # sublayer, by an in-graph branch scale (scale) or a hinge penalty on the objective (penalty,
    # weighted by residual_budget_weight); none disables
    c.model.residual_budget = "none"
    c.model.residual_budget_c = 0.9
    c.model.residual_budget_weight = 1.0
    c.model.positions = "rope"  # rope | learned | none
    # torch_default | normal_0.02 | lecun_normal | xavier (uniform) | xavier_normal (DeepNet's)
    c.model.init = "torch_default"
    c.model.tie_embeddings = False
    c.model.norm_eps = 1e-6
    c.model.rope_base = 10000.0
    c.model.dtype = "float32"  # float32 | bfloat16 (compute dtype; params stay float32)
    # auto | einsum | blocked | xla | cudnn | cpu (cudnn: GPU, bfloat16 only; cpu: the C++ CPU
    # kernel, float32, compiled on first use with the system's C++ compiler; auto: resolved once
    # when the run is built, to the fastest kernel that can run there, and recorded)
    c.model.attention = "auto"
    c.model.attention_block = 32  # query rows per block of the blocked kernel
    c.model.remat = "full"  # none | dots | dots_no_batch | full (what backward keeps per layer)
    # layers per iteration of the scanned layer loop; n_layers unrolls the loop: with remat=none
    # the fastest train step measured for this config on CPU, but a 3-7x longer compile
    # (docs/PERFORMANCE.md)
    c.model.scan_unroll = 1

    c.data = ml_collections.ConfigDict()
    c.data.source = "embedded"  # embedded | c4 | text_files
    c.data.data_dir = "~/tensorflow_datasets"
    c.data.text_files = ""
    c.data.c4_version = "3.0.1"
    c.data.seq_len = 128
    c.data.batch_size = 16  # global, over all processes and devices
    c.data.tokenizer = "sentencepiece"  # sentencepiece | byte
    c.data.vocab_size = 8192
    c.data.tokenizer_path = ""
    c.data.lfreq_sample_docs = 0

    c.opt = ml_collections.ConfigDict()
    # adamw | sgd (SGD with momentum opt.momentum: the control for methods that act on the
    # gradient's scale, which Adam's normalisation cancels)
    c.opt.optimizer = "adamw"
    c.opt.momentum = 0.9
    c.opt.lr = 1e-3
    c.opt.schedule = "cosine"  # cosine | constant (both after linear warmup)
    c.opt.warmup_steps = 20
    c.opt.min_lr_ratio = 0.1
    c.opt.b1 = 0.9
    c.opt.b2 = 0.95
    c.opt.eps = 1e-8
    c.opt.weight_decay = 0.1
    c.opt.decay_norms_and_embeddings = False
    c.opt.clip_norm = 0.0  # 0 disables global-norm clipping
    c.opt.z_loss = 0.0  # weight of mean(log Z^2), Z the softmax normaliser; 0 disables
    # the frequency-loss regulariser: the objective is CE - diversity_weight * min(D,
    # diversity_cap), D the position diversity of the predictions (postnorm.train.losses); 0
    # disables
    c.opt.diversity_weight = 0.0
    c.opt.diversity_cap = 1.0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 300
    c.train.log_every = 10
    c.train.eval_every = 100
    c.train.eval_batches = 4
    c.train.ckpt_every = 100
    c.train.keep_ckpts = 3
    c.train.nonfinite = "abort"  # abort | skip | rollback: a step with a NaN/Inf loss or gradient
    c.train.rollback_lr_factor = 0.5  # rollback: the learning rate is multiplied by this
    c.train.max_rollbacks = 3  # rollback: after this many, stop as abort does
    # model.norm=adaptive: at every diagnostic step (diag.every) lambda of each sublayer whose
    # signal alarms drops by placement_rate_down; every other lambda rises by placement_rate_up
    # (postnorm.train.placement_control). placement_signal: post_input_c (one way: the mean
    # contraction c of its Post norm under placement_c_min, or its input's tsim over
    # placement_tsim_max; the runs recorded before the field) | two_way (its backward gain
    # ||dL/dX_in|| / ||dL/dX_out|| under placement_gain_min)
    c.train.placement_controller = True
    c.train.placement_signal = "post_input_c"
    c.train.placement_c_min = 0.9
    c.train.placement_tsim_max = 0.9
    c.train.placement_gain_min = 0.9
    c.train.placement_rate_down = 0.25
    c.train.placement_rate_up = 0.02
    # gradient repair: backward, the signal reaching every residual norm's input is multiplied
    # per token by min(1/c, grad_repair_max^(1/(2 n_layers))) where c < grad_repair_threshold,
    # so the factors over the stack multiply to at most grad_repair_max (postnorm.model.repair)
    c.train.grad_repair = False
    c.train.grad_repair_max = 1e4
    c.train.grad_repair_threshold = 1.0

    c.diag = ml_collections.ConfigDict()
    # diag_step (per-layer statistics) runs at step 1, every `every` steps, and every
    # `dense_every` steps up to step `dense_until` (0: no dense phase;
    # postnorm.diagnostics.schedule)
    c.diag.every = 10
    c.diag.dense_every = 10
    c.diag.dense_until = 0

    # the collapse early-warning monitor (postnorm.diagnostics.early_warning), at every
    # diagnostic step, with the collapse rule's thresholds: watch when a layer's tsim reaches
    # 0.99; warn when >= half the layers have for warn_persistence diagnostic steps in a row and
    # the loss is within warn_loss_rtol of its batches' frequency floor
    c.monitor = ml_collections.ConfigDict()
    c.monitor.warn_persistence = 3
    c.monitor.warn_loss_rtol = 0.25
    # what a new warn does: none | lr_scale (the learning rate x lr_factor) | layer_lr (the
    # layers at tsim >= 0.99: their learning rate x layer_lr_factor) | clip (global-norm clipping
    # at clip_norm from then on, x clip_factor at each later action); with rollback, the run
    # first returns to its last checkpoint before the warn (step 0 if none). At most
    # max_actions times per run
    c.monitor.action = "none"
    c.monitor.rollback = False
    c.monitor.max_actions = 3
    c.monitor.lr_factor = 0.5
    c.monitor.layer_lr_factor = 0.5
    c.monitor.clip_norm = 1.0
    c.monitor.clip_factor = 0.5

    c.runtime = ml_collections.ConfigDict()
    # auto | system | tcmalloc: tcmalloc (preloaded by re-executing the command) keeps XLA's
    # per-call temporaries mapped; auto uses it when the library is installed
    c.runtime.allocator = "auto"
    # debug | info | warning | error: the level from which other libraries' log records (orbax's
    # saves, tfds, JAX, clu) reach the console; the project's own lines always do
    # (postnorm.runtime.console)
    c.runtime.log_level = "warning"
    # a directory for JAX's persistent compilation cache (e.g. ~/.cache/postnorm/jax): runs whose
    # programs an earlier run compiled (resumes, re-runs, other seeds' steps) load them; '' leaves
    # JAX's setting (none unless JAX_COMPILATION_CACHE_DIR is set)
    c.runtime.compilation_cache_dir = ""
    # XLA compile options for every program, name=value separated by spaces
    # (postnorm/runtime/xla_options.py): how programs are compiled, which a resume may change like
    # runtime.*, so put options that change the arithmetic (fast math) only in a new run. The
    # default's region analysis lets copy insertion drop copies around the scanned layer loop:
    # the same numbers, a faster CPU step (docs/PERFORMANCE.md). '' is XLA's defaults
    c.runtime.xla_options = "xla_cpu_copy_insertion_use_region_analysis=true"

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: all devices not used by fsdp and tensor
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    return c


def check_fields(config: ml_collections.ConfigDict) -> None:
    """Every field is one the trainer reads: those of ``base_config()`` (a misspelt field would
    otherwise be ignored, and its default used)."""
    known = flatten_fields(config_data(base_config()))
    unknown = [k for k in flatten_fields(config_data(config)) if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown config field {unknown[0]}{hint}: the fields are those of "
                          "postnorm/config/schema.py's base_config(); rename or remove it"
                          + (f" (also unknown: {', '.join(unknown[1:])})" if unknown[1:] else ""))
