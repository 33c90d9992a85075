"""python -m mooncake_connector.doctor: the same as `mooncake-connector doctor`."""
from .runner import main

main()
