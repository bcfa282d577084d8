"""A Hugging Face Hub on loopback for tests: a real HTTP server speaking the routes huggingface_hub 2.4 uses.

huggingface_hub itself is not patched: the client really talks HTTP to this server. It keeps model repos in memory
as git-like commits (branches, tags, commit ids) and serves:

- ``POST /api/repos/create``, ``POST /api/validate-yaml``
- ``POST /api/models/{repo}/preupload/{rev}`` (every file "regular": base64 in the commit, no LFS/Xet)
- ``POST /api/models/{repo}/commit/{rev}`` (ndjson: header, file, deletedFile)
- ``POST /api/models/{repo}/branch/{branch}``, ``POST /api/models/{repo}/tag/{rev}``
- ``GET /api/models/{repo}[/revision/{rev}]`` (model_info: sha, siblings, library_name from the card)
- ``GET /api/models/{repo}/tree/{rev}`` (snapshot_download's file listing)
- ``HEAD|GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag`` and ``Content-Length``

Errors carry the ``X-Error-Code`` header huggingface_hub maps to its exceptions (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``). These are private wire details of huggingface_hub 2.x, hence
the ``huggingface_hub>=2.4,<3`` pin.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

REPO = r"(?P<repo>[^/]+/[^/]+)"
REV = r"(?P<rev>[^/]+)"


def git_blob_id(data: bytes) -> str:
    """The git object id of a file, which the Hub uses as a regular file's ETag and oid."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """A model repo: commits (id -> files), branches and tags (name -> commit id)."""

    private: bool = False
    gated: bool = False
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        if revision in self.tags:
            return self.tags[revision]
        return revision if revision in self.commits else None

    def commit(self, parent: str | None, files: dict[str, bytes], message: str) -> str:
        digest = hashlib.sha1(json.dumps([parent, message, len(self.commits)]).encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + files[path])
        oid = digest.hexdigest()
        self.commits[oid] = files
        return oid


class HubError(Exception):
    """An HTTP error answer with the Hub's error code."""

    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class FakeHub:
    """The server and its state. Use as a context manager; ``url`` is its endpoint.

    Attributes:
        repos: repo id -> :class:`Repo`.
        requests: ``(method, path, authorization header)`` of every request, in order.
        granted_tokens: tokens that may read gated repos.
    """

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.granted_tokens: set[str] = set()
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Shut the server down: later requests are refused, as with no network."""
        self.server.shutdown()
        self.server.server_close()
        for connection in list(self.connections):  # kept-alive connections would otherwise go on being served
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def add_repo(self, repo_id: str, files: dict[str, bytes], gated: bool = False) -> str:
        """Create a repo holding ``files`` on ``main`` (for repos lm-zoo did not publish); returns the commit id."""
        repo = self.repos[repo_id] = Repo(gated=gated)
        repo.branches["main"] = repo.commit(None, dict(files), "initial commit")
        return repo.branches["main"]

    # ----------------------------------------------------------------------------------------------- routes
    def _repo(self, repo_id: str) -> Repo:
        if repo_id not in self.repos:
            raise HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
        return self.repos[repo_id]

    def _commit_id(self, repo: Repo, revision: str) -> str:
        oid = repo.resolve(unquote(revision))
        if oid is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}")
        return oid

    def handle(self, method: str, path: str, auth: str | None, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """Answer one request: ``(status, headers, body)``."""
        with self.lock:  # one request at a time touches the repos (snapshot_download fetches in threads)
            self.requests.append((method, path, auth))
            routes = [
                ("POST", r"/api/repos/create", self._create_repo),
                ("POST", r"/api/validate-yaml", lambda m, a, b: _json({"errors": [], "warnings": []})),
                ("POST", rf"/api/models/{REPO}/preupload/{REV}", self._preupload),
                ("POST", rf"/api/models/{REPO}/commit/{REV}", self._commit),
                ("POST", rf"/api/models/{REPO}/branch/(?P<branch>[^/]+)", self._branch),
                ("POST", rf"/api/models/{REPO}/tag/{REV}", self._tag),
                ("GET", rf"/api/models/{REPO}/tree/{REV}(?:/(?P<sub>.*))?", self._tree),
                ("GET", rf"/api/models/{REPO}(?:/revision/{REV})?", self._info),
                ("HEAD", rf"/{REPO}/resolve/{REV}/(?P<file>.+)", self._resolve),
                ("GET", rf"/{REPO}/resolve/{REV}/(?P<file>.+)", self._resolve),
            ]
            for verb, pattern, route in routes:
                match = re.fullmatch(pattern, urlsplit(path).path)
                if verb == method and match:
                    try:
                        return route(match, auth, body)
                    except HubError as err:
                        headers = {"X-Error-Message": err.message}
                        if err.code:
                            headers["X-Error-Code"] = err.code
                        if err.commit:
                            headers["X-Repo-Commit"] = err.commit
                        return err.status, headers, json.dumps({"error": err.message}).encode()
            return 404, {}, b'{"error": "no such route"}'

    def _create_repo(self, match: re.Match, auth: str | None, body: bytes) -> tuple[int, dict, bytes]:
        payload = json.loads(body)
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        if repo_id in self.repos:  # the Hub names the existing repo; create_repo(exist_ok=True) reads it
            return (
                409,
                {},
                json.dumps({"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}).encode(),
            )
        repo = self.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        repo.branches["main"] = repo.commit(None, {".gitattributes": b"*.safetensors filter=lfs\n"}, "initial commit")
        return _json({"url": f"{self.url}/{repo_id}", "name": repo_id})

    def _preupload(self, match: re.Match, auth: str | None, body: bytes) -> tuple[int, dict, bytes]:
        repo = self._repo(match["repo"])
        files = repo.commits[self._commit_id(repo, match["rev"])]
        answer = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": git_blob_id(files[f["path"]]) if f["path"] in files else None,
            }
            for f in json.loads(body)["files"]
        ]
        return _json({"files": answer})

    def _commit(self, match: re.Match, auth: str | None, body: bytes) -> tuple[int, dict, bytes]:
        repo_id, repo = match["repo"], self._repo(match["repo"])
        branch = unquote(match["rev"])
        parent = self._commit_id(repo, branch)
        files = dict(repo.commits[parent])
        message = ""
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                message = item["value"]["summary"]
            elif item["key"] == "file":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            elif item["key"] == "deletedFile":
                files.pop(item["value"]["path"], None)
            else:
                raise HubError(400, None, f"this test Hub does not support {item['key']}")
        oid = repo.commit(parent, files, message)
        repo.branches[branch] = oid
        return _json({"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid})

    def _branch(self, match: re.Match, auth: str | None, body: bytes) -> tuple[int, dict, bytes]:
        repo, branch = self._repo(match["repo"]), unquote(match["branch"])
        if branch in repo.branches:
            raise HubError(409, None, f"Branch {branch} already exists")
        start = (json.loads(body or b"{}") or {}).get("startingPoint") or "main"
        repo.branches[branch] = self._commit_id(repo, start)
        return _json({})

    def _tag(self, match: re.Match, auth: str | None, body: bytes) -> tuple[int, dict, bytes]:
        repo = self._repo(match["repo"])
        tag = json.loads(body)["tag"]
        if tag in repo.tags:
            raise HubError(409, None, f"Tag {tag} already exists")
        repo.tags[tag] = self._commit_id(repo, match["rev"])
        return _json({})

    def _info(self, match: re.Match, auth: str | None, body: bytes) -> tuple[int, dict, bytes]:
        repo_id, repo = match["repo"], self._repo(match["repo"])
        oid = self._commit_id(repo, match["rev"] or "main")
        files = repo.commits[oid]
        info: dict[str, Any] = {
            "id": repo_id,
            "sha": oid,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "siblings": [{"rfilename": name} for name in sorted(files)],
        }
        if "README.md" in files:  # the Hub reads library_name and tags from the card's metadata
            from huggingface_hub import ModelCard

            data = ModelCard(files["README.md"].decode()).data.to_dict()
            info.update(cardData=data, library_name=data.get("library_name"), tags=data.get("tags", []))
        return _json(info)

    def _tree(self, match: re.Match, auth: str | None, body: bytes) -> tuple[int, dict, bytes]:
        repo = self._repo(match["repo"])
        files = repo.commits[self._commit_id(repo, match["rev"])]
        prefix = unquote(match["sub"] or "")
        entries = [
            {"type": "file", "path": name, "size": len(data), "oid": git_blob_id(data)}
            for name, data in sorted(files.items())
            if name.startswith(prefix)
        ]
        return _json(entries)

    def _resolve(self, match: re.Match, auth: str | None, body: bytes) -> tuple[int, dict, bytes]:
        repo = self._repo(match["repo"])
        oid = self._commit_id(repo, match["rev"])
        if repo.gated and (auth or "").removeprefix("Bearer ") not in self.granted_tokens:
            raise HubError(403, "GatedRepo", "Access to this model is restricted: accept its conditions")
        name = unquote(match["file"])
        if name not in repo.commits[oid]:
            raise HubError(404, "EntryNotFound", f"{name} does not exist", commit=oid)
        data = repo.commits[oid][name]
        return 200, {"X-Repo-Commit": oid, "ETag": f'"{git_blob_id(data)}"'}, data


def _json(value: Any) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(value).encode()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects; every answer has a Content-Length

        def setup(self) -> None:
            super().setup()
            hub.connections.add(self.connection)

        def finish(self) -> None:
            hub.connections.discard(self.connection)
            super().finish()

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    chunk = self.rfile.read(size + 2)[:size]  # each chunk ends with CRLF
                    if size == 0:
                        break
                    chunks.append(chunk)
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _answer(self, method: str) -> None:
            status, headers, data = hub.handle(method, self.path, self.headers.get("Authorization"), self._body())
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._answer("GET")

        def do_HEAD(self) -> None:  # noqa: N802
            self._answer("HEAD")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, format: str, *args: Any) -> None:  # quiet: hub.requests records them
            pass

    return Handler
