"""The vLLM V1 KV connector (``MooncakeConnector``).

Modules, one concern each:
  settings.py   effective configuration (kv-transfer-config + mooncake.json)
  metadata.py   what the scheduler side tells the worker side each step
  scheduler.py  scheduler-side half (pure Python: no extension, no GPU)
  worker.py     worker-side half: WorkerSide, the facade vLLM's worker hooks call
  lifecycle.py    its engine from start to close, sleep mode, bootstrap server
  routes.py       fingerprints; which producer ranks serve a load (route, fanout)
  loads.py        consumer: pulls / push loads, finished_recving, load errors
  publishes.py    producer: publishing and holding blocks, finished_sending
  push.py         the push flow (both sides, the per-peer outbox)
  layout.py     paged KV-cache tensors -> per-block memory extents
  stats.py      KVConnectorStats for vLLM's logging and metrics
  connector.py  the class vLLM instantiates; delegates to the halves
  plugin.py     vLLM general plugin: the name "MooncakeConnector" -> ours
"""
