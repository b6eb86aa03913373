"""Downloading a model's files from the Hugging Face Hub onto this node (hub_download),
after checking that its disk holds them."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from worker import files
from worker.agent.host import Ask, Host, Route, progress_to, route
from worker.shared.protocol import control
from worker.shared.protocol.messages import CodedError

log = logging.getLogger("studiotui.agent")


class Hub:
    def __init__(self, host: Host) -> None:
        self.host = host

    def routes(self) -> Iterable[Route]:
        return (route(control.HubDownload, self.hub_download),)

    async def hub_download(self, ask: Ask, req: control.HubDownload) -> None:
        from worker import hub

        config = self.host.config
        bad = [n for n in req.files if not files.plain_name(n)]
        if bad:
            raise CodedError("bad_request", f"{bad[0]!r} is not a plain file name")
        cache = req.cache_dir
        where = files.resolve_dir(config.home, cache) if cache else hub.default_cache()
        need, free = req.total, files.free_bytes(where)
        if need > free:
            raise CodedError(
                "no_space",
                f"{config.name} has {files.human_bytes(free)} free at {where} but "
                f"its share needs {files.human_bytes(need)}: free disk space there or fetch to "
                "other nodes",
            )
        result = await hub.download(
            req.repo,
            req.revision,
            req.files,
            files.resolve_dir(config.home, cache) if cache else None,
            req.endpoint or None,
            req.total,
            progress_to(self.host, ask, "downloading", req.total),
        )
        log.info("downloaded %s of %s into %s", len(req.files), req.repo, result["path"])
        await ask.answer(control.Downloaded(**result))
