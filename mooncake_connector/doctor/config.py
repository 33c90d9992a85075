"""config: each field of mooncake.json, through the package's own parser."""
from __future__ import annotations

import json
import os
import re

from .report import FAIL, OK, WARN


def check_config(rep, path):
    """Parses mooncake.json with the package's parser; one row per field."""
    import mooncake_connector as mc

    where = path or os.environ.get("MOONCAKE_CONFIG_PATH")
    if not where:
        rep.add("config", "file", FAIL, "no config file given and MOONCAKE_CONFIG_PATH is not set",
                "pass --config /path/to/mooncake.json or export MOONCAKE_CONFIG_PATH=/path/to/"
                "mooncake.json (the file vLLM's connector reads)")
        return None
    try:
        cfg = mc.load_config(where)
    except mc.ConfigError as e:
        msg = str(e)
        m = re.search(r'field "([^"]+)"', msg)
        acc = re.search(r"accepted: (.*)$", msg)
        if m and acc and "unknown field" in msg:
            fix = f'edit {where}: remove "{m.group(1)}"; mooncake.json takes {acc.group(1)}'
        elif m and acc:
            fix = f'edit {where}: set "{m.group(1)}" to {acc.group(1)}'
        elif "No such file" in msg or "cannot read" in msg or "cannot open" in msg:
            fix = f"create {where} or point --config / MOONCAKE_CONFIG_PATH at the real file"
        else:
            fix = f"edit {where} as the message says (docs/connector.md shows a complete file)"
        rep.add("config", "file", FAIL, msg, fix)
        return None
    rep.add("config", "file", OK, cfg["origin"])
    rep.add("config", "prefill_url", OK, cfg["prefill_url"])
    rep.add("config", "decode_url", OK, cfg["decode_url"]
            + (" (decode port moved up by 100: same as prefill_url)"
               if cfg["decode_port_adjusted"] else ""))
    if cfg["metadata_backend_given"]:
        rep.add("config", "metadata_backend", WARN,
                f"deprecated field given; {cfg['metadata_backend']} is used",
                f'write the scheme into metadata_server ("{cfg["metadata_server"]}") and drop '
                "metadata_backend")
    rep.add("config", "metadata_server", OK,
            f"{_mask(cfg['metadata_server'])} ({cfg['metadata_backend']})")
    rep.add("config", "protocol", OK, cfg["protocol"])
    if cfg["protocol"] == "rdma":
        rep.add("config", "device_name", OK, cfg["device_name"])
    elif _raw_field(where, "device_name"):
        rep.add("config", "device_name", WARN,
                f'"{_raw_field(where, "device_name")}" is ignored with protocol tcp',
                'set "protocol": "rdma" to use these NICs, or clear device_name')
    return cfg


def _raw_field(path, name):
    try:
        with open(path, "rb") as f:
            v = json.load(f).get(name)
        return v if isinstance(v, str) else ""
    except (OSError, ValueError, AttributeError):
        return ""


def _mask(url):
    """A metadata URL as shown: its password (any scheme's) as ***."""
    from mooncake_connector.connector.settings import mask_url
    return mask_url(url)


def check_kv_transfer_config(rep, text, path):
    """vLLM's --kv-transfer-config with the mooncake.json (`path`, else
    MOONCAKE_CONFIG_PATH) as a server's start takes them
    (mooncake_connector.config.check_kv_transfer_config): one row, OK with
    what they yield or FAIL with the start's own message.  Returns the
    effective settings or None."""
    from mooncake_connector.config import CheckError
    from mooncake_connector.config import check_kv_transfer_config as check

    try:
        s, notes = check(text, path)
    except CheckError as e:
        rep.add("config", "kv-transfer-config", FAIL, str(e),
                "fix --kv-transfer-config (or the mooncake.json it reads) as the message says; "
                "`mooncake-connector config --kv-transfer-config JSON PATH` prints what they "
                "yield (docs/connector.md, \"Starting the servers\")")
        return None
    pushed = [k for k in ("push_layerwise", "push_layer_load", "push_layer_read",
                          "push_layer_load_async") if s.get(k)]
    rep.add("config", "kv-transfer-config", OK,
            f"{s['role']}, engine {s['engine']}, load_failure_policy "
            f"{s['load_failure_policy']}" + (f", {', '.join(pushed)}" if pushed else ""))
    for n in notes:
        if "replaced by" in n:
            rep.add("config", "kv_load_failure_policy", WARN, n,
                    "set load_failure_policy in kv_connector_extra_config and drop vLLM's "
                    "kv_load_failure_policy")
        elif " is given twice: " in n:  # a seed field at the top level and in the extra config
            rep.add("config", n.split()[0], WARN, n,
                    "give it once, in kv_connector_extra_config")
    where = path or os.environ.get("MOONCAKE_CONFIG_PATH")
    if s["config_path"] and where and not _same_file(s["config_path"], where):
        rep.add("config", "mooncake_config_path", WARN,
                f"the server reads {s['config_path']} (kv_connector_extra_config's "
                f"mooncake_config_path); the other checks here read {where}",
                f"pass --config {s['config_path']} to check the file the server reads")
    return s


def _same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return os.path.abspath(a) == os.path.abspath(b)
