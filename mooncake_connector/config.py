"""Check a mooncake.json, and vLLM's --kv-transfer-config, before a server starts.

    mooncake-connector config [PATH]
        PATH (default: $MOONCAKE_CONFIG_PATH) through the workers' own parser;
        prints the configuration it yields.
    mooncake-connector config --kv-transfer-config JSON [PATH]
        JSON: the value given to `vllm serve --kv-transfer-config`, checked as
        the server's start would check it: which class "MooncakeConnector"
        resolves to (this package's or vLLM's in-tree one, and why), the
        seed's kv_rank / kv_parallel_size / kv_buffer_size, kv_role,
        kv_connector_extra_config (every key, its value, the settings' cross-
        checks for that role) and the mooncake.json at PATH (or
        $MOONCAKE_CONFIG_PATH) the server would read; prints the connector's
        effective settings (the "effective config" line its start logs).
        Errors a server reports only once its model is loaded, seconds here.

    python -m mooncake_connector.config ...       (the same)

Exit status 0 when valid (notes on stderr); 2 with the message (the field,
the value, what is accepted, the fix) when not.
"""
import json
import os
import sys
from dataclasses import asdict
from types import SimpleNamespace

from mooncake_connector import ConfigError, load_config

USAGE = "usage: mooncake-connector config [--kv-transfer-config JSON] [PATH]"
HIDDEN = "(set, not shown)"


class CheckError(Exception):
    """A configuration the server's start would refuse: the message says why."""


def _parse_args(argv):
    """(kv_transfer_config text or None, path or None); ValueError with the
    usage error."""
    ktc, paths, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--kv-transfer-config" or a.startswith("--kv-transfer-config="):
            if ktc is not None:
                raise ValueError("--kv-transfer-config given twice")
            if "=" in a:
                ktc = a.split("=", 1)[1]
            elif i + 1 < len(argv):
                i += 1
                ktc = argv[i]
            else:
                raise ValueError("--kv-transfer-config needs a value: the JSON given to "
                                 "vLLM's --kv-transfer-config, quoted")
        elif a.startswith("-"):
            raise ValueError(f"unknown option {a!r} (a path starting with '-': write ./-NAME)")
        else:
            paths.append(a)
        i += 1
    if len(paths) > 1:
        raise ValueError(f"one PATH only, got {len(paths)} arguments")
    return ktc, (paths[0] if paths else None)


def _masked(d):
    if isinstance(d, dict) and d.get("auth_secret"):
        d = dict(d, auth_secret=HIDDEN)
    return d


def check_kv_transfer_config(text, path=None, env=None):
    """(effective settings as a dict, notes) for --kv-transfer-config `text`
    with the mooncake.json at `path` (or env's MOONCAKE_CONFIG_PATH), as a
    server's start would take them; CheckError naming what is wrong."""
    from mooncake_connector.connector import plugin
    from mooncake_connector.connector.settings import SettingsError, engine_name, resolve
    env = dict(os.environ if env is None else env)
    if path is not None:
        env["MOONCAKE_CONFIG_PATH"] = path  # what the server is to be started with
    notes = []
    try:
        d = json.loads(text)
    except RecursionError:
        raise CheckError("--kv-transfer-config nests JSON arrays or objects too deeply to "
                         "read") from None
    except ValueError as e:
        raise CheckError(f"--kv-transfer-config is not valid JSON: {e} (give the value of "
                         "vLLM's --kv-transfer-config, in single quotes in a shell, e.g. "
                         "'{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":"
                         "\"kv_consumer\"}')") from None
    if not isinstance(d, dict):
        raise CheckError(f"--kv-transfer-config is a JSON {type(d).__name__}, not an object "
                         "({\"kv_connector\": \"MooncakeConnector\", \"kv_role\": ...})")
    if d.get("kv_connector") != plugin.NAME:
        raise CheckError(f"kv_connector is {d.get('kv_connector')!r}: this package's connector "
                         f"is \"{plugin.NAME}\" (with MOONCAKE_CONFIG_PATH set or "
                         "\"kv_connector_module_path\": \"mooncake_connector\")")
    module = d.get("kv_connector_module_path")
    if module not in plugin.OUR_MODULES:
        raise CheckError(f"kv_connector_module_path is {module!r}: vLLM loads "
                         f"{plugin.NAME} from that module, not from this package (use "
                         "\"mooncake_connector\", or leave it out)")
    extra = d.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise CheckError(f"kv_connector_extra_config is a JSON {type(extra).__name__}, not an "
                         "object of settings")
    moved = sorted(k for k in plugin.SEED_FIELDS if k in d)
    d = json.loads(plugin._move_seed_fields(json.dumps(d)))
    if module is None:
        ours, why = plugin.choose(d.get("kv_connector_extra_config"), env)
        if not ours:
            fix = "add \"kv_connector_module_path\": \"mooncake_connector\""
            if not env.get("MOONCAKE_CONFIG_PATH"):
                fix = "set MOONCAKE_CONFIG_PATH (or give PATH), or " + fix
            raise CheckError(f"\"{plugin.NAME}\" resolves to vLLM's in-tree connector here, "
                             f"not this package's: {why}; for this package's, {fix}")
        notes.append(f"\"{plugin.NAME}\" resolves to this package's connector: {why}")
    if moved:
        notes.append(f"{moved} (the seed's fields, which vLLM's own KVTransferConfig does not "
                     "take) are moved into kv_connector_extra_config by this package's vLLM "
                     "plugin")
    try:
        s = resolve(SimpleNamespace(kv_role=d.get("kv_role"),
                                    kv_connector_extra_config=d.get("kv_connector_extra_config")),
                    env=env)
        engine = engine_name(s, 0)
    except SettingsError as e:
        raise CheckError(str(e)) from None
    if s.config_path is not None:  # the mooncake.json through the workers' own parser too
        try:
            cfg = load_config(os.fspath(s.config_path))
        except ConfigError as e:
            raise CheckError(str(e)) from None
        if cfg.get("notes"):
            notes.append(cfg["notes"])
    elif "MOONCAKE_CONFIG_PATH" in env:
        notes.append("MOONCAKE_CONFIG_PATH is set but empty: the connector reads no "
                     "mooncake.json")
    vllm_policy = d.get("kv_load_failure_policy")
    if vllm_policy is not None and vllm_policy != s.load_failure_policy:
        notes.append(f"kv_load_failure_policy {vllm_policy!r} (vLLM's) is replaced by the "
                     f"connector's load_failure_policy {s.load_failure_policy!r}: set "
                     "load_failure_policy in kv_connector_extra_config to choose")
    out = asdict(s)
    out["mooncake"] = _masked(out.get("mooncake"))
    out["engine"] = engine
    return out, notes


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    try:
        ktc, path = _parse_args(list(argv))
    except ValueError as e:
        print(f"{USAGE}\nerror: {e}", file=sys.stderr)
        return 2
    if ktc is not None:
        try:
            out, notes = check_kv_transfer_config(ktc, path)
        except CheckError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        print(json.dumps(out, indent=2, sort_keys=True, default=str))
        return 0
    try:
        cfg = load_config(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.get("notes"):
        print(f"note: {cfg['notes']}", file=sys.stderr)
    if cfg.get("auth_secret"):
        cfg["auth_secret"] = HIDDEN
    print(json.dumps(cfg, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
