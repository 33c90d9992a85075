"""The mooncake-connector command.

    mooncake-connector doctor [...]     check this host's setup (mooncake_connector.doctor)
    mooncake-connector config [--kv-transfer-config JSON] [PATH]
                                        validate a mooncake.json (and vLLM's
                                        --kv-transfer-config with it) and print
                                        what they yield
    python -m mooncake_connector ...    the same
"""
import sys

COMMANDS = {
    "doctor": ("mooncake_connector.doctor", "run",
               "check config, metadata server, engine address, RDMA, GPUs, vLLM, a peer"),
    "config": ("mooncake_connector.config", "main",
               "validate a mooncake.json and vLLM's --kv-transfer-config"),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mooncake-connector COMMAND [ARGS...]\n\ncommands:")
        for name, (_, _, what) in COMMANDS.items():
            print(f"  {name:8s} {what}")
        print("\n`mooncake-connector COMMAND --help` for each.")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"mooncake-connector: unknown command {argv[0]!r}; commands: "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    mod, fn, _ = COMMANDS[argv[0]]
    return getattr(importlib.import_module(mod), fn)(argv[1:])


def entry():
    sys.exit(main())
