"""Tokenization for GGUF models: text <-> ids, chat templates, and streaming detokenization."""
from tokenmill.tokenizer.chat_template import ChatTemplate, ChatTemplateError, TokenizerError
from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "TokenizerError"]
