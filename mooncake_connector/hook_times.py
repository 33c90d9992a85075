"""Time every connector hook vLLM calls, per kind of step (issue 31: where
the push's ~1 ms per request on the prefill and the decode's critical path
go).  Off unless ``MC_HOOK_TIMES=<path prefix>`` is set in the environment
of the vLLM servers: then each connector (scheduler side and worker side,
each process) rewrites ``<prefix>.<pid>.<side>.json`` at most once a second
while hooks run and at shutdown:

    {"pid", "side", "role", "tree", "hooks": {"<class>/<hook>":
        {"n", "wall_ms", "cpu_ms", "p50_ms", "p90_ms", "max_ms"}}, "steps": {"<class>": n}}

The class of a call is the kind of work it was for: worker side, the step's
(bound metadata's) ``push`` (a push publish or push load in the step),
``work`` (a publish or load without push) or ``empty``, and ``after_push``
for an empty step right after a push step (the decode's token-2 step after a
layer load: issue 31's gap 1->2); scheduler side, the
request's (``push`` when its kv_transfer_params ask for a push, else
``plain``) for the per-request hooks, the built metadata's for
``build_connector_meta`` and the step's for ``update_connector_output``.
``wall_ms`` / ``cpu_ms`` are sums (perf_counter; time.thread_time, so a wait
inside a hook shows as wall - cpu).  ``benchmarks/hook_times.py`` prints the
files side by side.  Each timed call costs ~1-2 us; percentiles come from at
most ``KEEP`` calls per hook and class (the first ones).
"""
import json
import os
import threading
import time

PREFIX = os.environ.get("MC_HOOK_TIMES") or None
ON = PREFIX is not None
KEEP = 20000

SCHED_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "request_finished", "request_finished_all_groups", "update_connector_output",
               "on_new_request", "get_kv_connector_stats", "take_events")
WORKER_HOOKS = ("bind_connector_metadata", "handle_preemptions", "start_load_kv",
                "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
                "get_block_ids_with_load_errors", "get_kv_connector_stats", "clear_connector_metadata",
                "build_connector_worker_meta", "get_kv_connector_kv_cache_events")


def step_class(meta):
    """push / work / empty: what a step's metadata asks of the worker."""
    items = (*(getattr(meta, "loads", None) or ()), *(getattr(meta, "publishes", None) or ()))
    if not items:
        return "empty"
    if any(getattr(x, "push_tid", None) for x in items):
        return "push"
    return "work"


def request_class(request):
    from mooncake_connector.connector import push
    params = getattr(request, "kv_transfer_params", None)
    try:
        return "push" if params and push.is_push(params) else "plain"
    except Exception:  # noqa: BLE001 - a malformed request is the hook's own business
        return "plain"


class Times:
    """One connector's hook times (one side of one process)."""

    def __init__(self, side, role):
        self.side, self.role = side, role
        self.data = {}        # "<class>/<hook>" -> [n, wall, cpu, [walls...]]
        self.steps = {}
        self.cls = "empty"    # worker: the bound step's class; scheduler: the last meta's
        self.prev = "empty"   # worker: the previous step's step_class (after_push)
        self._last_dump = 0.0
        self._lock = threading.Lock()
        import mooncake_connector
        self.tree = os.path.dirname(os.path.dirname(os.path.abspath(mooncake_connector.__file__)))

    def add(self, key, wall, cpu):
        with self._lock:
            d = self.data.get(key)
            if d is None:
                d = self.data[key] = [0, 0.0, 0.0, []]
            d[0] += 1
            d[1] += wall
            d[2] += cpu
            if len(d[3]) < KEEP:
                d[3].append(wall)
        now = time.monotonic()
        if now - self._last_dump >= 1.0:
            self._last_dump = now
            self.dump()

    def dump(self):
        with self._lock:
            hooks = {}
            for k, (n, w, c, walls) in sorted(self.data.items()):
                s = sorted(walls)
                hooks[k] = {"n": n, "wall_ms": round(w * 1e3, 4), "cpu_ms": round(c * 1e3, 4),
                            "p50_ms": round(s[len(s) // 2] * 1e3, 4),
                            "p90_ms": round(s[int(len(s) * 0.9)] * 1e3, 4),
                            "max_ms": round(s[-1] * 1e3, 4)}
            out = {"pid": os.getpid(), "side": self.side, "role": self.role, "tree": self.tree,
                   "hooks": hooks, "steps": dict(self.steps)}
        path = f"{PREFIX}.{os.getpid()}.{self.side}.json"
        tmp = path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(out, f)
            os.replace(tmp, path)
        except OSError:
            pass  # a full or vanished directory: timing is best effort, never the server's end


def caller(frame):
    """The first frame not of this module's wrappers (the connector takes
    vLLM 0.26's KV-cache manager from its caller's frame)."""
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    return frame


def install(conn, side, role):
    """Wrap conn's hooks (instance attributes shadow the class's methods)."""
    t = Times(side, role)
    conn._hook_times = t
    names = SCHED_HOOKS if side == "scheduler" else WORKER_HOOKS
    for name in names:
        f = getattr(conn, name, None)
        if f is None or not callable(f):
            continue
        setattr(conn, name, _wrap(t, side, name, f))
    return t


def _wrap(t, side, name, f):
    pc, tt = time.perf_counter, time.thread_time

    if side == "worker" and name == "bind_connector_metadata":
        def g(meta, *a, **k):
            cls = step_class(meta)
            t.cls = "after_push" if cls == "empty" and t.prev == "push" else cls
            t.prev = cls
            t.steps[t.cls] = t.steps.get(t.cls, 0) + 1
            w0, c0 = pc(), tt()
            try:
                return f(meta, *a, **k)
            finally:
                t.add(f"{t.cls}/{name}", pc() - w0, tt() - c0)
    elif side == "scheduler" and name == "build_connector_meta":
        def g(*a, **k):
            w0, c0 = pc(), tt()
            meta = None
            try:
                meta = f(*a, **k)
                return meta
            finally:
                w, c = pc() - w0, tt() - c0
                t.cls = step_class(meta)
                t.steps[t.cls] = t.steps.get(t.cls, 0) + 1
                t.add(f"{t.cls}/{name}", w, c)
    elif side == "scheduler" and name in ("get_num_new_matched_tokens", "update_state_after_alloc",
                                          "request_finished", "request_finished_all_groups",
                                          "on_new_request"):
        def g(request, *a, **k):
            w0, c0 = pc(), tt()
            try:
                return f(request, *a, **k)
            finally:
                w, c = pc() - w0, tt() - c0
                t.add(f"{request_class(request)}/{name}", w, c)
    else:
        def g(*a, **k):
            w0, c0 = pc(), tt()
            try:
                return f(*a, **k)
            finally:
                t.add(f"{t.cls}/{name}", pc() - w0, tt() - c0)
    g.__name__ = name
    g.__wrapped__ = f
    return g
