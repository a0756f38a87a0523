from tokenmill.gguf.config import ModelConfig
from tokenmill.gguf.reader import GGUFError, GGUFFile, open_gguf

__all__ = ["GGUFError", "GGUFFile", "ModelConfig", "open_gguf"]
