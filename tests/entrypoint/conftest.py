"""Fixtures of the entrypoint tests."""

# The daemon tests' certificate fixture (a CA, a server certificate for 127.0.0.1/localhost, a
# client certificate, another CA), for the TLS tests (test_tls).
from tests.kvstore.daemons import certs

__all__ = ["certs"]
