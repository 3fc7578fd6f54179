"""Execution backends: the operations model code runs (base.Backend), per-step row grouping
(step.Step), per-layer caches (cache.py), and the CPU backend (cpu.py)."""

from .base import Backend
from .cache import LayerCache, SequenceCache
from .cpu import CPUBackend
from .step import Step

__all__ = ["Backend", "CPUBackend", "LayerCache", "SequenceCache", "Step"]
