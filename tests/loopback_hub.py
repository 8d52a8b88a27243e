"""A Hugging Face hub on loopback for the tests: the endpoints ``huggingface_hub`` calls to download a repository
(revision info, the file tree, HEAD and GET of each file), serving folders the test wrote, so that hub ids are
tested for real without the internet.

    with LoopbackHub() as hub:
        hub.add("org/tiny", folder)                      # a model repo at revision "main" (and its commit sha)
        hub.add("org/data", folder, kind="datasets")     # a dataset repo
        hub.private.add("org/secret"); hub.gated.add("org/gated")   # 401 without the token / 403 gated
        env = {"HF_ENDPOINT": hub.url, ...}              # a subprocess; in-process: hub.patch(monkeypatch)

Requests are counted per path (``hub.requests``), so a test can show that an offline run made none.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

TOKEN = "hf_loopback_token"


class LoopbackHub:
    def __init__(self):
        # (kind, repo id) -> {"refs": {revision name: sha}, "commits": {sha: {path: bytes}}}
        self.repos: dict[tuple[str, str], dict] = {}
        self.private: set[str] = set()  # answered 401 unless the request carries TOKEN
        self.gated: set[str] = set()  # answered 403 (gated) unless the request carries TOKEN
        self.requests: Counter = Counter()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, head=True)

            def do_GET(self):
                hub._answer(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, folder: str | Path, kind: str = "models", revision: str = "main") -> str:
        """Serve every file under ``folder`` as ``repo_id`` at ``revision`` (a branch name such as ``main`` or
        ``refs/convert/parquet``); returns its commit sha."""
        files = {
            p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()
        }
        digest = sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items())
        sha = hashlib.sha1(repr((revision, digest)).encode()).hexdigest()
        repo = self.repos.setdefault((kind, repo_id), {"refs": {}, "commits": {}})
        repo["refs"][revision] = sha
        repo["commits"][sha] = files
        return sha

    def patch(self, monkeypatch) -> None:
        """Point this process's huggingface_hub at the hub (its endpoint is read when it is imported) and let it
        go online (the test environment sets HF_HUB_OFFLINE)."""
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", self.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    # --- the endpoints -------------------------------------------------------------------------------------
    def _answer(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        raw = urlparse(req.path).path
        path = unquote(raw)
        self.requests[path] += 1
        parts = [unquote(x) for x in raw.strip("/").split("/")]  # a revision may hold quoted slashes
        try:
            if parts[0] == "api" and parts[1] in ("models", "datasets"):
                kind, repo_id, rest = parts[1], "/".join(parts[2:4]), parts[4:]
                repo = self._repo(req, kind, repo_id)
                if repo is None:
                    return
                if rest[:1] in (["revision"], ["tree"]) or not rest:
                    sha = self._sha(repo, rest[1] if rest else "main")
                    if sha is None:
                        return self._error(req, 404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
                    files = repo["commits"][sha]
                    if rest[:1] == ["tree"]:
                        tree = [
                            {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for f, b in files.items()
                        ]
                        return self._json(req, tree)
                    siblings = [{"rfilename": f} for f in files]
                    return self._json(req, {"id": repo_id, "sha": sha, "siblings": siblings, "private": False})
                return self._error(req, 404, "EntryNotFound", f"no endpoint {path}")
            # /{repo_id}/resolve/{revision}/{file} (models) or /datasets/{repo_id}/resolve/...
            kind = "models"
            if parts[0] == "datasets":
                kind, parts = "datasets", parts[1:]
            repo_id, (verb, revision), name = "/".join(parts[:2]), parts[2:4], "/".join(parts[4:])
            if verb != "resolve":
                return self._error(req, 404, "EntryNotFound", f"no endpoint {path}")
            repo = self._repo(req, kind, repo_id)
            if repo is None:
                return
            sha = self._sha(repo, revision)
            if sha is None:
                return self._error(req, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            if name not in repo["commits"][sha]:
                return self._error(req, 404, "EntryNotFound", f"{name} does not exist")
            body = repo["commits"][sha][name]
            req.send_response(200)
            req.send_header("Content-Length", str(len(body)))
            req.send_header("ETag", '"' + hashlib.sha1(body).hexdigest() + '"')
            req.send_header("X-Repo-Commit", sha)
            req.end_headers()
            if not head:
                req.wfile.write(body)
        except (IndexError, ValueError):
            self._error(req, 404, "EntryNotFound", f"no endpoint {path}")

    @staticmethod
    def _sha(repo: dict, revision: str) -> str | None:
        return revision if revision in repo["commits"] else repo["refs"].get(revision)

    def _repo(self, req, kind: str, repo_id: str):
        authorized = req.headers.get("authorization") == f"Bearer {TOKEN}"
        if repo_id in self.private and not authorized:
            self._error(req, 401, "RepoNotFound", "Invalid username or password.")
            return None
        if repo_id in self.gated and not authorized:
            self._error(req, 403, "GatedRepo", f"Access to model {repo_id} is restricted.")
            return None
        repo = self.repos.get((kind, repo_id))
        if repo is None:
            self._error(req, 404, "RepoNotFound", "Repository not found")
        return repo

    @staticmethod
    def _json(req, obj) -> None:
        body = json.dumps(obj).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    @staticmethod
    def _error(req, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        req.send_response(status)
        req.send_header("X-Error-Code", code)
        req.send_header("X-Error-Message", message)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(body)
