"""Property test: any shared-prefix pair, any chunking, any hit path -> the cold answer."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_plugin.reference import SamplingParams


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), shared=st.integers(1, 140), tail=st.integers(1, 40),
       chunk=st.sampled_from([5, 16, 33, 64]), snapshots=st.booleans(),
       temperature=st.sampled_from([0.0, 0.9]))
def test_hit_equals_cold(rig, tmp_path_factory, seed, shared, tail, chunk, snapshots, temperature):
    import kvstore

    store = kvstore.connect(str(tmp_path_factory.mktemp("store")))
    try:
        rng = random.Random(seed)
        first = rig.tokens(rng, shared + rng.randint(0, 20))
        second = first[:shared] + rig.tokens(rng, tail)
        sp = SamplingParams(max_new_tokens=4, temperature=temperature, seed=seed)
        a = rig.engine(store, chunk=chunk)
        a.generate(first, sp)
        a.connector.flush()
        b = rig.engine(store, chunk=chunk, load_snapshots=snapshots)
        rig.same(rig.cold(second, sp), b.generate(second, sp))
    finally:
        rig.close()  # connectors before the store: no put may run while it closes
        store.close()
