"""engine_plugin: what an engine team imports to use the KV cache service.

Modules, in the order a request meets them:

* ``contract``: the hooks an engine calls (vLLM-v1-shaped, each with when / how
  often / what it guarantees) and the records that cross it.
* ``kv_connector``: ``KVStoreConnector``, the implementation over the tiers
  (device pool prefix cache -> ``tiers.HostCache`` -> any ``kvstore`` store),
  with SWA bounded replay and snapshot policy; ``connector_config``: its
  ``ConnectorConfig`` record (every knob, checked at construction) and the
  save policies.
* ``devices``: device backends (cpu / cuda / npu, a registry) and pinned
  staging buffers; ``loader``: tiers -> staging -> device on the loader
  thread (straight into the pool on a host-resident backend); ``saver``: the
  bounded background save queue; ``tiers``: host LRU cache, the guarded store
  gateway, metrics.
* ``reference``: a small real torch model and engine (paged global KV,
  chunked prefill, batched decode) used by tests, benchmarks and the
  walkthrough.

Typical wiring::

    store = kvstore.connect("./kvstack-data")
    model = ReferenceModel(model_preset("tiny"))
    conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16), store)
    engine = Engine(model, EngineConfig(block_size=16), connector=conn)
"""
