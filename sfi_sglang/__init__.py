"""Slow-Fast Inference for SGLang.

Kept import-light: `sfi_sglang._startup` runs in every Python process of the
environment, and importing this package must not pull in torch or SGLang.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "Engine":
        from sfi_sglang.engine import Engine

        return Engine
    if name == "SFIConfig":
        from sfi_sglang.method.config import SFIConfig

        return SFIConfig
    raise AttributeError(f"module 'sfi_sglang' has no attribute {name!r}")
