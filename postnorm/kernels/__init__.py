"""Hand-written kernels XLA calls through its FFI: the CPU causal attention of
``model.attention='cpu'`` (``causal_attention.py``), compiled by ``build.py``."""
