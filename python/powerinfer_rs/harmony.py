"""gpt-oss's harmony format, read back from its output: the model writes each message as
`<|channel|>NAME<|message|>TEXT<|end|>` (the first one's header follows the prompt's
`<|start|>assistant`; later ones start with `<|start|>assistant`), the reasoning on the
`analysis` channel and the answer on `final`, and stops with `<|return|>` (or `<|call|>` for a
tool call). `HarmonySplit` turns that text, piece by piece as it streams, into reasoning and
answer, as llama.cpp's server does for `reasoning_content` and `content`.

The markup tokens always decode whole (each is one token the tokenizer renders as text), so a
piece never holds part of one."""

from __future__ import annotations

import re

_MARKUP = re.compile(r"(<\|(?:start|channel|constrain|message|end|return|call)\|>)")


class HarmonySplit:
    """Feed it the output's text in order (`push`); each call returns the (field, text) parts
    of that piece, field "reasoning_content" (the analysis channel) or "content" (any other
    channel). Headers (role, channel name, constraint) and the markup itself are dropped. Text
    the model writes before any markup counts as content, so output that ignores the format
    comes through whole."""

    def __init__(self) -> None:
        self._mode = "header"  # header | body | between
        self._seen_markup = False
        self._in_channel_name = False
        self._channel = ""

    def push(self, piece: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for part in _MARKUP.split(piece):
            if not part:
                continue
            if _MARKUP.fullmatch(part):
                self._seen_markup = True
                self._markup(part)
                continue
            if self._mode == "body":
                field = "reasoning_content" if self._channel == "analysis" else "content"
                out.append((field, part))
            elif self._mode == "header" and self._in_channel_name:
                self._channel += part.strip()
            elif not self._seen_markup or self._mode == "between":
                out.append(("content", part))
        return out

    def _markup(self, m: str) -> None:
        self._in_channel_name = False
        if m == "<|start|>":
            self._mode, self._channel = "header", ""
        elif m == "<|channel|>":
            self._mode, self._channel, self._in_channel_name = "header", "", True
        elif m == "<|constrain|>":
            self._mode = "header"
        elif m == "<|message|>":
            self._mode = "body"
        else:  # <|end|>, <|return|>, <|call|>
            self._mode = "between"


def split(text: str) -> dict[str, str]:
    """A whole output as {"content": ..., "reasoning_content": ...} (the latter only when the
    output has reasoning)."""
    parts = HarmonySplit().push(text)
    out = {"content": "".join(t for f, t in parts if f == "content")}
    reasoning = "".join(t for f, t in parts if f == "reasoning_content")
    if reasoning:
        out["reasoning_content"] = reasoning
    return out
