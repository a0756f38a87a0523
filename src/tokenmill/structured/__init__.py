"""Structured output: constraining what a sequence may generate (JSON, JSON Schema, regex, choices,
Lark/GBNF grammars) with llguidance token masks.

`GrammarSpec` says what a request wants, `GrammarCompiler` compiles it off the engine thread into a
`Grammar`, each sequence advances its own `Constraint`, and `MaskWorker` computes the step's masks
while the model runs."""
from tokenmill.structured.compiler import GrammarCompiler, compiler_for
from tokenmill.structured.constraint import GRAMMAR_FAILED, Constraint, grammar_failure
from tokenmill.structured.grammar import Grammar, GrammarError, GrammarSpec, check_finite
from tokenmill.structured.masks import MaskWorker, PendingMasks, TokenMasks, apply_token_masks
from tokenmill.structured.schema_refs import rebase_refs
from tokenmill.structured.vocab import grammar_tokenizer

__all__ = ["GRAMMAR_FAILED", "Constraint", "Grammar", "GrammarCompiler", "GrammarError", "GrammarSpec", "MaskWorker",
           "PendingMasks", "TokenMasks", "apply_token_masks", "check_finite", "compiler_for", "grammar_failure",
           "grammar_tokenizer", "rebase_refs"]
