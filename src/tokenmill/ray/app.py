"""The Ray Serve application: an ingress deployment (HTTP, routing keys; no model) in front of a
deployment of tokenmill replicas (one engine each), with the prefix-aware router on the handle
between them, health checks and, optionally, autoscaling on the engines' queues.

Ray users run it as they run any Serve app:

    serve run tokenmill.ray.app:build_app model=smollm2 replicas=4
    serve run tokenmill.ray.app:app          # everything from TOKENMILL_* / TOKENMILL_CONFIG

or from a Serve config file (`import_path: tokenmill.ray.app:build_app`, `args: {...}`)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields, replace
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from tokenmill.config import BY_NAME, Config, ConfigError, load_config
from tokenmill.engine.config import CPU_STEP_SIZES
from tokenmill.ray.ingress import TokenmillIngress
from tokenmill.ray.replica import TokenmillReplica

ROUTERS = {
    "prefix": "tokenmill.ray.router:PrefixAwareRouter",
    "default": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",  # Serve's own, to compare
}


@dataclass(frozen=True)
class RayOptions:
    """How the deployment is laid out; the engine and server settings are the Config's."""
    replicas: int = 2                # fixed replica count (the starting count when autoscaling)
    max_replicas: int = 0            # > replicas: autoscale between min_replicas and this
    min_replicas: int = 1
    upscale_delay_s: float = 30.0    # autoscaling: how long the queue must say "more" before a replica is added
    downscale_delay_s: float = 600.0
    look_back_s: float = 30.0        # autoscaling: the window the replicas' queue lengths are averaged over
    router: str = "prefix"           # prefix | default
    max_imbalance: int = 4           # requests a prefix holder may have above the least-loaded replica
    stats_period_s: float = 2.0      # how often replicas publish their prefix summary
    health_period_s: float = 10.0
    health_timeout_s: float = 30.0
    cpus_per_replica: float = 0.0    # CPUs Ray reserves per replica; 0 = the `threads` setting, or 1
    ingress_replicas: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be at least 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.max_replicas and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ConfigError(f"need min_replicas <= replicas <= max_replicas, got {self.min_replicas}, "
                              f"{self.replicas}, {self.max_replicas}")


def replica_cpus(settings: Config, opts: RayOptions) -> float:
    """The CPUs Ray reserves for each replica."""
    return opts.cpus_per_replica or settings.threads or 1


def replica_settings(settings: Config, opts: RayOptions) -> Config:
    """A replica's settings: without an explicit `threads`, its engine runs as many threads as Ray
    reserves CPUs for it (rounded down, at least 1), not the default of every core of the node,
    which each of several replicas on one node would take for itself."""
    if settings.threads:
        return settings
    return replace(settings, threads=max(1, math.floor(replica_cpus(settings, opts))))


def _replica_options(settings: Config, opts: RayOptions) -> dict[str, Any]:
    router = RequestRouterConfig(
        request_router_class=ROUTERS[opts.router],
        request_router_kwargs={"max_imbalance": opts.max_imbalance} if opts.router == "prefix" else {},
        request_routing_stats_period_s=opts.stats_period_s,
        request_routing_stats_timeout_s=max(opts.stats_period_s * 5, 10.0))
    options: dict[str, Any] = dict(
        name="tokenmill-replica",
        ray_actor_options={"num_cpus": replica_cpus(settings, opts)},
        max_ongoing_requests=settings.max_queue,
        health_check_period_s=opts.health_period_s,
        health_check_timeout_s=opts.health_timeout_s,
        request_router_config=router,
    )
    if opts.max_replicas > opts.min_replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=opts.min_replicas, initial_replicas=opts.replicas, max_replicas=opts.max_replicas,
            upscale_delay_s=opts.upscale_delay_s, downscale_delay_s=opts.downscale_delay_s,
            # Serve wants its (deprecated) scrape interval below the window: keep it so for short windows.
            look_back_period_s=opts.look_back_s, metrics_interval_s=min(10.0, opts.look_back_s / 2),
            policy=AutoscalingPolicy(policy_function="tokenmill.ray.autoscaling:WaitingQueuePolicy",
                                     # Replicas are placed by CPUs (num_cpus, no num_gpus) and run there, so
                                     # an automatic --parallel is the CPU's.
                                     policy_kwargs={"slots": settings.parallel or CPU_STEP_SIZES.parallel}))
    else:
        options["num_replicas"] = opts.replicas
    return options


def build(settings: Config, opts: RayOptions | None = None):
    """The bound application for `serve.run`."""
    opts = opts or RayOptions()
    replicas = serve.deployment(TokenmillReplica).options(**_replica_options(settings, opts))
    ingress = serve.deployment(TokenmillIngress).options(
        name="tokenmill-ingress", num_replicas=opts.ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(settings.max_queue * opts.replicas, 1000))
    return ingress.bind(replicas.bind(replica_settings(settings, opts)), settings)


def build_app(args: dict[str, Any]):
    """Serve's application builder: `args` holds tokenmill settings (model, kv_size, threads, ...,
    and `config` for a tokenmill config file) and RayOptions fields (replicas, router, ...)."""
    args = dict(args)
    ray_names = {f.name for f in fields(RayOptions)}
    ray_args = {k: args.pop(k) for k in list(args) if k in ray_names}
    config_file = args.pop("config", None)
    unknown = [k for k in args if k not in BY_NAME]
    if unknown:
        raise ConfigError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join([*BY_NAME, *ray_names])}")
    settings = load_config(argparse.Namespace(**{k: str(v) for k, v in args.items()}), config_file=config_file)
    typed = {f.name: f.type for f in fields(RayOptions)}
    converters = {"int": int, "float": float, "str": str}
    opts = RayOptions(**{k: converters[typed[k]](v) for k, v in ray_args.items()})
    return build(settings, opts)


def __getattr__(name: str):
    # `serve run tokenmill.ray.app:app`: built on first access, from the environment and config file.
    if name == "app":
        return build_app({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
