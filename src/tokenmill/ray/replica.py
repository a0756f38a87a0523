"""One Ray Serve replica: one tokenmill engine behind the same app `tokenmill serve` runs, plus the
hooks Ray Serve calls on a replica: its health (a failing replica is replaced), its routing stats
(the prefix summary the router matches requests against), and its autoscaling stats (queue
lengths, which the autoscaling policy scales on)."""
from __future__ import annotations

import logging
import weakref
from collections.abc import AsyncIterator

from ray import serve

from tokenmill.config import Config
from tokenmill.engine import LLMEngine
from tokenmill.ray.asgi_bridge import ForwardedRequest, ResponseStart, replay
from tokenmill.ray.autoscaling import RUNNING, WAITING
from tokenmill.ray.metrics import sample_value
from tokenmill.ray.prefix_summary import pack
from tokenmill.server import LoadSpec, ModelHost, create_app
from tokenmill.server.model_host import HostPolicy
from tokenmill.server.model_host import Loaded, default_loader

log = logging.getLogger("tokenmill.ray")

# Newest cached blocks a replica publishes (8 bytes each); older ones are the first to be evicted
# anyway, so a router that does not know them loses little.
SUMMARY_BLOCKS = 8192
LOAD_TIMEOUT_SECONDS = 1800.0  # a first pull of a large model may take this long


class TokenmillReplica:
    def __init__(self, settings: Config):
        self.default_model = settings.model
        # Weak: when keep_alive unloads the model, the engine and its KV cache must go with it.
        self._engine: weakref.ref[LLMEngine] | None = None
        # The replica's own /metrics is behind the API key like every route but /health.
        self._auth = ((b"authorization", f"Bearer {settings.api_key}".encode()),) if settings.api_key else ()
        self.host = ModelHost(max_queue=settings.max_queue, retire_timeout=settings.drain_timeout,
                              loader=self._load, policy=HostPolicy.from_settings(settings))
        self.host.start_load(LoadSpec(settings.model, settings.engine_config()))
        if not self.host.wait_ready(LOAD_TIMEOUT_SECONDS):
            status = self.host.status
            self.host.shutdown()
            # Serve marks the replica as failed to start and tries another.
            raise RuntimeError(f"tokenmill replica: loading {settings.model} failed (status {status})")
        # shutdown_host: the lifespan never runs in process; __del__ shuts the host down instead.
        self.app = create_app(self.host, settings, shutdown_host=False)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        log.info("tokenmill replica %s serving %s", self.replica_id, settings.model)

    def _load(self, spec: LoadSpec, report) -> Loaded:
        loaded = default_loader(spec, report)
        # The prefix summary reads the configured model's block index: the router keys prompts with
        # that model's tokenizer. Models that requests load on demand are not summarized.
        if spec.model == self.default_model:
            self._engine = weakref.ref(loaded.engine)
        return loaded

    def _cached_hashes(self) -> list[bytes]:
        engine = self._engine() if self._engine is not None else None
        return engine.blocks.cached_block_hashes(SUMMARY_BLOCKS) if engine is not None else []

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        async for item in replay(self.app, request, self.replica_id):
            yield item

    async def metrics_text(self) -> str:
        get = ForwardedRequest("GET", "/metrics", b"", self._auth, b"")
        return b"".join([item async for item in replay(self.app, get) if isinstance(item, bytes)]).decode()

    # --- Ray Serve hooks ---------------------------------------------------------------------
    async def check_health(self) -> None:
        status = self.host.status
        if status != "ok":
            raise RuntimeError(f"tokenmill replica {self.replica_id} is unhealthy: status {status}")

    async def record_routing_stats(self) -> dict:
        text = await self.metrics_text()
        hashes = self._cached_hashes()
        waiting = sample_value(text, "vllm:num_requests_waiting") or 0
        running = sample_value(text, "vllm:num_requests_running") or 0
        return {"replica": self.replica_id, "prefix": pack(hashes), "waiting": int(waiting),
                "running": int(running), "metrics": text}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        text = await self.metrics_text()
        return {WAITING: sample_value(text, "vllm:num_requests_waiting") or 0.0,
                RUNNING: sample_value(text, "vllm:num_requests_running") or 0.0}

    def __del__(self) -> None:
        host = getattr(self, "host", None)
        if host is not None:
            host.shutdown()
