"""python -m mooncake_connector COMMAND ...  (see mooncake_connector.cli)."""
import sys

from mooncake_connector.cli import main

sys.exit(main())
