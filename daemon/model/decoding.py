"""Decode steps for the serving loop: each sequence's next token, sampled where its logits are.

    decoder = decoder_for(model)         DeviceDecoder when the backend samples on the device,
                                         else HostDecoder
    decoder.attach(seq) / detach(seq)    a sequence joins the decode batch (after its first token) /
                                         leaves it (no launched step has its row any more)
    pending = decoder.launch(seqs, src, prev)
    tokens, errors = pending.wait()      [S] int32, and the exception of each row that failed

A sequence here is daemon.scheduler.sequence.Sequence: launch reads its `token` (the input, when
the host knows it), `cache`, and `sampler` + `history` (host sampling) or `slot` (device).

DeviceDecoder.launch does not wait: the step samples on the device and copies its ids to pinned
host memory, and `src[s] >= 0` feeds sequence s the token that `prev` (the step before, still in
flight) sampled in its row src[s]. That is what lets the serving loop launch step N+1 before it
has seen step N's tokens. `overlaps(seqs)` says when it may: the model must not read the step's
tokens on the host, and no KV pool may grow (a pool grows by copying on another stream).

HostDecoder.launch runs the step and samples each row on the host with the sequence's Sampler;
its pending is complete (the CPU computes in the calling thread).

Legend: S = sequences of the step, V = vocabulary.
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelError
from ..sampling import NON_FINITE


class Done:
    """A launched step whose tokens are known."""

    def __init__(self, tokens: np.ndarray, errors: list):
        self._result = (tokens, errors)
        self.tokens = None  # no device array to feed from: the host has the tokens

    def wait(self) -> tuple[np.ndarray, list]:
        return self._result


class HostDecoder:
    """Logits [S, V] to the host; each row sampled by its sequence's Sampler."""

    overlapping = False

    def __init__(self, model):
        self.model = model

    def attach(self, seq) -> None:
        pass

    def detach(self, seq) -> None:
        pass

    def overlaps(self, seqs) -> bool:
        return False

    def launch(self, seqs, src=None, prev=None) -> Done:
        logits = self.model.forward_batch([s.token for s in seqs], [s.cache for s in seqs])  # [S, V]
        tokens = np.zeros(len(seqs), np.int32)
        errors: list = [None] * len(seqs)
        for b, s in enumerate(seqs):
            try:
                tokens[b] = s.sampler.sample(logits[b], s.history)
            except Exception as e:  # noqa: BLE001 - non-finite logits, or a bug: this row only
                errors[b] = e
        return Done(tokens, errors)


class DevicePending:
    """A step in flight: its sampled ids on the device (`tokens`, for the next step's feed) and on
    their way to the host."""

    def __init__(self, backend, tokens, flags):
        self.tokens = tokens
        self._copy = backend.readback((tokens, flags))

    def wait(self) -> tuple[np.ndarray, list]:
        tokens, flags = self._copy.wait()
        return tokens, [ModelError(NON_FINITE) if f else None for f in flags]


class DeviceDecoder:
    """Sampling in the step, on the device (the backend's `sample` and sampler slots)."""

    overlapping = True

    def __init__(self, model):
        self.model = model
        self.backend = model.backend
        self.slots = model.backend.sampler_slots()

    def attach(self, seq) -> None:
        seq.slot = self.slots.assign(seq.options, seq.history, seq.n_ctx)

    def detach(self, seq) -> None:
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None

    def overlaps(self, seqs) -> bool:
        """Whether the step may be launched before the step in flight is waited for."""
        return self.model.device_fed and not any(s.cache.grows(s.cache.n_past + 1) for s in seqs)

    def launch(self, seqs, src=None, prev=None) -> DevicePending:
        tokens = [0 if s.token is None else s.token for s in seqs]
        feed = None
        if src is not None and prev is not None and prev.tokens is not None and any(r >= 0 for r in src):
            feed = (np.asarray(src, np.int32), prev.tokens)
        out, flags = self.model.decode_sampled(tokens, [s.cache for s in seqs], [s.slot for s in seqs], feed)
        return DevicePending(self.backend, out, flags)


def decoder_for(model) -> HostDecoder | DeviceDecoder:
    return DeviceDecoder(model) if hasattr(model.backend, "sample") else HostDecoder(model)
