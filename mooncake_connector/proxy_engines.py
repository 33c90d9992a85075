"""Flow push over a prefill server with vLLM data parallelism: which engine
runs a request's prefill leg (the proxy's).

A push's decode leg names the prefill engine that writes the KV
(`remote_engine_id`), so the prefill leg must run on that engine: vLLM's
API server routes a request with `X-data-parallel-rank: r` to its engine r.
Without this table every push prefill went to rank 0.  The prefill's
bootstrap server (connector/bootstrap.py, the proxy's
`--prefill-bootstrap`) lists every rank with its engine name (`GET
/query`); the table is looked up in the background (never on a request's
path): at a prefill's first push request, every TABLE_REFRESH_S after,
and at once when a prefill leg on a picked rank failed (an engine gone, a
rank vLLM no longer has).  A server with one engine, a table not known
yet, or none to ask: no rank is picked (the leg goes as before).  Each
request takes the rank with the fewest legs out, the next in turn on a
tie.

Without --prefill-bootstrap for a prefill, its bootstrap server is found
from the prefill's own push answers (hint): our producer names its engine
(`remote_engine_id`) and its bootstrap server's port (`bootstrap_port`);
the proxy asks http://<the --prefill URL's host>:<that port>/query and
takes the table only if it names the engine that answered (a port held by
another server on that host names other engines: not taken, said once in
the log, tried again after HINT_RETRY_S).
"""
import asyncio
import logging
import time

import aiohttp

from mooncake_connector import json_in
from mooncake_connector.hostport import engine_name_problem, is_engine_name, url_of

logger = logging.getLogger("mooncake_connector.proxy")

#: A known table is looked up again this often (engines that came up late).
TABLE_REFRESH_S = 30.0
#: A lookup that failed is tried again after this long.
RETRY_S = 5.0
#: The most of a /query answer read.
TABLE_MAX = 1 << 20
LOOKUP_TIMEOUT_S = 5.0
#: A bootstrap URL found from a push answer whose table did not name the
#: answering engine is not asked again for this long.
HINT_RETRY_S = 60.0


def parse_table(body):
    """[(rank, engine name)] in rank order from a /query answer's JSON
    (bootstrap.query_table's shape); ValueError if it is not one."""
    try:
        table = json_in.loads(body)
    except ValueError as e:
        raise ValueError(f"not a JSON object ({e})") from None
    if not isinstance(table, dict) or not table:
        raise ValueError("not a non-empty JSON object")
    out = []
    for rank, entry in table.items():
        engine = entry.get("engine_id") if isinstance(entry, dict) else None
        if not (rank.isascii() and rank.isdigit()):
            raise ValueError(f"rank {rank[:20]!r}: not a rank number")
        problem = engine_name_problem(engine)
        if problem:
            raise ValueError(f"rank {rank[:20]!r}: engine_id {str(engine)[:80]!r}: {problem}")
        out.append((rank, engine))
    return sorted(out, key=lambda e: int(e[0]))


class _NotOurs(ValueError):
    """A table found from a push answer that does not name the answering engine."""


class PrefillEngines:
    """The engine tables of the proxy's prefill servers (index = --prefill's)."""

    def __init__(self, bootstrap_urls, counts):
        """counts: the proxy's counters (/stats): prefill_table_lookups,
        prefill_table_lookup_failures are added."""
        self.counts = counts
        counts.update(prefill_table_lookups=0, prefill_table_lookup_failures=0)
        self.urls = [u.rstrip("/") if u else None for u in bootstrap_urls]
        # a prefill without --prefill-bootstrap: its URL is found from its
        # push answers (hint); _expect: the engine its table must name
        self.auto = [u is None for u in self.urls]
        self._expect = [None] * len(self.urls)
        self._refused = {}                      # index -> (URL, monotonic time)
        self._tables = [None] * len(self.urls)  # [(rank, engine)], 2 or more; else None
        self._due = [0.0] * len(self.urls)      # monotonic time of the next lookup
        self._looking = set()                   # indexes with a lookup out
        self._out = {}                          # (index, rank) -> legs out
        self._turn = [0] * len(self.urls)
        self._bg = set()
        self._session = None  # the proxy's client session (given by pick)

    def pick(self, idx, session):
        """(rank, engine name) for a push to prefill `idx`, counted out until
        done(); None: no rank to pick (one engine, or the table not known)."""
        self._session = session
        self._refresh_if_due(idx)
        table = self._tables[idx]
        if not table:
            return None
        n = len(table)
        start = self._turn[idx] % n
        self._turn[idx] += 1
        rank, engine = min((table[(start + i) % n] for i in range(n)),
                           key=lambda e: self._out.get((idx, e[0]), 0))
        self._out[(idx, rank)] = self._out.get((idx, rank), 0) + 1
        return rank, engine

    def done(self, idx, rank, ok=True):
        """The prefill leg on `rank` ended; not ok: look the table up again now."""
        left = self._out.get((idx, rank), 0) - 1
        if left > 0:
            self._out[(idx, rank)] = left
        else:
            self._out.pop((idx, rank), None)
        if not ok:
            self._due[idx] = 0.0
            self._refresh_if_due(idx)

    def wants_hint(self, idx):
        """Whether prefill `idx`'s push answers may name its bootstrap server
        (no --prefill-bootstrap for it, none found yet)."""
        return self.auto[idx] and self.urls[idx] is None

    def hint(self, idx, prefill_url, params):
        """A push answer of prefill `idx` (its kv_transfer_params): where it
        names its engine and its bootstrap server's port, that server's
        table is looked up (in the background); it is taken only if it
        names the engine that answered (_look_up)."""
        if not self.wants_hint(idx) or not isinstance(params, dict):
            return
        port, engine = params.get("bootstrap_port"), params.get("remote_engine_id")
        if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536
                and is_engine_name(engine)):
            return
        from urllib.parse import urlsplit
        try:
            host = urlsplit(prefill_url).hostname
        except ValueError:
            return
        if not host:
            return
        url = url_of(host, port)
        refused = self._refused.get(idx)
        if refused and refused[0] == url and time.monotonic() - refused[1] < HINT_RETRY_S:
            return
        self.urls[idx], self._expect[idx], self._due[idx] = url, engine, 0.0
        logger.info("prefill %s: its engine %s names bootstrap port %d: looking up its "
                    "engine table at %s", prefill_url, engine, port, url)
        self._refresh_if_due(idx)

    def _refresh_if_due(self, idx):
        if self.urls[idx] is None or idx in self._looking or \
                time.monotonic() < self._due[idx]:
            return
        self._looking.add(idx)
        task = asyncio.ensure_future(self._look_up(idx, self._session))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _look_up(self, idx, session):
        url = self.urls[idx] + "/query"
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(
                    total=LOOKUP_TIMEOUT_S)) as r:
                body = await r.content.read(TABLE_MAX + 1)
                if r.status != 200 or len(body) > TABLE_MAX:
                    raise ValueError(f"answered {r.status} ({len(body)} bytes)")
            table = parse_table(body)
            want = self._expect[idx]
            if want is not None and want not in (e for _, e in table):
                raise _NotOurs(f"its table names engines {', '.join(e for _, e in table)}, "
                               f"not {want}, the engine that answered the push: another "
                               "server's bootstrap server")
            self._set(idx, table)
            self._due[idx] = time.monotonic() + TABLE_REFRESH_S
        except _NotOurs as e:
            self.counts["prefill_table_lookup_failures"] += 1
            logger.warning("prefill bootstrap %s: not taken (%s); push prefills go to its "
                           "rank 0 (give --prefill-bootstrap to name it)", url, e)
            self._refused[idx] = (self.urls[idx], time.monotonic())
            self.urls[idx], self._expect[idx], self._tables[idx] = None, None, None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            self.counts["prefill_table_lookup_failures"] += 1
            self._due[idx] = time.monotonic() + RETRY_S
            logger.info("prefill bootstrap %s: no engine table (%r); push prefills go to "
                        "its rank 0 meanwhile%s", url, e,
                        "" if self._tables[idx] is None else " (keeping the known table)")
        finally:
            self._looking.discard(idx)
            self.counts["prefill_table_lookups"] += 1  # once its outcome is in

    def _set(self, idx, table):
        table = table if len(table) > 1 else None
        if table != self._tables[idx]:
            logger.info("prefill bootstrap %s: %s", self.urls[idx],
                        f"push prefills spread over DP ranks "
                        f"{', '.join(f'{r} ({e})' for r, e in table)}" if table else
                        "one engine: push prefills go to rank 0")
        self._tables[idx] = table
