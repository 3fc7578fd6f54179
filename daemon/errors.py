"""The exception tree of moed. Every error moed raises on purpose is a MoedError.

    MoedError
    ├── ConfigError            a setting or environment variable has a bad value
    ├── ModelError             the model cannot be used
    │   ├── GGUFError          the file is not a well-formed GGUF (names what is wrong)
    │   ├── UnsupportedError   well-formed, but an architecture / quant type / feature moed lacks
    │   ├── StorageError       expert bytes could not be read (file truncated, I/O error)
    │   │   └── ModelFileChanged   the model file changed on disk while loaded (the model unloads)
    │   └── DeviceError        the GPU failed: no usable device, out of memory, a CUDA error
    ├── RequestError           a bad request: prompt, token ids, sampling options, a replay trace
    │                          that is no regular file or too large
    ├── SynthError             `moed synth` cannot write the model (bad option, no space, bad path)
    └── SchedulerError         the daemon cannot serve a request now; `.code` says why (busy,
                               not_found, forbidden, shutdown, ...)

MoedError itself is raised where no subclass fits: the daemon's log file is unsafe (logfile.py).

wire_error(exc) is the one mapping from an exception to the (code, message) of the Error reply
that ends a request (ipc.protocol, "Error codes"): SchedulerError its own code, RequestError and
ConfigError "bad_request", any other MoedError "model_error", anything else "internal" (a bug).
"""


class MoedError(Exception):
    """Base of every error moed raises deliberately."""


class ConfigError(MoedError):
    """A setting or environment variable has a value moed cannot use."""


class ModelError(MoedError):
    """The model cannot be loaded or run."""


class GGUFError(ModelError):
    """The file is not a well-formed GGUF file; the message names the offending field."""


class UnsupportedError(ModelError):
    """The file is valid but uses an architecture, quant type or feature moed does not support."""


class StorageError(ModelError):
    """Expert weights could not be read from disk: the file was truncated, removed or gave an I/O
    error. The request that needed them fails; the engine stays usable."""


class ModelFileChanged(StorageError):
    """The model file was truncated, replaced or rewritten while it was loaded (its size, mtime or
    inode differ from what was loaded, or, after its ctime moved, its sampled content: see
    storage/identity.py). The request fails and the model is unloaded: its weights can no longer
    be trusted to match what was validated."""


class DeviceError(ModelError):
    """The GPU cannot be used or failed: MOE_DEVICE names a device that is not usable, the model
    does not fit in its memory, or a CUDA call failed during a request (that request fails; the
    engine stays usable unless the error poisoned the device context)."""


class RequestError(MoedError):
    """A request is malformed: bad tokens, empty prompt, sampling options out of range."""


class SynthError(MoedError):
    """`moed synth` cannot write the model: an unknown preset or bad option, too little free disk
    space, or a path it cannot write. No partial file is left behind."""


class SchedulerError(MoedError):
    """A request cannot be served; `code` is the wire error code (ipc.protocol "Error codes")."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def wire_error(e: BaseException) -> tuple[str, str]:
    """(code, message) of the Error reply for a request that failed because of e."""
    if isinstance(e, SchedulerError):
        return e.code, str(e)
    if isinstance(e, (RequestError, ConfigError)):
        return "bad_request", str(e)
    if isinstance(e, MoedError):
        return "model_error", str(e)
    return "internal", f"{type(e).__name__}: {e}"
