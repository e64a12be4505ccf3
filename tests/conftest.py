"""Test session setup: 8 simulated CPU devices, so sharded steps run on a real mesh; with
``--kernel-march=TARGET``, the C++ attention kernel built for that CPU target instead of this
CPU's own (``tests/kernels/test_causal_attention.py`` runs its kernel tests so for every target
the build chooses from that this CPU can run)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_addoption(parser):
    parser.addoption("--kernel-march", default=None,
                     help="the -march the C++ attention kernel is built for in this session")


def pytest_configure(config):
    march = config.getoption("--kernel-march")
    if march:
        from postnorm.kernels.build import register_attention_kernels
        register_attention_kernels(march=march)
