#!/usr/bin/env python
"""Thread scaling, tokenmill next to llama.cpp (same as `tokenmill bench scaling`); see --help."""
import sys

from tokenmill.bench.scaling import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench/scaling.py"))
