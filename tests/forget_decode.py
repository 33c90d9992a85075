"""A stand-in decode server in a process of its own (SIGSTOP, SIGKILL and a
restart on the same port are real), for the proxy's forget tests
(tests/test_proxy_forget.py).  It answers the proxy's "mc_forget" with the
connector's own ledger (connector/legs.LegLedger), as a decode's connector
does; a decode leg gets its answer's headers and then no output (the
client leaves, or the server dies, before any).

python tests/forget_decode.py PORT MODE [N503]
  MODE "drop":   a decode leg never reaches the connector (vLLM dropped it)
  MODE "arrive": a decode leg reaches the connector (LIVE in the ledger)
  N503:          the first N forgets are answered 503 (overloaded)
Prints "ready" once it listens.  GET /legs: decode legs received."""
import asyncio
import sys

from aiohttp import web

from mooncake_connector.connector import legs


def main():
    port, mode = int(sys.argv[1]), sys.argv[2]
    n503 = [int(sys.argv[3]) if len(sys.argv) > 3 else 0]
    legs._randomized[:] = [False]  # vLLM ids as made: "cmpl-<X-Request-Id>-0"
    ledger = legs.LegLedger()
    got = {"legs": 0, "forgets": 0}

    async def models(request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def count(request):
        return web.json_response(got)

    async def complete(request):
        body = await request.json()
        forget = (body.get("kv_transfer_params") or {}).get("mc_forget")
        if forget is not None:
            got["forgets"] += 1
            if n503[0] > 0:
                n503[0] -= 1
                return web.json_response({"error": {"message": "overloaded"}}, status=503)
            verdict = ledger.forget(forget["x_request_id"], forget.get("ask"))
            return web.json_response({"id": "f", "choices": [{"index": 0, "text": "x"}],
                                      "kv_transfer_params": {"mc_forget": verdict}})
        got["legs"] += 1
        if mode == "arrive":
            ledger.arrived(f"cmpl-{request.headers['X-Request-Id']}-0")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(3600)  # no output
        return resp

    app = web.Application()
    app.router.add_route("GET", "/v1/models", models)
    app.router.add_route("GET", "/legs", count)
    app.router.add_route("POST", "/v1/completions", complete)

    async def serve():
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
