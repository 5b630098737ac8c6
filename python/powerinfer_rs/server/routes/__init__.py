"""The server's routes, one module per concern: `models` (/health, /v1/models), `completions`
(/v1/completions) and `chat` (/v1/chat/completions). Each reads the shared state from
`app.state.server` (`..state.ServerState`)."""

from . import chat, completions, models

__all__ = ["chat", "completions", "models"]
