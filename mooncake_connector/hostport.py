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
