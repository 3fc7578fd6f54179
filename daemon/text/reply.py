"""A chat reply's structure, parsed from the model's text as it streams: reasoning, the answer,
and tool calls (issue 29, item 6).

    parser = reply_parser(arch, chat_template)      by the model's format:
        HermesReply   Qwen3 and other templates with <tool_call>: <think>...</think> is reasoning,
                      <tool_call>{"name": ..., "arguments": {...}}</tool_call> a call
        HarmonyReply  gpt-oss: <|channel|>analysis<|message|>... is reasoning, the final channel
                      the answer, a commentary message to=functions.NAME a call (its body the
                      arguments), each ended by <|end|>, <|return|> or <|call|>
        PlainReply    anything else: all content
    events = parser.feed(text)   -> [(CONTENT, str) | (THINKING, str) | (TOOL_CALL, ToolCall)]
    events += parser.finish()    at the end: what was held back

Text that may be the start of a marker is held back until it is known not to be one, so a marker
never reaches the content in pieces. A call whose JSON does not parse is given back as content,
as it came: nothing the model wrote is lost. The text must keep the special tokens' text
(the daemon's stream decoder does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CONTENT, THINKING, TOOL_CALL = "content", "thinking", "tool_call"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                best = max(best, n)
                break
    return best


def _call(body: str) -> ToolCall | None:
    """A call from {"name": ..., "arguments": {...}} (arguments may come as a JSON string)."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], args if isinstance(args, dict) else {"value": args})


class PlainReply:
    def feed(self, text: str) -> list:
        return [(CONTENT, text)] if text else []

    def finish(self) -> list:
        return []


class HermesReply:
    """<think> reasoning </think>, text, and <tool_call> JSON </tool_call> calls."""

    OPEN = {"<think>": THINKING, "<tool_call>": TOOL_CALL}
    CLOSE = {THINKING: "</think>", TOOL_CALL: "</tool_call>"}

    def __init__(self):
        self.state = CONTENT
        self.buf = ""  # text not yet given out
        self.call = ""  # the body of the call being read
        self.trim = False  # the whitespace after a closing tag is the template's, not the answer's
        self.thought = False  # some reasoning was given out

    def feed(self, text: str) -> list:
        self.buf += text
        out = []
        while self.buf:
            if self.state == CONTENT:
                at = [(self.buf.find(m), m) for m in self.OPEN if m in self.buf]
                if at:
                    i, m = min(at)
                    self._emit(out, CONTENT, self.buf[:i])
                    self.buf = self.buf[i + len(m):]
                    self.state = self.OPEN[m]
                    continue
                keep = _held(self.buf, tuple(self.OPEN))
                self._emit(out, CONTENT, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            close = self.CLOSE[self.state]
            i = self.buf.find(close)
            body, rest = (self.buf, "") if i < 0 else (self.buf[:i], self.buf[i + len(close):])
            keep = _held(body, (close,)) if i < 0 else 0
            part, self.buf = body[:len(body) - keep], body[len(body) - keep:] + rest
            if self.state == THINKING:
                self._emit(out, THINKING, part)
            else:
                self.call += part
            if i < 0:
                break
            if self.state == TOOL_CALL:
                self._end_call(out)
            self.state = CONTENT
            self.trim = True
            self.buf = rest
        return out

    def _end_call(self, out: list) -> None:
        call = _call(self.call.strip())
        if call is not None:
            out.append((TOOL_CALL, call))
        else:  # not a call after all: given back as the model wrote it
            self._emit(out, CONTENT, f"<tool_call>{self.call}</tool_call>")
        self.call = ""

    def _emit(self, out: list, kind: str, text: str) -> None:
        if kind == CONTENT and self.trim:
            text = text.lstrip()
            self.trim = not text
        elif kind == THINKING:
            if not self.thought:  # the newline after <think> is the template's
                text = text.lstrip("\n")
            self.thought = True
        if text:
            out.append((kind, text))

    def finish(self) -> list:
        out = []
        if self.state == TOOL_CALL:  # cut off inside a call (max_tokens): what there is, as text
            self._emit(out, CONTENT, f"<tool_call>{self.call}{self.buf}")
        else:
            self._emit(out, self.state, self.buf)
        self.buf, self.call, self.state = "", "", CONTENT
        return out


class HarmonyReply:
    """gpt-oss's harmony format: messages of channels, each header then <|message|> then a body."""

    ENDS = ("<|end|>", "<|return|>", "<|call|>")
    MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>") + ENDS

    def __init__(self):
        self.in_body = False
        self.header = ""  # "analysis", "final", "commentary to=functions.get_weather <|constrain|>json"
        self.buf = ""
        self.body = ""  # a call's arguments, collected

    def feed(self, text: str) -> list:
        self.buf += text
        out = []
        while self.buf:
            if not self.in_body:
                i = self.buf.find("<|message|>")
                if i < 0:
                    break  # a header is short: held until its <|message|>
                self.header += self.buf[:i]
                self.buf = self.buf[i + len("<|message|>"):]
                self.in_body = True
                continue
            at = [(self.buf.find(m), m) for m in self.ENDS if m in self.buf]
            if at:
                i, m = min(at)
                self._body(out, self.buf[:i])
                self.buf = self.buf[i + len(m):]
                self._end(out)
                continue
            keep = _held(self.buf, self.ENDS)
            self._body(out, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    def _channel(self) -> tuple[str, str | None]:
        """(channel, recipient) of the current header."""
        h = self.header.replace("<|start|>", " ").replace("<|channel|>", " ").replace("<|constrain|>", " ")
        words = h.split()
        recipient = next((w[3:] for w in words if w.startswith("to=")), None)
        channel = next((w for w in words if w in ("analysis", "commentary", "final")), "final")
        return channel, recipient

    def _body(self, out: list, text: str) -> None:
        if not text:
            return
        channel, recipient = self._channel()
        if recipient is not None:
            self.body += text
        else:
            out.append((THINKING if channel == "analysis" else CONTENT, text))

    def _end(self, out: list) -> None:
        channel, recipient = self._channel()
        if recipient is not None:
            name = recipient.removeprefix("functions.")
            try:
                args = json.loads(self.body) if self.body.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                args = None
            if isinstance(args, dict):
                out.append((TOOL_CALL, ToolCall(name, args)))
            else:
                out.append((CONTENT, self.body))
        self.header, self.body, self.in_body = "", "", False

    def finish(self) -> list:
        out = []
        if self.in_body:
            channel, recipient = self._channel()
            if recipient is not None:
                self.body += self.buf
                self._end(out)
            elif self.buf:
                out.append((THINKING if channel == "analysis" else CONTENT, self.buf))
        elif self.header + self.buf:  # no <|message|>: not harmony after all
            out.append((CONTENT, self.header + self.buf))
        self.buf, self.header, self.body, self.in_body = "", "", "", False
        return out


def reply_parser(arch: str, chat_template: str | None):
    """The parser for a model's replies, by its architecture and chat template."""
    if arch == "gpt-oss":
        return HarmonyReply()
    template = chat_template or ""
    if "<tool_call>" in template or "<think>" in template:
        return HermesReply()
    return PlainReply()
