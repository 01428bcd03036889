"""A stand-in for the Hugging Face Hub: a local HTTP server speaking the part of the Hub's file
protocol that ``huggingface_hub``'s ``hf_hub_download`` and ``list_repo_files`` use, so that
``hf:`` downloads are tested with no network. Routes:

- ``HEAD``/``GET /{org}/{repo}/resolve/{revision}/{file}``: the file, with the headers the Hub
  sends for an LFS file (``ETag``, ``X-Repo-Commit``, ``X-Linked-Etag`` = its sha256,
  ``X-Linked-Size``) and ``Range`` requests answered ``206``;
- ``GET /api/models/{org}/{repo}/tree/{revision}``: the repository's files.

Knobs a test turns: ``cut_at`` (the next GET of a file sends that many bytes of the body it
announced, then closes the connection), ``stated_sha256`` (the digest the server claims, to
test that a wrong one is refused). Every request is recorded (method, path, Range, bytes sent).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)")


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    sent: int = 0


@dataclass
class HubStandIn:
    """The stand-in's state: repositories of files, the knobs, the requests it answered."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    cut_at: int | None = None
    stated_sha256: dict[str, str] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    url: str = ""

    def sha256(self, repo: str, name: str) -> str:
        return self.stated_sha256.get(name) or hashlib.sha256(self.repos[repo][name]).hexdigest()


def handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            return None

        def do_HEAD(self) -> None:
            self.answer(body=False)

        def do_GET(self) -> None:
            self.answer(body=True)

        def answer(self, body: bool) -> None:
            record = Request(self.command, self.path, self.headers.get("Range"))
            hub.requests.append(record)
            tree = TREE.match(self.path)
            if tree and tree["repo"] in hub.repos:
                files = hub.repos[tree["repo"]]
                listing = [
                    {"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                    for n, d in files.items()
                ]
                self.send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"})
                return
            found = RESOLVE.match(self.path.split("?")[0])
            if not found or found["file"] not in hub.repos.get(found["repo"], {}):
                self.send(404, b'{"error":"Entry not found"}', {"X-Error-Code": "EntryNotFound"})
                return
            data = hub.repos[found["repo"]][found["file"]]
            headers = {
                "ETag": f'"{hub.sha256(found["repo"], found["file"])}"',
                "X-Linked-Etag": f'"{hub.sha256(found["repo"], found["file"])}"',
                "X-Linked-Size": str(len(data)),
                "X-Repo-Commit": COMMIT,
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            start = 0
            asked = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
            if asked:
                start = int(asked[1])
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            part = data[start:]
            if not body:
                self.send(206 if asked else 200, b"", {**headers, "Content-Length": str(len(part))})
                return
            cut, hub.cut_at = hub.cut_at, None
            record.sent = len(part) if cut is None else min(cut, len(part))
            self.send(206 if asked else 200, part[: record.sent], headers, len(part))
            if cut is not None:
                self.close_connection = True

        def send(
            self, status: int, data: bytes, headers: dict[str, str], length: int | None = None
        ) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(data) if length is None else length))
            self.end_headers()
            if data:
                self.wfile.write(data)
                self.wfile.flush()

    return Handler


@contextmanager
def hub_standin() -> Iterator[HubStandIn]:
    """The stand-in, serving on a free port of 127.0.0.1 until the block ends."""
    hub = HubStandIn()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
