"""Token sampling: repeat penalty, then top-k, top-p, min-p, temperature, and a seeded draw.

temperature <= 0 is greedy (the first index of the maximum logit). The same seed, prompt and
options give the same tokens.

Sampling is total over validated options: extreme but finite ones (repeat_penalty=1e-300 or
1e300, temperature=1e-300 or 1e300, top_p tiny, min_p=1) always give a token id. The repeat
penalty is applied in float32, as llama.cpp does (the same tokens as before for ordinary values),
and saturates at the float32 range where it overflows; everything after it works in float64, where
differences of such logits stay finite. Logits that are not finite (NaN or inf: a broken model or
file) raise ModelError(NON_FINITE) instead of sampling garbage.

The options are ipc.protocol.SamplingOptions, the wire struct (its checks raise ValueError);
sampling_options(**fields) builds them for in-process callers, a bad value a RequestError.
"""

from __future__ import annotations

import numpy as np

from ipc.protocol import SamplingOptions  # a wire struct: the client library builds it without numpy

from .errors import ModelError, RequestError

NON_FINITE = "the model produced non-finite values"
_LOGIT_LIMIT = np.finfo(np.float32).max  # a penalized logit stays a logit the model could give


def sampling_options(**fields) -> SamplingOptions:
    """SamplingOptions for in-process callers: a bad value is a RequestError (the struct raises
    ValueError, which the wire decoder turns into bad_request)."""
    try:
        return SamplingOptions(**fields)
    except ValueError as e:
        raise RequestError(str(e)) from None


class Sampler:
    def __init__(self, options: SamplingOptions):
        self.options = options
        self.rng = np.random.default_rng(options.seed)

    def sample(self, logits: np.ndarray, history: list[int], mask: np.ndarray | None = None) -> int:
        """logits: [V] f32 for the next token; history: tokens so far (prompt + generated); mask:
        int32 [ceil(V / 32)], the tokens a grammar allows (daemon.grammar), applied after the
        repeat penalty. ModelError(NON_FINITE) when a logit is NaN or infinite."""
        o = self.options
        logits = np.asarray(logits, dtype=np.float32)
        if not np.isfinite(logits).all():
            raise ModelError(NON_FINITE)
        if o.repeat_penalty != 1.0 and o.repeat_last_n and history:
            logits = self._penalized(logits, history)
        if mask is not None:
            from .grammar import apply_mask

            logits = apply_mask(logits, mask)
        if o.temperature <= 0:
            return int(np.argmax(logits))
        return self._draw(logits)

    def _penalized(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """A copy of logits with the recent tokens' logits divided (> 0) or multiplied (< 0) by
        the penalty, in float32; a penalty that rounds to 0 or inf there, or a result past the
        float32 range, saturates at the range's ends (never inf, never NaN: 0 stays 0)."""
        o = self.options
        logits = logits.copy()
        recent = np.unique(np.asarray(history[-o.repeat_last_n:], dtype=np.int64))
        recent = recent[(recent >= 0) & (recent < len(logits))]
        vals = logits[recent]
        with np.errstate(all="ignore"):  # the penalty may round to 0 or inf; then x / 0 and 0 * inf
            penalty = np.float32(o.repeat_penalty)  # arise, in branches np.where does not pick
            penalized = np.where(vals > 0, vals / penalty, np.where(vals < 0, vals * penalty, vals))
        logits[recent] = np.clip(penalized, -_LOGIT_LIMIT, _LOGIT_LIMIT)
        return logits

    def _draw(self, logits: np.ndarray) -> int:
        """top-k, top-p, min-p, temperature, then the seeded draw, in float64. Every logit lies
        in the float32 range, so every difference below is finite; exp() of one is in [0, 1]
        and the best candidate's is exactly 1, so no sum is 0 and no cut leaves nothing."""
        o = self.options
        order = _best_first(logits, o.top_k)  # candidates, best first
        cand = logits[order].astype(np.float64)
        with np.errstate(over="ignore", under="ignore"):  # a tiny temperature: -inf, exp() -> 0
            probs = np.exp(cand - cand[0])
            probs /= probs.sum()
            if o.top_p < 1.0:
                keep = int(np.searchsorted(np.cumsum(probs), o.top_p) + 1)
                order, cand, probs = order[:keep], cand[:keep], probs[:keep]
            if o.min_p > 0:
                keep = probs >= o.min_p * probs[0]  # min_p <= 1: the best candidate always stays
                order, cand = order[keep], cand[keep]
            p = np.exp((cand - cand[0]) / o.temperature)
        p /= p.sum()
        return int(order[self.rng.choice(len(order), p=p)])


def _best_first(logits: np.ndarray, top_k: int) -> np.ndarray:
    """The first top_k indices of the stable descending order (ties: the lower index first); all
    of them when top_k is 0 or >= V. A partial selection finds the k-th largest value, so a token
    costs O(V + k log k), not a sort of the vocabulary (151,936 logits); the same indices in the
    same order as the full sort, so seeded draws do not change."""
    v = len(logits)
    if not 0 < top_k < v:
        return np.argsort(-logits, kind="stable")  # top-p needs the whole order
    thr = np.partition(logits, v - top_k)[v - top_k]  # the k-th largest value
    above = np.flatnonzero(logits > thr)
    ties = np.flatnonzero(logits == thr)[:top_k - len(above)]  # the lowest-indexed ties make k
    idx = np.union1d(above, ties)  # in index order, so the stable sort puts ties by index
    return idx[np.argsort(-logits[idx], kind="stable")]


class StopMatcher:
    """Holds back text that might begin a stop string; reports when one appears.

    feed(text) -> what is safe to emit: on a stop, the text before the stop string that begins
    first (in the held-back text plus `text`), and `stopped` is set; else all but the longest tail
    that begins some stop string. An Aho-Corasick automaton over the stop strings (built once)
    keeps that tail as its state, so a feed costs O(len(text)) amortized, whatever the number of
    stops (a scan of every stop per token stalled every stream of the model: issue 25).
    Characters are code points: the detokenizer never hands over half a UTF-8 character.
    """

    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)  # "" is ignored, as llama.cpp's server does
        self.pending = ""  # held back: always the string of trie node `_state`
        self.stopped = False
        self._state = 0
        self._goto, self._fail, self._depth, self._match = _automaton(self.stops)

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        goto, fail, match = self._goto, self._fail, self._match
        s, first = self._state, None  # first: where the earliest-beginning stop begins
        end = len(self.pending) - len(text)
        for c in text:
            end += 1
            while s and c not in goto[s]:
                s = fail[s]
            s = goto[s].get(c, 0)
            if match[s] and (first is None or end - match[s] < first):
                first = end - match[s]  # the longest stop ending here begins earliest
        if first is not None:
            self.stopped = True
            out, self.pending, self._state = self.pending[:first], "", 0
            return out
        self._state = s
        cut = len(self.pending) - self._depth[s]
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending, self._state = self.pending, "", 0
        return out


def _automaton(stops: tuple[str, ...]) -> tuple[list[dict[str, int]], list[int], list[int], list[int]]:
    """Aho-Corasick over stops (node 0 = the root): goto edges, failure links (the node of the
    longest proper suffix that is also in the trie), depth (the node's string length) and match
    (the length of the longest stop that is a suffix of the node's string; 0 = none)."""
    goto: list[dict[str, int]] = [{}]
    depth, match = [0], [0]
    for stop in stops:
        s = 0
        for c in stop:
            if c not in goto[s]:
                goto[s][c] = len(goto)
                goto.append({})
                depth.append(depth[s] + 1)
                match.append(0)
            s = goto[s][c]
        match[s] = len(stop)
    fail = [0] * len(goto)
    queue = list(goto[0].values())  # breadth first: a node's failure link is shallower than it
    for s in queue:
        for c, t in goto[s].items():
            f = fail[s]
            while f and c not in goto[f]:
                f = fail[f]
            fail[t] = goto[f].get(c, 0)
            match[t] = match[t] or match[fail[t]]
            queue.append(t)
    return goto, fail, depth, match
