"""Which attention kernel can run where, and ``model.attention=auto``'s choice among them."""

from postnorm.kernels.build import KernelBuildError, register_attention_kernels
from postnorm.kernels.causal_attention import HEAD_DIMS

AUTO = "auto"
# What to set instead of a kernel that cannot run.
ALTERNATIVES = {"cpu": "model.attention=auto or blocked", "cudnn": "model.attention=auto or xla"}


def config_refusal(kernel: str, *, dtype: str, d_model: int, n_heads: int) -> str | None:
    """Why ``kernel`` cannot compute this model's attention (its dtype or head dim); None
    when it can."""
    head_dim = d_model // n_heads
    if kernel == "cpu" and dtype != "float32":
        return f"model.attention='cpu' computes in float32, but model.dtype={dtype!r}"
    if kernel == "cpu" and head_dim > HEAD_DIMS[-1]:
        return (f"model.attention='cpu' takes head dims up to {HEAD_DIMS[-1]}, but "
                f"model.d_model/model.n_heads = {d_model}/{n_heads} = {head_dim}")
    if kernel == "cudnn" and dtype != "bfloat16":
        return ("model.attention='cudnn' needs model.dtype='bfloat16' (cuDNN attention has no "
                "float32 kernel)")
    return None


def backend_refusal(kernel: str, *, platform: str) -> str | None:
    """Why ``kernel`` cannot run on ``platform`` (``jax.default_backend()``); None when it can."""
    if kernel == "cpu" and platform != "cpu":
        return f"model.attention='cpu' is a CPU kernel, but JAX runs on {platform!r}"
    if kernel == "cudnn" and platform != "gpu":
        return f"model.attention='cudnn' needs a GPU, but JAX runs on {platform!r}"
    return None


def unrunnable(kernel: str, *, dtype: str, d_model: int, n_heads: int,
               platform: str) -> str | None:
    """Why ``kernel`` cannot run here; None when it can. The C++ kernel is built to find out."""
    why = (config_refusal(kernel, dtype=dtype, d_model=d_model, n_heads=n_heads)
           or backend_refusal(kernel, platform=platform))
    if why is None and kernel == "cpu":
        try:
            register_attention_kernels()
        except KernelBuildError as err:
            why = f"the C++ CPU kernel cannot be built here ({err})"
    return why


def choose_attention(*, dtype: str, d_model: int, n_heads: int, platform: str,
                     recorded: str | None = None) -> tuple[str, str]:
    """(kernel, why) for ``model.attention=auto`` on ``platform``.

    ``recorded`` (the kernel a resumed run started with) wins where it can run. Otherwise: on
    the CPU the C++ kernel (``cpu``) where it can run, else ``blocked``; on a GPU cuDNN's fused
    kernel in bfloat16, else ``blocked``; elsewhere ``blocked``, which XLA compiles everywhere
    and which skips the masked half of the score blocks.
    """
    model = {"dtype": dtype, "d_model": d_model, "n_heads": n_heads, "platform": platform}
    before = ""
    if recorded not in (None, AUTO):
        why_not = unrunnable(recorded, **model)
        if why_not is None:
            return recorded, "the kernel the run started with (its config.json)"
        before = f"the run started with {recorded!r}, which cannot run here ({why_not}); "
    if platform == "cpu":
        why_not = unrunnable("cpu", **model)
        if why_not is None:
            return "cpu", before + "the C++ CPU kernel, built for this CPU"
        return "blocked", before + why_not
    if unrunnable("cudnn", **model) is None:
        return "cudnn", before + "cuDNN's fused attention on a GPU in bfloat16"
    return "blocked", before + f"the blocked XLA kernel on {platform!r} in {dtype}"
