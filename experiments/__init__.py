"""One script per paper figure or table; each is importable and runs with ``python -m``."""
