#!/usr/bin/env python
"""Shared-prefix TTFT benchmark (same as `tokenmill bench shared-prefix`); see --help."""
import sys

from tokenmill.bench.shared_prefix import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench/shared_prefix.py"))
