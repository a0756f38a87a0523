#!/usr/bin/env python
"""Serving load generator (same as `tokenmill bench serve`); see --help."""
import sys

from tokenmill.bench.serving import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench/serving.py"))
