"""An aiohttp app served from a thread of the test process (stand-in
upstreams for the proxy's tests): AppThread(routes) serves at .url until
.close().  routes: (method, path, handler) triples."""
import asyncio
import threading

from aiohttp import web


class AppThread:
    def __init__(self, routes):
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            app = web.Application()
            for method, path, handler in routes:
                app.router.add_route(method, path, handler)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        if not ready.wait(10):
            raise RuntimeError("the stand-in upstream did not start within 10 s")

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
