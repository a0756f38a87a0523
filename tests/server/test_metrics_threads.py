"""/metrics and /api/version say how many compute threads the process runs, and why."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill import cpu_threads
from tokenmill.cpu_threads import ThreadChoice
from tokenmill.server.metrics import render_threads


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_render_threads_is_valid_prometheus():
    choice = ThreadChoice(4, '8 physical cores in affinity (16 logical), cgroup quota 4 CPUs -> 4 "q"\\')
    got = families(render_threads(choice, 1))
    assert got["tokenmill:threads"].type == "gauge"
    assert got["tokenmill:threads"].samples[0].value == 4
    info = got["tokenmill:threads_info"].samples[0]
    assert info.value == 1
    assert info.labels == {"reason": choice.reason, "source": "default"}  # quotes and backslashes survive
    assert got["tokenmill:torch_threads"].samples[0].value == 1


def test_render_threads_before_any_choice():
    got = families(render_threads(None, 2))
    assert "tokenmill:threads" not in got
    assert got["tokenmill:torch_threads"].samples[0].value == 2


def test_requested_threads_say_so():
    info = families(render_threads(ThreadChoice(3, "threads=3 requested", explicit=True), 3))["tokenmill:threads_info"]
    assert info.samples[0].labels["source"] == "requested"


def test_metrics_endpoint_shows_the_threads(client):
    choice = cpu_threads.current_threads()
    assert choice is not None  # the engine configured them
    got = families(client.get("/metrics").text)
    assert got["tokenmill:threads"].samples[0].value == choice.count
    assert got["tokenmill:threads_info"].samples[0].labels["reason"] == choice.reason
    assert got["tokenmill:torch_threads"].samples[0].value == cpu_threads.torch_threads()


def test_api_version_shows_the_threads(client):
    threads = client.get("/api/version").json()["threads"]
    choice = cpu_threads.current_threads()
    assert threads == {"count": choice.count, "reason": choice.reason, "torch_intra_op": cpu_threads.torch_threads()}
