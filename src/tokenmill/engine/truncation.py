"""Temperature and truncation (top_k, typical_p, top_p, min_p) for the sampled rows the compiled
draws do not take (kernels/categorical.py draws the plain, nucleus and top_k rows: what is left here is
typical_p): the candidates' scaled logits, sorted, with removed tokens at -inf. The order and the rules
are sampler.py's."""
from __future__ import annotations

import torch

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.uploads import column, device_index
from tokenmill.kernels.topk import topk_rows

_NEG_INF = float("-inf")


def truncate_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature and truncation in vocabulary order: the logits a draw is made from, with removed
    tokens at -inf, for every row through the torch path (the rows the sampler draws with compiled
    kernels take a full sort here, with the same rules). For tests and debugging."""
    out = torch.full_like(logits, _NEG_INF)
    for rows, vals, ids in truncated_candidates(logits, params, every_row=True):
        out[rows] = out[rows].scatter_(1, ids, vals)
    return out


# The groups sample_group sorts rows into that kernels/categorical.py draws (sampler.py); the others
# take the torch path here.
COMPILED_GROUPS = ("top_k", "nucleus", "plain")


def sample_group(p: SamplingParams, vocab: int) -> str:
    """How much of the vocabulary a sampled row looks at, and who draws it: "top_k" (top_p and min_p
    then see only the k survivors), "top_k_typical" (typical_p too), "sort" (typical_p without top_k:
    it needs the entropy of the whole distribution), "nucleus" (top_p), "plain"."""
    if 0 < p.top_k < vocab:
        return "top_k_typical" if p.typical_p < 1.0 else "top_k"
    if p.typical_p < 1.0:
        return "sort"
    return "nucleus" if p.top_p < 1.0 else "plain"


def truncated_candidates(logits: torch.Tensor, params: list[SamplingParams], *, every_row: bool = False):
    """Scale by temperature and apply top_k, typical_p, top_p, min_p, for the rows with typical_p (the
    others take compiled draws: sampler.py), or with every_row for all of them.

    Each group of rows yields (rows, values, ids): the candidates' scaled logits, sorted descending
    (removed ones at -inf), and their vocabulary ids."""
    vocab = logits.shape[1]
    dev = logits.device
    n = logits.shape[0]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]

    groups: dict[str, list[int]] = {"top_k": [], "sort": []}
    for i, p in enumerate(params):
        group = sample_group(p, vocab)
        if every_row or group not in COMPILED_GROUPS:
            groups["top_k" if group.startswith("top_k") else "sort"].append(i)

    def scaled(rows: list[int], x: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of logits / temperature (or of x, already gathered for those rows)."""
        if x is None:
            x = logits if len(rows) == n else logits[device_index(rows, dev)]
        temps = [params[i].temperature if params[i].temperature > 0 else 1.0 for i in rows]
        return x / column(temps, x)

    if rows := groups["top_k"]:
        sub = [params[i] for i in rows]
        ks = [top_k[i] for i in rows]
        # Top-k commutes with a positive temperature: select first, then scale only k values.
        raw = logits if len(rows) == n else logits[device_index(rows, dev)]
        vals, ids = topk_rows(raw, max(ks))
        vals = scaled(rows, vals)
        pos = torch.arange(vals.shape[1], device=dev)
        vals = vals.masked_fill(pos[None, :] >= column(ks, vals, torch.long), _NEG_INF)
        yield device_index(rows, dev), filter_sorted(vals, sub), ids
    if rows := groups["sort"]:
        vals, ids = scaled(rows).sort(dim=-1, descending=True, stable=True)
        yield device_index(rows, dev), filter_sorted(vals, [params[i] for i in rows]), ids


def filter_sorted(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """typical_p, top_p, min_p on candidates sorted by descending logit (top_k already applied)."""
    if any(p.typical_p < 1.0 for p in params):
        x = _typical(x, params)
    if any(p.top_p < 1.0 for p in params):
        x = _top_p(x, params)
    return _min_p(x, params)


def _typical(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Locally typical sampling as llama.cpp does it: rank tokens by |surprise - entropy| and keep
    the closest ones until their mass exceeds typical_p (the token crossing it is kept)."""
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).nan_to_num(nan=0.0).sum(dim=-1, keepdim=True)  # 0 * -inf -> 0
    shifted = (-logp - entropy).abs()  # removed tokens: +inf, so they rank last
    order = shifted.argsort(dim=-1, stable=True)
    mass_before = _shift_right(p.gather(1, order).cumsum(dim=-1))
    drop_sorted = mass_before > column([q.typical_p for q in params], x)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    active = column([q.typical_p < 1.0 for q in params], x, torch.bool)
    return x.masked_fill(drop & active, _NEG_INF)


def _top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Keep the shortest prefix (x is sorted descending) whose mass reaches top_p. With top_k, the
    mass is the k candidates' (renormalised), as in llama.cpp and Ollama."""
    cum = torch.exp(x - x.logsumexp(dim=-1, keepdim=True)).cumsum(dim=-1)
    p = column([q.top_p for q in params], x)
    excl = _shift_right(cum)
    # excl == 0 exactly for the most likely survivor (everything before it is a removed 0), so it
    # is always kept, even for top_p = 0.
    drop = (excl >= p) & (excl > 0) & column([q.top_p < 1.0 for q in params], x, torch.bool)
    return x.masked_fill(drop, _NEG_INF)


def _min_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    active = [p.min_p > 0.0 for p in params]
    if not any(active):
        return x
    # Keep p >= min_p * p_max, i.e. logit >= max_logit + log(min_p); needs no sort.
    thresh = x.max(dim=-1, keepdim=True).values + torch.log(column([p.min_p for p in params], x))
    return x.masked_fill((x < thresh) & column(active, x, torch.bool), _NEG_INF)


def _shift_right(cum: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sums -> exclusive ones (the mass strictly before each token)."""
    return torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
