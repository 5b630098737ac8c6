"""Tokenization with Hugging Face `tokenizers`, built from the vocabulary inside a GGUF file
(or from a `tokenizer.json` beside the model when there is one).

Three vocabulary kinds are understood, as llama.cpp names them in `tokenizer.ggml.model`:
- ``gpt2``: byte-level BPE with merges and a pre-tokenizer chosen by `tokenizer.ggml.pre`;
- ``llama``: SentencePiece-style BPE ranked by token scores, with byte fallback;
- ``gemma4``: BPE with merges over raw UTF-8 (spaces as `▁`, no leading one), byte fallback.

Detokenization goes through raw bytes per token so a streamed multi-byte character split across
tokens is held back until complete (see `StreamDecoder`).
"""

from __future__ import annotations

import codecs
import datetime
import functools
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# llama.cpp's token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1,
    2,
    3,
    4,
    5,
    6,
)

# Pre-tokenizers of byte-level BPE vocabularies, by `tokenizer.ggml.pre`: the regexes llama.cpp
# splits a text with, applied one after another (each splits the pieces the one before left;
# text between matches stays a piece of its own), and whether a piece that is itself a token
# skips the merges (`ignore_merges`, Llama 3's rule).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_RE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_RE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER_THEN_LOWER = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
)
_GPT4O_RE = (
    _UPPER_THEN_LOWER.replace("{c}", _CONTRACTIONS + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_RE = (
    _UPPER_THEN_LOWER.replace("{c}", "")
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)

# DeepSeek LLM's letters and punctuation, as explicit ranges (its tokenizer.json lists them)
_DEEPSEEK_LLM_LETTERS = "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)


# (names, regexes, ignore_merges, BOS added when the file does not say)
_PRE_TOKENIZER_TABLE = [
    (
        ("default",),
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]"),
        False,
        False,
    ),
    (
        (
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "granite-docling",
            "a.x-4.0",
            "mellum",
        ),
        (_GPT2_RE,),
        False,
        False,
    ),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        (_LLAMA3_RE,),
        True,
        True,
    ),
    (("dbrx", "smaug-bpe"), (_LLAMA3_RE,), False, False),
    (
        (
            "qwen2",
            "deepseek-r1-qwen",
            "stablelm2",
            "megrez",
            "hunyuan",
            "solar-open",
            "kormo",
            "f2llmv2",
        ),
        (_QWEN2_RE,),
        False,
        False,
    ),
    (("qwen35",), (_QWEN35_RE,), False, False),
    (
        (
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        (r"\p{N}", _GPT2_RE),
        False,
        False,
    ),
    (("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_RE, r"[0-9][0-9][0-9]"), False, False),
    (
        ("deepseek-coder",),
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"),
        False,
        False,
    ),
    (("deepseek-llm",), _DEEPSEEK_LLM, False, False),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK_V3, False, False),
    (("gpt-4o", "llama4", "kanana2", "talkie"), (_GPT4O_RE,), False, False),
    (("tekken",), (_TEKKEN_RE,), True, True),
]
_PRE_TOKENIZERS = {
    name: (regexes, ignore, bos)
    for names, regexes, ignore, bos in _PRE_TOKENIZER_TABLE
    for name in names
}

# Texts that end generation (llama.cpp's list; such a token counts only if it is a control
# token, which llama.cpp makes it, whatever its type).
_END_OF_GENERATION = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "[e~[",
}
# gpt-oss's harmony markup, which llama.cpp renders as text whatever its type (so that a chat
# parser can split the reasoning from the answer)
_HARMONY_MARKUP = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}
# Texts llama.cpp turns into control tokens whatever type the file gives them (so they are
# parsed only with `special=True` and dropped when detokenizing without it): the above and
# fill-in-the-middle markers.
_CONTROL_BY_TEXT = _END_OF_GENERATION | {
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<\uff5cfim\u2581begin\uff5c>",
    "<PRE>",
    "\u2581<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<\uff5cfim\u2581hole\uff5c>",
    "<SUF>",
    "\u2581<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<\uff5cfim\u2581end\uff5c>",
    "<MID>",
    "\u2581<MID>",
    "<|code_middle|>",
    "<|middle|>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_pre_tokenizer(regexes: tuple[str, ...]) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges for a SentencePiece vocabulary: every split of a piece into two pieces, ranked by
    the merged piece's score (higher first). llama.cpp's SPM tokenizer joins the adjacent pair
    whose join is the best-scored token of any type, leftmost first among equals. BPE over these
    merges does the same, except that two different tokens of equal score are ordered by id
    (SentencePiece gives every normal piece its own score, so only zero-scored specials tie)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, pid in vocab.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((-scores[pid], pid, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` as pairs. As llama.cpp reads them, the separator is the first
    space after the first character (Gemma 4's merges may start with a space)."""
    out = []
    for m in metadata.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)
        if cut < 0:
            raise ValueError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        out.append((m[:cut], m[cut + 1 :]))
    return out


# `▁` back to spaces, `<0xNN>` pieces back to bytes (SentencePiece and Gemma 4 vocabularies)
_SPM_DECODER = decoders.Sequence(
    [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
)


def _rstripped_specials(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int]
) -> set[str]:
    """Special tokens that swallow the whitespace after them. GGUF has no field for this;
    llama.cpp sets it for Phi-3 by the model's name, and so does this."""
    name = str(metadata.get("general.name") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    out = {
        t for t, k in zip(tokens, types) if k in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)
    }
    return (out | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"}


def _raise_exception(message: str):
    raise ValueError(f"chat template error: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    # Hugging Face's `tojson`: plain JSON, where Jinja's own escapes HTML characters
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


class GGUFTokenizer:
    """Tokenizer for one model, from its GGUF metadata (or a tokenizer.json beside it)."""

    def __init__(self, metadata: Mapping[str, Any], model_path: str | os.PathLike | None = None):
        self.kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if self.kind not in ("gpt2", "llama", "gemma4") or not tokens:
            raise ValueError(
                f"the model's tokenizer ({self.kind!r}) is not supported: expected tokenizer.ggml.model 'gpt2', 'llama' "
                "or 'gemma4' with tokenizer.ggml.tokens"
            )
        self.tokens: list[str] = list(tokens)
        n = len(self.tokens)
        control_by_text = _CONTROL_BY_TEXT
        if "<|tool_response>" in self.tokens or "<|plamo:eos|>" in self.tokens:
            # Gemma 4's and PLaMo's `</s>` is a normal token (llama.cpp)
            control_by_text = control_by_text - {"</s>"}
        # gpt-oss's harmony format, as llama.cpp reads it: its markup is always rendered, and
        # where the vocabulary has <|return|> and <|call|> (or <|calls|> and <|flush|>),
        # <|end|> closes a message inside the answer (the reasoning) instead of ending it
        vocab = set(self.tokens)
        harmony = "<|end|>" in vocab and (
            {"<|return|>", "<|call|>"} <= vocab or {"<|calls|>", "<|flush|>"} <= vocab
        )
        rendered = _HARMONY_MARKUP | ({"<|end|>"} if harmony else set())
        # (the server splits such a model's reasoning from its answer: `harmony.HarmonySplit`)
        self.harmony: bool = harmony and {"<|channel|>", "<|message|>"} <= vocab
        self.types: list[int] = [
            TOKEN_USER_DEFINED
            if t in rendered
            else TOKEN_CONTROL
            if k in (TOKEN_NORMAL, TOKEN_USER_DEFINED) and t in control_by_text
            else k
            for t, k in zip(
                self.tokens, metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * n
            )
        ]
        self.bos_token_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        # a BPE file without a pre-tokenizer gets "default", as in llama.cpp
        self.pre: str | None = (
            metadata.get("tokenizer.ggml.pre", "default") if self.kind == "gpt2" else None
        )
        # a tokenizer.json beside the model brings its own pre-tokenizer
        beside = (
            os.path.join(os.path.dirname(os.fspath(model_path)), "tokenizer.json")
            if model_path
            else None
        )
        beside = beside if beside and os.path.isfile(beside) else None
        known_pre = self.pre in _PRE_TOKENIZERS
        if self.kind == "gpt2" and not known_pre and beside is None:
            raise ValueError(
                f"the model's pre-tokenizer tokenizer.ggml.pre={self.pre!r} is not supported; supported: "
                + ", ".join(sorted(_PRE_TOKENIZERS))
                + " (or put the model's tokenizer.json beside the GGUF file)"
            )
        default_bos = self.kind == "llama" or (
            self.kind == "gpt2" and known_pre and _PRE_TOKENIZERS[self.pre][2]
        )
        # llama.cpp adds Gemma 4's BOS even where its file says not to
        self.add_bos: bool = self.kind == "gemma4" or bool(
            metadata.get("tokenizer.ggml.add_bos_token", default_bos)
        )
        self.add_space_prefix: bool = bool(
            metadata.get("tokenizer.ggml.add_space_prefix", self.kind == "llama")
        )
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")

        self.token_bytes: list[bytes] = [self._piece_bytes(i) for i in range(n)]
        self.special_ids = frozenset(
            i for i, t in enumerate(self.types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)
        )
        eog = {i for i in self.special_ids if self.tokens[i] in _END_OF_GENERATION}
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
            if metadata.get(key) is not None:
                eog.add(int(metadata[key]))
        if harmony:
            eog -= {self.tokens.index("<|end|>")}
        self.end_of_generation = frozenset(eog)

        if beside is not None:
            self._tok = Tokenizer.from_file(beside)
        elif self.kind == "gpt2":
            self._tok = self._build_gpt2(metadata)
        elif self.kind == "gemma4":
            self._tok = self._build_gemma4(metadata)
        else:
            self._tok = self._build_spm(metadata)
        # Texts matched before the tokenizer runs, as llama.cpp does: control and unknown tokens
        # only when asked to (`special=True`), user-defined ones always.
        rstrip = _rstripped_specials(metadata, self.tokens, self.types)

        def added(kinds: tuple[int, ...]) -> list[AddedToken]:
            return [
                AddedToken(t, normalized=False, rstrip=t in rstrip)
                for t, k in zip(self.tokens, self.types)
                if k in kinds
            ]

        self._tok.add_special_tokens(added((TOKEN_CONTROL, TOKEN_UNKNOWN)))
        self._tok.add_tokens(added((TOKEN_USER_DEFINED,)))
        self._lock = threading.Lock()

    def _piece_bytes(self, i: int) -> bytes:
        piece, kind = self.tokens[i], self.types[i]
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN, TOKEN_UNUSED):
            return piece.encode("utf-8")
        if self.kind == "gpt2":
            try:
                return bytes(_BYTE_DECODER[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        if kind == TOKEN_BYTE and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def _build_gpt2(self, metadata: Mapping[str, Any]) -> Tokenizer:
        vocab = {t: i for i, t in enumerate(self.tokens)}
        regexes, ignore_merges, _ = _PRE_TOKENIZERS[self.pre]
        tok = Tokenizer(models.BPE(vocab, _merges(metadata), ignore_merges=ignore_merges))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(regexes)
        tok.decoder = decoders.ByteLevel()
        return tok

    def _build_gemma4(self, metadata: Mapping[str, Any]) -> Tokenizer:
        vocab = {t: i for i, t in enumerate(self.tokens)}
        tok = Tokenizer(models.BPE(vocab, _merges(metadata), byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        # llama.cpp splits only lines from runs of newlines (no newline inside a merge)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
        tok.decoder = _SPM_DECODER
        return tok

    def _build_spm(self, metadata: Mapping[str, Any]) -> Tokenizer:
        scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(self.tokens))
        vocab = {t: i for i, t in enumerate(self.tokens)}
        unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)
        tok = Tokenizer(
            models.BPE(
                vocab,
                _spm_merges(self.tokens, scores),
                unk_token=self.tokens[unk_id],
                byte_fallback=True,
                fuse_unk=True,
            )
        )
        norms = [normalizers.Replace(" ", "\u2581")]
        if self.add_space_prefix:
            norms.insert(0, normalizers.Prepend("\u2581"))
        tok.normalizer = normalizers.Sequence(norms)
        tok.decoder = _SPM_DECODER
        return tok

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a conversation in `chat_template`, rendered as Hugging Face's
        `apply_chat_template` renders it (sandboxed Jinja with `raise_exception`, `strftime_now`,
        loop controls and its `tojson`). A template that fails names itself in a ValueError."""
        template = self.chat_template
        if not template:
            raise ValueError(
                "the model has no tokenizer.chat_template; use generate() with a plain prompt"
            )
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
            )
        for m in messages:
            if (
                not isinstance(m, Mapping)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
        bos = self.tokens[self.bos_token_id] if self.bos_token_id is not None else ""
        eos = self.tokens[self.eos_token_id] if self.eos_token_id is not None else ""
        try:
            return (
                _chat_environment()
                .from_string(template)
                .render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=bos,
                    eos_token=eos,
                )
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from None

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of `text`. `special=True` turns control-token texts such as `<|im_start|>`
        into their ids (chat templates need this); otherwise they are plain text."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            # a lone surrogate ("\ud800") is a str but not text: no UTF-8, so no tokens
            raise ValueError(
                f"text is not valid Unicode: a lone surrogate {text[e.start]!r} at index {e.start}"
            ) from None
        with self._lock:
            self._tok.encode_special_tokens = not special
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_token_id is not None:
            ids = [int(self.bos_token_id)] + ids
        return ids

    def decode_bytes(self, ids: Iterable[int], special: bool = False) -> bytes:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.token_bytes):
                raise ValueError(
                    f"token id {i} is out of range (vocabulary has {len(self.token_bytes)})"
                )
            if i in self.special_ids and not special:
                continue
            out.append(self.token_bytes[i])
        data = b"".join(out)
        if self.kind == "llama" and self.add_space_prefix and data.startswith(b" "):
            data = data[1:]
        return data

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        return self.decode_bytes(ids, special).decode("utf-8", errors="replace")


class StreamDecoder:
    """Turns a stream of token ids into text pieces that never split a UTF-8 character."""

    def __init__(self, tokenizer: GGUFTokenizer, special: bool = False):
        self._tok = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        if token_id in self._tok.special_ids and not self._special:
            return ""
        data = self._tok.token_bytes[token_id]
        if (
            self._first
            and self._tok.kind == "llama"
            and self._tok.add_space_prefix
            and data.startswith(b" ")
        ):
            data = data[1:]
        self._first = False
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
