"""Check a mooncake.json and print the configuration it yields.

    python -m mooncake_connector.config [PATH]     (default: $MOONCAKE_CONFIG_PATH)

Exit status 0 when valid; 2 with the parser's message (file, field, value and
the accepted forms) when not.
"""
import json
import sys

from mooncake_connector import ConfigError, load_config


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if len(argv) > 1 or argv and argv[0].startswith("-"):
        what = (f"unknown option {argv[0]!r}" if argv[0].startswith("-")
                else f"one PATH only, got {len(argv)} arguments")
        print(f"usage: mooncake-connector config [PATH]\nerror: {what} (a path starting with "
              "'-': write ./-NAME)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(argv[0] if argv else None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.get("notes"):
        print(f"note: {cfg['notes']}", file=sys.stderr)
    if cfg.get("auth_secret"):
        cfg["auth_secret"] = "(set, not shown)"
    print(json.dumps(cfg, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
