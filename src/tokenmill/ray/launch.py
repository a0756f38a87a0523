"""`tokenmill serve --ray --replicas N`: join the Ray cluster at RAY_ADDRESS (or start a local Ray
instance), deploy the tokenmill application on Ray Serve at the configured host and port, and keep
it up until Ctrl-C / SIGTERM, then take it down."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from tokenmill.config import ConfigError
from tokenmill.server.commands import read_settings

log = logging.getLogger("tokenmill.ray")

APP_NAME = "tokenmill"


def cmd_serve_ray(args: argparse.Namespace) -> int:
    settings = read_settings(args)
    if isinstance(settings, int):
        return settings
    if settings.ssl_certfile or settings.ssl_keyfile:
        # Ray Serve's own HTTP proxy listens, not uvicorn: HTTPS is a proxy's job in front of it.
        print("error: --ssl-certfile/--ssl-keyfile do not apply with --ray: terminate TLS in front of Ray Serve",
              file=sys.stderr)
        return 1
    try:
        import ray
        from ray import serve
    except ImportError:
        print("error: --ray needs Ray Serve: pip install 'tokenmill[ray]'", file=sys.stderr)
        return 1
    from tokenmill.ray.app import RayOptions, build

    try:
        opts = RayOptions(replicas=args.replicas, max_replicas=args.max_replicas or 0, router=args.router)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address or None)  # None: a local instance, stopped with this process
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build(settings, opts), name=APP_NAME, route_prefix="/", blocking=False)
    where = f"the Ray cluster at {address}" if address else "a local Ray instance"
    print(f"tokenmill on {where}: {opts.replicas} replica(s) of {settings.model}, "
          f"listening on http://{settings.host}:{settings.port}", file=sys.stderr)
    stop.wait()
    print("shutting down the tokenmill application", file=sys.stderr)
    serve.delete(APP_NAME)
    if not address:
        serve.shutdown()
        ray.shutdown()
    return 0
