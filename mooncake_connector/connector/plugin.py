"""vLLM general plugin (entry point ``vllm.general_plugins``).

Makes the seed's command line work unchanged once this package is installed,
without breaking deployments of vLLM's in-tree connector of the same name:
  * ``"kv_connector": "MooncakeConnector"`` without ``kv_connector_module_path``
    resolves to this package's connector only for OUR shape of configuration
    (``choose()``): ``MOONCAKE_CONFIG_PATH`` set, or the seed's ``kv_rank`` /
    ``kv_parallel_size`` / ``kv_buffer_size``, or ``mooncake_config_path`` or
    another key only this connector knows (or a near miss of one: a typo,
    which its start then names) in ``kv_connector_extra_config``.
    A configuration in the in-tree connector's shape (e.g.
    ``{"mooncake_protocol": "tcp"}``, or nothing at all) keeps vLLM's class.
    One log line per process says which class was chosen and why;
  * the seed's ``kv_rank``, ``kv_parallel_size`` and ``kv_buffer_size`` (which
    vLLM's KVTransferConfig does not accept) are moved into
    ``kv_connector_extra_config`` when the connector is ours.
Set MOONCAKE_CONNECTOR_DISABLE_PLUGIN=1 to keep vLLM's in-tree connector.
The plugin never raises: vLLM's start-up must not fail because of it.
"""
import difflib
import json
import logging
import os
import sys

from mooncake_connector import json_in

logger = logging.getLogger("vllm.mooncake_connector")
NAME = "MooncakeConnector"
SEED_FIELDS = ("kv_rank", "kv_parallel_size", "kv_buffer_size")
OUR_MODULES = (None, "mooncake_connector", "mooncake_connector.connector.connector")
_done = False
_said = set()


def _our_keys():
    from mooncake_connector.connector.settings import KNOBS, MOONCAKE_FIELDS
    return set(SEED_FIELDS) | {"mooncake_config_path"} | set(MOONCAKE_FIELDS) | set(KNOBS)


def choose(extra, env=None):
    """(ours: bool, reason) for a bare "MooncakeConnector" whose
    kv_connector_extra_config is `extra`.  Keys in the extra config decide
    first (they name one connector or the other); then MOONCAKE_CONFIG_PATH."""
    env = os.environ if env is None else env
    extra = extra if isinstance(extra, dict) else {}
    ours = sorted(set(extra) & _our_keys())
    if ours:
        return True, f"kv_connector_extra_config has {ours}"
    # A typo of one of our keys ("push_layer_rad", "hold_timout_s") made the
    # configuration look like the in-tree connector's, which was taken in
    # its place: ours, whose start then names the key and its near miss.
    # (No in-tree connector key is this close to one of ours.)
    near = sorted(str(k) for k in extra
                  if difflib.get_close_matches(str(k), _our_keys(), n=1, cutoff=0.8))
    if near:
        return True, (f"kv_connector_extra_config has {near}, near misses of this package's "
                      "keys (a typo?)")
    if env.get("MOONCAKE_CONFIG_PATH"):
        others = sorted(extra)
        if others:  # only keys we do not know: the in-tree connector's config
            return False, (f"kv_connector_extra_config has only keys this package does not "
                           f"know {others}, so it is vLLM's connector's configuration "
                           f"(MOONCAKE_CONFIG_PATH is ignored for the choice)")
        return True, "MOONCAKE_CONFIG_PATH is set"
    if extra:
        return False, (f"kv_connector_extra_config {sorted(extra)} is in the in-tree "
                       f"connector's shape and MOONCAKE_CONFIG_PATH is not set")
    return False, ("neither MOONCAKE_CONFIG_PATH nor mooncake-connector keys "
                   "(kv_rank/kv_parallel_size/kv_buffer_size, mooncake_config_path) are set")


def _say(ours, reason):
    """One line per process and decision; the processes a server starts
    inherit the marker and stay quiet when they decide the same."""
    what = ("mooncake_connector.MooncakeConnector (this package)" if ours
            else "vLLM's in-tree MooncakeConnector")
    msg = f"mooncake-connector: \"{NAME}\" resolves to {what}: {reason}"
    if msg in _said:
        return
    _said.add(msg)
    key = "1:" + reason if ours else "0:" + reason
    if os.environ.get("_MOONCAKE_CONNECTOR_ANNOUNCED") == key:
        return
    os.environ["_MOONCAKE_CONNECTOR_ANNOUNCED"] = key
    if ours:
        msg += " (MOONCAKE_CONNECTOR_DISABLE_PLUGIN=1 keeps vLLM's class)"
    else:
        msg += (" (for this package's connector set MOONCAKE_CONFIG_PATH or "
                "\"kv_connector_module_path\": \"mooncake_connector\")")
    if logger.hasHandlers():
        logger.info(msg)
    else:
        print(msg, file=sys.stderr)


def _wrap_factory(factory):
    orig = factory.__dict__["get_connector_class"].__func__
    if getattr(orig, "_mooncake", False):
        return

    def get_connector_class(cls, kv_transfer_config):
        if getattr(kv_transfer_config, "kv_connector", None) == NAME and \
                not getattr(kv_transfer_config, "kv_connector_module_path", None):
            ours, reason = choose(getattr(kv_transfer_config, "kv_connector_extra_config",
                                          None))
            _say(ours, reason)
            if ours:
                from mooncake_connector.connector.connector import MooncakeConnector
                return MooncakeConnector
        return orig(cls, kv_transfer_config)

    get_connector_class._mooncake = True
    get_connector_class.__doc__ = orig.__doc__
    factory.get_connector_class = classmethod(get_connector_class)


def _move_seed_fields(text):
    """JSON text of --kv-transfer-config -> the same with the seed's extra
    fields moved into kv_connector_extra_config (only for our connector)."""
    try:
        d = json_in.loads(text)
    except (TypeError, ValueError):
        return text  # vLLM's own parse says what is wrong with it
    if not isinstance(d, dict) or d.get("kv_connector") != NAME:
        return text
    if d.get("kv_connector_module_path") not in OUR_MODULES:
        return text
    moved = {k: d.pop(k) for k in SEED_FIELDS if k in d}
    if not moved:
        return text
    extra = d.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        return text
    d["kv_connector_extra_config"] = {**moved, **extra}
    return json.dumps(d)


DISABLE_VAR = "MOONCAKE_CONNECTOR_DISABLE_PLUGIN"


def disabled(env=None):
    """(whether DISABLE_VAR turns the plugin off, a warning or None): 1,
    true, yes, on turn it off; unset, empty, 0, false, no, off leave it on;
    any other value turns it off (as it always did) and is named."""
    raw = (os.environ if env is None else env).get(DISABLE_VAR, "")
    v = raw.strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False, None
    if v in ("1", "true", "yes", "on"):
        return True, None
    return True, (f"{DISABLE_VAR}={raw[:40]!r} is neither on (1, true, yes, on) nor off (0, "
                  "false, no, off); taken as on: the plugin is disabled")


def register():
    global _done
    if _done:
        return
    _done = True
    off, why = disabled()
    if why:
        logger.warning("mooncake-connector: %s", why)
    if off:
        logger.info("mooncake-connector: plugin disabled (MOONCAKE_CONNECTOR_DISABLE_PLUGIN); "
                    "\"MooncakeConnector\" is vLLM's in-tree connector")
        return
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        _wrap_factory(KVConnectorFactory)
    except Exception as e:  # never break vLLM's start-up
        logger.warning("mooncake-connector: could not hook vLLM's connector factory (%s); "
                       "use \"kv_connector_module_path\": \"mooncake_connector\"", e)
        return
    try:
        import vllm.engine.arg_utils as au
        orig = getattr(au, "_expand_json_human_readable_numbers", None)
        if orig is not None and not getattr(orig, "_mooncake", False):
            def expand(val, _orig=orig):
                # vLLM's expansion first: the seed's "kv_buffer_size": 2G is
                # JSON (to move) only once expanded
                return _move_seed_fields(_orig(val))
            expand._mooncake = True
            au._expand_json_human_readable_numbers = expand
    except Exception as e:
        logger.warning("mooncake-connector: seed fields kv_rank/kv_parallel_size/kv_buffer_size "
                       "will not be accepted on the command line (%s); put them in "
                       "kv_connector_extra_config", e)
