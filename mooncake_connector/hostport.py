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
