"""Property test: random add / abort / step sequences never break the KV cache's integrity, and
every block is free once all requests are done."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import assert_all_free, make_engine
from tokenmill.engine import SamplingParams


action = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(3, 270), min_size=1, max_size=40), st.integers(1, 12),
              st.sampled_from([0.0, 1.0])),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=1, max_size=25), num_blocks=st.integers(4, 12),
       n_batch=st.sampled_from([4, 16, 64]), prefix=st.booleans())
def test_random_workload_keeps_cache_consistent(loaded, actions, num_blocks, n_batch, prefix):
    engine = make_engine(loaded, max_total_tokens=num_blocks * 16, n_batch=n_batch, parallel=6,
                         enable_prefix_caching=prefix)
    rids: list[str] = []
    for act in actions:
        if act[0] == "add":
            _, ids, max_tokens, temp = act
            try:
                rids.append(engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=temp, seed=1)))
            except ValueError:
                pass  # too long for this cache: rejected up front, nothing allocated
        elif act[0] == "abort" and rids:
            engine.abort(rids[act[1] % len(rids)])
        else:
            for _ in range(act[1]):
                engine.step()
        engine.blocks.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.blocks.check_integrity()
    assert_all_free(engine)
