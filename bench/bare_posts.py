"""A bare aiohttp POST loop in a process of its own: the ceiling an HTTP relay in Python
reaches on this machine, with nothing of a relay (no database, no claim, no settle, no
signing: the requests come ready-made).

`python -m bench.bare_posts REQUESTS URL CONCURRENCY` reads REQUESTS (JSON lines, each
`{"headers": {...}, "body": "..."}`), POSTs each once to URL, CONCURRENCY at a time on the
webhook sink's own session (`http_exchange.new_session`, the sink's default settings), reads
every answer, and prints one JSON line: `seconds` (first POST to last answer) and `cpu_s`
(this process's CPU over the same span). A status >= 300 exits 1, naming it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from relayd.core import __version__
from relayd.sinks.http.exchange import new_session
from relayd.sinks.webhook.settings import WebhookSettings


async def _post_all(
    url: str, requests: list[tuple[dict[str, str], bytes]], concurrency: int
) -> float:
    settings = WebhookSettings(url=url, concurrency=concurrency)
    pending: Iterator[tuple[dict[str, str], bytes]] = iter(requests)

    async def post_each(http: aiohttp.ClientSession) -> None:
        for headers, body in pending:  # one shared iterator: each request is sent once
            async with http.post(url, data=body, headers=headers, allow_redirects=False) as r:
                await r.read()
                if r.status >= 300:
                    raise SystemExit(f"bare POSTs: HTTP {r.status}")

    async with new_session(settings, {"User-Agent": f"relayd/{__version__}"}) as http:
        started = time.perf_counter()
        await asyncio.gather(*(post_each(http) for _ in range(concurrency)))
        return time.perf_counter() - started


def main(argv: list[str]) -> None:
    path, url, concurrency = Path(argv[0]), argv[1], int(argv[2])
    requests = []
    for line in path.read_text(encoding="utf-8").splitlines():
        request = json.loads(line)
        requests.append((request["headers"], request["body"].encode()))
    cpu0 = time.process_time()
    seconds = asyncio.run(_post_all(url, requests, concurrency))
    print(json.dumps({"seconds": seconds, "cpu_s": time.process_time() - cpu0}))


if __name__ == "__main__":
    main(sys.argv[1:])
