"""`powerinfer-rs chat`: an interactive conversation in the terminal.

Answers stream as they are generated. The conversation is kept as long as it fits the context
(the oldest turns are dropped first, the system message never), and the KV cache of the previous
turn is reused, so a new turn evaluates only its new tokens. Ctrl-C stops the answer being
written (what was written stays in the conversation), not the program; Ctrl-D or /exit ends it.
An answer that only repeats itself is ended, with a line saying so (`SamplingSettings.
stop_repetition`, on by default here). With a seed, the whole conversation can be had again:
each turn's seed is drawn from it. A gpt-oss model's reasoning goes to standard error, its
answer to standard output, and only the answer stays in the conversation (as its chat template
expects of earlier turns).
"""

from __future__ import annotations

import random
import signal
import sys
import threading
from typing import TextIO

from .harmony import HarmonySplit, split
from .settings import CHAT, SamplingSettings

HELP = """commands:
  /reset   forget the conversation (the system message stays)
  /exit    quit (so does Ctrl-D)
  /help    this text
  a line ending in \\ continues on the next line; Ctrl-C stops the current answer"""


def fit_history(engine, messages: list[dict], reserve: int) -> tuple[list[dict], list[int]]:
    """The newest part of `messages` whose prompt leaves `reserve` tokens of the context free:
    whole turns are dropped from the oldest on, a leading system message is kept. Returns the
    kept messages and their prompt's token ids; ValueError when even the last message alone
    does not fit."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    while True:
        kept = system + turns
        ids = engine.tokenizer.encode(engine.apply_chat_template(kept), add_bos=False, special=True)
        if len(ids) + reserve <= engine.n_ctx:
            return kept, ids
        if len(turns) <= 1:
            raise ValueError(
                f"the message needs {len(ids)} tokens with the system message, and the context holds "
                f"{engine.n_ctx} with {reserve} kept for the answer (-c sets the context)"
            )
        # drop the oldest exchange: a user message and the answers after it
        turns = turns[1:]
        while len(turns) > 1 and turns[0]["role"] != "user":
            turns = turns[1:]


def _read_message(stdin: TextIO, prompt: str) -> str | None:
    """One message (lines ending in a backslash continue); None at end of input."""
    lines = []
    while True:
        if stdin.isatty():
            line = input(prompt if not lines else "... ")
        else:
            line = stdin.readline()
            if not line:
                if lines:
                    return "\n".join(lines)
                return None
            line = line.rstrip("\n").rstrip("\r")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def run(
    engine,
    sampling: SamplingSettings = CHAT,
    system: str | None = None,
    stdin: TextIO = sys.stdin,
    out: TextIO = sys.stdout,
) -> int:
    """Talks with the user on `stdin`/`out` until end of input or /exit; returns the exit code."""
    if not engine.chat_template:
        raise ValueError("the model has no tokenizer.chat_template; give one with --chat-template")
    interactive = stdin.isatty()
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C stops an answer: a process started with SIGINT ignored (as a shell does for
        # background jobs, or a parent that ignores it) would otherwise never see it
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"{engine!r}\n/help for commands, Ctrl-D to quit", file=sys.stderr)
    print(sampling.describe(), file=sys.stderr)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    cached = None  # (tokens, session) of the last finished answer
    reserve = min(sampling.max_tokens, engine.n_ctx // 2)
    kwargs = sampling.as_kwargs()
    turn_seeds = random.Random(sampling.seed)
    while True:
        try:
            text = _read_message(stdin, "> ")
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /exit quits)", file=sys.stderr)
            continue
        except EOFError:
            text = None
        if text is None:
            if interactive:
                print(file=sys.stderr)
            return 0
        command = text.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command in ("/reset", "/clear"):
            messages, cached = list(start), None
            print("(conversation reset)", file=sys.stderr)
            continue
        if command == "/help":
            print(HELP, file=sys.stderr)
            continue
        if command.startswith("/") and " " not in command:
            print(f"unknown command {command}; /help lists them", file=sys.stderr)
            continue
        if not command:
            continue
        try:
            messages, ids = fit_history(
                engine, messages + [{"role": "user", "content": text}], reserve
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        pieces, gen = [], None
        harmony = HarmonySplit() if engine.tokenizer.harmony else None
        try:
            gen = engine.stream(ids, **dict(kwargs, seed=turn_seeds.getrandbits(64)))
            gen.keep_session = True
            if cached is not None:
                gen.reuse_session(cached[1], cached[0])
                cached = None
            for piece in gen:
                pieces.append(piece)
                if harmony is None:
                    out.write(piece)
                for field, part in harmony.push(piece) if harmony else []:
                    (sys.stderr if field == "reasoning_content" else out).write(part)
                out.flush()
        except KeyboardInterrupt:
            if gen is not None:
                gen.close()
            cached = None
            out.write("\n")
            print("(stopped)", file=sys.stderr)
        else:
            out.write("\n")
            if gen.repetition is not None:
                out.flush()
                print("(stopped: the answer was repeating itself)", file=sys.stderr)
        out.flush()
        answer = "".join(pieces)
        if harmony is not None:
            answer = split(answer)["content"]
        messages.append({"role": "assistant", "content": answer})
        session = gen.finished_session if gen is not None else None
        if session is not None:
            cached = (session.tokens, session)
