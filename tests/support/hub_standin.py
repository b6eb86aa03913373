"""A stand-in for the Hugging Face hub: the HTTP the real `huggingface_hub` client uses.

The hub is unreachable here, so tests point the real client at this server with
HF_ENDPOINT: repository info (`/api/models/<repo>/revision/<rev>`) and file
downloads (`/<repo>/resolve/<rev>/<file>`, HEAD and GET with Range), answered with
the headers the client reads (X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size).
Weights are served as LFS objects (their ETag is their SHA-256, as on the hub). It
counts the bytes it serves per file, so a test can tell who downloaded what.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import Counter
from pathlib import Path

from aiohttp import web


class HubStandIn:
    def __init__(self, repo: str, folder: Path, commit: str, address: str, port: int) -> None:
        self.repo, self.folder, self.commit = repo, folder, commit
        self.address, self.port = address, port
        self.served: Counter[str] = Counter()
        self.etags = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{file}", self._file)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.address, self.port).start()

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _known(self, request: web.Request) -> bool:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        return repo == self.repo and request.match_info["rev"] in ("main", self.commit)

    async def _info(self, request: web.Request) -> web.Response:
        if not self._known(request):
            return web.json_response({"error": "Repository not found"}, status=404)
        siblings = [{"rfilename": name} for name in sorted(self.etags)]
        return web.json_response(
            {"id": self.repo, "modelId": self.repo, "sha": self.commit, "siblings": siblings}
        )

    async def _tree(self, request: web.Request) -> web.Response:
        if not self._known(request):
            return web.json_response({"error": "Repository not found"}, status=404)
        entries = []
        for name, etag in sorted(self.etags.items()):
            size = (self.folder / name).stat().st_size
            entry: dict[str, object] = {"type": "file", "path": name, "size": size, "oid": etag}
            if name.endswith(".safetensors"):
                entry["lfs"] = {"oid": etag, "size": size, "pointerSize": 134}
            entries.append(entry)
        return web.json_response(entries)

    async def _file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["file"]
        path = self.folder / name
        if not self._known(request) or name not in self.etags:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
        size = path.stat().st_size
        headers = {
            "X-Repo-Commit": self.commit,
            "ETag": f'"{self.etags[name]}"',
            "Accept-Ranges": "bytes",
        }
        if name.endswith(".safetensors"):
            headers["X-Linked-Etag"] = f'"{self.etags[name]}"'
            headers["X-Linked-Size"] = str(size)
        if request.method == "HEAD":
            headers["Content-Length"] = str(size)
            return web.Response(status=200, headers=headers)
        start = 0
        if request.http_range.start is not None:
            start = request.http_range.start
        data = path.read_bytes()[start:]
        self.served[name] += len(data)
        status = 206 if start else 200
        if start:
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        return web.Response(status=status, body=data, headers=headers)
