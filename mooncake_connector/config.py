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
import re
import sys
from dataclasses import asdict
from types import SimpleNamespace

from mooncake_connector import ConfigError, load_config
from mooncake_connector.connector.settings import HIDDEN, mask_url

USAGE = "usage: mooncake-connector config [--kv-transfer-config JSON] [PATH]"


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
        elif not a:
            raise ValueError("PATH is empty (an unset shell variable?): give the path of the "
                             "mooncake.json, or leave PATH out for $MOONCAKE_CONFIG_PATH")
        else:
            paths.append(a)
        i += 1
    if len(paths) > 1:
        raise ValueError(f"one PATH only, got {len(paths)} arguments")
    return ktc, (paths[0] if paths else None)


# vLLM's KVTransferConfig fields (0.32), which refuses any other key; a key
# outside them is looked up in the installed vLLM's (slow: only then).
VLLM_FIELDS = ("kv_connector", "engine_id", "kv_buffer_device", "kv_role", "kv_port",
               "kv_connector_extra_config", "kv_connector_module_path",
               "enable_permute_local_kv", "kv_load_failure_policy")


def _vllm_kv_transfer_config():
    """The installed vLLM's KVTransferConfig class (its import is slow: only
    when needed), or None without a usable vLLM here."""
    import contextlib
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its import's log lines
            from vllm.config.kv_transfer import KVTransferConfig
        return KVTransferConfig
    except Exception:  # noqa: BLE001  no (usable) vLLM here
        return None


def _installed_vllm_fields():
    """The installed vLLM's KVTransferConfig field names, or None without one."""
    import dataclasses
    cls = _vllm_kv_transfer_config()
    return None if cls is None else {f.name for f in dataclasses.fields(cls)}


def _check_vllm_fields(d, plugin):
    """What vLLM's own parse of --kv-transfer-config (before any connector)
    refuses: a key its KVTransferConfig does not have (a connector setting
    put at the top level, a typo), a kv_load_failure_policy it does not
    take.  The seed's fields are the plugin's to move."""
    import difflib
    for key in d:
        if key in VLLM_FIELDS or key in plugin.SEED_FIELDS:
            continue
        if key in plugin._our_keys():
            raise CheckError(f"{key!r} is a setting of this package's connector, not a field of "
                             "vLLM's --kv-transfer-config (vLLM refuses it): move it into "
                             f"\"kv_connector_extra_config\": {{{json.dumps(key)}: ...}}")
        typo = difflib.get_close_matches(key, VLLM_FIELDS, n=1, cutoff=0.85)
        fields = set() if typo else _installed_vllm_fields()  # a typo: no need to ask
        if fields and key in fields:
            continue
        known = sorted(set(VLLM_FIELDS) | (fields or set()))
        close = typo or difflib.get_close_matches(key, known, n=1)
        raise CheckError(f"{key!r} is not a field of vLLM's --kv-transfer-config"
                         f"{' (vLLM is not importable here)' if fields is None else ''}: vLLM "
                         f"refuses it{f'; did you mean {close[0]!r}?' if close else ''} "
                         f"(fields: {', '.join(known)}; this connector's settings go in "
                         "kv_connector_extra_config)")
    policy = d.get("kv_load_failure_policy", "fail")
    if policy not in ("recompute", "fail"):
        raise CheckError(f"kv_load_failure_policy is {policy!r}: vLLM takes 'recompute' or "
                         "'fail' (this connector replaces it with kv_connector_extra_config's "
                         "load_failure_policy: set that, and leave kv_load_failure_policy out)")


# The fields whose values are checked here; another's (kv_port, engine_id...)
# only vLLM's own validation judges (pydantic's lax rules: "123" is a port).
CHECKED_HERE = ("kv_connector", "kv_role", "kv_connector_extra_config",
                "kv_connector_module_path", "kv_load_failure_policy")


def _vllm_refusal(d):
    """The installed vLLM's own validation of --kv-transfer-config d (as its
    argument parser runs it): what it refuses, or None (accepted, or no
    vLLM here)."""
    import contextlib
    cls = _vllm_kv_transfer_config()
    if cls is None:
        return None
    from pydantic import TypeAdapter, ValidationError  # vLLM's own dependency
    with contextlib.redirect_stdout(sys.stderr):  # vLLM's log lines
        try:
            TypeAdapter(cls).validate_json(json.dumps(d))
        except ValidationError as e:
            return "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']} (given "
                             f"{x.get('input')!r})" for x in e.errors())
        except Exception as e:  # noqa: BLE001  its own checks (__post_init__)
            return str(e)
    return None


def _check_engine_name(s, engine, parse_config):
    """The engine name the start gives its engine, through the C address
    parser the engine's start uses (as prefill_url's): local_hostname as
    given, or the role's URL as the start writes it (host:port)."""
    from mooncake_connector import ConfigError
    if s.local_hostname:
        what = "kv_connector_extra_config.local_hostname"
    else:
        url = "decode_url" if s.role == "kv_consumer" else "prefill_url"
        what = f"the engine name the connector's start makes of {url} {s.mooncake.get(url)!r}"
    try:
        engine.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckError(f"{what} {engine!r} is not text the engine can take (a lone UTF-16 "
                         "surrogate): give host:port") from None
    try:
        parse_config(json.dumps({"prefill_url": engine, "decode_url": engine,
                                 "metadata_server": "P2PHANDSHAKE"}),
                     "kv_connector_extra_config")
    except ConfigError as e:
        if s.local_hostname:
            raise CheckError(str(e).replace('field "prefill_url"', 'field "local_hostname"', 1)) \
                from None
        why = re.search(r"is not a valid address \((.*)\); accepted", str(e))
        raise CheckError(f"{what} is {engine!r}, which the engine refuses "
                         f"({why.group(1) if why else e}): the start fails; give host:port there "
                         "(a host name, an IPv4 address or [IPv6])") from None


def _vllm_expanded(text):
    """text with vLLM's own expansion of bare human-readable numbers (2G,
    8M: vLLM's --kv-transfer-config takes them), or None without vLLM."""
    import contextlib
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its import's log lines
            from vllm.engine.arg_utils import _expand_json_human_readable_numbers
    except Exception:  # noqa: BLE001  no (usable) vLLM here
        return None
    try:
        return _expand_json_human_readable_numbers(text)
    except Exception as e:  # noqa: BLE001  vLLM's own refusal ("2.5G"): its start's too
        raise CheckError(f"--kv-transfer-config: {e} (vLLM's reading of a number such as "
                         "2G)") from None


def _load_json(text):
    """--kv-transfer-config's JSON as vLLM reads it (a number such as 2G
    expanded by vLLM's own code, which only then is imported)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise CheckError("--kv-transfer-config nests JSON arrays or objects too deeply to "
                         "read") from None
    except ValueError as e:
        err = e
    # a digit and a k/m/g/t suffix somewhere: maybe vLLM's human-readable form
    expanded = _vllm_expanded(text) if re.search(r"\d[kmgtKMGT]", text) else None
    if expanded is not None and expanded != text:
        try:
            return json.loads(expanded)
        except (ValueError, RecursionError):
            pass
    raise CheckError(f"--kv-transfer-config is not valid JSON: {err} (give the value of "
                     "vLLM's --kv-transfer-config, in single quotes in a shell, e.g. "
                     "'{\"kv_connector\":\"MooncakeConnector\",\"kv_role\":"
                     "\"kv_consumer\"}')")


def check_kv_transfer_config(text, path=None, env=None):
    """(effective settings as a dict, notes) for --kv-transfer-config `text`
    with the mooncake.json at `path` (or env's MOONCAKE_CONFIG_PATH), as a
    server's start would take them; CheckError naming what is wrong."""
    from mooncake_connector import parse_config
    from mooncake_connector.connector import lifecycle, plugin
    from mooncake_connector.connector.settings import (SettingsError, engine_name, resolve,
                                                       shown_mooncake)
    env = dict(os.environ if env is None else env)
    if path is not None:
        env["MOONCAKE_CONFIG_PATH"] = path  # what the server is to be started with
    notes = []
    d = _load_json(text)
    if not isinstance(d, dict):
        raise CheckError(f"--kv-transfer-config is a JSON {type(d).__name__}, not an object "
                         "({\"kv_connector\": \"MooncakeConnector\", \"kv_role\": ...})")
    if d.get("kv_connector") != plugin.NAME:
        raise CheckError(f"kv_connector is {d.get('kv_connector')!r}: this package's connector "
                         f"is \"{plugin.NAME}\" (with MOONCAKE_CONFIG_PATH set or "
                         "\"kv_connector_module_path\": \"mooncake_connector\")")
    module = d.get("kv_connector_module_path")
    if module == "":
        raise CheckError("kv_connector_module_path is empty: give \"mooncake_connector\", or "
                         "leave it out")
    if module not in plugin.OUR_MODULES:
        raise CheckError(f"kv_connector_module_path is {module!r}: vLLM loads "
                         f"{plugin.NAME} from that module, not from this package (use "
                         "\"mooncake_connector\", or leave it out)")
    extra = d.get("kv_connector_extra_config")
    if extra is not None and not isinstance(extra, dict):
        raise CheckError(f"kv_connector_extra_config is a JSON {type(extra).__name__}, not an "
                         "object of settings")
    _check_vllm_fields(d, plugin)
    moved = sorted(k for k in plugin.SEED_FIELDS if k in d)
    both = [(k, d[k], extra[k]) for k in moved if extra and k in extra]
    d = json.loads(plugin._move_seed_fields(json.dumps(d)))
    others = sorted(k for k in d if k not in CHECKED_HERE)
    why = _vllm_refusal(d) if others else None  # slow (vLLM's import): only then
    if why:
        raise CheckError(f"vLLM refuses --kv-transfer-config: {why} (this connector uses none "
                         f"of {others}: fix the value, or leave it out)")
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
    for k, top, inner in both:  # the plugin's merge: the extra config's own value wins
        notes.append(f"{k} is given twice: {top!r} at the top level is ignored, "
                     f"kv_connector_extra_config's {inner!r} is used (give it once)")
    try:
        s = resolve(SimpleNamespace(kv_role=d.get("kv_role"),
                                    kv_connector_extra_config=d.get("kv_connector_extra_config")),
                    env=env)
        engine_name(s, 0)  # no address at all: its message names the field to set
        # The workers' start (lifecycle.start_engine): the file's fields with
        # kv_connector_extra_config's on top, through the C parser; the engine
        # named from what that parser yields (its port rules applied).
        origin = os.fspath(s.config_path) if s.config_path else "kv_connector_extra_config"
        cfg = parse_config(json.dumps({k: v for k, v in s.mooncake.items() if v is not None}),
                           origin)
        engine = lifecycle._name(SimpleNamespace(s=s, dp_local=0, tp_size=1, facts={},
                                                 pp_rank=0, tp_rank=0), cfg)[1]
        _check_engine_name(s, engine, parse_config)
    except (SettingsError, ConfigError) as e:
        raise CheckError(str(e)) from None
    if cfg.get("notes"):
        notes.append(cfg["notes"])
    if path is not None and s.config_path != path:
        notes.append(f"PATH {path} is not read: the server reads kv_connector_extra_config's "
                     f"mooncake_config_path {s.config_path} (checked here)")
    if s.config_path is None and "MOONCAKE_CONFIG_PATH" in env:
        notes.append("MOONCAKE_CONFIG_PATH is set but empty: the connector reads no "
                     "mooncake.json")
    vllm_policy = d.get("kv_load_failure_policy")
    if vllm_policy is not None and vllm_policy != s.load_failure_policy:
        notes.append(f"kv_load_failure_policy {vllm_policy!r} (vLLM's) is replaced by the "
                     f"connector's load_failure_policy {s.load_failure_policy!r}: set "
                     "load_failure_policy in kv_connector_extra_config to choose")
    out = asdict(s)
    out["mooncake"] = shown_mooncake(out["mooncake"])
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
    for key in ("metadata_server", "metadata_server_raw"):  # a Redis password: ***
        if isinstance(cfg.get(key), str):
            cfg[key] = mask_url(cfg[key])
    print(json.dumps(cfg, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
