"""host:port as engine names and URLs write it: an IPv6 address in brackets.
The C config parser hands prefill_host / decode_host back without them."""


def bracket_host(host):
    """"::1" -> "[::1]"; a host already in brackets, a name or IPv4 as it is."""
    host = str(host)
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def join_hostport(host, port):
    """host:port (an engine name, a URL's authority): IPv6 in brackets."""
    return f"{bracket_host(host)}:{port}"


def url_of(host, port):
    """http://host:port (IPv6 in brackets)."""
    return f"http://{join_hostport(host, port)}"


def engine_name_problem(name):
    """None if name is an engine's host:port ("h:p", "1.2.3.4:p", "[v6]:p",
    port 1-65535), else what is wrong with it, in a few words."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    host, sep, port = name.rpartition(":")
    if not (sep and host):
        return "no host:port"
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return f"port {port[:20]!r} is not 1-65535"
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3 or "[" in host[1:] or "]" in host[:-1]:
            return "unbalanced brackets"
        return None
    if ":" in host:
        return f"an IPv6 address without brackets (write [{host[:60]}]:{port})"
    if "]" in host:
        return "unbalanced brackets"
    return None


def is_engine_name(name):
    """host:port as engine names are written (engine_name_problem)."""
    return engine_name_problem(name) is None


def listen_host_problem(host):
    """None if host has the form of an address or name to listen on ("::1",
    "[::1]", "10.0.0.2", "fe80::1%eth0", "prefill-a"), else what is wrong
    with it and the fix, in a few words.  Whether it is one of this host's
    addresses is the bind's to say."""
    import ipaddress
    import re
    if not isinstance(host, str) or not host:
        return "not a non-empty string"
    try:
        host.encode("utf-8")
    except UnicodeError:
        return "not UTF-8 text (a lone surrogate)"
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in host):
        return "it has spaces or control characters"
    if re.fullmatch(r"(\[[^]]*\]|[^:]+):[0-9]*", host):
        return "it has a port: give the address alone, the port as bootstrap_port"
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if "[" in bare or "]" in bare:
        return "unbalanced brackets (IPv6 as ::1 or [::1])"
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        if ":" in bare:
            return "not an IPv6 address"
        return None  # a name: the bind looks it up
    if ip.version == 6 and ip.is_link_local and "%" not in bare:
        return f"a link-local address needs its interface after a %, e.g. {bare}%eth0"
    return None
