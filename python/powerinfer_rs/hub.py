"""Model files named `hf://owner/repo/path/file.gguf` (or `hf://owner/repo@revision/file.gguf`),
downloaded from the Hugging Face Hub through `huggingface_hub`: cached where it caches (HF_HOME,
HF_HUB_CACHE), from the endpoint it is pointed at (HF_ENDPOINT), offline when it is told to be
(HF_HUB_OFFLINE=1: only what is already cached)."""

from __future__ import annotations

import os

PREFIX = "hf://"


def is_hub_path(path: object) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def parse(uri: str) -> tuple[str, str, str | None]:
    """(repo_id, filename, revision) of an `hf://` name; ValueError naming what is missing."""
    rest = uri[len(PREFIX) :]
    parts = rest.split("/")
    if len(parts) < 3 or not all(parts):
        raise ValueError(
            f"{uri!r}: expected hf://owner/repo/file.gguf (or hf://owner/repo@revision/path/file.gguf)"
        )
    owner, repo, filename = parts[0], parts[1], "/".join(parts[2:])
    revision = None
    if "@" in repo:
        repo, revision = repo.split("@", 1)
        if not repo or not revision:
            raise ValueError(f"{uri!r}: expected hf://owner/repo@revision/file.gguf")
    return f"{owner}/{repo}", filename, revision


def resolve(path: str | os.PathLike) -> str:
    """A local path for `path`: itself, or for an `hf://` name the cached download."""
    if not is_hub_path(path):
        return os.fspath(path)
    repo_id, filename, revision = parse(path)
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError as e:  # a dependency, so only a broken install gets here
        raise ImportError(
            f"{path}: downloading from the Hugging Face Hub needs huggingface_hub ({e})"
        ) from e
    try:
        return huggingface_hub.hf_hub_download(repo_id, filename, revision=revision)
    except errors.LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"{path}: not in the Hugging Face cache and the Hub cannot be reached "
            f"(offline mode, HF_HUB_OFFLINE=1, or no connection): {e}"
        ) from e
    except errors.RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"{path}: the Hub has no repository {repo_id!r} (or it needs a token: HF_TOKEN)"
        ) from e
    except errors.RevisionNotFoundError as e:
        raise FileNotFoundError(
            f"{path}: repository {repo_id!r} has no revision {revision!r}"
        ) from e
    except errors.EntryNotFoundError as e:
        raise FileNotFoundError(f"{path}: repository {repo_id!r} has no file {filename!r}") from e
    except errors.HfHubHTTPError as e:
        raise OSError(f"{path}: the Hub refused the download: {e}") from e
