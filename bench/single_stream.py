#!/usr/bin/env python
"""Single-stream load + decode benchmark (same as `tokenmill bench single-stream`); see --help."""
import sys

from tokenmill.bench.single_stream import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench/single_stream.py"))
