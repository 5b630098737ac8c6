"""The server against its own OpenAPI schema (`/openapi.json`), fuzzed by Schemathesis: requests
generated from the schema (valid and invalid), and the methods and bodies it does not declare.
No response may be a 5xx, and every response must match the schema: a declared status code,
content type and headers, and a body of the declared shape (errors in OpenAI's shape; `Allow`
on a 405).

Schemathesis' "positive data acceptance" check is left out, on purpose: the schema accepts the
whole OpenAI request (unknown fields too, as newer clients send them), and the routes refuse with
a 400 naming the field what this engine cannot honour (`n` > 1, `logprobs`, tools, ...)."""

import shutil
import subprocess
import sys

from serving import Server
from synth import write_model

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def test_every_response_matches_the_openapi_schema(tmp_path):
    model = write_model(
        tmp_path / "tiny.gguf", n_ctx=256, extra_meta={"tokenizer.chat_template": TEMPLATE}
    )
    s = Server(str(model), n_ctx=256)
    try:
        exe = shutil.which("schemathesis") or [sys.executable, "-m", "schemathesis.cli"]
        cmd = [exe] if isinstance(exe, str) else exe
        r = subprocess.run(
            [
                *cmd,
                "run",
                s.url + "/openapi.json",
                "--checks",
                "all",
                "--exclude-checks",
                "positive_data_acceptance",
                "--max-examples",
                "25",
                "--request-timeout",
                "60",
                "--seed",
                "1",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
        assert "0 passed" not in r.stdout and " passed" in r.stdout
        # the server is still up and answers
        assert s.health()["status"] == "ok"
    finally:
        s.stop()
    assert not any("Traceback" in l for l in s.lines), "".join(s.lines[-40:])
