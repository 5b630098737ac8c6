"""Training text as tokens: reads text files and folders, tokenizes them with a model's own
tokenizer and keeps them as one compact shard (`.npz`: uint16 tokens where the vocabulary has
at most 65,536 pieces, else uint32), so tens of millions of tokens travel in a few tens of MB.

The evaluation text is kept out by file: whole files go to the held-out slice (those named by
`eval_paths`, else every file whose name hashes into the `eval_fraction` share), never a part
of a file the training also reads. A corpus of a single file is the one exception: its last
`eval_fraction` of tokens is held out, which the shard's metadata says.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = (".txt", ".rst", ".md", ".pod", ".html")
SHARD_VERSION = 1


class _HtmlText(HTMLParser):
    """The text of an HTML page without its scripts, styles and navigation."""

    SKIP = {"script", "style", "nav", "head", "footer"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.depth = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.depth += 1
        elif tag in ("p", "div", "li", "pre", "br", "h1", "h2", "h3", "h4", "tr", "dt", "dd"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if not self.depth:
            self.parts.append(data)


def read_text(path: Path) -> str:
    """A file's text: HTML pages reduced to what a reader sees, other files as they are."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".html":
        parser = _HtmlText()
        parser.feed(text)
        text = re.sub(r"\n\s*\n+", "\n\n", "".join(parser.parts)).strip()
    return text


def text_files(paths: list[str] | str) -> list[Path]:
    """The files of `paths`: files as given, folders searched for text files (*.txt, *.rst,
    *.md, *.pod, *.html) in sorted order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(
                sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            )
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"corpus path {str(p)!r} does not exist")
    if not files:
        raise ValueError(f"no text files found in {[str(p) for p in paths]}")
    return files


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary: shards are only read with the tokenizer that wrote them."""
    h = hashlib.sha256()
    for t in tokenizer.tokens:
        h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


def _is_eval(path: Path, eval_fraction: float) -> bool:
    # a stable hash of the file's name (not of the run), so the split is the same everywhere
    return (zlib.crc32(path.name.encode()) % 10_000) < eval_fraction * 10_000


def pack(
    tokenizer,
    corpus: list[str] | str,
    output: str | None = None,
    eval_paths: list[str] | str | None = None,
    eval_fraction: float = 0.05,
    max_tokens: int | None = None,
) -> dict:
    """Tokenizes `corpus` with `tokenizer` (a `GGUFTokenizer`, e.g. `Engine.load(model).tokenizer`).
    Returns {"train", "eval" (token arrays), "meta" (dict)}; with `output`, also writes the shard
    there. Documents are separated by the end-of-text token where the vocabulary has one.
    `max_tokens` stops reading training files once that many tokens are packed."""
    if not (isinstance(eval_fraction, (int, float)) and 0.0 < eval_fraction < 1.0):
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    files = text_files(corpus)
    held = {f.resolve() for f in text_files(eval_paths)} if eval_paths else None
    n_vocab = len(tokenizer.tokens)
    dtype = np.uint16 if n_vocab <= 1 << 16 else np.uint32
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id

    def tokens_of(f: Path) -> list[int]:
        ids = tokenizer.encode(read_text(f), add_bos=False)
        return ids + ([sep] if sep is not None else [])

    train_files = [
        f
        for f in files
        if (f.resolve() not in held if held is not None else not _is_eval(f, eval_fraction))
    ]
    if held is not None:
        eval_files = text_files(eval_paths)
    else:
        eval_files = [f for f in files if _is_eval(f, eval_fraction)]
        if not eval_files and len(files) > 1:
            # no name hashed into the share: hold out the last file instead
            eval_files, train_files = files[-1:], files[:-1]
    train: list[int] = []
    used_train: list[str] = []
    for f in train_files:
        train.extend(tokens_of(f))
        used_train.append(str(f))
        if max_tokens is not None and len(train) >= max_tokens:
            del train[max_tokens:]
            break
    held_out: list[int] = []
    for f in eval_files:
        held_out.extend(tokens_of(f))
    split = "by file"
    if not eval_files:
        # one file: its tail is the held-out slice
        cut = int(len(train) * (1 - eval_fraction))
        train, held_out = train[:cut], train[cut:]
        split = f"last {eval_fraction:.0%} of the only file"
    meta = {
        "version": SHARD_VERSION,
        "n_vocab": n_vocab,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "train_tokens": len(train),
        "eval_tokens": len(held_out),
        "train_files": used_train,
        "eval_files": [str(f) for f in eval_files],
        "split": split,
    }
    shard = {
        "train": np.asarray(train, dtype=dtype),
        "eval": np.asarray(held_out, dtype=dtype),
        "meta": meta,
    }
    if output is not None:
        tmp = f"{output}.tmp.npz"
        np.savez_compressed(
            tmp,
            train=shard["train"],
            eval=shard["eval"],
            meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
        )
        os.replace(tmp, output)
    return shard


def is_shard(path: str | os.PathLike) -> bool:
    return str(path).endswith(".npz") and os.path.isfile(path)


def load_shard(path: str | os.PathLike, tokenizer=None) -> dict:
    """A shard written by `pack`; with `tokenizer`, checked to come from the same vocabulary."""
    try:
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            shard = {"train": z["train"], "eval": z["eval"], "meta": meta}
    except (KeyError, ValueError, OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path} is not a token shard written by `powerinfer-rs pack` ({e})"
        ) from e
    if meta.get("version") != SHARD_VERSION:
        raise ValueError(
            f"{path}: shard version {meta.get('version')!r}, this version reads {SHARD_VERSION}"
        )
    if tokenizer is not None and meta["tokenizer"] != tokenizer_fingerprint(tokenizer):
        raise ValueError(
            f"{path} was tokenized with another vocabulary than this model's; pack the text again for it"
        )
    return shard
