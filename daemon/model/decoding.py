"""Decode steps for the serving loop: each sequence's next token, sampled where its logits are.

    decoder = decoder_for(model)         DeviceDecoder when the backend samples on the device,
                                         else HostDecoder
    tokens, errors = decoder.prefill(seqs)   the prompts' pass and each one's first token
    decoder.detach(seq)                  a sequence leaves (no launched step has its row any more)
    pending = decoder.launch(seqs, src, prev)
    tokens, errors = pending.wait()      [S] int32, and the exception of each row that failed

A sequence here is daemon.scheduler.sequence.Sequence: launch reads its `token` (the input, when
the host knows it), `cache`, and `sampler` + `history` (host sampling) or `slot` (device), and
`grammar` (a request's format): its mask goes into the logits before sampling, on either side
(the device's in its slot), and a constrained sequence's steps are not overlapped.

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

WARM_CELLS = (128, 256, 512)  # contexts whose decode graphs are captured at load (a prompt of
#                               64 and 256 tokens generated stays within them)


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

    def __init__(self, model, max_batch: int = 16):
        self.model = model

    def attach(self, seq) -> None:
        pass

    def detach(self, seq) -> None:
        pass

    def warm(self, n_ctx: int, prefill_rows: int = 512) -> int:
        return 0

    def overlaps(self, seqs) -> bool:
        return False

    def prefill(self, seqs) -> tuple[np.ndarray, list]:
        """The prompts of seqs in one pass (alone: the plain forward), each one's first token
        sampled -> (tokens [S], errors)."""
        if len(seqs) == 1:
            logits = self.model.forward(seqs[0].ids, seqs[0].cache)[-1:]
        else:
            logits = self.model.forward_many([s.ids for s in seqs], [s.cache for s in seqs])  # [S, V]
        return _sampled(seqs, logits)

    def launch(self, seqs, src=None, prev=None) -> Done:
        logits = self.model.forward_batch([s.token for s in seqs], [s.cache for s in seqs])  # [S, V]
        return Done(*_sampled(seqs, logits))


def _sampled(seqs, logits: np.ndarray) -> tuple[np.ndarray, list]:
    """Row b of logits [S, V] drawn by seqs[b]'s Sampler -> (tokens [S], errors)."""
    tokens = np.zeros(len(seqs), np.int32)
    errors: list = [None] * len(seqs)
    for b, s in enumerate(seqs):
        try:
            tokens[b] = s.sampler.sample(logits[b], s.history, s.allowed())
        except Exception as e:  # noqa: BLE001 - non-finite logits, or a bug: this row only
            errors[b] = e
    return tokens, errors


class DevicePending:
    """A step in flight: its sampled ids on the device (`tokens`, for the next step's feed) and on
    their way to the host. Rows past S (padding) are dropped."""

    def __init__(self, backend, tokens, flags, S: int):
        self.tokens = tokens
        self.S = S
        self._copy = backend.readback((tokens, flags))

    def wait(self) -> tuple[np.ndarray, list]:
        tokens, flags = self._copy.wait()
        return tokens[:self.S], [ModelError(NON_FINITE) if f else None for f in flags[:self.S]]


class DeferredPending:
    """A step whose layers are launched and whose sampling waits for its grammar masks: issued
    (masks into the slots, then the sampling kernels on the stream) when its tokens are first
    needed, by the next launch (its feed) or by wait. By then the host has accepted the tokens of
    the step before, so each grammar is at this step's position; the GPU meanwhile runs the
    layers, so the masks cost the serving loop no step of its own."""

    def __init__(self, decoder: DeviceDecoder, sample, seqs):
        self.decoder = decoder
        self.seqs = seqs
        self._sample = sample  # () -> (tokens, flags) on the device
        self._pending: DevicePending | None = None

    def issue(self) -> DevicePending:
        if self._pending is None:
            self.decoder._masks(self.seqs)
            out, flags = self._sample()
            self._pending = DevicePending(self.decoder.backend, out, flags, len(self.seqs))
        return self._pending

    @property
    def tokens(self):
        return self.issue().tokens

    def wait(self) -> tuple[np.ndarray, list]:
        return self.issue().wait()


def padded_size(S: int, most: int) -> int:
    """The batch size a step of S sequences runs as: 1, 2, 4, 8, then multiples of 8 (vLLM's
    captured sizes); never past max(S, most)."""
    n = 1 << (S - 1).bit_length() if S <= 8 else -(-S // 8) * 8
    return max(S, min(n, most))


class DeviceDecoder:
    """Sampling in the step, on the device (the backend's `sample` and sampler slots)."""

    overlapping = True

    def __init__(self, model, max_batch: int = 16):
        self.model = model
        self.backend = model.backend
        self.slots = model.backend.sampler_slots()
        self.max_batch = max_batch

    @property
    def pad(self) -> bool:
        """Steps padded to few sizes (padded_size), each a captured graph; not where the host
        reads the routing or the tokens (the expert cache or a trace would count the copies)."""
        return self.model.paddable and self.model.device_fed

    def attach(self, seq) -> None:
        seq.slot = self.slots.assign(seq.options, seq.history, seq.n_ctx, stream=self.backend.stream)

    def detach(self, seq) -> None:
        if seq.slot is not None:
            self.slots.release(seq.slot)  # its grammar mask too
            seq.slot = None

    def _masks(self, seqs) -> None:
        """Each constrained sequence's grammar mask into its slot, before the step samples it (an
        ended one's row is dropped: its grammar may be past its end)."""
        for s in seqs:
            if s.grammar is not None and not s.ended:
                s.grammar.mask_into(self.slots.mask_row(s.slot, s.grammar.words))
                self.slots.push_mask(s.slot, stream=self.backend.stream)

    def warm(self, n_ctx: int, prefill_rows: int = 512, cells: tuple[int, ...] = WARM_CELLS) -> int:
        """Capture now, at load, the decode graphs of every batch size a step runs as (padded:
        1, 2, 4, 8, 16, ...; a model with recurrent layers, which cannot pad, each of
        1..max_batch) for contexts up to each of `cells`, so that the first burst of users does
        not wait for them: each shape runs once eagerly and is then captured. First a prefill
        pass of `prefill_rows` and prefills of 1..16 rows and of 1..max_batch prompts compile what
        they need (a first burst would compile its row and prompt counts' kernels), and the KV
        pool makes room for max_batch sequences. Longer contexts' graphs are captured when first
        met, once: the pool's growth keeps graphs. -> graphs made."""
        cells = tuple(c for c in cells if c < n_ctx)
        if not (cells and self.model.device_fed and getattr(self.backend, "use_graphs", False)):
            return 0
        self._warm_prefills(n_ctx, prefill_rows)
        caches = [self.model.new_cache(max(cells) + 1) for _ in range(self.max_batch)]
        used = caches[:1] if self.pad else caches  # padded steps copy one sequence's row
        for cache in used:
            cache.reserve(max(cells))
        if self.pad:
            steps = [(used, n) for n in sorted({padded_size(S, self.max_batch) for S in range(1, self.max_batch + 1)})]
        else:  # each size its own sequences (a recurrent state is a sequence's alone)
            steps = [(caches[:S], 0) for S in range(1, self.max_batch + 1)]
        self.backend.graphs.keep_at_least(len(cells) * len(steps))
        before = self.backend.graphs.captures
        for c in cells:
            for seqs, n in steps:
                feed = None
                for _ in range(2):  # eager once, then captured (cuda_graphs.GraphCache); fed as in serving
                    for cache in seqs:
                        cache.n_past = max(0, c // 2)  # positions in (c/2, c]: this many cells
                    out, _flags = self.model.decode_sampled([0] * len(seqs), seqs, [-1] * len(seqs), feed, pad=n)
                    feed = (np.zeros(len(seqs), np.int32), out)
        self.backend.stream.synchronize()
        return self.backend.graphs.captures - before

    def _warm_prefills(self, n_ctx: int, prefill_rows: int) -> None:
        """The prefill kernels a serving loop's first passes would compile: one pass as large as
        it makes, and short prompts, whose kernels up to mmvq.MAX_COLS rows are specialized by
        the row count, and whose output rows (one per prompt) by theirs."""
        rows = max(1, min(prefill_rows, n_ctx - 1))
        self.model.forward_many([[0] * rows], [self.model.new_cache(rows)])
        from ..kernels.cuda.mmvq import MAX_COLS  # the GEMV path's most rows (this decoder is CUDA's)

        for t in range(1, MAX_COLS + 1):
            self.model.prefill_sampled([[0] * t], [self.model.new_cache(t)], [-1])
        for k in range(2, self.max_batch + 1):
            self.model.prefill_sampled([[0, 0]] * k, [self.model.new_cache(2) for _ in range(k)], [-1] * k)

    def prefill(self, seqs) -> tuple[np.ndarray, list]:
        """The prompts of seqs in one pass, each one's first token sampled on the device by its
        slot (given here, its history the prompt) -> (tokens [S], errors). Nothing may be in
        flight (a slot's pools may grow)."""
        for s in seqs:
            if s.slot is None:
                self.attach(s)
        self._masks(seqs)
        out, flags = self.model.prefill_sampled([s.ids for s in seqs], [s.cache for s in seqs], [s.slot for s in seqs])
        return DevicePending(self.backend, out, flags, len(seqs)).wait()

    def overlaps(self, seqs) -> bool:
        """Whether the step may be launched before the step in flight is waited for."""
        return self.model.device_fed and not any(s.cache.grows(s.cache.n_past + 1) for s in seqs)

    def launch(self, seqs, src=None, prev=None) -> DevicePending | DeferredPending:
        """A step with a constrained sequence launches its layers now and samples later
        (DeferredPending): its grammar masks need the tokens of the step before, which the host
        accepts while these layers run."""
        S = len(seqs)
        n = padded_size(S, self.max_batch) if self.pad else S
        tokens = [0 if s.token is None else s.token for s in seqs]
        slots = [s.slot for s in seqs]
        if prev is not None and isinstance(prev, DeferredPending):
            prev.issue()  # its sampling reads the logits buffer this step's graph may reuse
        feed = None
        if src is not None and prev is not None and prev.tokens is not None and any(r >= 0 for r in src):
            feed = (np.asarray(src, np.int32), prev.tokens)
        if any(s.grammar is not None for s in seqs):
            sample = self.model.decode_sampled(tokens, [s.cache for s in seqs], slots, feed, pad=n, deferred=True)
            return DeferredPending(self, sample, seqs)
        out, flags = self.model.decode_sampled(tokens, [s.cache for s in seqs], slots, feed, pad=n)
        return DevicePending(self.backend, out, flags, S)


def decoder_for(model, max_batch: int = 16) -> HostDecoder | DeviceDecoder:
    return DeviceDecoder(model, max_batch) if hasattr(getattr(model, "backend", None), "sample") else HostDecoder(model)
