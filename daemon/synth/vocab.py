"""Byte-level BPE vocabularies for random-weight models: real tokenizers that llama.cpp and moed
both load, of any size, with the special tokens and chat template of a model family.

    make_vocab(n_vocab=512)      (tokens, types, merges) of the test fixtures (tests/fixtures/build.py)
    family_vocab(family, n)      a Vocab of exactly n tokens for "gpt-oss", "qwen", "qwen35" or "mistral"

The merges are trained on a fixed English text (a few hundred of them), so prompts tokenize into
words and pieces of words. Every other id is filled: the family's special tokens at the ids the
real model has them, the 256 bytes, the merged tokens, then unique "filler" words that no merge
reaches (they are never produced by tokenizing, only by sampling, and decode as text). All of them
use the GPT-2 byte alphabet, as `tokenizer.ggml.model = gpt2` requires. Mixtral's real vocabulary
is SentencePiece; its synthetic one is byte-level BPE too (the shapes are what matter), with the
[INST] template and <s>/</s> at ids 1/2 as in the real model.
"""

from __future__ import annotations

import dataclasses
import re

CORPUS = """
The quick brown fox jumps over the lazy dog. A mixture of experts model routes each
token to a small number of expert networks, and only those experts are computed for
that token. The router is a linear layer followed by a softmax; the top experts are
selected and their outputs are summed with the router weights. Attention lets every
position look at the positions before it, and the key and value vectors are kept in a
cache so that generation does not recompute them. Rotary position embeddings rotate
pairs of dimensions by an angle that grows with the position. Normalization keeps the
scale of the hidden state stable from one layer to the next. Quantization stores the
weights in blocks with a shared scale, which makes the model smaller and faster to read
from memory. This is a test of the tokenizer and the model: there are numbers like 123,
4567 and 89, some punctuation (commas, periods; colons!) and words that repeat: the the
the, and and and, expert expert, token token token, layer layer, weight weight weight.
When the model is loaded, the loader checks the names and the shapes of the tensors,
and the metadata tells it how many layers, heads and experts there are. Every test in
this repository compares the output of the new runner with the output of the reference.
"""

FIXTURE_SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>"]
NORMAL, CONTROL = 1, 3  # llama.cpp token types


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def train_merges(max_merges: int) -> list[tuple[str, str]]:
    """Up to `max_merges` BPE merges learned on CORPUS (most frequent pair first, ties by text),
    with GPT-2's pre-split: an optional leading space attaches to the word."""
    b2u = bytes_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for w in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", CORPUS):
        key = tuple(b2u[b] for b in w.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    merges: list[tuple[str, str]] = []
    vocab_set = set(b2u.values())
    while len(merges) < max_merges:
        pairs: dict[tuple[str, str], int] = {}
        for w, cnt in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + cnt
        pairs = {p: n for p, n in pairs.items() if p[0] + p[1] not in vocab_set}
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        vocab_set.add(best[0] + best[1])
        words = _apply_merge(words, best)
    return merges


def _apply_merge(words: dict[tuple[str, ...], int], best: tuple[str, str]) -> dict[tuple[str, ...], int]:
    new_words: dict[tuple[str, ...], int] = {}
    for w, cnt in words.items():
        out: list[str] = []
        i = 0
        while i < len(w):
            if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                out.append(w[i] + w[i + 1])
                i += 2
            else:
                out.append(w[i])
                i += 1
        new_words[tuple(out)] = new_words.get(tuple(out), 0) + cnt
    return new_words


def make_vocab(n_vocab: int = 512) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of a tiny byte-level BPE trained on CORPUS.

    Ids 0..255 are the bytes 0..255 (GPT-2 byte-to-unicode spelling), then one token per
    merge, then `<|bos|>`, `<|eos|>`, `<|pad|>` (type CONTROL)."""
    b2u = bytes_to_unicode()
    n_merges = n_vocab - 256 - len(FIXTURE_SPECIAL)
    merges = train_merges(n_merges)
    if len(merges) < n_merges:
        raise ValueError(f"corpus too small for {n_vocab} tokens ({len(merges)} merges)")
    tokens = [b2u[b] for b in range(256)] + [a + b for a, b in merges] + list(FIXTURE_SPECIAL)
    types = [NORMAL] * (256 + len(merges)) + [CONTROL] * len(FIXTURE_SPECIAL)
    return tokens, types, [f"{a} {b}" for a, b in merges]


# --------------------------------------------------------------------------------------
# model families

MAX_MERGES = 1000

# Harmony-like (gpt-oss): the real template also renders channels, tools and a system preamble.
_HARMONY = (
    "{%- for m in messages -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
_CHATML = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
_INST = (
    "{{ bos_token }}{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{ m.content + '\\n\\n' }}"
    "{%- elif m.role == 'user' -%}{{ '[INST] ' + m.content + ' [/INST]' }}"
    "{%- else -%}{{ m.content + eos_token }}{%- endif -%}{%- endfor -%}"
)


@dataclasses.dataclass(frozen=True)
class Family:
    pre: str  # tokenizer.ggml.pre
    template: str
    special: dict[int, str]  # id -> text (CONTROL tokens)
    bos: int
    eos: int
    pad: int
    add_bos: bool


def _reserved(lo: int, hi: int, taken: dict[int, str]) -> dict[int, str]:
    return {i: f"<|reserved_{i}|>" for i in range(lo, hi) if i not in taken}


_GPT_OSS_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                  200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>",
                  200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"}
_QWEN_NAMED = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
# Qwen3.5's 248k vocabulary: the same three first specials from 248044 (bos = pad = <|endoftext|>,
# eos = <|im_end|> in published GGUFs), pre-tokenizer "qwen35"
_QWEN35_NAMED = {248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>"}


def _family(name: str, n_vocab: int) -> Family:
    if name == "gpt-oss":
        # o200k: ids from 199998 are special, the last ones reserved (as in the release)
        base = min(199998, n_vocab - 16)
        named = {base + i - 199998: t for i, t in _GPT_OSS_NAMED.items()}
        return Family("gpt-4o", _HARMONY, {**named, **_reserved(base, n_vocab, named)},
                      bos=base, eos=base + 4, pad=base + 1, add_bos=False)
    if name == "qwen":
        base = min(151643, n_vocab - 32)
        named = {base + i - 151643: t for i, t in _QWEN_NAMED.items()}
        return Family("qwen2", _CHATML, {**named, **_reserved(base, base + 26, named)},
                      bos=base, eos=base + 2, pad=base, add_bos=False)
    if name == "qwen35":
        base = min(248044, n_vocab - 40)
        named = {base + i - 248044: t for i, t in _QWEN35_NAMED.items()}
        return Family("qwen35", _CHATML, {**named, **_reserved(base, base + 33, named)},
                      bos=base, eos=base + 2, pad=base, add_bos=False)
    if name == "mistral":
        return Family("default", _INST, {0: "<unk>", 1: "<s>", 2: "</s>"}, bos=1, eos=2, pad=0, add_bos=True)
    raise ValueError(f"unknown tokenizer family {name!r}")


@dataclasses.dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    family: Family


def family_vocab(family: str, n_vocab: int) -> Vocab:
    """A byte-level BPE vocabulary of exactly `n_vocab` tokens with `family`'s special tokens."""
    fam = _family(family, n_vocab)
    b2u = bytes_to_unicode()
    merges = train_merges(min(MAX_MERGES, n_vocab - 256 - len(fam.special) - 1))
    learned = [b2u[b] for b in range(256)] + [a + b for a, b in merges]
    free = n_vocab - len(fam.special)
    if free < len(learned):
        raise ValueError(f"vocabulary of {n_vocab} is too small for the {family} tokenizer")
    texts = learned + list(_fillers(free - len(learned), set(learned)))
    tokens: list[str] = []
    types: list[int] = []
    normal = iter(texts)
    for i in range(n_vocab):
        if i in fam.special:
            tokens.append(fam.special[i])
            types.append(CONTROL)
        else:
            tokens.append(next(normal))
            types.append(NORMAL)
    return Vocab(tokens, types, [f"{a} {b}" for a, b in merges], fam)


def _fillers(n: int, taken: set[str]):
    """n unique lower-case words with a leading space ("Ġ"), none of them in `taken`."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    made = 0
    while made < n:
        k, word = i, ""
        while True:
            word = letters[k % 26] + word
            k = k // 26 - 1
            if k < 0:
                break
        i += 1
        text = "Ġ" + word
        if text not in taken:
            made += 1
            yield text
