"""The chat page at `/` (open to all, as the page is; its requests to /v1/* carry the API key
the user enters)."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()


@cache
def chat_page() -> str:
    return resources.files("powerinfer_rs.server").joinpath("chat.html").read_text("utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(chat_page())
