"""Generated gRPC stubs of the kvstore daemon (``kvstore.proto`` -> ``kvstore_pb2*.py``).

Do not edit the ``_pb2`` files: change ``kvstore.proto`` and run
``python tools/gen_proto.py``. ``tests/kvstore/server/test_proto.py`` fails when the
committed stubs are stale. The service contract is documented in
``kvstore/server/__init__.py``.
"""
