#!/usr/bin/env python
"""Weight-format quality benchmark (same as `tokenmill bench quality`); see --help."""
import sys

from tokenmill.bench.quality import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench/quality.py"))
