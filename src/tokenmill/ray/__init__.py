"""tokenmill on Ray Serve (`pip install tokenmill[ray]`): replicas of the tokenmill server across a
Ray cluster, behind one HTTP endpoint with the same OpenAI and Ollama APIs, routed by prompt prefix.

- app: the Serve application (`serve run tokenmill.ray.app:build_app ...`)
- launch: `tokenmill serve --ray --replicas N`
- ingress / replica: the two deployments; asgi_bridge: an HTTP request between them
- router, routing_policy, routing_key, prefix_summary, router_stats: prefix-aware routing
- autoscaling: scaling on the engines' waiting queues; metrics: GET /metrics across replicas

Modules that need Ray import it themselves, so the pure routing logic is usable (and tested)
without it."""
