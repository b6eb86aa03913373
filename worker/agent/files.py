"""A model's files on this node (worker/files.py): what is here (files_status), landing
copied files (files_commit), serving them to another node (serve_files, unserve_files),
and fetching them from one (fetch_files)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import msgspec

from worker import files
from worker.agent.host import Ask, Host, Route, progress_to, route
from worker.shared.protocol import control
from worker.shared.protocol.messages import CodedError

log = logging.getLogger("studiotui.agent")


class Files:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.server: files.FileServer | None = None

    def routes(self) -> Iterable[Route]:
        return (
            route(control.FilesStatus, self.status),
            route(control.FilesCommit, self.commit),
            route(control.ServeFiles, self.serve),
            route(control.UnserveFiles, self.unserve),
            route(control.FetchFiles, self.fetch),
        )

    def hashed_to(self, ask: Ask, total: int) -> Callable[[int], None]:
        """A callback adding bytes hashed, relayed as progress towards `total`."""
        send = progress_to(self.host, ask, "hashing", total)
        seen = [0]

        def add(n: int) -> None:
            seen[0] += n
            send(seen[0], total)

        return add

    async def status(self, ask: Ask, req: control.FilesStatus) -> None:
        on_bytes = self.hashed_to(ask, sum(f.size for f in req.files))
        found = []
        for name in req.dirs:
            directory = files.resolve_dir(self.host.config.home, name)
            try:
                here = await asyncio.to_thread(files.status, directory, req.files, on_bytes)
            except files.FileError as exc:
                raise CodedError("bad_request", str(exc)) from None
            found.append(msgspec.convert({"dir": name, **here}, control.DirStatus))
        await ask.answer(control.FilesFound(dirs=found))

    async def commit(self, ask: Ask, req: control.FilesCommit) -> None:
        directory = files.resolve_dir(self.host.config.home, req.dir)
        on_bytes = self.hashed_to(ask, sum(f.size for f in req.files))
        for f in req.files:
            try:
                await asyncio.to_thread(files.commit, directory, f, on_bytes)
            except files.FileError as exc:
                raise CodedError("failed", str(exc)) from None
            log.info("verified and placed %s in %s", f.name, directory)
        await ask.answer(control.Ok())

    async def serve(self, ask: Ask, req: control.ServeFiles) -> None:
        directory = files.resolve_dir(self.host.config.home, req.dir)
        wanted = {f.name: f.size for f in req.files}
        for name, size in wanted.items():
            path = directory / name
            if not files.plain_name(name) or not path.is_file() or path.stat().st_size != size:
                raise CodedError("not_found", f"{path} is not here at {size} B")
        if self.server is None:
            port = self.host.free_ports(1)[0]
            keys = self.host.config.keys()
            self.server = files.FileServer(self.host.ctx, keys, self.host.config.address, port)
            self.server.start()
        token = self.server.grant(directory, wanted)
        log.info("serving %d files of %s on port %d", len(wanted), directory, self.server.port)
        await ask.answer(control.Granted(port=self.server.port, token=token))

    async def unserve(self, ask: Ask, req: control.UnserveFiles) -> None:
        sent = 0
        if self.server is not None:
            sent = self.server.revoke(req.token)
            if not self.server.grants:
                await self.server.close()
                self.server = None
        await ask.answer(control.Unserved(sent=sent))

    async def fetch(self, ask: Ask, req: control.FetchFiles) -> None:
        directory = files.resolve_dir(self.host.config.home, req.dir)
        total = sum(f.size for f in req.files)
        began = time.monotonic()
        try:
            result = await files.fetch(
                self.host.ctx,
                self.host.config.keys(),
                req.endpoint,
                req.key.encode(),
                req.token,
                directory,
                req.files,
                progress_to(self.host, ask, "copying", total),
            )
        except files.FileError as exc:
            raise CodedError("failed", str(exc)) from None
        log.info(
            "fetched %d B into %s from %s in %.1f s (%d B resumed)",
            result["received"],
            directory,
            req.endpoint,
            time.monotonic() - began,
            result["resumed"],
        )
        await ask.answer(control.Fetched(path=str(directory.resolve()), **result))

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
