"""The connector's counters as vLLM's connector stats: deltas per report, summed across workers."""

from __future__ import annotations

import pytest

from engine_plugin.vllm import KvstackConnector, KvstackConnectorStats

pytestmark = pytest.mark.vllm  # imports vLLM: the second stage of tools/run_tests.sh


def test_stats_aggregate_by_sum_and_report_empty_when_nothing_moved():
    a = KvstackConnector.build_kv_connector_stats({"hit_tokens": 256, "load_errors": 0})
    b = KvstackConnectorStats(data={"hit_tokens": 128, "bytes_loaded": 4096})
    both = a.aggregate(b)
    assert both.reduce() == {"hit_tokens": 384, "load_errors": 0, "bytes_loaded": 4096}
    assert a.reduce() == {"hit_tokens": 256, "load_errors": 0}  # aggregate makes a new record
    assert KvstackConnectorStats(data={"load_errors": 0}).is_empty()
    assert not both.is_empty()
    both.reset()
    assert both.is_empty() and both.reduce() == {}
