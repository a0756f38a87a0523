from tokenmill.model.attention import AttentionMetadata, ChunkSpec
from tokenmill.model.registry import ARCHITECTURES, LoadedModel, ModelLoadError, load_model

__all__ = ["ARCHITECTURES", "AttentionMetadata", "ChunkSpec", "LoadedModel", "ModelLoadError", "load_model"]
