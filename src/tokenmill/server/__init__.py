"""HTTP serving: Ollama, OpenAI and llama-server style APIs over one AsyncEngine."""
from tokenmill.server.app import create_app
from tokenmill.server.model_host import LoadSpec, ModelHost
from tokenmill.server.settings import ServerSettings, load_settings

__all__ = ["LoadSpec", "ModelHost", "ServerSettings", "create_app", "load_settings"]
