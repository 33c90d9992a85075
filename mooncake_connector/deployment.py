"""A whole disaggregated deployment on one host, as a user would run it.

    dep = Deployment(workdir, model_dir, connector="mooncake", flows=("a", "b"))
    dep.start()          # metadata server, prefill, decode, colocated, proxies
    dep.proxies["a"].url, dep.colocated.url, dep.external_kv_tokens()
    dep.stop()

The prefill and decode servers are started with the seed's command-line
shape: `MOONCAKE_CONFIG_PATH=mooncake.json python -m
vllm.entrypoints.openai.api_server ... --kv-transfer-config '{...kv_producer /
kv_consumer...}'`.  The connector is one switch (`connector`):

* "mooncake": ours, `mooncake_connector.MooncakeConnector`, with a
  mooncake.json pointing at the embedded metadata server;
* "example": vLLM's in-tree ExampleConnector (KV through files in a shared
  directory), a stand-in that validates the harness itself.

A colocated server (no connector) serves as the reference for outputs and
latency.
"""
import json
import os
import re

from mooncake_connector import serving
from mooncake_connector.hostport import join_hostport, url_of

CONNECTORS = ("mooncake", "example")
#: The connector used when nothing else is asked for ($MC_E2E_CONNECTOR overrides).
DEFAULT_CONNECTOR = "mooncake"


def default_connector():
    kind = os.environ.get("MC_E2E_CONNECTOR", DEFAULT_CONNECTOR)
    if kind not in CONNECTORS:
        raise ValueError(f"MC_E2E_CONNECTOR={kind!r}: expected one of {', '.join(CONNECTORS)}")
    return kind


def _port_pair(span=4):
    """Two free ports at least serving.PORT_DISTANCE apart (mooncake.json's
    rule for one host), each the first of `span` free ones (a TP or PP side
    listens on port + rank)."""
    p = serving.free_port(span)
    return p, serving.free_port(span, away=[p])


def kv_transfer_configs(kind, workdir, metadata_url=None, engine_host="127.0.0.1"):
    """(prefill config, decode config, extra env) for connector `kind`;
    engine_host: the engines' address in mooncake.json (IPv6 in brackets)."""
    if kind == "mooncake":
        p, d = _port_pair()
        cfg_path = os.path.join(workdir, "mooncake.json")
        with open(cfg_path, "w") as f:
            json.dump({"prefill_url": join_hostport(engine_host, p),
                       "decode_url": join_hostport(engine_host, d),
                       "metadata_server": metadata_url, "protocol": "tcp",
                       "device_name": ""}, f, indent=1)
        common = {"kv_connector": "MooncakeConnector",
                  "kv_connector_module_path": "mooncake_connector",
                  "kv_parallel_size": 2, "kv_buffer_size": 2e9}
        return (dict(common, kv_role="kv_producer", kv_rank=0),
                dict(common, kv_role="kv_consumer", kv_rank=1),
                {"MOONCAKE_CONFIG_PATH": cfg_path})
    if kind == "example":
        store = os.path.join(workdir, "kv-store")
        os.makedirs(store, exist_ok=True)
        common = {"kv_connector": "ExampleConnector",
                  "kv_connector_extra_config": {"shared_storage_path": store}}
        return (dict(common, kv_role="kv_producer"), dict(common, kv_role="kv_consumer"), {})
    raise ValueError(f"unknown connector {kind!r}; expected one of {', '.join(CONNECTORS)}")


def metric_value(url, metric):
    """A counter's value (summed over its labels) from a server's /metrics."""
    status, body = serving.http_get(url + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}: {body[:300]}")
    return sum(v for (name, _), v in parse_metrics(body).items() if name == metric)


def scrape_metrics(url, timeout=3.0):
    """A server's /metrics as {name: value summed over its labels}, a
    recompute counter per reason as name{reason}; None if it did not answer
    200 (soak.py, stopped_producer_probe.py)."""
    status, body = serving.http_get(url + "/metrics", timeout=timeout)
    if status != 200:
        return None
    vals = {}
    for (name, labels), v in parse_metrics(body).items():
        reason = dict(labels).get("reason")
        key = f"{name}{{{reason}}}" if reason else name
        vals[key] = vals.get(key, 0) + v
    return vals


def parse_metrics(text):
    """Prometheus text -> {(name, frozenset(labels)): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][\w:]*)(\{([^}]*)\})?\s+(\S+)', line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        try:
            out[(m.group(1), labels)] = float(m.group(4))
        except ValueError:
            pass
    return out


def prompt_tokens_by_source(url, timeout=10.0):
    """{source: tokens} from a vLLM server's /metrics (local_compute,
    local_cache_hit, external_kv_transfer), summed over engines."""
    status, body = serving.http_get(url + "/metrics", timeout=timeout)
    if status != 200:
        raise RuntimeError(f"GET {url}/metrics answered {status}: {body[:300]}")
    out = {}
    for (name, labels), v in parse_metrics(body).items():
        if name == "vllm:prompt_tokens_by_source_total":
            src = dict(labels).get("source")
            out[src] = out.get(src, 0) + int(v)
    return out


def proxy_stats(url, timeout=10.0, raw=False):
    """Our proxy's counters (GET /stats); raw: with its timings' values."""
    status, body = serving.http_get(url + "/stats" + ("?raw=1" if raw else ""), timeout=timeout)
    if status != 200:
        raise RuntimeError(f"GET {url}/stats answered {status}: {body[:300]}")
    return json.loads(body)


def connector_log_stats(log_path, since=0):
    """Sums the connector's own counters over the "KV Transfer metrics:"
    lines vLLM's stat logger writes (every ~10 s, each for its interval) to a
    server's log, from byte offset `since`.  {} when there are none (vLLM's
    ExampleConnector reports no stats)."""
    totals = {}
    try:
        with open(log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return totals
    weighted = 0.0
    for line in text.splitlines():
        if "KV Transfer metrics:" not in line:
            continue
        fields = dict(re.findall(r"(\w+)=([0-9.]+)", line.split("KV Transfer metrics:", 1)[1]))
        for key, val in fields.items():
            if key.endswith(("_ms", "_GBps")):
                continue  # per-interval averages do not add up
            totals[key] = totals.get(key, 0) + (float(val) if "." in val else int(val))
        if "load_time_avg_ms" in fields and fields.get("loads"):
            weighted += float(fields["load_time_avg_ms"]) * int(fields["loads"])
    if weighted and totals.get("loads"):
        totals["load_time_avg_ms"] = weighted / totals["loads"]  # over all loads
    return totals


def log_size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class Deployment:
    def __init__(self, workdir, model, connector=None, flows=("a",), colocated=True,
                 max_model_len=2048, kv_cache_bytes=64 << 20, python=None, extra_vllm_args=(),
                 env=None, extra_proxies=None, colocated_proxy=False, side_args=None,
                 decode_extra_config=None, prefix_caching=False, colocated_cached=False,
                 prefill_extra_config=None, host="127.0.0.1"):
        """flows: one proxy per flow, named by it (first token from prefill);
        side_args: {"prefill"|"decode"|"colocated": [vLLM args]} for one side
        only (e.g. --tensor-parallel-size; the colocated reference should
        get the decode side's);
        extra_proxies: {name: serving.proxy keyword arguments, e.g.
        {"flow": "a", "first_token": "decode"}}; colocated_proxy: also a
        pass-through proxy in front of the colocated server
        (self.colocated_proxy); decode_extra_config: keys merged into the
        decode side's kv_connector_extra_config (e.g. push_layer_load_max_batch);
        prefill_extra_config: the same for the prefill side (e.g.
        hold_timeout_s);
        prefix_caching: every vLLM server of this deployment keeps vLLM's
        default (prefix caching on), as the seed's commands run them,
        instead of serving.BASE_VLLM_ARGS's --no-enable-prefix-caching.
        host: the address every server listens on and the engines' address
        in mooncake.json (e.g. "::1": an IPv6 deployment, "[::1]:port");
        colocated_cached: a second colocated server, the same as the first
        but with vLLM's prefix cache on (self.colocated_cached): a prompt
        sent to it twice computes only its tail over cached KV the second
        time, as a decode server over loaded KV does."""
        self.workdir = os.path.abspath(workdir)
        self.host = host
        self._prefill_extra = prefill_extra_config
        os.makedirs(self.workdir, exist_ok=True)
        self.model = model
        self.connector = connector or default_connector()
        self.python = python
        logs = os.path.join(self.workdir, "logs")
        self.logs = logs
        # (--distributed-executor-backend uni would save a process, but vLLM's
        # CPU platform turns it back into "mp": docs/vllm-cpu.md.)
        common = dict(model=model, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                      extra_args=list(extra_vllm_args), python=python,
                      prefix_caching=prefix_caching, host=host)
        env = dict(env or {})
        side = {k: list(v) for k, v in (side_args or {}).items()}
        unknown = set(side) - {"prefill", "decode", "colocated"}
        if unknown:
            raise ValueError(f"side_args: unknown side(s) {sorted(unknown)}")

        def args_for(name):
            return dict(common, extra_args=common["extra_args"] + side.get(name, []))

        self.metadata = None
        meta_url = None
        if self.connector == "mooncake":
            self.metadata = serving.metadata_server(serving.free_port(),
                                                    os.path.join(logs, "metadata.log"), python,
                                                    host=host)
            meta_url = self.metadata.url
        pre_cfg, dec_cfg, kv_env = kv_transfer_configs(self.connector, self.workdir, meta_url,
                                                       host)
        if decode_extra_config:
            dec_cfg = dict(dec_cfg, kv_connector_extra_config=dict(
                dec_cfg.get("kv_connector_extra_config") or {}, **decode_extra_config))
        if prefill_extra_config:
            pre_cfg = dict(pre_cfg, kv_connector_extra_config=dict(
                pre_cfg.get("kv_connector_extra_config") or {}, **prefill_extra_config))
        self.kv_configs = {"prefill": pre_cfg, "decode": dec_cfg}
        # Our producer's bootstrap server (vLLM's in-tree contract: routers
        # such as vllm-router --kv-connector mooncake ask it): a free port,
        # not the shared default 8998.
        self.bootstrap_port = None
        pre_env = dict(env, **kv_env)
        if self.connector == "mooncake":
            self.bootstrap_port = serving.free_port()
            pre_env.setdefault("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(self.bootstrap_port))
            self.bootstrap_port = int(pre_env["VLLM_MOONCAKE_BOOTSTRAP_PORT"])
        self.prefill = serving.vllm_server("prefill", port=serving.free_port(),
                                           log_path=os.path.join(logs, "prefill.log"),
                                           kv_transfer_config=pre_cfg, env=pre_env,
                                           **args_for("prefill"))
        self.decode = serving.vllm_server("decode", port=serving.free_port(),
                                          log_path=os.path.join(logs, "decode.log"),
                                          kv_transfer_config=dec_cfg, env=dict(env, **kv_env),
                                          **args_for("decode"))
        self.colocated = None
        if colocated:
            self.colocated = serving.vllm_server("colocated", port=serving.free_port(),
                                                 log_path=os.path.join(logs, "colocated.log"),
                                                 env=env, **args_for("colocated"))
        self.colocated_cached = None
        if colocated_cached:
            self.colocated_cached = serving.vllm_server(
                "colocated-cached", port=serving.free_port(),
                log_path=os.path.join(logs, "colocated-cached.log"), env=env,
                **dict(args_for("colocated"), prefix_caching=True))
        self.proxies = {f: serving.proxy([self.prefill.url], [self.decode.url],
                                         serving.free_port(),
                                         os.path.join(logs, f"proxy-{f}.log"), flow=f,
                                         python=python, host=host,
                                         extra_args=self._push_args(f) + self._forget_args(f))
                        for f in flows}
        for name, kw in (extra_proxies or {}).items():
            kw = dict(kw)
            # "prefill_bootstrap": False: a push proxy without
            # --prefill-bootstrap (it finds the table from the push answers)
            boot = kw.pop("prefill_bootstrap", True)
            kw["extra_args"] = tuple(kw.get("extra_args", ())) + (
                self._push_args(kw.get("flow", "a")) if boot else ()) + \
                self._forget_args(kw.get("flow", "a"))
            self.proxies[name] = serving.proxy([self.prefill.url], [self.decode.url],
                                               serving.free_port(),
                                               os.path.join(logs, f"proxy-{name}.log"),
                                               python=python, name=f"proxy {name}",
                                               **dict({"host": host}, **kw))
        self.colocated_proxy = None
        if colocated_proxy:
            if self.colocated is None:
                raise ValueError("colocated_proxy needs colocated=True")
            self.colocated_proxy = serving.proxy(
                [], [], serving.free_port(), os.path.join(logs, "proxy-colocated.log"),
                python=python, passthrough=[self.colocated.url], host=host)

    def _forget_args(self, flow):
        """Flows a, b over a prefill with its own hold_timeout_s: the
        proxy's --forget-retry-s below it (proxy.forget_retry_for)."""
        hold = (self._prefill_extra or {}).get("hold_timeout_s")
        if flow not in ("a", "b") or hold is None:
            return ()
        from mooncake_connector.proxy import forget_retry_for
        return ("--forget-retry-s", f"{forget_retry_for(float(hold)):g}")

    def _push_args(self, flow):
        """A push proxy's --prefill-bootstrap (the prefill's bootstrap server:
        push prefills spread over a data-parallel prefill's engines)."""
        if flow != "push" or not self.bootstrap_port:
            return ()
        return ("--prefill-bootstrap", url_of(self.host, self.bootstrap_port))

    @property
    def processes(self):
        ps = [self.metadata, self.prefill, self.decode, self.colocated,
              self.colocated_cached, *self.proxies.values(), self.colocated_proxy]
        return [p for p in ps if p is not None]

    def start(self, timeout=600.0):
        """Starts everything in parallel and waits until all are healthy."""
        # The metadata server first: the connectors register with it on start.
        if self.metadata is not None:
            serving.start_all([self.metadata], 30.0)
        serving.start_all(self.processes, timeout)
        return self

    def stop(self):
        # The metadata server last: the connectors unregister on shutdown.
        serving.stop_all([p for p in self.processes if p is not self.metadata])
        if self.metadata is not None:
            serving.stop_all([self.metadata])

    def restart_prefill(self, timeout=600.0):
        self.prefill.stop()
        serving.start_all([self.prefill], timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def external_kv_tokens(self):
        """Prompt tokens the decode server loaded through the connector."""
        return prompt_tokens_by_source(self.decode.url).get("external_kv_transfer", 0)

    def describe(self):
        lines = [f"connector: {self.connector}  (workdir {self.workdir})"]
        for p in self.processes:
            ready = f"ready in {p.ready_s:.0f} s" if p.ready_s is not None else "not started"
            lines.append(f"  {p.name:<16} {getattr(p, 'url', '')}  {ready}  log {p.log_path}")
        return "\n".join(lines)
