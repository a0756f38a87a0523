#!/usr/bin/env python
"""Offline throughput benchmark (same as `tokenmill bench offline`); see --help."""
import sys

from tokenmill.bench.offline import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench/offline.py"))
