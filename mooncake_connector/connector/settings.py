"""Effective connector configuration.

Sources, later ones win: mooncake.json (``MOONCAKE_CONFIG_PATH``, or
``kv_connector_extra_config["mooncake_config_path"]``), then the same fields
in ``kv_connector_extra_config``.  The seed's ``kv_rank``,
``kv_parallel_size`` and ``kv_buffer_size`` arrive in the extra config (the
plugin moves them there, since vLLM's own config has no such fields).

Pure Python (no extension): the scheduler process uses it too.  The worker
validates mooncake.json strictly with the C parser when it starts its engine;
its keys and their value types are checked here already, with the C parser's
messages (an unknown field, with the field it is a near miss of; a field
given twice; a value of the wrong JSON type, or longer than the C parser
holds), so the scheduler process does not start on a file the workers refuse.
"""
import difflib
import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field


logger = logging.getLogger("vllm.mooncake_connector")

ROLES = ("kv_producer", "kv_consumer", "kv_both")
MOONCAKE_FIELDS = ("prefill_url", "decode_url", "metadata_server", "protocol", "device_name",
                   "metadata_backend", "auth_secret", "same_host_cpu")
# The C parser's (csrc/config/config.c) view of a mooncake.json field it does
# not accept: its fields in its order, the keys of vLLM's --kv-transfer-config
# and of Mooncake Store's mooncake.json it names as such.  _check_fields gives
# its message word for word, so the scheduler process (which reads the file
# here, without the extension) and the workers (the C parser) say the same.
C_FIELDS = ("prefill_url", "decode_url", "metadata_server", "metadata_backend", "protocol",
            "device_name", "auth_secret", "same_host_cpu")
VLLM_KEYS = ("kv_connector", "kv_role", "kv_rank", "kv_parallel_size", "kv_buffer_size",
             "kv_ip", "kv_port")
STORE_KEYS = ("local_hostname", "global_segment_size", "local_buffer_size",
              "master_server_address", "replica_num", "transfer_timeout")
# The C parser's "accepted" text per field (k_accepted), for its messages on a
# value of the wrong type; same_host_cpu is its one boolean field.
_ACC_URL = '"host:port" with a port in 1..65535, e.g. "192.168.0.137:13003"'
C_ACCEPTED = {
    "prefill_url": _ACC_URL,
    "decode_url": _ACC_URL,
    "metadata_server": '"P2PHANDSHAKE", "etcd://h:p[,h:p...]", "redis://[:password@]h:p[/db]", '
                       '"http(s)://h:p/path", or bare "h:p"',
    "metadata_backend": '"etcd", "redis", "http" (deprecated: prefer a scheme in '
                        'metadata_server)',
    "protocol": '"tcp", "rdma"',
    "device_name": 'comma-separated RDMA NIC names of [A-Za-z0-9_.-], e.g. "erdma_0" or '
                   '"mlx5_0,mlx5_1"',
    "auth_secret": 'the peer authentication secret, the same on every engine '
                   '(docs/security.md); "" = off',
    "same_host_cpu": "true (default: peers on this host use the same-host CPU path when the "
                     "OS allows it) or false (they use protocol's path); a JSON boolean",
}
C_STR_MAX = 1024   # MC_CFG_STR_MAX: a string field's bytes, with its NUL
C_MSG_MAX = 512    # MC_ERR_MSG_MAX: an error message's bytes, with its NUL
KNOBS = {  # extra-config key: (type, default, meaning)
    "hold_timeout_s": (float, 120.0, "producer: how long a finished request's KV stays "
                       "available for a consumer before its blocks are freed"),
    "load_timeout_s": (float, 30.0, "consumer: how long one KV load may take before the "
                       "request falls back to computing its prompt locally"),
    "flow_a": (bool, True, "consumer: look prompts up by token hashes at the configured "
               "producer when a request carries no kv_transfer_params"),
    "load_failure_policy": (str, "recompute", "what vLLM does when a load fails: 'recompute' "
                            "(compute the prompt locally) or 'fail' (the request errors)"),
    "local_hostname": (str, "", "this instance's engine name host:port (default: prefill_url "
                       "for producers, decode_url for consumers); TP rank r adds r to the port"),
    "load_workers": (int, 4, "consumer: concurrent KV loads per worker"),
    "lookup_timeout_s": (float, 0.25, "consumer, flow a: how long the scheduler waits for the "
                         "producer to say how much of a prompt it holds (one round trip); "
                         "on timeout the prompt is computed locally"),
    "probe_wait_ms": (float, 5.0, "consumer, flow a: while no other request is running, the "
                      "scheduler waits up to this long (GIL released) for the producer's "
                      "answer to a new request's lookup, so a quick answer (hit or miss) "
                      "schedules the request in that step instead of one more empty step "
                      "(~2 ms on a 2-vCPU host); busy or slower: the request waits a step "
                      "and is asked about again, no running request waits. 0: never wait; "
                      "at most 10000"),
    "sync_load_max_bytes": (int, 8 << 20, "consumer: loads up to this many bytes (per worker) "
                            "run inside the step that schedules the request, which waits for "
                            "them (no extra scheduler steps); larger ones in the background. "
                            "0: always in the background"),
    "sync_load_timeout_s": (float, 2.0, "consumer: how long a step may wait for an in-step "
                            "load before the request computes its prompt locally"),
    "idle_wait_ms": (float, 2.0, "producer: a step with nothing scheduled while the connector "
                     "holds finished requests' KV waits up to this long for a consumer's "
                     "release (vLLM otherwise runs empty steps back to back until then: "
                     "~30% of a core on a 2-vCPU host); a new request may wait as long. "
                     "0: never wait"),
    "push_layerwise": (bool, False, "producer, push flow: write each layer's KV to the decode "
                       "side as soon as vLLM computed it (save_kv_layer), overlapping the "
                       "transfer with the rest of the prefill; false: one write of every layer "
                       "after the forward (docs/connector.md, Push flow: where each wins)"),
    "push_layerwise_cuda": (bool, True, "producer, push flow with CUDA KV caches: stream layer "
                            "by layer too (save_kv_layer records a CUDA event per layer; a "
                            "background thread starts each layer's write once its event "
                            "completed); false: CUDA KV caches push whole prompts after the "
                            "forward"),
    "push_layer_gate": (bool, True, "producer, push layer by layer with CUDA KV caches: each "
                        "layer's writes are handed to the engine at once with the layer's "
                        "CUDA event (the engine's gate thread starts them once it completed) "
                        "and, for push_layer_load, the engine sends the decode that layer's "
                        "'layer' notification when they landed: no Python thread per layer; "
                        "with CPU KV caches the engine sends that notification too (the "
                        "layer's write batch carries it), not the landing thread; "
                        "false: the layer-event and landing threads (push_layerwise_cuda, "
                        "push_layer_watch)"),
    "push_layer_watch": (bool, True, "producer, push layer load: a thread tells the decode "
                         "each layer as soon as its writes land (false: told from vLLM's "
                         "forward thread only, at the next layer's save_kv_layer and, for the "
                         "last layer, after the rest of the forward); per request "
                         "\"push_layer_watch\" in the prefill leg's kv_transfer_params wins"),
    "push_layer_load": (bool, False, "consumer, push flow: schedule a pushed request at once "
                        "(an in-step load) and let each attention layer wait "
                        "(wait_for_layer_load) until the producer's write of that layer "
                        "landed, so the decode's forward overlaps the transfer; every other "
                        "request of that step waits with it (docs/connector.md, Layer load). "
                        "Per request: kv_transfer_params \"push_layer_load\". True here "
                        "also makes vLLM use PIECEWISE CUDA graphs, not FULL ones (a FULL "
                        "replay calls no wait_for_layer_load).  Under vLLM's asynchronous "
                        "scheduling (its GPU default) a layer load is taken as the "
                        "whole-prompt push (counted): start the decode with "
                        "--no-async-scheduling, or see push_layer_load_async"),
    "push_layer_load_async": (bool, False, "consumer, push_layer_load under vLLM's "
                              "asynchronous scheduling: load in the step anyway instead of "
                              "taking the whole-prompt push; needs load_failure_policy 'fail' "
                              "(vLLM's engine dies recovering a failed in-step load under "
                              "asynchronous scheduling; under 'fail' the request ends with an "
                              "error the proxy sends once more: --decode-retake)"),
    "push_layer_read": (bool, False, "consumer, push_layer_load: the decode READs each layer "
                        "from the producer's blocks itself once the producer says it is "
                        "computed (the producer writes nothing into the decode's blocks), so a "
                        "silent producer is given up after push_layer_read_stall_s and the "
                        "request recomputed at once (docs/connector.md, Layer read).  Per "
                        "request: kv_transfer_params \"push_layer_read\" on the decode leg"),
    "push_layer_read_stall_s": (float, 0.5, "consumer, push_layer_read: give up a layer load "
                                "(its request recomputes) when no layer of it was announced "
                                "for this long (from the target's send, then from the last "
                                "layer announced)"),
    "push_layer_load_max_batch": (int, 0, "consumer, push_layer_load: schedule a layer load "
                                  "only while the decode's previous step ran at most this "
                                  "many other requests (each would stall with it, layer by "
                                  "layer, for the prefill); a busier decode takes the request "
                                  "as a whole-prompt push instead (WAITING_FOR_REMOTE_KVS), "
                                  "counted push_layer_load_busy (docs/connector.md, Layer load)"),
    "early_recv": (bool, True, "consumer under vLLM's asynchronous scheduling with one "
                   "worker (TP 1, PP 1): tell vLLM's scheduler of a load that ended cleanly "
                   "with the output it takes next, one engine step sooner (connector/early.py; "
                   "a whole-prompt push's TTFT 1.3-2.6 ms shorter on an H100); false: told "
                   "with the output that carries it, a step later (docs/connector.md, "
                   "Asynchronous scheduling)"),
    "push_target_direct": (bool, True, "consumer, push_layer_load: vLLM's forward thread "
                           "sends a layer load's target itself (one round trip to a producer "
                           "reached before, the one rank of its route, at most 50 ms, GIL "
                           "released) instead of the push outbox's thread, which first waits "
                           "for the GIL (up to Python's 5 ms switch interval); a failed send "
                           "goes through the outbox as before; false: always the outbox"),
    "push_layer_timeout_s": (float, 10.0, "consumer, push_layer_load: the lease of such a "
                             "load; a step waits at most this (+ 2 s when the producer does "
                             "not answer the cancel) for the prompt's KV, then the request "
                             "computes its prompt locally"),
    "kv_cache_access": (str, "auto", "vLLM >= 0.34 on CUDA: 'auto' (the engine registers the "
                        "KV cache and exports driver-mapped memory as POSIX fds: vLLM keeps "
                        "its extensible KV cache), 'legacy_ipc' (classic allocation, for "
                        "--kv-cache-memory-bytes / --num-gpu-blocks-override, with which vLLM "
                        "refuses the fd export) or 'exports_fd'"),
    "bootstrap_port": (int, None, "producer: port of the bootstrap server vLLM's in-tree "
                       "MooncakeConnector contract asks (GET /query; vllm-router --kv-connector "
                       "mooncake); default VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998; 0: none"),
    "bootstrap_host": (str, "", "producer: address the bootstrap server listens on "
                       "(default: every address, IPv6 and IPv4; 0.0.0.0 where the host "
                       "has no IPv6)"),
    "idle_wait_max_ms": (float, 50.0, "producer: consecutive such steps that free nothing "
                         "wait twice as long each time, from idle_wait_ms up to this (every "
                         "step resets vLLM's 1 s busy-poll of its worker queues: with TP > 1 "
                         "back-to-back empty steps keep every worker process at 100% of a "
                         "core); a new request may wait as long; at most 1000; below "
                         "idle_wait_ms it is idle_wait_ms (no growth)"),
    "malloc_trim_idle_s": (float, 30.0, "worker: once no step has run for this long (the "
                           "server idle), give the memory the process freed back to the "
                           "system once (glibc malloc_trim(0), on a thread of its own): the "
                           "RSS a load left behind falls to what is in use; 0: never "
                           "(docs/connector.md, Memory)"),
}


class SettingsError(ValueError):
    """A configuration value is wrong; the message says which and how to fix it."""


@dataclass
class Settings:
    role: str
    kv_rank: int | None = None
    kv_parallel_size: int | None = None
    kv_buffer_size: int = 2_000_000_000
    mooncake: dict = field(default_factory=dict)  # mooncake.json fields (after overrides)
    config_path: str | None = None
    hold_timeout_s: float = 120.0
    load_timeout_s: float = 30.0
    flow_a: bool = True
    load_failure_policy: str = "recompute"
    local_hostname: str = ""
    load_workers: int = 4
    lookup_timeout_s: float = 0.25
    probe_wait_ms: float = 5.0
    sync_load_max_bytes: int = 8 << 20
    sync_load_timeout_s: float = 2.0
    idle_wait_ms: float = 2.0
    idle_wait_max_ms: float = 50.0
    kv_cache_access: str = "auto"
    bootstrap_port: int | None = None  # None: VLLM_MOONCAKE_BOOTSTRAP_PORT, else 8998
    bootstrap_host: str = ""
    push_layerwise: bool = False
    push_layerwise_cuda: bool = True
    push_layer_gate: bool = True
    push_layer_watch: bool = True
    push_layer_load: bool = False
    push_layer_timeout_s: float = 10.0
    push_layer_load_max_batch: int = 0
    push_layer_load_async: bool = False
    push_layer_read: bool = False
    push_layer_read_stall_s: float = 0.5
    early_recv: bool = True
    push_target_direct: bool = True
    malloc_trim_idle_s: float = 30.0

    @property
    def is_producer(self):
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self):
        return self.role in ("kv_consumer", "kv_both")

    def summary(self):
        d = asdict(self)
        d["mooncake"] = shown_mooncake(d["mooncake"])
        return json.dumps(d, sort_keys=True, default=str)


HIDDEN = "(set, not shown)"


def shown_mooncake(fields):
    """mooncake.json's fields as they may be logged or printed: auth_secret
    hidden, a metadata_server URL's password as *** (the C parser's
    mask_password)."""
    out = dict(fields)
    if out.get("auth_secret"):
        out["auth_secret"] = HIDDEN
    if isinstance(out.get("metadata_server"), str):
        out["metadata_server"] = mask_url(out["metadata_server"])
    return out


def mask_url(url):
    """A metadata server URL with what precedes its host's "@" (a password,
    a user) shown as ":***", as the C parser's mask_password shows it."""
    sep = url.find("://")
    start = sep + 3 if sep >= 0 else 0
    at = url.rfind("@", start)
    return url if at < 0 else f"{url[:start]}:***{url[at:]}"


# As the C parser (csrc/config): a mooncake.json is a few hundred bytes.
MAX_CONFIG_BYTES = 1 << 20


def _read_json(path, what, source="MOONCAKE_CONFIG_PATH"):
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise SettingsError(f"{what} path must be a non-empty string (the path of your "
                            f"mooncake.json), not {path!r}")
    try:
        # O_NONBLOCK: a FIFO nothing writes to would block open() forever;
        # reads block again (a pipe without a writer reads as empty).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as f:
            os.set_blocking(fd, True)
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise SettingsError(f"{what} {path!r} cannot be read ({e.strerror}); set "
                            f"{source} to a readable mooncake.json") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise SettingsError(f"{what} {path!r} is over {MAX_CONFIG_BYTES} bytes; refused (is "
                            f"{source} really your mooncake.json?)")
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0  # skipped, as the C parser does
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = e.start + bom
        raise SettingsError(f"{what} {path!r} is not UTF-8 text (byte 0x{raw[at]:02x} at "
                            f"offset {at}); save it as UTF-8") from None
    top = []

    def pairs(kv):  # every object's keys; the top level's are the last to come
        top[:] = kv
        return _JsonObject(kv)

    deep = False
    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise SettingsError(f"{what} {path!r} is not valid JSON: {e.msg} at line {e.lineno} "
                            f"column {e.colno}") from None
    except RecursionError:
        data = deep = None
    if deep is None or _nesting(data) > C_JSON_DEPTH_MAX:  # deeper: as the C parser
        raise SettingsError(f"{what} {path!r} is not valid JSON: nesting too deep (a "
                            "mooncake.json is one object of strings and booleans)")
    if not isinstance(data, dict):
        raise SettingsError(f"{what} {path!r} must hold a JSON object, not "
                            f"{type(data).__name__}")
    _check_fields(top, os.fspath(path))
    return data


C_JSON_DEPTH_MAX = 64  # the C parser's JSON_DEPTH_MAX (csrc/util/json_check.c)


def _nesting(value):
    """How deep arrays and objects nest in value (a top-level object: 1)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _edit_distance(a: bytes, b: bytes):
    """Levenshtein distance, as the C parser's edit_distance (99 past 64 bytes)."""
    if len(a) > 64 or len(b) > 64:
        return 99
    row = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        diag, row[0] = row[0], i
        for j in range(1, len(b) + 1):
            up = row[j]
            row[j] = min(diag + (a[i - 1] != b[j - 1]), up + 1, row[j - 1] + 1)
            diag = up
    return row[len(b)]


def _show(text, limit, quote=False):
    """As the C parser's show(): control characters as \\xNN, cut at limit
    characters with "..."; with quote, in double quotes, inner quotes and
    backslashes escaped."""
    out = "".join("\\" + c if quote and c in '"\\' else
                  f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7f else
                  f"\\u{ord(c):04x}" if 0xd800 <= ord(c) < 0xe000 else c
                  for c in text[:limit])
    out += "..." if len(text) > limit else ""
    return f'"{out}"' if quote else out


class _JsonObject(dict):
    """A JSON object as read, its pairs kept in file order (duplicates too),
    so a value of the wrong type is shown as the C parser shows it."""

    def __init__(self, pairs):
        super().__init__(pairs)
        self.pairs = list(pairs)


def _cjson_string(text):
    """cJSON's rendering of a string (print_string_ptr)."""
    esc = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n",
           "\r": "\\r", "\t": "\\t"}
    return '"' + "".join(esc.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 else c)
                         for c in text) + '"'


def _cjson_number(value):
    """cJSON's (1.7.15) rendering of a number (print_number): a double, with
    15 significant digits unless that does not read back (within an
    epsilon), then 17; NaN and infinities as null."""
    try:
        d = float(value)
    except OverflowError:  # a Python int past the double range: strtod gives inf
        return "null"
    if not math.isfinite(d):
        return "null"
    short = "%1.15g" % d
    if abs(float(short) - d) <= max(abs(float(short)), abs(d)) * 2.220446049250313e-16:
        return short
    return "%1.17g" % d


def _cjson_text(value, depth=0):
    """cJSON_PrintUnformatted of a value, as the C parser shows a value of the
    wrong type.  Past 100 levels "...": messages show its first 80
    characters, and a level starts one character in at least (a value nested
    some 600 deep, which json.loads takes, overflowed Python's stack)."""
    if depth > 100:
        return "..."
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return _cjson_number(value)
    if isinstance(value, str):
        return _cjson_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_cjson_text(v, depth + 1) for v in value) + "]"
    if isinstance(value, dict):
        pairs = value.pairs if isinstance(value, _JsonObject) else value.items()
        return "{" + ",".join(f"{_cjson_string(str(k))}:{_cjson_text(v, depth + 1)}"
                              for k, v in pairs) + "}"
    return "?"


def _value_text(value):
    """A wrong-typed value as the C parser's error shows it (value_text):
    cJSON's text, except a number past the double range (1e400)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and _cjson_number(value) == "null":
        return "<a number out of range>"
    return _cjson_text(value)


def _json_type_name(value):
    """The C parser's json_type_name."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "an unknown JSON type"


def _c_line(msg):
    """The message as the C parser's error buffer holds it: cut at
    C_MSG_MAX - 1 bytes, a character cut short by that as one '?' per byte
    (utf8_clean)."""
    raw = msg.encode("utf-8", "surrogatepass")
    if len(raw) < C_MSG_MAX:
        return msg
    raw = raw[:C_MSG_MAX - 1]
    for cut in range(4):
        try:
            return raw[:len(raw) - cut].decode("utf-8") + "?" * cut
        except UnicodeDecodeError:
            continue
    return raw.decode("utf-8", "replace")


def _origin_shown(origin):
    """The file's name as the C parser's messages show it (ctx_init): over 120
    bytes, "..." and its last 117 bytes from a character's start; bytes that
    are not UTF-8 as \\xNN."""
    raw, head = os.fsencode(origin), ""
    if len(raw) > 120:
        raw, head = raw[len(raw) - 117:].lstrip(bytes(range(0x80, 0xc0))), "..."
    return head + "".join(f"\\x{ord(c) - 0xdc00:02x}" if 0xdc80 <= ord(c) <= 0xdcff else
                          _show(c, 1) for c in raw.decode("utf-8", "surrogateescape"))


def _value_error(shown, key, value):
    """The C parser's message (check_object) on mooncake.json field key's
    value when its JSON type is wrong or it is too long; None when it is
    fine."""
    accepted = C_ACCEPTED[key]
    if key == "same_host_cpu":
        if isinstance(value, bool):
            return None
        return _c_line(f'{shown}: field "{key}": value {_show(_value_text(value), 80)} is '
                       f"{_json_type_name(value)}; expected true or false; accepted: {accepted}")
    if not isinstance(value, str):
        # As the C parser, never the secret's text, even of the wrong type.
        text = "?" if key == "auth_secret" else _show(_value_text(value), 80)
        return _c_line(f'{shown}: field "{key}": value {text} is {_json_type_name(value)}; '
                       f"expected a string; accepted: {accepted}")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size >= C_STR_MAX:
        text = "" if key == "auth_secret" else f"value {_show(value, 80, quote=True)} "
        return _c_line(f'{shown}: field "{key}": {text}is {size} bytes long; at most '
                       f"{C_STR_MAX - 1} are accepted; accepted: {accepted}")
    return None


def _check_values(items, origin):
    """The mooncake fields' values as the worker's C parser gets them
    (lifecycle.start_engine: the file's fields with kv_connector_extra_config's
    on top, None dropped): one of the wrong type is refused with its
    message."""
    shown = _origin_shown(origin)
    for key, value in items:
        if value is not None and key in C_ACCEPTED:
            msg = _value_error(shown, key, value)
            if msg:
                raise SettingsError(msg)


def _check_fields(pairs, origin):
    """mooncake.json's top-level fields, in file order, as the C parser checks
    them: an unknown key (with the field it is closest to, within two
    edits), one given twice, or a value of the wrong JSON type (or longer
    than the C parser holds) is a SettingsError with the C parser's
    message."""
    shown = _origin_shown(origin)
    seen = set()
    for key, value in pairs:
        if key not in C_FIELDS:
            hint = ""
            dist = [_edit_distance(key.encode(), f.encode()) for f in C_FIELDS]
            if min(dist) < 3:
                hint = f'; did you mean "{C_FIELDS[dist.index(min(dist))]}"?'
            if key in VLLM_KEYS:
                hint = " (it belongs in vLLM's --kv-transfer-config, not mooncake.json)"
            if key in KNOBS or key == "mooncake_config_path":  # the C parser's k_knob_keys
                hint = (" (a connector setting: it belongs in kv_connector_extra_config of "
                        "vLLM's --kv-transfer-config, not mooncake.json)")
            if key in STORE_KEYS:
                hint = " (a Mooncake Store setting; this connector does not use it: remove it)"
            raise SettingsError(_c_line(f'{shown}: field "{_show(key, 80)}": unknown '
                                        f'field{hint}; accepted: {", ".join(C_FIELDS)}'))
        if key in seen:
            raise SettingsError(f'{shown}: field "{key}": appears more than once; accepted: '
                                "each field once")
        seen.add(key)
        msg = _value_error(shown, key, value)
        if msg:
            raise SettingsError(msg)


def _coerce(key, typ, value):
    if typ is str:
        if not isinstance(value, str):
            raise SettingsError(f"kv_connector_extra_config.{key} must be a string, not "
                                f"{value!r}")
        return value
    if typ is int and (isinstance(value, bool) or isinstance(value, float) and (
            not math.isfinite(value) or value != int(value))):
        raise SettingsError(f"kv_connector_extra_config.{key} must be an integer, not "
                            f"{value!r}")
    if typ is float and isinstance(value, bool):  # float(True) is 1.0: never meant
        raise SettingsError(f"kv_connector_extra_config.{key} must be a number, not "
                            f"{value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        raise SettingsError(f"kv_connector_extra_config.{key} must be true or false, not "
                            f"{value!r}")
    try:
        out = typ(value)
    except OverflowError:  # an integer past the double range (a JSON 1 and 400 zeros)
        raise SettingsError(f"kv_connector_extra_config.{key} must be a finite number, not "
                            f"an integer of {len(str(value))} digits") from None
    except (TypeError, ValueError):
        what = {int: "an integer", float: "a number"}.get(typ, f"a {typ.__name__}")
        raise SettingsError(f"kv_connector_extra_config.{key} must be {what}, not "
                            f"{value!r}") from None
    if typ is float and not math.isfinite(out):
        raise SettingsError(f"kv_connector_extra_config.{key} must be a finite number, not "
                            f"{value!r}")
    if typ in (int, float) and out < 0:
        raise SettingsError(f"kv_connector_extra_config.{key} must be >= 0, not {value!r}")
    return out


def _int_field(name, value, lo=None, hi=None):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            isinstance(value, float) and not math.isfinite(value) or value != int(value):
        raise SettingsError(f"{name} must be an integer, not {value!r}")
    value = int(value)
    if lo is not None and value < lo:
        raise SettingsError(f"{name} must be >= {lo}, not {value}")
    if hi is not None and value > hi:
        raise SettingsError(f"{name} must be <= {hi}, not {value}")
    return value


#: Knobs that put per-layer work in vLLM's forward for every request
#: (wait_for_layer_load / save_kv_layer), which a FULL CUDA-graph replay skips.
LAYERWISE_KNOBS = ("push_layer_load", "push_layerwise")


def layerwise_in_forward(extra_config):
    """Whether kv_connector_extra_config turns per-layer work in the forward
    on for every request (MooncakeConnector.requires_piecewise_for_cudagraph).
    A value resolve() would refuse counts as off here: the connector's start
    reports it."""
    extra = extra_config if isinstance(extra_config, dict) else {}
    for key in LAYERWISE_KNOBS:
        if key in extra:
            try:
                if _coerce(key, bool, extra[key]):
                    return True
            except SettingsError:
                pass
    return False


def resolve(kv_transfer_config, env=None):
    """Settings from vLLM's KVTransferConfig (duck-typed: kv_role,
    kv_connector_extra_config)."""
    env = os.environ if env is None else env
    role = getattr(kv_transfer_config, "kv_role", None)
    if role not in ROLES:
        raise SettingsError(f"kv_role is {role!r}; MooncakeConnector needs one of "
                            f"{', '.join(ROLES)} in --kv-transfer-config")
    extra = dict(getattr(kv_transfer_config, "kv_connector_extra_config", None) or {})
    s = Settings(role=role)
    s.config_path = extra.pop("mooncake_config_path", None)
    source = "kv_connector_extra_config.mooncake_config_path"
    if s.config_path is None:  # given, "" is refused by _read_json (was: the environment's)
        s.config_path = env.get("MOONCAKE_CONFIG_PATH") or None
        source = "MOONCAKE_CONFIG_PATH"
    if s.config_path is not None:
        s.mooncake = {k: v for k, v in _read_json(s.config_path, "mooncake config",
                                                  source).items()}
    for k in MOONCAKE_FIELDS:
        if k in extra:
            s.mooncake[k] = extra.pop(k)
    _check_values(s.mooncake.items(),
                  os.fspath(s.config_path) if s.config_path else "kv_connector_extra_config")
    s.kv_rank = _int_field("kv_rank", extra.pop("kv_rank", None), lo=0)
    s.kv_parallel_size = _int_field("kv_parallel_size", extra.pop("kv_parallel_size", None),
                                    lo=1)
    buf = extra.pop("kv_buffer_size", None)
    if buf is not None:
        s.kv_buffer_size = _int_field("kv_buffer_size", buf, lo=1, hi=1 << 50)
    if s.kv_rank is not None and s.kv_parallel_size is not None and \
            s.kv_rank >= s.kv_parallel_size:
        raise SettingsError(f"kv_rank {s.kv_rank} must be below kv_parallel_size "
                            f"{s.kv_parallel_size}")
    if "bootstrap_port" in extra:
        s.bootstrap_port = _int_field("kv_connector_extra_config.bootstrap_port",
                                      extra.pop("bootstrap_port"), lo=0)
    for key, (typ, _default, _doc) in KNOBS.items():
        if key in extra:
            setattr(s, key, _coerce(key, typ, extra.pop(key)))
    for key in ("lookup_timeout_s", "sync_load_timeout_s", "load_timeout_s",
                "push_layer_timeout_s", "hold_timeout_s"):
        if getattr(s, key) <= 0:
            # hold_timeout_s 0 was taken: the lookup buffer's ttl 0 means never
            # (a pulled prompt held until evicted), a push job's 0 at once
            raise SettingsError(f"kv_connector_extra_config.{key} must be > 0 seconds, not "
                                f"{getattr(s, key)!r}")
    for key in ("lookup_timeout_s", "sync_load_timeout_s", "load_timeout_s",
                "push_layer_timeout_s", "hold_timeout_s"):
        if getattr(s, key) > 86_400:  # the engine's bound on a transfer's timeout
            raise SettingsError(f"kv_connector_extra_config.{key} must be at most 86400 "
                                f"seconds, not {getattr(s, key)!r}")
    if not 1 <= s.load_workers <= 64:
        raise SettingsError("kv_connector_extra_config.load_workers must be 1-64 (concurrent "
                            f"KV loads per worker), not {s.load_workers!r}")
    if not 0.01 <= s.push_layer_read_stall_s <= 86_400:  # also refuses NaN
        raise SettingsError("kv_connector_extra_config.push_layer_read_stall_s must be "
                            f"0.01-86400 seconds, not {s.push_layer_read_stall_s!r}")
    if s.push_layer_timeout_s <= 1.0:
        raise SettingsError("kv_connector_extra_config.push_layer_timeout_s must be > 1 s (the "
                            "producer starts no write in the last second of the lease), not "
                            f"{s.push_layer_timeout_s!r}")
    if s.push_layer_read_stall_s >= s.push_layer_timeout_s:
        # A layer read gives up a silent producer after the stall; at or past
        # the lease it never would (the lease's end and its cancel come first).
        raise SettingsError(
            f"kv_connector_extra_config.push_layer_read_stall_s={s.push_layer_read_stall_s:g} "
            f"is not below push_layer_timeout_s={s.push_layer_timeout_s:g}: a layer read's "
            "stall would never be noticed before its lease ends; set push_layer_read_stall_s "
            "below push_layer_timeout_s (defaults 0.5 and 10)")
    if not 0 <= s.malloc_trim_idle_s <= 86_400:  # also refuses NaN
        raise SettingsError("kv_connector_extra_config.malloc_trim_idle_s must be 0 (off) to "
                            f"86400 seconds, not {s.malloc_trim_idle_s!r}")
    if not 0 <= s.probe_wait_ms <= 10_000:  # also refuses NaN
        raise SettingsError("kv_connector_extra_config.probe_wait_ms must be 0-10000 (a new "
                            f"request's first step may wait as long), not {s.probe_wait_ms!r}")
    for key in ("idle_wait_ms", "idle_wait_max_ms"):
        v = getattr(s, key)
        if v > 1000 or v != v:
            raise SettingsError(f"kv_connector_extra_config.{key} must be <= 1000 (it delays "
                                f"new requests as long), not {v!r}")
    if s.bootstrap_port is not None and s.bootstrap_port > 65535:
        raise SettingsError("kv_connector_extra_config.bootstrap_port must be a port number "
                            f"(0-65535; 0 = no bootstrap server), not {s.bootstrap_port}")
    if s.bootstrap_host:
        from mooncake_connector.hostport import listen_host_problem
        problem = listen_host_problem(s.bootstrap_host)
        if problem:
            raise SettingsError(f"kv_connector_extra_config.bootstrap_host "
                                f"{s.bootstrap_host[:80]!r}: {problem}; or leave it unset "
                                "(the bootstrap server listens on every address)")
    if s.load_failure_policy not in ("recompute", "fail"):
        raise SettingsError("kv_connector_extra_config.load_failure_policy must be 'recompute' "
                            f"or 'fail', not {s.load_failure_policy!r}")
    if s.push_layer_load_async and s.is_consumer and s.load_failure_policy != "fail":
        # A producer (kv_producer) loads nothing: the setting is inert there,
        # so one kv_connector_extra_config can serve both sides.  vLLM
        # recovers ("recompute") a failed in-step load under async
        # scheduling by truncating a request the step already scheduled
        # counts computed: the next step's device-side assert kills the
        # engine (benchmarks/JOURNAL.md, runs 36 and 49).
        raise SettingsError(
            "kv_connector_extra_config.push_layer_load_async is true but load_failure_policy "
            f"is {s.load_failure_policy!r}: vLLM's engine dies recovering a failed in-step "
            "load under asynchronous scheduling; set load_failure_policy to 'fail' in "
            "kv_connector_extra_config (the connector sets vLLM's kv_load_failure_policy from "
            "it, whatever --kv-transfer-config's own kv_load_failure_policy says; the proxy "
            "sends a request that failed so once more without kv_transfer_params: "
            "--decode-retake on, its default), or leave push_layer_load_async false")
    from mooncake_connector.connector.access import MODES as ACCESS_MODES
    if s.kv_cache_access not in ACCESS_MODES:
        raise SettingsError("kv_connector_extra_config.kv_cache_access must be one of "
                            f"{', '.join(ACCESS_MODES)}, not {s.kv_cache_access!r}")
    if extra:
        known = sorted(set(KNOBS) | set(MOONCAKE_FIELDS) |
                       {"kv_rank", "kv_parallel_size", "kv_buffer_size", "mooncake_config_path"})
        unknown = sorted(extra, key=str)  # keys of other types (Python callers): no TypeError
        hints = [f"{k!r}: did you mean {close[0]!r}?" for k in unknown
                 for close in [difflib.get_close_matches(str(k), known, n=1)] if close]
        raise SettingsError(f"unknown kv_connector_extra_config key(s) {unknown}"
                            f"{' (' + '; '.join(hints) + ')' if hints else ''}; known: "
                            f"{', '.join(known)}")
    return s


def engine_name(s, tp_rank):
    """host:port of this worker's engine: the role's URL, port + TP rank."""
    base = s.local_hostname or (s.mooncake.get("prefill_url") if s.role != "kv_consumer"
                                else s.mooncake.get("decode_url"))
    if not base:
        need = "prefill_url" if s.role != "kv_consumer" else "decode_url"
        raise SettingsError(f"no engine address: set {need} in mooncake.json "
                            "(MOONCAKE_CONFIG_PATH) or local_hostname in "
                            "kv_connector_extra_config")
    return shift_port(base, tp_rank)


def dp_base(base, dp_local, tp_size, pp_size):
    """The base name (host:port) of a server's data-parallel engine number
    `dp_local` (connector.dp_local): the configured base for engine 0 (and
    without data parallelism), moved by dp_local * tp_size * pp_size, past
    the previous engine's ranks (base + pp * tp_size + tp).  A server with D
    DP engines of TP t and PP p uses ports base .. base + D*t*p - 1."""
    if not dp_local:
        return base
    return shift_port(base, dp_local * tp_size * pp_size)


def shift_port(hostport, delta):
    host, sep, port = str(hostport).rpartition(":")
    if not sep or not port.isdigit():
        raise SettingsError(f"{hostport!r} is not host:port")
    p = int(port) + delta
    if not 0 < p < 65536:
        raise SettingsError(f"{hostport!r} + TP rank {delta} is not a valid port")
    return f"{host}:{p}"
