"""The daemon's scheduler: request queue, model registry (load once, keep-alive), continuous
batching on one compute thread per model, the per-sequence token loop.

    scheduler.py   Scheduler: generate/load/unload/ps/stats, the bounded queue (busy)
    models.py      ModelRegistry: one load per file, reference counts, keep-alive, unload, the cap
    access.py      what a peer other than the daemon's user may ask for (readable model files)
    capacity.py    MOED_MAX_LOADED_MODELS' default, the host-memory check before a CPU load
    batcher.py     Batcher: the compute thread; prefill at step boundaries, forward_batch steps
    sequence.py    Sequence: one request's sampler, detokenizer, stop strings, KV cache, counts
"""

from ..errors import SchedulerError
from .batcher import Batcher
from .models import LoadedModel, ModelRegistry
from .scheduler import Scheduler
from .sequence import Sequence

__all__ = ["Batcher", "LoadedModel", "ModelRegistry", "Scheduler", "SchedulerError", "Sequence"]
