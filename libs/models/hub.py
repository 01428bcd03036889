"""Model files from outside the cluster: ``hf:ORG/REPO[/FILE]`` from the Hugging Face Hub, and
plain ``https://`` / ``http://`` URLs.

Both resume a download that was cut (a partial file stays beside the target and the next
request asks for the rest with ``Range``), report ``progress(bytes, total)``, and check the
file's sha256 against what the server states before handing it over: the Hub gives an LFS
file's sha256 as ``X-Linked-Etag``; a URL may carry it as ``#sha256=HEX`` (or its server as a
64-hex ``ETag``). A file that does not match is deleted and refused.

A host with no route to the server is told so at once: the host is probed with a
``CONNECT_TIMEOUT_S`` TCP connect before anything else, so an offline host fails in seconds
with the reason, not after the HTTP library's retries.

``hf:`` goes through ``huggingface_hub`` (its cache under ``model_cache_dir()/hub``, the
endpoint ``HF_ENDPOINT`` names, a token from the usual places); tests point ``HF_ENDPOINT``
at a local stand-in for the Hub. ``hf:ORG/REPO`` of a repository with no GGUF but a Hugging
Face model (``config.json`` and ``.safetensors``) downloads that model's folder (``FOLDER``:
its config, weights and tokenizer, each file checked; no other weight format, no code, no
subfolder) and hands over the folder, which vLLM serves.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from libs.models.gguf_info import Progress, sha256_of
from libs.runtime.settings import model_cache_dir

log = logging.getLogger(__name__)

HF_PREFIX = "hf:"
#: Seconds to open a TCP connection to the server: an unreachable host is said so this soon.
CONNECT_TIMEOUT_S = 3.0
#: Seconds without a byte before a transfer is given up (then resumed, ``ATTEMPTS`` times).
READ_TIMEOUT_S = 30.0
ATTEMPTS = 5
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class DownloadError(RuntimeError):
    """A model file could not be downloaded: the cause is in the message."""


@dataclass(frozen=True)
class HfSource:
    """``hf:ORG/REPO[/FILE]``: the repository and, when named, the file in it."""

    repo: str
    file: str | None
    revision: str = "main"


def is_remote(source: str) -> bool:
    """Whether ``source`` names a download (``hf:`` or an http(s) URL), not a local path."""
    return source.startswith(HF_PREFIX) or source.startswith(("https://", "http://"))


def parse_hf(source: str) -> HfSource:
    """``hf:ORG/REPO[/PATH/FILE]`` parsed (``hf:ORG/REPO@REV[/FILE]`` picks a revision)."""
    parts = source.removeprefix(HF_PREFIX).strip("/").split("/")
    if not source.startswith(HF_PREFIX) or len(parts) < 2 or not all(parts):
        raise DownloadError(f"{source!r} is not hf:ORG/REPO or hf:ORG/REPO/FILE")
    repo, _, revision = f"{parts[0]}/{parts[1]}".partition("@")
    return HfSource(repo, "/".join(parts[2:]) or None, revision or "main")


def download(
    source: str,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
    endpoint: str | None = None,
) -> Path:
    """Download ``source`` (``hf:…`` or a URL) and return the checked local file. Raises
    ``DownloadError`` naming the cause (no route, not found, checksum refused)."""
    if source.startswith(HF_PREFIX):
        return download_hf(parse_hf(source), progress, cache_dir, endpoint)
    if source.startswith(("https://", "http://")):
        return download_url(source, progress, cache_dir)
    raise DownloadError(f"{source!r} is neither hf:ORG/REPO[/FILE] nor an http(s) URL")


def reach(url: str) -> None:
    """Raise ``DownloadError`` at once when this host cannot open a TCP connection to
    ``url``'s server within ``CONNECT_TIMEOUT_S``."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), CONNECT_TIMEOUT_S):
            return
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else str(exc)
        raise DownloadError(
            f"this host has no route to {host}:{port} ({reason}, within "
            f"{CONNECT_TIMEOUT_S:.0f} s): download the file where the network reaches it and "
            "add it by path, or set HF_ENDPOINT to a mirror this host reaches"
        ) from None


# -- the Hub -------------------------------------------------------------------------------------
def download_hf(
    source: HfSource,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
    endpoint: str | None = None,
) -> Path:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.is_offline_mode():
        raise DownloadError("HF_HUB_OFFLINE is set on this host: it downloads nothing from the Hub")
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    reach(endpoint)
    try:
        if source.file:
            return _get_hf(source, source.file, progress, cache_dir, endpoint).resolve()
        files = list(
            HfApi(endpoint=endpoint).list_repo_files(source.repo, revision=source.revision)
        )
        folder = folder_files(files)
        if folder is not None and not any(f.lower().endswith(".gguf") for f in files):
            got = [_get_hf(source, f, progress, cache_dir, endpoint) for f in folder]
            return got[0].parent  # the revision's snapshot: the folder, file by file
        return _get_hf(source, _only_gguf(files, source), progress, cache_dir, endpoint).resolve()
    except HfHubHTTPError as exc:
        raise DownloadError(f"the Hub at {endpoint} refused {source.repo}: {exc}") from None
    except (httpx.HTTPError, OSError) as exc:
        raise DownloadError(f"downloading from {endpoint} failed: {exc}") from None


def _get_hf(
    source: HfSource, name: str, progress: Progress | None, cache_dir: Path | None, endpoint: str
) -> Path:
    """One file of the repository, downloaded (resumed) into the Hub's cache and checked."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    url = hf_hub_url(source.repo, name, revision=source.revision, endpoint=endpoint)
    meta = get_hf_file_metadata(url, timeout=READ_TIMEOUT_S, endpoint=endpoint)
    path = hf_hub_download(
        source.repo,
        name,
        revision=source.revision,
        cache_dir=(cache_dir or model_cache_dir()) / "hub",
        endpoint=endpoint,
        etag_timeout=READ_TIMEOUT_S,
        tqdm_class=_reporting(progress) if progress is not None else None,
    )
    local = Path(path)
    _check(local, (meta.etag or "").strip('"').lower(), f"hf:{source.repo}/{name}")
    return local


#: What a Hugging Face model's folder needs, by suffix (its config, weights and tokenizer).
FOLDER = (".json", ".safetensors", ".txt", ".model", ".tiktoken", ".jinja")


def folder_files(files: list[str]) -> list[str] | None:
    """A Hugging Face model's files among a repository's ``files`` (``config.json`` first),
    or None when it holds none (no ``config.json``, or no ``.safetensors`` weights)."""
    top = [f for f in files if "/" not in f]
    if "config.json" not in top or not any(f.endswith(".safetensors") for f in top):
        return None
    return ["config.json", *sorted(f for f in top if f.endswith(FOLDER) and f != "config.json")]


def _only_gguf(files: list[str], source: HfSource) -> str:
    """The repository's one GGUF file (a repository of several must be told which)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if len(ggufs) == 1:
        return str(ggufs[0])
    if not ggufs:
        raise DownloadError(
            f"hf:{source.repo} holds no .gguf file and no Hugging Face model (config.json "
            "and .safetensors weights)"
        )
    listed = ", ".join(sorted(ggufs)[:12])
    raise DownloadError(f"hf:{source.repo} holds several GGUF files; name one: {listed}")


def _reporting(progress: Progress) -> type:
    """A tqdm class that reports to ``progress`` and draws nothing (huggingface_hub's hook)."""
    from tqdm.auto import tqdm

    class Reporting(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done, self.expected = int(kwargs.get("initial") or 0), kwargs.get("total") or 0

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            progress(self.done, int(self.expected or 0))
            return None

    return Reporting


# -- plain URLs ----------------------------------------------------------------------------------
def download_url(url: str, progress: Progress | None = None, cache_dir: Path | None = None) -> Path:
    """``url`` into ``model_cache_dir()/downloads/<hash of url>/<file name>``, resumed from the
    part a cut download left, its sha256 checked against ``#sha256=HEX`` or a 64-hex ETag."""
    plain, _, fragment = url.partition("#")
    expected = fragment.removeprefix("sha256=").lower() if fragment.startswith("sha256=") else ""
    name = Path(urlsplit(plain).path).name or "model.gguf"
    folder = (
        (cache_dir or model_cache_dir())
        / "downloads"
        / hashlib.sha256(plain.encode()).hexdigest()[:16]
    )
    target, part = folder / name, folder / f"{name}.part"
    folder.mkdir(parents=True, exist_ok=True)
    reach(plain)
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    stated = ""
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        for attempt in range(ATTEMPTS):
            try:
                stated = _get(client, plain, part, progress) or stated
                break
            except httpx.TransportError as exc:  # cut: the next attempt asks for the rest
                log.warning("download cut; resuming", extra={"url": plain, "error": str(exc)})
                if attempt == ATTEMPTS - 1:
                    raise DownloadError(
                        f"downloading {plain} failed {ATTEMPTS} times: {exc}"
                    ) from None
            except httpx.HTTPStatusError as exc:
                raise DownloadError(f"{plain} answered {exc.response.status_code}") from None
    _check(part, expected or stated, plain)
    part.replace(target)
    return target


def _get(client: httpx.Client, url: str, part: Path, progress: Progress | None) -> str:
    """Append the rest of ``url`` to ``part``; the sha256 the server states ('' when none)."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with client.stream("GET", url, headers=headers) as response:
        if response.status_code == 416:  # nothing left: the part is whole
            return ""
        response.raise_for_status()
        if response.status_code == 200:
            have = 0  # the server ignored the range: start over
        total = have + int(response.headers.get("content-length") or 0)
        with open(part, "ab" if have else "wb") as file:
            for piece in response.iter_bytes():  # as it arrives: a cut loses nothing received
                file.write(piece)
                have += len(piece)
                if progress is not None:
                    progress(have, total)
        for header in ("x-linked-etag", "etag"):
            value = str(response.headers.get(header, "")).strip('"').lower().removeprefix("w/")
            if SHA256.match(value):
                return value
    return ""


def _check(path: Path, expected: str, what: str) -> None:
    """Refuse (delete) ``path``, and the link to it when it is one, when ``expected`` is a
    sha256 it does not have."""
    if not SHA256.match(expected):
        log.info("no checksum stated; the file is hashed when it is added", extra={"source": what})
        return
    actual = sha256_of(path)
    if actual != expected:
        for gone in (path.resolve(), path):
            with contextlib.suppress(OSError):
                gone.unlink()
        raise DownloadError(
            f"{what}: the downloaded file's sha256 is {actual}, not the {expected} its server "
            "states: refused and deleted"
        )
