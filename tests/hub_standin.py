"""A local stand-in for the Hugging Face Hub's HTTP API, enough for `huggingface_hub` to create a model repository,
a branch and a tag, list a branch's files and commit files to it (the machines that run the tests cannot reach the
Hub). The real client talks to it over HTTP; nothing in the client is replaced.

It answers the `preupload` call with "regular" for every file, so files travel inside the commit (base64) rather
than through LFS or Xet storage, which the real Hub would use for large ones; what reaches a branch is the same.
Every request must carry `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Commit:
    oid: str
    summary: str
    description: str
    files: dict[str, bytes]


@dataclass
class Repo:
    private: bool
    branches: dict[str, list[Commit]] = field(default_factory=lambda: {"main": []})
    tags: dict[str, str] = field(default_factory=dict)  # tag -> commit oid

    def head(self, branch: str) -> Commit | None:
        commits = self.branches.get(branch)
        return commits[-1] if commits else None

    def files(self, branch: str) -> dict[str, bytes]:
        head = self.head(branch)
        return dict(head.files) if head else {}


def _blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandIn:
    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) in order
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                standin._handle(self, "GET")

            def do_POST(self):
                standin._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- routing ---------------------------------------------------------------------------------------------------

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        path = urlsplit(request.path).path
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        with self._lock:
            self.requests.append((method, path))
            if request.headers.get("Authorization") != f"Bearer {self.token}":
                return self._reply(request, 401, {"error": "Invalid credentials in Authorization header"})
            try:
                status, payload = self._route(method, path, body)
            except KeyError as err:
                status, payload = 404, {"error": f"not found: {err}"}
        self._reply(request, status, payload)

    def _route(self, method: str, path: str, body: bytes) -> tuple[int, object]:
        if method == "POST" and path == "/api/repos/create":
            spec = json.loads(body)
            repo_id = f"{spec['organization']}/{spec['name']}" if spec.get("organization") else spec["name"]
            if repo_id in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
            self.repos[repo_id] = Repo(private=spec.get("visibility") == "private" or bool(spec.get("private")))
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id}
        parts = path.split("/")
        if len(parts) < 6 or parts[:3] != ["", "api", "models"]:
            raise KeyError(path)
        repo_id, op, rev = f"{parts[3]}/{parts[4]}", parts[5], unquote("/".join(parts[6:]))
        repo = self.repos[repo_id]
        if method == "GET" and op == "revision":
            head = repo.head(rev)
            return 200, {"id": repo_id, "sha": head.oid if head else None, "private": repo.private, "siblings": []}
        if method == "GET" and op == "refs":
            branches = [
                {"name": name, "ref": f"refs/heads/{name}", "targetCommit": commits[-1].oid}
                for name, commits in repo.branches.items()
                if commits
            ]
            tags = [{"name": tag, "ref": f"refs/tags/{tag}", "targetCommit": oid} for tag, oid in repo.tags.items()]
            return 200, {"branches": branches, "tags": tags, "converts": []}
        if method == "GET" and op == "tree":
            files = repo.files(rev) if rev in repo.branches else {}
            return 200, [{"type": "file", "path": p, "oid": _blob_oid(d), "size": len(d)} for p, d in files.items()]
        if method == "POST" and op == "branch":
            if rev in repo.branches:
                return 409, {"error": "Reference already exists"}
            repo.branches[rev] = list(repo.branches["main"])
            return 200, {}
        if method == "POST" and op == "tag":
            tag = json.loads(body)["tag"]
            if tag in repo.tags:
                return 409, {"error": "Tag already exists"}
            branch = repo.head(rev)
            repo.tags[tag] = branch.oid if branch else rev
            return 200, {}
        if method == "POST" and op == "preupload":
            files = json.loads(body)["files"]
            return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
        if method == "POST" and op == "commit":
            return self._commit(repo_id, repo, rev, body)
        raise KeyError(path)

    def _commit(self, repo_id: str, repo: Repo, branch: str, body: bytes) -> tuple[int, object]:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        files = repo.files(branch)
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "deletedFile":
                files.pop(value["path"], None)
            elif line["key"] == "deletedFolder":
                files = {p: d for p, d in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
            elif line["key"] != "header":
                return 400, {"error": f"the stand-in takes regular files only, not {line['key']}"}
        digest = hashlib.sha1(json.dumps(sorted((p, _blob_oid(d)) for p, d in files.items())).encode())
        digest.update(str(len(repo.branches.setdefault(branch, []))).encode())
        commit = Commit(digest.hexdigest(), header["summary"], header.get("description", ""), files)
        repo.branches[branch].append(commit)
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{commit.oid}", "commitOid": commit.oid}

    @staticmethod
    def _reply(request: BaseHTTPRequestHandler, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)
