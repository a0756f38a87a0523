"""Speculative decoding: sequences propose tokens (prompt lookup, ngram.py), the engine computes them as
extra rows of the same step and keeps the ones the model agrees with (verify.py), so a step can give a
sequence several tokens while the output stays what it would have been without it."""
from tokenmill.engine.speculative.config import METHODS, SpecConfig, SpecConfigError
from tokenmill.engine.speculative.ngram import NgramIndex
from tokenmill.engine.speculative.proposer import NgramProposer, SpecCounters, SpecState
from tokenmill.engine.speculative.speculator import Speculator
from tokenmill.engine.speculative.verify import num_accepted, row_generators, settle_generator

__all__ = ["METHODS", "NgramIndex", "NgramProposer", "SpecConfig", "SpecConfigError", "SpecCounters", "SpecState",
           "Speculator", "num_accepted", "row_generators", "settle_generator"]
