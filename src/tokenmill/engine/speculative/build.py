"""Which proposer an engine's speculator uses: prompt lookup, or a draft model loaded here (a name or
.gguf path from the server's configuration, resolved as `serve` resolves its own model; never from a
request)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.engine.speculative.config import SpecConfig, SpecConfigError
from tokenmill.engine.speculative.draft import DraftModel, DraftProposer
from tokenmill.engine.speculative.proposer import NgramProposer, SpecCounters
from tokenmill.engine.speculative.speculator import Speculator
from tokenmill.kvcache.storage import KVStorage

if TYPE_CHECKING:
    from tokenmill.model import LoadedModel

log = logging.getLogger(__name__)

VOCAB_KEY = "tokenizer.ggml.tokens"


def build_speculator(cfg: SpecConfig, target: "LoadedModel", *, num_blocks: int, block_size: int, n_ubatch: int,
                     kv_dtype, counters: SpecCounters, draft: "LoadedModel | None" = None) -> Speculator:
    """The engine's speculator. For method "draft", the draft model is loaded from cfg.draft_model
    unless given (tests hand one in), checked against the target, and given a KV cache of num_blocks
    blocks of its own."""
    if cfg.method != "draft":
        return Speculator(cfg, counters, NgramProposer(cfg))
    draft = draft if draft is not None else load_draft(cfg.draft_model)
    check_compatible(target, draft)
    mc = draft.config
    # As many token slots as the target's cache (num_blocks x block_size), so every sequence the target
    # holds can draft: up to the draft's K/V bytes per token (2 x layers x kv heads x head size x the
    # element size, plus int8's scales) times that; uninitialised (lazy, as the target's), so what the
    # process holds grows with the slots written.
    kv = KVStorage(mc.n_layers, num_blocks, block_size, mc.n_kv_heads, mc.head_dim, kv_dtype, lazy=True,
                   device=draft.device)
    cost = cfg.draft_cost if cfg.draft_cost is not None else weight_bytes(draft) / max(weight_bytes(target), 1)
    log.info("speculative decoding with draft model %s (%d layers; a draft step ~%.2f of a target step)",
             cfg.draft_model, mc.n_layers, cost)
    proposer = DraftProposer(cfg, DraftModel(draft.model, kv, n_ubatch, mc.context_length, weight_bytes(draft)), cost)
    return Speculator(cfg, counters, proposer)


def load_draft(name: str) -> "LoadedModel":
    from tokenmill.model import load_model
    from tokenmill.store import resolve_model

    try:
        path = resolve_model(name)
    except Exception as exc:  # noqa: BLE001 - the store's own errors say what is missing
        raise SpecConfigError(f"draft model {name!r}: {exc}") from None
    return load_model(path, "gguf")


def check_compatible(target: "LoadedModel", draft: "LoadedModel") -> None:
    """The draft proposes token ids the target reads as its own: the vocabularies must be the same,
    token for token; and it runs on the native kernels like the target."""
    if draft.config.vocab_size != target.config.vocab_size or \
            list(draft.gguf.metadata.get(VOCAB_KEY, [])) != list(target.gguf.metadata.get(VOCAB_KEY, [])):
        raise SpecConfigError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the "
                              f"target's ({target.config.vocab_size} tokens): a draft model needs the same tokens")
    if draft.weights != "gguf" or draft.device.type != "cpu":
        raise SpecConfigError("the draft model must run on the CPU's native kernels, as the target does")


def weight_bytes(loaded: "LoadedModel") -> int:
    try:
        return Path(loaded.gguf.path).stat().st_size
    except (OSError, TypeError):
        return 0
