"""The routing logic of tokenmill.ray without Ray: prefix summaries against a real block manager,
routing keys from real requests, the routing policy, metrics relabelling and the autoscaling rule."""
from __future__ import annotations

import json

import pytest

from tokenmill.kvcache import BlockManager
from tokenmill.ray.autoscaling import desired_replicas
from tokenmill.ray.metrics import merge, relabel, render, sample_value
from tokenmill.ray.prefix_summary import KEY_BYTES, match_length, pack, request_keys, unpack
from tokenmill.ray.router_stats import RouterStats
from tokenmill.ray.routing_key import RoutingKeyMaker
from tokenmill.ray.routing_policy import (LEAST_LOADED, OVERLOADED, PREFIX, SESSION, Candidate, PolicyConfig,
                                          choose)
from tokenmill.server.chat import render_chat

BS = 4


def _cache_holding(*prompts: list[int]) -> BlockManager:
    """A block manager whose prefix cache holds the full blocks of each prompt, as the engine leaves it."""
    bm = BlockManager(64, BS)
    for seq_id, ids in enumerate(prompts):
        bm.allocate(seq_id, len(ids), bm.match_prefix(ids))
        bm.commit_full_blocks(seq_id, ids, len(ids))
        bm.free(seq_id)
    return bm


def test_summary_matches_what_the_engine_would_reuse():
    shared = list(range(100, 124))                       # 6 blocks
    bm = _cache_holding(shared + [1, 2, 3, 4, 5])
    held = unpack(pack(bm.cached_block_hashes()))
    assert all(len(k) == KEY_BYTES for k in held)
    request = shared + [9, 9, 9, 9, 9, 9]
    engine_match = bm.match_prefix(request).num_tokens // BS
    assert match_length(request_keys(request, BS, 64), held) == engine_match == 6
    # A different first block changes every key after it (chained hashes): no match at all.
    assert match_length(request_keys([7] + shared[1:] + [9] * 6, BS, 64), held) == 0


def test_summary_is_capped_to_the_newest_blocks():
    bm = _cache_holding(list(range(40)), list(range(1000, 1040)))
    everything = bm.cached_block_hashes()
    assert len(everything) == 20
    assert bm.cached_block_hashes(5) == everything[-5:]
    assert bm.cached_block_hashes(0) == []


def test_request_keys_leave_out_the_last_token():
    # 8 tokens = 2 full blocks, but the engine must compute the last token, so only 1 is reusable.
    assert len(request_keys(list(range(8)), BS, 64)) == 1
    assert len(request_keys(list(range(9)), BS, 64)) == 2
    assert len(request_keys(list(range(400)), BS, 10)) == 10


def test_routing_key_renders_chat_like_the_server(tiny_tokenizer):
    maker = RoutingKeyMaker(tiny_tokenizer, BS)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, how are you?"}]
    key = maker.key("/v1/chat/completions", json.dumps({"messages": messages}).encode(), {"x-session-id": "s1"})
    ids = render_chat(tiny_tokenizer, messages)
    assert key.blocks == request_keys(ids, BS, 256)
    assert key.session == "s1"
    assert maker.key("/api/chat", json.dumps({"messages": messages}).encode(), {}).blocks == key.blocks
    # The Responses and Messages APIs render the same conversation as the chat endpoint does.
    responses = {"instructions": "be brief", "input": "hello there, how are you?"}
    assert maker.key("/v1/responses", json.dumps(responses).encode(), {}).blocks == key.blocks
    anthropic = {"system": "be brief", "max_tokens": 5, "messages": messages[1:]}
    assert maker.key("/v1/messages", json.dumps(anthropic).encode(), {}).blocks == key.blocks


@pytest.mark.parametrize("path, body", [
    ("/api/generate", {"prompt": "the same words as before", "raw": True}),
    ("/v1/completions", {"prompt": "the same words as before"}),
    ("/v1/completions", {"prompt": ["the same words as before", "another"]}),
])
def test_routing_key_of_plain_prompts(tiny_tokenizer, path, body):
    key = RoutingKeyMaker(tiny_tokenizer, BS).key(path, json.dumps(body).encode(), {})
    ids = tiny_tokenizer.encode("the same words as before", add_special_tokens=True)
    assert key.blocks == request_keys(ids, BS, 256) and key.blocks


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b'{"messages": "not a list"}'),
    ("/v1/messages", b'{"messages": [{"role": "system", "content": "not here"}], "max_tokens": 5}'),
    ("/api/tags", b""),
    ("/v1/embeddings", b'{"input": "text"}'),
])
def test_unreadable_or_promptless_requests_get_an_empty_key(tiny_tokenizer, path, body):
    assert RoutingKeyMaker(tiny_tokenizer, BS).key(path, body, {}).blocks == ()


def test_policy_prefers_the_longest_prefix():
    cands = [Candidate("a", 3, 2), Candidate("b", 1, 9), Candidate("c", 0, 0)]
    choice = choose(cands, None, PolicyConfig(), num_blocks=10)
    assert (choice.preferred, choice.decision, choice.matched) == ("b", PREFIX, 9)


def test_policy_breaks_equal_matches_by_load():
    cands = [Candidate("a", 5, 9), Candidate("b", 2, 9)]
    assert choose(cands, None, PolicyConfig(), num_blocks=10).preferred == "b"


def test_policy_gives_up_a_prefix_holder_that_is_too_busy():
    cands = [Candidate("a", 20, 9), Candidate("b", 1, 0)]
    choice = choose(cands, None, PolicyConfig(max_imbalance=8), num_blocks=10)
    assert (choice.preferred, choice.decision) == (None, OVERLOADED)


def test_policy_ignores_short_shared_headers():
    # Every chat prompt starts with the template's header: 2 blocks of 20 decide nothing.
    cands = [Candidate("a", 0, 2), Candidate("b", 0, 0)]
    assert choose(cands, None, PolicyConfig(), num_blocks=20).decision == LEAST_LOADED


def test_policy_keeps_a_session_on_its_replica_while_it_can():
    cands = [Candidate("a", 2, 0), Candidate("b", 0, 9)]
    assert choose(cands, "a", PolicyConfig(), num_blocks=10).decision == SESSION
    assert choose(cands, "gone", PolicyConfig(), num_blocks=10).preferred == "b"
    busy = [Candidate("a", 30, 0), Candidate("b", 0, 0)]
    assert choose(busy, "a", PolicyConfig(max_imbalance=8), num_blocks=10).decision == LEAST_LOADED


PAGE = """# HELP vllm:num_requests_waiting Sequences waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3
# HELP vllm:e2e_request_latency_seconds End-to-end request latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"} 4
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5
vllm:e2e_request_latency_seconds_count{model_name="m"} 4
"""


def test_metrics_relabel_and_merge_replicas():
    assert sample_value(PAGE, "vllm:num_requests_waiting") == 3
    assert 'vllm:num_requests_waiting{replica="r1",model_name="m"} 3' in relabel(PAGE, "r1")
    merged = merge({"r1": PAGE, "r2": PAGE.replace(" 3\n", " 5\n")})
    assert merged.count("# TYPE vllm:num_requests_waiting gauge") == 1
    assert 'vllm:num_requests_waiting{replica="r2",model_name="m"} 5' in merged
    # A histogram's samples stay under its one HELP/TYPE header, replica by replica.
    start = merged.index("# TYPE vllm:e2e_request_latency_seconds histogram")
    assert merged[start + 1:start + 7] == [line for r in ("r1", "r2") for line in relabel(PAGE, r)[-3:]]


def test_router_hit_rate_is_rendered():
    stats = RouterStats()
    stats.record(PREFIX, 10, 8)
    stats.record(LEAST_LOADED, 10, 0)
    stats.record(LEAST_LOADED, 0, 0)   # no full block: not a keyed request
    text = render(stats)
    assert "tokenmill:router_prefix_hit_rate 0.4" in text
    assert 'tokenmill:router_requests_total{decision="least_loaded"} 2' in text
    assert "tokenmill:router_keyed_requests_total 2" in text


@pytest.mark.parametrize("current, waiting, running, want", [
    (2, 0, 50, 2),       # nothing waits, but one replica would run over half its slots: stay
    (2, 40, 128, 3),     # 40 waiting at 64 per replica: one more
    (2, 200, 20, 22),    # a deep queue on small batches: many more
    (3, 0, 10, 2),       # idle enough to run on one fewer
    (1, 0, 0, 1),        # never below one by this rule (min_replicas decides)
    (0, 1, 0, 1),        # scaled to zero and a request arrives
])
def test_autoscaling_follows_the_waiting_queue(current, waiting, running, want):
    assert desired_replicas(current, waiting, running, slots=64) == want


def test_serve_ray_flag_goes_to_the_ray_launcher(capsys):
    from tokenmill.cli import main

    assert main(["serve", "--ray", "--replicas", "3", "--print-config", "--kv-size", "4096"]) == 0
    assert "kv_size = 4096  # flag --kv-size" in capsys.readouterr().out


def test_cluster_simulation_keeps_prefixes_where_they_are_cached():
    from tokenmill.bench.ray_sim import build_parser, simulate

    args = build_parser().parse_args(["--replicas", "16", "--groups", "32", "--requests", "3000", "--load", "0.8"])
    prefix, default = simulate(args, "prefix"), simulate(args, "default")
    # Power of two choices scatters every prefix over all replicas; the prefix router does not.
    assert prefix["hit_rate"] > 0.9 > default["hit_rate"] + 0.2
    assert prefix["ttft_p50"] < default["ttft_p50"]


def test_autoscaling_policy_reads_what_replicas_report():
    from types import SimpleNamespace

    from tokenmill.ray.autoscaling import RUNNING, WAITING, WaitingQueuePolicy

    # Serve hands the policy each replica's record_autoscaling_stats values, aggregated, by name.
    ctx = SimpleNamespace(current_num_replicas=2,
                          aggregated_metrics={WAITING: {"r1": 30.0, "r2": 10.0}, RUNNING: {"r1": 64.0, "r2": 64.0}})
    assert WaitingQueuePolicy(slots=64)(ctx) == (3, {})
    # No numbers yet (replicas starting): no change.
    assert WaitingQueuePolicy(slots=64)(SimpleNamespace(current_num_replicas=2, aggregated_metrics=None)) == (2, {})
