"""The admin reply streams (``Maintain``, ``ExportIndex``) are read to their end by the client,
past the message marked ``final``, so the daemon's handler finishes and counts the call OK
(``kvstore.client.admin``'s docstring). Before, the client cancelled right after the final
message: under load the daemon then counted the complete call CANCELLED, or counted it only
after the client had returned (a stress run of the suite failed on it)."""

from __future__ import annotations

import kvstore
from kvstore import PutItem

from tests.kvstore.cli.test_kvtool import K


class _Recorded:
    """A server-streaming call's replies, recording whether they were read to the end."""

    def __init__(self, call):
        self.call, self.ended = call, False

    def __iter__(self) -> "_Recorded":
        return self

    def __next__(self):
        try:
            return next(self.call)
        except StopIteration:
            self.ended = True
            raise

    def cancel(self) -> bool:
        return self.call.cancel()


def test_admin_streams_are_read_to_their_end_and_counted_ok(make_daemon, monkeypatch) -> None:
    d = make_daemon(max_message_bytes=64 * 1024)  # the export then comes in several chunks
    calls: dict[str, _Recorded] = {}
    with kvstore.connect(d.address, max_message_bytes=64 * 1024) as s:
        assert all(s.put_many([PutItem(K(i), b"v%d" % i * 40) for i in range(300)]))
        for name in ("ExportIndex", "Maintain"):
            def recorded(*args, _name=name, _real=getattr(s._rpc.stub, name), **kwargs):
                calls[_name] = _Recorded(_real(*args, **kwargs))
                return calls[_name]
            monkeypatch.setattr(s._rpc.stub, name, recorded)
        assert sum(b.num_rows for b in s.export_index_batches()) == 300
        phases: list[str] = []
        assert s.check(progress=lambda phase, done, total: phases.append(phase)) == []
        assert phases  # it went through Maintain, with progress
    assert {name: c.ended for name, c in calls.items()} == {"ExportIndex": True, "Maintain": True}
    reg = d.metrics.registry
    for name in ("ExportIndex", "Maintain"):  # counted before the client saw the end: no wait needed
        assert reg.get_sample_value("kvstore_requests_total", {"method": name, "code": "OK"}) == 1, name
        assert reg.get_sample_value("kvstore_requests_total", {"method": name, "code": "CANCELLED"}) is None, name
