#!/usr/bin/env bash
# Quick start 1: prepare the environment, then run the demo: disaggregated
# serving with real vLLM servers (metadata server, prefill, decode, colocated
# reference, proxy), TTFT both ways and KV bytes moved; everything stopped at
# the end.  A few minutes: vLLM servers take 30-150 s to start on a small CPU.
#   scripts/demo.sh [demo args...]     (arguments go to mooncake_connector.demo)
#   scripts/demo.sh --transfer-only    the two-process KV transfer demo (no vLLM)
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

bash "$repo/scripts/env.sh" || exit $?

py="$repo/.venv/bin/python"
# -P: do not put the current directory first on sys.path, so the installed
# package (with its compiled _core) is imported even when run from the repo.
if "$py" -P -c '' 2>/dev/null; then
    exec "$py" -P -m mooncake_connector.demo "$@"
fi
cd "$repo/.cache" && exec "$py" -m mooncake_connector.demo "$@"
