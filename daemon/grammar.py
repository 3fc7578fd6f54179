"""Structured output: a grammar that masks the tokens a sequence may sample next (issue 29, item 5).

    compile_format(format, tokenizer) -> Grammar   "json" (any JSON object), a JSON schema (its
                                                   text), or "lark:" and a Lark grammar, compiled
                                                   once per request by llguidance
    tool_call_format(tools, name) -> format        the reply as one <tool_call> of these tools
    g = grammar.matcher()      one sequence's state
    g.mask()   -> int32 [W]    bit t % 32 of word t // 32 set: token t may come next (W = ceil(V / 32))
    g.consume(token)           the sampled token advances the state
    apply_mask(logits, mask)   logits [V] with every token the mask forbids set to MASKED

Why llguidance: it computes a mask from a JSON schema in tens of microseconds for a 150k vocabulary
(its token trie and lexer are Rust), it takes any tokenizer given each token's bytes, and it needs
neither torch nor a tokenizer library of its own (xgrammar pulls in torch).

The mask comes from the host, from the sequence's last token, so a constrained sequence's next
step waits for its last token (model/decoding.py: it leaves the overlapped loop); a device sampler
applies the mask in the step (the CUDA backend's mask kernel) before it samples.

End of generation: the tokenizer's end-of-generation ids are the grammar's end tokens, so a
finished value allows only them, and the sequence ends as it would on its own ("stop").

MASKED is a large finite negative, not -inf: the samplers flag non-finite logits as a model
fault, and the repeat penalty may multiply a masked logit (MASKED * penalty stays finite for any
penalty below 3e8).
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numba
import numpy as np

from .errors import RequestError

MASKED = np.float32(-1e30)

# One line, a space after ":" and ",", as OpenAI's JSON mode writes it. No free whitespace: a
# model could otherwise write newlines forever, never finishing the value.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # moed Tokenizer -> LLTokenizer
_lock = threading.Lock()


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer: each token's bytes, the special
    ids, and an encoder."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        n = tokenizer.n_vocab
        self.tokens = [tokenizer.token_to_piece(i, special=True) for i in range(n)]
        # control tokens, and added ones written <|...|> (gpt-oss's <|channel|> and <|message|> are
        # user-defined): a grammar names them as tokens; the rest are matched as text
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i) or _marker(self.tokens[i])]
        self.eos_token_id = min(tokenizer.eog_ids) if tokenizer.eog_ids else tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.encode(text, add_special=False, parse_special=False)


def _marker(piece: bytes) -> bool:
    return piece.startswith(b"<|") and piece.endswith(b"|>") and len(piece) > 4


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of a moed Tokenizer (made once per tokenizer: a 150k vocabulary
    takes a second)."""
    import llguidance

    with _lock:
        ll = _tokenizers.get(tokenizer)
        if ll is None:
            vocab = _Vocabulary(tokenizer)
            eog = sorted(tokenizer.eog_ids) or [vocab.eos_token_id]
            wrapper = llguidance.TokenizerWrapper(vocab)
            try:
                ll = llguidance.LLTokenizer(wrapper, n_vocab=len(vocab.tokens), eos_token=eog)
            except TypeError:  # llguidance before 1.7 takes one end token
                ll = llguidance.LLTokenizer(wrapper, n_vocab=len(vocab.tokens), eos_token=vocab.eos_token_id)
            _tokenizers[tokenizer] = ll
        return ll


LARK = "lark:"  # a format that is a llguidance Lark grammar (the tool-call grammar below)


def tool_call_format(tools: list[dict[str, Any]], name: str | None = None, style: str = "hermes") -> str:
    """A format that makes the reply one call of one of `tools` (or of the one named), the
    arguments held to the tool's parameter schema, written as the model writes calls:
        hermes   <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>  (Qwen3 and the like)
        harmony  <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}  (gpt-oss;
                 the end of generation, <|call|>, follows: the grammar's end allows only it)
    RequestError for a name no tool has, or a tool without a name."""
    functions = _functions(tools, name)
    if style == "harmony":
        return _harmony_call(functions)
    options = [{"type": "object", "properties": {"name": {"const": fn}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False} for fn, params in functions]
    schema = {"anyOf": options, "x-guidance": JSON_STYLE}
    return LARK + 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema)


def _functions(tools: list[dict[str, Any]], name: str | None) -> list[tuple[str, dict]]:
    """(name, parameter schema) of the tools, or of the one named."""
    out = []
    for t in tools:
        f = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise RequestError("tools: each is {\"type\": \"function\", "
                               "\"function\": {\"name\": ..., \"parameters\": {...}}}")
        if name is None or f["name"] == name:
            out.append((f["name"], f.get("parameters") or {"type": "object"}))
    if not out:
        raise RequestError(f"tool_choice: no tool is named {name!r}" if name else "tool_choice: there are no tools")
    return out


def _harmony_call(functions: list[tuple[str, dict]]) -> str:
    """gpt-oss's call: the commentary channel to the function, then its JSON arguments."""
    rules = []
    alts = []
    for i, (fn, params) in enumerate(functions):
        schema = {**params, "x-guidance": JSON_STYLE}
        rules.append(f"args{i}: %json {json.dumps(schema)}")
        alts.append(f'"commentary to=functions.{fn} " <|constrain|> "json" <|message|> args{i}')
    return LARK + "start: <|channel|> call\ncall: " + " | ".join(alts) + "\n" + "\n".join(rules)


def schema_of(format: str) -> dict[str, Any]:
    """The JSON schema a request's format names: "json" is any JSON object; else the text of a
    schema. RequestError for anything else."""
    if format == "json":
        return {"type": "object"}
    try:
        schema = json.loads(format)
    except (json.JSONDecodeError, RecursionError):
        raise RequestError("format: expected \"json\" or a JSON schema") from None
    if not isinstance(schema, dict):
        raise RequestError("format: a JSON schema is an object")
    return schema


class Grammar:
    """A compiled grammar for one tokenizer; matcher() gives each sequence its state."""

    def __init__(self, ll, grammar: str, n_vocab: int):
        self.ll = ll
        self.grammar = grammar
        self.n_vocab = n_vocab

    def matcher(self) -> Matcher:
        import llguidance

        m = llguidance.LLMatcher(self.ll, self.grammar, log_level=0)
        if m.is_error():
            raise RequestError(f"format: {m.get_error()}")
        return Matcher(m, self.n_vocab)


def compile_format(format: str, tokenizer) -> Grammar:
    """The request's format compiled for this tokenizer; RequestError for a schema llguidance
    refuses (with its reason)."""
    import llguidance

    ll = ll_tokenizer(tokenizer)
    try:
        if format.startswith(LARK):
            grammar = llguidance.LLMatcher.grammar_from_lark(format[len(LARK):])
        else:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_of(format), defaults=JSON_STYLE)
    except (ValueError, TypeError) as e:
        raise RequestError(f"format: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll)
    if is_error:
        raise RequestError(f"format: the schema is not supported: {messages[0] if messages else 'invalid'}")
    return Grammar(ll, grammar, tokenizer.n_vocab)


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, n_vocab: int):
        self._m = matcher
        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32
        self._mask = np.empty(self.words, np.int32)

    def mask(self) -> np.ndarray:
        """int32 [W]: the tokens allowed next (a view, rewritten by the next call)."""
        return self.mask_into(self._mask)

    def mask_into(self, out: np.ndarray) -> np.ndarray:
        """The mask written into `out` (C-contiguous int32 [W], e.g. a device sampler's pinned
        row) -> out."""
        if out.dtype != np.int32 or out.shape != (self.words,) or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"a grammar mask is C-contiguous int32 [{self.words}]")
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._m.is_error():
            raise RequestError(f"format: {self._m.get_error()}")
        return out

    def consume(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise RequestError(f"format: token {token} does not fit the grammar: {self._m.get_error()}")

    @property
    def stopped(self) -> bool:
        return self._m.is_stopped()


def allowed(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """bool [V] of a mask int32 [W]."""
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return bits[:n_vocab].astype(bool)


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A copy of logits [V] where every token the mask forbids is MASKED."""
    out = np.array(logits, np.float32)
    _mask_out(out, mask.view(np.uint32))
    return out


@numba.njit(cache=True, nogil=True)
def _mask_out(logits, words):  # one pass, no [V] bool temporaries: 0.1 ms at V = 201k, not 2
    for t in range(logits.shape[0]):
        if not (words[t >> 5] >> (t & 31)) & 1:
            logits[t] = MASKED
