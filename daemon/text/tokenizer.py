"""Tokenizer built from GGUF metadata, matching llama.cpp's tokenization.

The heavy lifting (BPE merging, regex pre-tokenization, byte-level mapping) is done by the
HuggingFace ``tokenizers`` library; this module only assembles a ``tokenizers.Tokenizer``
from the vocabulary stored in the GGUF file and reproduces the parts of llama.cpp's
``llama-vocab.cpp`` that sit around the BPE model:

* special-token partitioning (``tokenize(..., parse_special=...)``): control / user-defined /
  unknown tokens are cut out of the text before the BPE sees it, longest token text first,
  exactly like ``tokenizer_st_partition``.  Control (and unknown) tokens are only matched when
  ``parse_special`` is true; user-defined tokens are always matched (as llama.cpp and HF do).
* BOS/EOS insertion (``add_special``), the default ``add_bos``/``add_eos`` per model family and
  their ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` overrides.
* the end-of-generation token set (``eog_ids``) including llama.cpp's name-based detection
  (``<|im_end|>``, ``<|eot_id|>``, ``<|return|>``, ``<|call|>``, FIM pad/repo/sep tokens, ...)
  and its gpt-oss fix-ups (``<|end|>`` is not EOG when ``<|return|>``/``<|call|>`` exist;
  ``<|channel|>``, ``<|message|>``, ``<|start|>``, ``<|constrain|>`` become user-defined).
* token -> bytes (``token_to_piece``) with llama.cpp's rules per token attribute.

Supported vocabularies (``tokenizer.ggml.model``):

``gpt2``
    byte-level BPE (tokens + merges).  The pre-tokenizer is the list of regexes llama.cpp uses
    for ``tokenizer.ggml.pre`` (applied one after the other, each splitting the pieces of the
    previous one and keeping both matches and the text between matches, like
    ``unicode_regex_split``).  Pre types: see ``PRE_TOKENIZERS``.  The regexes are llama.cpp's
    (not the original ``tokenizer.json`` ones where llama.cpp adapted them, e.g. gpt-4o), so the
    output follows llama.cpp where the two differ.  An unknown pre type raises
    ``UnsupportedError`` (llama.cpp refuses it too: a wrong pre-tokenizer silently degrades
    generation); a *missing* pre type falls back to ``default`` with a warning, as llama.cpp does.
    Families: GPT-2 (``gpt-2``, ``olmo``, ``mpt``, ...), digits-then-GPT-2 (``smollm``,
    ``starcoder``, ...), Llama 3 (``llama-bpe``, ``llama3``, ...), Qwen2/Qwen3 (``qwen2``, ...),
    ``qwen35``, o200k (``gpt-4o``, ``llama4``), ``tekken``, DeepSeek (``deepseek-llm``,
    ``deepseek-coder``, ``deepseek-v3``) and ``default``.
``llama``
    SentencePiece vocabulary (tokens + scores + token types, ``<0xXX>`` byte fallback, ``▁`` for
    spaces).  llama.cpp tokenizes it with a BPE that repeatedly merges the adjacent pair whose
    concatenation is the highest-scoring vocabulary token; we express the same thing as a
    ``tokenizers`` BPE model whose merges are all splits of every token into two tokens,
    ranked by the score of the merged token.  The text gets a leading space when
    ``add_space_prefix`` is set (default true, ``tokenizer.ggml.add_space_prefix``) at the start
    and after every special token, as llama.cpp does.

``tests/text/test_tokenizer.py`` checks every entry of ``PRE_TOKENIZERS`` and the SPM path
against llama-cpp-python (0.3.36 when written) token for token, plus SmolLM2's real vocabulary.

Known deviations from llama.cpp, all deliberate:

* ``decode`` never applies llama.cpp's ``clean_spaces`` post-processing (" ." -> ".", which is
  lossy); it is the plain concatenation of ``token_to_piece``, which is also what llama.cpp's
  server streams.  For SPM vocabularies with a space prefix, the one space ``encode`` inserts
  at the start of the text and after every special token is removed again, so that
  ``decode(encode(s)) == s`` (llama.cpp only drops it at the start, and not after a BOS).
  :class:`StreamDecoder` does not remove anything.
* a ``gpt2`` vocabulary without ``bos_token_id``/``eos_token_id`` gets no BOS/EOS (llama.cpp
  defaults both to id 11, a Falcon leftover that makes "," an end-of-generation token in most
  vocabularies).
* in a BPE token, a character outside the GPT-2 byte alphabet is emitted as its UTF-8 bytes
  (llama.cpp emits an ``[UNK_BYTE_0x..]`` marker).
* per-model ``lstrip``/``rstrip`` token attributes (phi-3, jina, modern-bert) are not applied.
* SPM: when several vocabulary tokens have exactly the same score llama.cpp merges the leftmost
  pair first, we merge in token-id order; real SPM vocabularies have distinct scores.
* when several tokens look like an end-of-turn token (``<|im_end|>``, ``<|endoftext|>``, ...)
  and the file names none, ``eot_id`` is the first in llama.cpp's list order (llama.cpp takes
  whichever its hash map yields first); all of them are in ``eog_ids`` either way.
* ``tokenizer.ggml.model`` values other than ``gpt2`` and ``llama`` (bert, t5, rwkv, plamo2,
  gemma4, ...) and unknown pre types raise ``UnsupportedError``.
"""

from __future__ import annotations

import codecs
import logging
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models as _models
from tokenizers import pre_tokenizers as _pre

from daemon.errors import ModelError, RequestError, UnsupportedError

__all__ = [
    "PRE_TOKENIZERS",
    "StreamDecoder",
    "TokenAttr",
    "TokenType",
    "Tokenizer",
]

log = logging.getLogger("moed.tokenizer")


class TokenType:
    """Values of ``tokenizer.ggml.token_type`` (llama.cpp ``llama_token_type``)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


class TokenAttr:
    """Token attribute bits, as llama.cpp's ``llama_token_attr``."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


_TYPE_TO_ATTR = {
    TokenType.UNDEFINED: TokenAttr.UNDEFINED,
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.BYTE: TokenAttr.BYTE,
}

_SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # hidden unless rendering specials
_PARTITION_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN

# --------------------------------------------------------------------------------------------
# pre-tokenizer regexes (from llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe)
# --------------------------------------------------------------------------------------------

_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's adaptation of the o200k regex: "upper" = a letter that is not a-z, "lower" = a
# letter that is not A-Z (so non-ASCII letters count as both), no \p{M} in letter runs.
_RE_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# Regexes without \p{..} classes see non-ASCII whitespace replaced by \v in llama.cpp, so a
# literal range covering e.g. U+3000 does not match it there: "&&\S" does the same here.
# (Written with escapes: the exact code points matter and NFC normalization would change some.)
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff"
_RE_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + "]+",
    r"\s?[[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002" + r"]&&\S]+",
    r"\s+\z",
    r"[[" + _CJK_HANGUL + r"]&&\S]+",
    r"\p{N}+",
)
_RE_DEEPSEEK_CODER = (
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    r"[[" + _CJK_HANGUL + r"]&&\S]+",
    r"\p{N}",
)
_RE_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    _RE_GPT2,
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-tokenizes one ``tokenizer.ggml.pre`` family."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole pre-token found in the vocab is used as is
    add_bos: bool = False  # default of add_bos (``tokenizer.ggml.add_bos_token`` overrides)


_PT_GPT2 = PreTokenizer((_RE_GPT2,))
_PT_SMOLLM = PreTokenizer((r"\p{N}", _RE_GPT2))
_PT_LLAMA3 = PreTokenizer((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_PT_DBRX = PreTokenizer((_RE_LLAMA3,))
_PT_QWEN2 = PreTokenizer((_RE_QWEN2,))
_PT_GPT4O = PreTokenizer((_RE_GPT4O,))
_PT_DEFAULT = PreTokenizer(_RE_DEFAULT)
_PT_QWEN35 = PreTokenizer((_RE_QWEN35,))
_PT_TEKKEN = PreTokenizer((_RE_TEKKEN,), ignore_merges=True, add_bos=True)
_PT_DEEPSEEK3 = PreTokenizer(_RE_DEEPSEEK3)
_PT_DEEPSEEK_LLM = PreTokenizer(_RE_DEEPSEEK_LLM)
_PT_DEEPSEEK_CODER = PreTokenizer(_RE_DEEPSEEK_CODER)

#: ``tokenizer.ggml.pre`` values this module supports (same grouping as llama.cpp).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _PT_DEFAULT,
    # GPT-2 regex
    **dict.fromkeys(
        ["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "gigachat", "exaone4",
         "a.x-4.0", "mellum"],
        _PT_GPT2,
    ),
    # individual digits, then the GPT-2 regex
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
         "mellum2"],
        _PT_SMOLLM,
    ),
    # Llama 3
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        _PT_LLAMA3,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _PT_DBRX),
    # Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "kormo", "f2llmv2",
         "solar-open"],
        _PT_QWEN2,
    ),
    "qwen35": _PT_QWEN35,
    # o200k (gpt-oss, Llama 4)
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "minimax-m2"], _PT_GPT4O),
    "tekken": _PT_TEKKEN,
    # DeepSeek V2 / V3 (MoE)
    "deepseek-llm": _PT_DEEPSEEK_LLM,
    "deepseek-coder": _PT_DEEPSEEK_CODER,
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _PT_DEEPSEEK3),
}

# vocabularies llama.cpp knows but this module does not implement
_UNSUPPORTED_MODELS = {"bert", "t5", "rwkv", "plamo2", "gemma4", "hybriddna", "whitespace",
                       "no_vocab", "none"}

# --------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode mapping
# --------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}

_SPM_SPACE = "\u2581"
_SURROGATES = re.compile("[\ud800-\udfff]")

# llama.cpp's name-based detection (llama_vocab::impl::load)
_EOT_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_NAMES = ("<|eom_id|>",)
_FIM_PAD_NAMES = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_NAMES = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_NAMES = ("<|file_sep|>",)
_FIM_PRE_NAMES = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                  "▁<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_NAMES = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                  "▁<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_NAMES = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                  "▁<MID>", "<|code_middle|>", "<|middle|>")
_EOG_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss

_K = "tokenizer.ggml."


def _meta_int(metadata: Mapping[str, Any], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ModelError(f"metadata {key!r} should be an integer, got {value!r}") from None


def _meta_bool(metadata: Mapping[str, Any], key: str) -> bool | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        raise ModelError(f"metadata {key!r} should be a boolean, got {value!r}")
    return bool(value)


def _meta_list(metadata: Mapping[str, Any], key: str, n: int | None = None) -> list | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise ModelError(f"metadata {key!r} should be an array")
    out = value.tolist() if hasattr(value, "tolist") else list(value)
    if n is not None and len(out) < n:
        raise ModelError(f"metadata {key!r} has {len(out)} entries, the vocabulary has {n}")
    return out


class Tokenizer:
    """Text <-> token ids for one GGUF model.  Build it with :meth:`from_metadata`."""

    # ---------------------------------------------------------------- construction

    def __init__(self) -> None:  # use from_metadata
        self.model: str = ""
        self.pre: str | None = None
        self._texts: list[str] = []
        self._attrs: list[int] = []
        self._ids: dict[str, int] = {}
        self._hf: _HFTokenizer | None = None
        self._pieces: list[bytes | None] = []
        self._special_by_len: list[int] = []
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.eot_id: int | None = None
        self.eom_id: int | None = None
        self.unk_id: int | None = None
        self.sep_id: int | None = None
        self.pad_id: int | None = None
        self.mask_id: int | None = None
        self.fim_pre_id: int | None = None
        self.fim_suf_id: int | None = None
        self.fim_mid_id: int | None = None
        self.fim_pad_id: int | None = None
        self.fim_rep_id: int | None = None
        self.fim_sep_id: int | None = None
        self.add_bos: bool = False
        self.add_eos: bool = False
        self.add_space_prefix: bool = False
        self.eog_ids: frozenset[int] = frozenset()

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from a GGUF metadata mapping (``tokenizer.ggml.*`` keys).

        Raises ``UnsupportedError`` for a vocabulary type or pre-tokenizer this module lacks and
        ``ModelError`` for a broken vocabulary (missing tokens, duplicates, bad special ids).
        """
        self = cls()
        model = metadata.get(_K + "model")
        if not isinstance(model, str):
            raise ModelError("GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
        self.model = model
        if model in _UNSUPPORTED_MODELS:
            raise UnsupportedError(
                f"tokenizer type {model!r} is not supported (gpt2 and llama are)")
        if model not in ("gpt2", "llama"):
            raise UnsupportedError(f"unknown tokenizer type {model!r}")

        texts = _meta_list(metadata, _K + "tokens")
        if not texts:
            raise ModelError("GGUF metadata has no vocabulary (tokenizer.ggml.tokens)")
        n = len(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ModelError(f"tokenizer.ggml.tokens[{i}] is not a string")
            if t == "":
                log.warning("empty token at index %d", i)
                texts[i] = f"[EMPTY_{i}]"
        ids: dict[str, int] = {}
        for i, t in enumerate(texts):
            j = ids.setdefault(t, i)
            if j != i:
                raise ModelError(f"duplicate token in vocabulary: {t!r} has ids {j} and {i}")
        self._texts, self._ids = texts, ids

        scores = _meta_list(metadata, _K + "scores", n)
        types = _meta_list(metadata, _K + "token_type", n)
        if types is None:
            attrs = [TokenAttr.NORMAL] * n
        else:
            attrs = [_TYPE_TO_ATTR.get(int(t), TokenAttr.UNDEFINED) for t in types[:n]]
        self._attrs = attrs

        if model == "llama":
            bos, eos, unk = 1, 2, 0
            self.add_space_prefix, self.add_bos, self.add_eos = True, True, False
            pre_tok = None
        else:
            bos = eos = unk = None
            pre = metadata.get(_K + "pre")
            if pre is None or pre == "":
                log.warning("GGUF has no tokenizer.ggml.pre: using the 'default' pre-tokenizer "
                            "(generation quality may degrade; consider re-converting the model)")
                pre = "default"
            if not isinstance(pre, str):
                raise ModelError(f"tokenizer.ggml.pre should be a string, got {pre!r}")
            pre_tok = PRE_TOKENIZERS.get(pre)
            if pre_tok is None:
                raise UnsupportedError(
                    f"pre-tokenizer {pre!r} is not supported (supported: "
                    f"{', '.join(sorted(PRE_TOKENIZERS))})")
            self.pre = pre
            self.add_space_prefix, self.add_bos, self.add_eos = False, pre_tok.add_bos, False
        asp = _meta_bool(metadata, _K + "add_space_prefix")
        if asp is not None:
            self.add_space_prefix = asp

        # ---- special ids: defaults, then metadata (ignored when out of range, like llama.cpp)
        def in_range(v: int | None) -> int | None:
            return v if v is not None and 0 <= v < n else None

        special: dict[str, int | None] = {
            "bos": in_range(bos), "eos": in_range(eos), "unk": in_range(unk),
            "eot": None, "eom": None, "sep": None, "pad": None, "mask": None,
            "fim_pre": None, "fim_suf": None, "fim_mid": None,
            "fim_pad": None, "fim_rep": None, "fim_sep": None,
        }
        keys = [
            ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("eot", "eot_token_id"),
            ("eom", "eom_token_id"), ("unk", "unknown_token_id"), ("sep", "seperator_token_id"),
            ("pad", "padding_token_id"), ("mask", "mask_token_id"),
            ("fim_pre", "fim_pre_token_id"), ("fim_suf", "fim_suf_token_id"),
            ("fim_mid", "fim_mid_token_id"), ("fim_pad", "fim_pad_token_id"),
            ("fim_rep", "fim_rep_token_id"), ("fim_sep", "fim_sep_token_id"),
            ("fim_pre", "prefix_token_id"), ("fim_suf", "suffix_token_id"),
            ("fim_mid", "middle_token_id"),
        ]
        for name, key in keys:
            v = _meta_int(metadata, _K + key)
            if v is None:
                continue
            if 0 <= v < n:
                special[name] = v
            else:
                log.warning("bad special token %s = %d (vocabulary has %d tokens), ignored",
                            _K + key, v, n)

        for key, attr_name, tok_name in (("add_bos_token", "add_bos", "bos"),
                                         ("add_eos_token", "add_eos", "eos")):
            v = _meta_bool(metadata, _K + key)
            if v is not None:
                setattr(self, attr_name, v)
            if getattr(self, attr_name) and special[tok_name] is None:
                if v:
                    raise ModelError(f"{_K}{key} is true, but there is no {tok_name.upper()} token")
                log.warning("no %s token: %s disabled", tok_name.upper(), attr_name)
                setattr(self, attr_name, False)

        # ---- name-based detection (llama.cpp: "auto-detect special tokens by text")
        def detect(name: str, names: Sequence[str]) -> None:
            if special[name] is not None:
                return
            for t in names:
                i = ids.get(t)
                if i is not None:
                    special[name] = i
                    attrs[i] |= TokenAttr.CONTROL
                    return

        detect("eot", _EOT_NAMES)
        detect("eom", _EOM_NAMES)
        for name, names in (("fim_pre", _FIM_PRE_NAMES), ("fim_suf", _FIM_SUF_NAMES),
                            ("fim_mid", _FIM_MID_NAMES), ("fim_pad", _FIM_PAD_NAMES),
                            ("fim_rep", _FIM_REP_NAMES), ("fim_sep", _FIM_SEP_NAMES)):
            detect(name, names)

        for i, a in enumerate(attrs):  # control tokens named "...unused..." are unused
            if a & TokenAttr.CONTROL and "unused" in texts[i]:
                attrs[i] = a | TokenAttr.UNUSED

        eog: set[int] = set()
        for name in ("fim_pad", "fim_rep", "fim_sep"):
            if special[name] is not None:
                eog.add(special[name])
        for t in _EOG_NAMES:
            i = ids.get(t)
            if i is not None:
                eog.add(i)
                attrs[i] |= TokenAttr.CONTROL
        for t in _ALWAYS_RENDERED:
            i = ids.get(t)
            if i is not None:
                attrs[i] = TokenAttr.USER_DEFINED
        for name in ("eos", "eot", "eom"):
            if special[name] is not None:
                eog.add(special[name])
        # o200k_harmony (gpt-oss) / solar-open: "<|end|>" ends a message, not the generation
        by_text = {texts[i]: i for i in eog}
        has_call = "<|call|>" in by_text or "<|calls|>" in by_text
        if "<|end|>" in by_text and has_call and (
                "<|return|>" in by_text or "<|flush|>" in by_text):
            end = by_text["<|end|>"]
            eog.discard(end)
            attrs[end] = TokenAttr.USER_DEFINED
        if "<|tool_response>" in by_text and "</s>" in by_text:
            s = by_text["</s>"]
            eog.discard(s)
            attrs[s] = TokenAttr.NORMAL

        self.eog_ids = frozenset(eog)
        for name, v in special.items():
            setattr(self, name + "_id", v)

        # special tokens, longest text (in UTF-8 bytes) first, as llama.cpp partitions them
        special_ids = [i for i, a in enumerate(attrs) if a & _PARTITION_ATTRS]
        special_ids.sort(key=lambda i: (-len(texts[i].encode("utf-8", "surrogatepass")), i))
        self._special_by_len = special_ids
        self._pieces = [None] * n

        if model == "gpt2":
            assert pre_tok is not None
            self._hf = self._build_bpe(metadata, pre_tok)
        else:
            if scores is None:
                log.warning("SPM vocabulary without tokenizer.ggml.scores: all scores are 0")
                scores = [0.0] * n
            self._hf = self._build_spm(scores)
        return self

    def _build_bpe(self, metadata: Mapping[str, Any], pre_tok: PreTokenizer) -> _HFTokenizer:
        raw = _meta_list(metadata, _K + "merges")
        if raw is None:
            raise ModelError("gpt2 tokenizer without merges (tokenizer.ggml.merges)")
        ids = self._ids
        merges: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        dropped = 0
        for m in raw:
            if not isinstance(m, str):
                raise ModelError("tokenizer.ggml.merges holds a non-string entry")
            pos = m.find(" ", 1)
            if pos < 0:
                dropped += 1
                continue
            pair = (m[:pos], m[pos + 1:])
            if pair in seen:
                continue  # llama.cpp keeps the first rank of a duplicate pair
            if pair[0] not in ids or pair[1] not in ids or pair[0] + pair[1] not in ids:
                dropped += 1
                continue
            seen.add(pair)
            merges.append(pair)
        if dropped:
            log.warning("%d BPE merges are malformed or produce tokens outside the vocabulary; "
                        "they were ignored", dropped)
        try:
            bpe = _models.BPE(vocab=dict(ids), merges=merges, ignore_merges=pre_tok.ignore_merges)
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            raise ModelError(f"cannot build the BPE tokenizer: {e}") from e
        hf = _HFTokenizer(bpe)
        steps = [_pre.Split(Regex(r), behavior="isolated") for r in pre_tok.regexes]
        steps.append(_pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
        hf.pre_tokenizer = _pre.Sequence(steps)
        return hf

    def _build_spm(self, scores: Sequence[float]) -> _HFTokenizer:
        texts, ids = self._texts, self._ids
        # every way to split a token into two tokens is a merge, ranked by the merged token's
        # score (highest first): llama.cpp merges the adjacent pair whose concatenation is the
        # best-scoring vocabulary token.
        ranked: list[tuple[float, int, int, str, str]] = []
        for tid, t in enumerate(texts):
            if len(t) < 2:
                continue
            s = float(scores[tid])
            for k in range(1, len(t)):
                left, right = t[:k], t[k:]
                if left in ids and right in ids:
                    ranked.append((-s, tid, k, left, right))
        ranked.sort()
        merges = [(left, right) for _, _, _, left, right in ranked]
        unk = self._texts[self.unk_id] if self.unk_id is not None else None
        try:
            bpe = _models.BPE(vocab=dict(ids), merges=merges, unk_token=unk, byte_fallback=True)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"cannot build the SPM tokenizer: {e}") from e
        return _HFTokenizer(bpe)  # no normalizer / pre-tokenizer: whole fragments, like llama.cpp

    # ---------------------------------------------------------------- properties

    @property
    def n_vocab(self) -> int:
        return len(self._texts)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (byte-level / ``▁`` encoded)."""
        return self._texts[self._check_id(token_id)]

    def token_id(self, text: str) -> int | None:
        """The id of the vocabulary entry whose text is exactly ``text``, or None."""
        return self._ids.get(text)

    def token_attr(self, token_id: int) -> int:
        return self._attrs[self._check_id(token_id)]

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens (those ``decode(skip_special=True)`` hides)."""
        return bool(self._attrs[self._check_id(token_id)] & _SPECIAL_ATTRS)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def _check_id(self, token_id: int) -> int:
        try:
            i = operator.index(token_id)  # int, numpy integer; not float / bool-like strings
        except TypeError:
            raise RequestError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= i < len(self._texts) or isinstance(token_id, bool):
            raise RequestError(f"token id {token_id!r} is outside the vocabulary "
                               f"(0..{len(self._texts) - 1})")
        return i

    # ---------------------------------------------------------------- encoding

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Tokenize ``text`` like llama.cpp's ``llama_tokenize(text, add_special, parse_special)``.

        ``add_special`` adds BOS / EOS when the model asks for them (``add_bos`` / ``add_eos``).
        ``parse_special`` lets control tokens written in the text (``<|im_start|>``) become
        their token; user-defined tokens are always matched.
        """
        if not isinstance(text, str):
            raise RequestError(f"text to tokenize must be a string, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (e.g. from a JSON "\ud83d" escape)
            text = _SURROGATES.sub("\ufffd", text)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)  # type: ignore[arg-type]
        fragments = self._partition(text, parse_special) if text else []
        if self.model == "llama":
            self._encode_spm(fragments, out)
        else:
            self._encode_bpe(fragments, out)
        if add_special and self.add_eos:
            out.append(self.eos_id)  # type: ignore[arg-type]
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Cut special tokens out of ``text`` (llama.cpp ``tokenizer_st_partition``)."""
        frags: list[str | int] = [text]
        texts, attrs = self._texts, self._attrs
        for tid in self._special_by_len:
            tok = texts[tid]
            if tok not in text:
                continue
            if not parse_special and attrs[tid] & _SPECIAL_ATTRS:
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(tok)
                for k, part in enumerate(parts):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def _encode_bpe(self, fragments: list[str | int], out: list[int]) -> None:
        hf = self._hf
        assert hf is not None
        raw = [f for f in fragments if isinstance(f, str)]
        if not raw:
            out.extend(fragments)  # type: ignore[arg-type]
            return
        encoded = iter(self._hf_encode(raw))
        for f in fragments:
            if isinstance(f, int):
                out.append(f)
            else:
                out.extend(next(encoded))

    def _encode_spm(self, fragments: list[str | int], out: list[int]) -> None:
        raw: list[str] = []
        prev_special = True  # a leading space goes in front of the text and after specials
        for f in fragments:
            if isinstance(f, int):
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                f = " " + f
            raw.append(f.replace(" ", _SPM_SPACE))
            prev_special = False
        encoded = iter(self._hf_encode(raw)) if raw else iter(())
        for f in fragments:
            if isinstance(f, int):
                out.append(f)
            else:
                out.extend(next(encoded))

    def _hf_encode(self, texts: list[str]) -> list[list[int]]:
        hf = self._hf
        assert hf is not None
        if len(texts) == 1:
            return [hf.encode(texts[0], add_special_tokens=False).ids]
        return [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)]

    # ---------------------------------------------------------------- decoding

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The raw bytes of one token (may be an incomplete UTF-8 sequence).

        With ``special=False`` control and unknown tokens give ``b""`` (llama.cpp's
        ``llama_token_to_piece(..., special=false)``).  Unused / undefined tokens always give b"".
        """
        token_id = self._check_id(token_id)
        attr = self._attrs[token_id]
        if not special and attr & _SPECIAL_ATTRS:
            return b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id)
        return piece

    def _make_piece(self, token_id: int) -> bytes:
        text, attr = self._texts[token_id], self._attrs[token_id]
        if attr & (_SPECIAL_ATTRS | TokenAttr.USER_DEFINED):
            return text.encode("utf-8", "surrogatepass")
        if attr & TokenAttr.NORMAL:
            if self.model == "llama":
                return text.replace(_SPM_SPACE, " ").encode("utf-8", "surrogatepass")
            table = _UNICODE_TO_BYTE
            out = bytearray()
            for ch in text:
                b = table.get(ch)
                if b is None:
                    out += ch.encode("utf-8", "surrogatepass")
                else:
                    out.append(b)
            return bytes(out)
        if attr & TokenAttr.BYTE:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                try:
                    return bytes([int(text[3:5], 16)])
                except ValueError:
                    pass
            raise ModelError(f"byte token {token_id} has malformed text {text!r}")
        return b""

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Concatenated token bytes (see :meth:`decode`)."""
        ids = list(ids)
        parts = [self.token_to_piece(i, special=not skip_special) for i in ids]
        if self.add_space_prefix:
            # undo the space encode() puts at the start and after every special token
            attrs = self._attrs
            after_special = True
            for k, i in enumerate(ids):
                if attrs[i] & _PARTITION_ATTRS:
                    after_special = True
                    continue
                if after_special and parts[k].startswith(b" "):
                    parts[k] = parts[k][1:]
                after_special = False
        return b"".join(parts)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Token ids -> text.  ``skip_special`` drops control / unknown tokens.

        Invalid UTF-8 (e.g. a sequence cut in the middle of a character) becomes U+FFFD; use
        :class:`StreamDecoder` to decode a stream of tokens incrementally.
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self.bos_id}, eos={self.eos_id}, eog={sorted(self.eog_ids)})")


class StreamDecoder:
    """Incremental detokenizer: feed token ids, get back only complete UTF-8 text.

    Bytes of a character split across tokens (emoji, CJK with byte-fallback tokens) are held
    back until the character is complete; invalid sequences become U+FFFD instead of stalling.
    Call :meth:`flush` at the end of the stream for whatever is still pending.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: int | Iterable[int]) -> str:
        """Add one token id (or several); return the text that became complete."""
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        data = b"".join(self._tok.token_to_piece(t, special=not self._skip_special)
                        for t in token_ids)
        return self._dec.decode(data, final=False)

    @property
    def pending(self) -> bytes:
        """Bytes received but not yet returned (an incomplete UTF-8 sequence)."""
        return self._dec.getstate()[0]

    def flush(self) -> str:
        """End of stream: return the pending bytes (incomplete sequences as U+FFFD) and reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    def reset(self) -> None:
        self._dec.reset()
