"""The vLLM V1 KV connector (``MooncakeConnector``).

Modules, one concern each:
  settings.py   effective configuration (kv-transfer-config + mooncake.json)
  metadata.py   what the scheduler side tells the worker side each step
  scheduler.py  scheduler-side half (pure Python: no extension, no GPU)
  worker.py     worker-side half (engine, lookup buffer, pulls, publishes)
  layout.py     paged KV-cache tensors -> per-block memory extents
  stats.py      KVConnectorStats for vLLM's logging and metrics
  connector.py  the class vLLM instantiates; delegates to the halves
  plugin.py     vLLM general plugin: the name "MooncakeConnector" -> ours
"""
