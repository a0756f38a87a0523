#!/usr/bin/env python
"""Ray Serve benchmark (same as `tokenmill bench ray`): replicas vs threads, prefix vs default router; see --help."""
import sys

from tokenmill.bench.ray_routing import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench/ray_routing.py"))
