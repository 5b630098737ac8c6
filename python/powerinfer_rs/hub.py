"""Model files named `hf://owner/repo/path/file.gguf` (or `hf://owner/repo@revision/file.gguf`),
downloaded from the Hugging Face Hub through `huggingface_hub`: cached where it caches (HF_HOME,
HF_HUB_CACHE), from the endpoint it is pointed at (HF_ENDPOINT), offline when it is told to be
(HF_HUB_OFFLINE=1: only what is already cached).

Without a network, huggingface_hub retries its first request for about 30 seconds before it
gives up; a quick connection test to the endpoint (or the proxy in front of it) comes first, so
that an offline machine gets its cached copy, or a clear error, at once."""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
import urllib.request

PREFIX = "hf://"
# How long the Hub (or the proxy) may take to accept a connection before it counts as
# unreachable: the Hub answers within a second from anywhere it can be reached at all.
CONNECT_TIMEOUT = 3.0


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


def unreachable(endpoint: str, timeout: float = CONNECT_TIMEOUT) -> str | None:
    """Why no connection to `endpoint` opens within `timeout` seconds (the name does not
    resolve, the connection is refused, no answer), or None when one does. With a proxy set for
    the endpoint (HTTPS_PROXY, ALL_PROXY, not bypassed by NO_PROXY), the proxy is what is tried."""
    url = urllib.parse.urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        host, port = p.hostname or "", p.port or (443 if p.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except socket.gaierror:
            outcome.append(f"the name {host} does not resolve")
        except TimeoutError:
            outcome.append(f"no answer from {host}:{port} within {timeout:g} s")
        except OSError as e:
            outcome.append(f"{host}:{port}: {(e.strerror or str(e)).lower()}")

    # in a thread, so that a resolver that hangs is bounded by the same timeout
    attempt = threading.Thread(target=connect, daemon=True)
    attempt.start()
    attempt.join(timeout + 0.5)
    return outcome[0] if outcome else f"no answer from {host}:{port} within {timeout:g} s"


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
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        why = unreachable(constants.ENDPOINT)
        if why is not None:
            # what huggingface_hub itself falls back to after its retries: the cached copy
            try:
                return huggingface_hub.hf_hub_download(
                    repo_id, filename, revision=revision, local_files_only=True
                )
            except errors.LocalEntryNotFoundError:
                raise FileNotFoundError(
                    f"{path}: the Hugging Face Hub at {constants.ENDPOINT} cannot be reached ({why}) "
                    f"and the file is not in the cache ({constants.HF_HUB_CACHE}): connect to the "
                    "network, or point HF_ENDPOINT at a mirror that can be reached"
                ) from None
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
