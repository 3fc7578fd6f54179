"""moed: a local runner for Mixture-of-Experts GGUF models."""

from .errors import ConfigError, GGUFError, ModelError, MoedError, RequestError, UnsupportedError

__all__ = ["Engine", "MoedError", "ConfigError", "ModelError", "GGUFError", "UnsupportedError", "RequestError"]


def __getattr__(name):  # Engine imports numba kernels: load them on first use only
    if name == "Engine":
        from .engine import Engine
        return Engine
    raise AttributeError(name)
