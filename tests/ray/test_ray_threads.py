"""A Ray replica's engine runs as many threads as Ray reserves CPUs for it, unless `threads` says."""
from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")  # the `ray` extra (tokenmill[ray])

from tokenmill.config import Config  # noqa: E402
from tokenmill.ray.app import RayOptions, replica_cpus, replica_settings  # noqa: E402


@pytest.mark.parametrize(("threads", "cpus_per_replica", "reserved", "replica_threads"), [
    (0, 0.0, 1, 1),      # the defaults: one CPU, one thread (not every core of the node per replica)
    (4, 0.0, 4, 4),      # --threads reserves that many CPUs
    (0, 3.0, 3.0, 3),
    (0, 2.5, 2.5, 2),    # a fractional reservation: rounded down, as a cgroup quota is
    (0, 0.5, 0.5, 1),
    (2, 4.0, 4.0, 2),    # explicit threads stay what they say
])
def test_replica_threads_follow_the_reservation(threads, cpus_per_replica, reserved, replica_threads):
    settings = Config(threads=threads)
    opts = RayOptions(cpus_per_replica=cpus_per_replica)
    assert replica_cpus(settings, opts) == reserved
    assert replica_settings(settings, opts).threads == replica_threads
    assert settings.threads == threads  # the ingress's settings are left alone
