"""Batched token sampling for one decode step.

Order, per row:
    penalties (repeat, presence, frequency) -> logit_bias -> grammar mask (constrained rows only)
    -> suppression (min_tokens / ignore_eos)
    -> greedy rows: argmax
    -> temperature -> top_k -> typical_p -> top_p -> min_p -> draw

This is llama.cpp's chain except for where temperature sits: llama.cpp scales last, so its top_p /
min_p see temperature-1 probabilities; Ollama's own Go sampler and vLLM scale first, and since we
serve the Ollama API we behave like Ollama. Each truncation step renormalises over the survivors
of the previous one, as llama.cpp, Ollama and vLLM all do.

Logprobs are reported from the distribution after penalties, logit_bias, the grammar mask and
suppression but before temperature and truncation: that is what the model "thinks" given the
repetition rules and what the output may be, and is independent of the sampling knobs (vLLM's default
is the raw distribution, before penalties and masks).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.truncation import COMPILED_GROUPS, sample_group, truncated_candidates
from tokenmill.engine.uploads import device_index, upload
from tokenmill.kernels.argmax import argmax_rows
from tokenmill.kernels.categorical import sample_categorical, sample_nucleus, sample_top_k
from tokenmill.kernels.logprobs import row_logprobs
from tokenmill.kernels.penalties import apply_penalties_rows
from tokenmill.kernels.topk import topk_rows
from tokenmill.model.host_tensors import host_tensor
from tokenmill.structured import TokenMasks, apply_token_masks

_NEG_INF = float("-inf")


@dataclass
class SamplerInput:
    """One row per sequence that samples this step; every list is indexed by row.

    Lists other than `params` may be left empty, meaning "nothing for any row"."""

    params: list[SamplingParams]
    # Per-request generator, seeded when params.seed is set (see make_generator). Rows with a
    # generator are sampled on their own so the draw does not depend on the batch around them.
    generators: list[torch.Generator | None] = field(default_factory=list)
    # Penalty window per row: the last repeat_last_n tokens of prompt + output. Re-trimmed here to
    # params.repeat_last_n, so passing a longer history is harmless.
    recent_token_ids: list[list[int]] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    # The model's end-of-generation ids (EOS/EOT). Suppressed always when ignore_eos is set, and,
    # together with params.stop_token_ids, while num_output_tokens < min_tokens.
    stop_token_ids: list[frozenset[int]] = field(default_factory=list)
    # Allowed tokens of the rows with a grammar constraint; None when no row has one.
    token_masks: TokenMasks | None = None
    # The penalty windows already on the logits' device, as (ids, offsets) the way apply_penalties
    # lays them out, in place of recent_token_ids: decode steps in a row (engine/decode_steps.py)
    # build them with tokens that never came back to the host.
    penalty_windows: tuple[torch.Tensor, torch.Tensor] | None = None
    # The (rows, token ids) suppression sets to -inf, already on the logits' device (suppressed_tokens
    # of this input; () for none), in place of working it out from the lists above: decode steps in a
    # row reuse one for every step whose rows are on the same side of their min_tokens.
    suppression: tuple[torch.Tensor, torch.Tensor] | tuple[()] | None = None


@dataclass
class SampleResult:
    token_ids: list[int]
    # Logprob of the chosen token for rows with params.logprobs or top_logprobs > 0, None for the
    # other rows; the whole list is None when no row asked.
    logprobs: list[float | None] | None = None
    # Per row, the top_logprobs best (id, logprob), most likely first; [] for rows not asking.
    top_logprobs: list[list[tuple[int, float]]] | None = None


def greedy_exclusions(p: SamplingParams, num_output_tokens: int, stop_ids: frozenset[int],
                      vocab: int) -> tuple[int, ...] | None:
    """For a row whose token is its logits' argmax once its suppression is applied (greedy, no
    logprobs, penalties or logit_bias): the ids it suppresses (its end tokens under ignore_eos, and its
    stop tokens too below min_tokens; () for none), which its token can never be. None for any other
    row. Such rows need no logits either (DecoderLM.greedy_tokens excludes those columns)."""
    if not (p.is_greedy and not p.logprobs and p.top_logprobs == 0 and not p.uses_penalties and not p.logit_bias):
        return None
    below_min = num_output_tokens < p.min_tokens
    if not (p.ignore_eos or below_min):
        return ()
    return _suppressed_ids(stop_ids, tuple(p.stop_token_ids) if below_min else (), vocab)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The generator a request keeps for its lifetime, or None to use the global RNG."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    # manual_seed wants a value that fits in 64 bits; negative seeds wrap like C would.
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


class Sampler:
    @torch.inference_mode()  # the runner's logits are inference tensors; updating them in place needs this
    def __call__(self, logits: torch.Tensor, inp: SamplerInput, *, owned: bool = False) -> SampleResult:
        """owned: the caller hands `logits` over, so it may be modified in place (saves a copy of
        [rows, vocab] per step)."""
        n = logits.shape[0]
        params = inp.params
        if n != len(params):
            raise ValueError(f"{n} logit rows but {len(params)} sampling params")
        if n == 0:
            return SampleResult(token_ids=[])

        logits, tokens = self._pick(logits, inp, owned)
        token_list = tokens.tolist()
        result = SampleResult(token_ids=token_list)
        _add_logprobs(result, logits, tokens, params)
        return result

    @torch.inference_mode()
    def on_device(self, logits: torch.Tensor, inp: SamplerInput) -> torch.Tensor:
        """The tokens __call__ picks for rows without grammar masks or logprobs, left on the
        logits' device as int64 (engine/decode_steps.py feeds them to the next step there, so the
        host does not wait for them). The same operations as __call__, the seeded rows' draws from
        their generators in the same order."""
        if inp.token_masks is not None:
            raise ValueError("on_device takes rows without grammar masks")
        return self._pick(logits, inp, owned=True)[1]

    def _pick(self, logits: torch.Tensor, inp: SamplerInput, owned: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(the processed float32 logits the tokens were picked from, the tokens on their device)."""
        n = logits.shape[0]
        params = inp.params
        # Penalties, temperature and cumulative sums want float32, and so does the greedy max: on
        # bf16 argmax ran 2.3x slower than a widening copy (0.26 ms at 64 rows) plus a float32 one.
        logits = logits.float()
        penalised = apply_penalties(logits, params, inp.recent_token_ids, in_place=owned, windows=inp.penalty_windows)
        penalised = apply_logit_bias(penalised, params, in_place=owned or penalised is not logits)
        where = inp.suppression if inp.suppression is not None else suppressed_tokens(inp, logits.shape[1],
                                                                                      logits.device)
        held = None
        if inp.token_masks is not None:
            penalised = apply_token_masks(penalised, inp.token_masks, in_place=owned or penalised is not logits)
            held = penalised[where] if where else None  # what suppression takes from a row the grammar may need
        logits = _suppress_stop_tokens(penalised, where, in_place=owned or penalised is not logits)
        if inp.token_masks is not None:
            _keep_a_way_out(logits, inp, where, held)

        greedy = [p.is_greedy for p in params]
        if all(greedy):
            tokens = greedy_tokens(logits)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=logits.device)
            gens = inp.generators or [None] * n
            greedy_rows = [i for i in range(n) if greedy[i]]
            shared_rows = [i for i in range(n) if not greedy[i] and gens[i] is None]
            seeded_rows = [i for i in range(n) if not greedy[i] and gens[i] is not None]

            def draw_rows(rows: list[int], draw) -> None:
                """tokens[rows] = draw(those rows' logits); a group of every row needs no gather or scatter
                (a single stream's sampled step: ~20 us of copies right after the model's)."""
                nonlocal tokens
                if len(rows) == n:
                    tokens = draw(logits)
                    return
                idx = device_index(rows, logits.device)
                tokens[idx] = draw(logits[idx])

            if greedy_rows:
                draw_rows(greedy_rows, greedy_tokens)
            if shared_rows:
                draw_rows(shared_rows, lambda x: _sample(x, [params[i] for i in shared_rows], None))
            # A seeded row's draw must depend only on its own logits, params and generator, so the
            # same seed gives the same tokens whatever else is in the batch. The compiled draws are
            # per row by construction: those rows share one call, each with a uniform from its own
            # generator. The torch path samples a seeded row as a batch of one.
            vocab = logits.shape[1]
            batched = [i for i in seeded_rows if sample_group(params[i], vocab) in COMPILED_GROUPS]
            if batched:
                draw_rows(batched, lambda x: _draw_compiled(x, [params[i] for i in batched],
                                                            [torch.rand((1,), generator=gens[i]).item()
                                                             for i in batched]))
            for i in seeded_rows:
                if sample_group(params[i], vocab) not in COMPILED_GROUPS:
                    tokens[i] = _sample(logits[i : i + 1], [params[i]], gens[i])[0]

        return logits, tokens


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index on ties, with torch.max(dim=-1)'s rules (torch's argmax
    kernel was slower still). The compiled kernel (kernels/argmax.py) reads the rows at memory speed:
    torch's max took 2.2 ms of SmolLM2's 64-sequence decode step."""
    return argmax_rows(logits)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], recent_token_ids: list[list[int]],
                    *, in_place: bool = False,
                    windows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """llama.cpp's penalties sampler over each row's window (kernels/penalties.py). Touches only the
    tokens in the windows; returns the input when no row has any, else the penalised logits (the
    input itself when in_place). windows: (ids, offsets) already laid out (SamplerInput.penalty_windows)."""
    if windows is not None:
        out = logits if in_place else logits.clone()
        _penalise(out, params, *windows)
        return out
    if not recent_token_ids:
        return logits
    windows: list[int] = []
    offsets = [0]
    for i, p in enumerate(params):
        if p.uses_penalties:
            window = recent_token_ids[i]
            windows += window[-p.repeat_last_n :] if p.repeat_last_n > 0 else window
        offsets.append(len(windows))
    if not windows:
        return logits
    out = logits if in_place else logits.clone()
    dev = logits.device
    _penalise(out, params, upload(dev, host_tensor(windows, torch.int64)), upload(dev, host_tensor(offsets, torch.int64)))
    return out


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams], *, in_place: bool = False) -> torch.Tensor:
    """OpenAI's logit_bias: each row's biases added to its logits (the input itself when no row has one,
    or when in_place). The values go up with the ids, without waiting for the device's queue."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for r, p in enumerate(params):
        if p.logit_bias:
            rows += [r] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            values += p.logit_bias.values()
    if not rows:
        return logits
    out = logits if in_place else logits.clone()
    dev = out.device
    out.index_put_((upload(dev, host_tensor(rows, torch.int64)), upload(dev, host_tensor(ids, torch.int64))),
                   upload(dev, host_tensor(values, out.dtype)), accumulate=True)
    return out


def _penalise(out: torch.Tensor, params: list[SamplingParams], ids: torch.Tensor, offsets: torch.Tensor) -> None:
    dev = out.device
    apply_penalties_rows(out, ids, offsets,
                         upload(dev, host_tensor([p.repeat_penalty for p in params], torch.float32)),
                         upload(dev, host_tensor([p.frequency_penalty for p in params], torch.float32)),
                         upload(dev, host_tensor([p.presence_penalty for p in params], torch.float32)))


@functools.lru_cache(maxsize=256)
def _suppressed_ids(eos: frozenset[int], extra: tuple[int, ...], vocab: int) -> tuple[int, ...]:
    """The ids a row suppresses (its end tokens, and while below min_tokens its stop tokens too)
    that exist in the vocabulary; the same few sets every step, for every row."""
    return tuple(sorted(t for t in eos.union(extra) if 0 <= t < vocab))


def suppressed_tokens(inp: SamplerInput, vocab: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
    """The (rows, token ids) pairs a step suppresses, as index tensors on `device`: each row's end
    tokens when it ignores EOS, and while it is below min_tokens its stop tokens too; () for none."""
    rows: list[int] = []
    toks: list[int] = []
    for i, p in enumerate(inp.params):
        below_min = (inp.num_output_tokens[i] if inp.num_output_tokens else 0) < p.min_tokens
        if not (p.ignore_eos or below_min):
            continue
        eos = inp.stop_token_ids[i] if inp.stop_token_ids else frozenset()
        ids = _suppressed_ids(eos if isinstance(eos, frozenset) else frozenset(eos), tuple(p.stop_token_ids) if below_min else (), vocab)
        rows.extend([i] * len(ids))
        toks.extend(ids)
    if not toks:
        return ()
    return _index_pair(tuple(rows), tuple(toks), torch.device(device))


@functools.lru_cache(maxsize=64)
def _index_pair(rows: tuple[int, ...], toks: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """suppressed_tokens' index tensors, made once for each set of rows and ids (a batch keeps its
    set from step to step): right after a decode step has streamed the weights through the caches,
    building two small tensors took 60 us of a single stream's 5 ms step. Never written to."""
    return device_index(list(rows), device), device_index(list(toks), device)


def _suppress_stop_tokens(logits: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor] | tuple[()],
                          in_place: bool) -> torch.Tensor:
    if not where:
        return logits
    out = logits if in_place else logits.clone()
    # The value as a tensor on the logits' device: index_put_ copies a host scalar to the GPU
    # synchronously, which made every step of an ignore_eos request wait there for the model run.
    neg_inf = torch.full((), _NEG_INF, dtype=out.dtype, device=out.device)
    out.index_put_(where, neg_inf)
    return out


def _dead_rows(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """Those of `rows` with every token at -inf: nothing left to sample."""
    picked = logits if rows == list(range(logits.shape[0])) else logits.index_select(0, device_index(rows, logits.device))
    dead = torch.isneginf(picked.max(dim=-1).values).tolist()
    return [row for row, is_dead in zip(rows, dead) if is_dead]


def _keep_a_way_out(logits: torch.Tensor, inp: SamplerInput, where: tuple[torch.Tensor, torch.Tensor] | tuple[()],
                    held: torch.Tensor | None) -> None:
    """A constrained row whose grammar allows only tokens that suppression removed would have nothing
    to sample: the grammar wins, and the row gets those tokens back (`held`: their logits before
    suppression). That is a stop_token_ids entry the grammar requires while the row is below
    min_tokens: there it is an ordinary token, which does not end the sequence. Giving such a row an
    end token instead made the grammar refuse it, and the request failed."""
    dead = _dead_rows(logits, inp.token_masks.rows)
    if dead and held is not None:
        back = torch.isin(where[0], torch.tensor(dead, device=where[0].device))
        logits.index_put_((where[0][back], where[1][back]), held[back])
        dead = _dead_rows(logits, dead)
    # Still nothing (a grammar that allows nothing at all): let it end on a stop token.
    for row in dead:
        stops = [t for t in (inp.stop_token_ids[row] if inp.stop_token_ids else ()) if 0 <= t < logits.shape[1]]
        logits[row, device_index(stops or [0], logits.device)] = 0.0


def _sample(logits: torch.Tensor, params: list[SamplingParams], gen: torch.Generator | None) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for rows, vals, ids in truncated_candidates(logits, params):
        # Inverse CDF over unnormalised weights: one uniform per row. The float64 running sum
        # only rises at tokens with weight > 0, so a removed (-inf) token can never be hit.
        w = (vals - vals.max(dim=-1, keepdim=True).values).exp_().double()
        cdf = w.cumsum(dim=-1)
        # float32 uniforms stay below 1 - 2^-24, so u < total survives the float64 rounding. Drawn on
        # the host (a request's generator lives there), so a seed gives the same draws on every device.
        u = _uniforms(vals.shape[0], gen, vals.device).double() * cdf[:, -1:]
        # A NaN row (a model whose weights or activations overflowed) has a NaN total, and the search
        # lands past the last candidate: clamp it into the row, as the compiled draws do.
        choice = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
        out[rows] = (choice if ids is None else ids.gather(1, choice)).squeeze(1)
    rows = [i for i, p in enumerate(params) if sample_group(p, logits.shape[1]) in COMPILED_GROUPS]
    if rows:
        idx = device_index(rows, logits.device)
        sub = logits if len(rows) == logits.shape[0] else logits[idx]
        # The same draws from gen as _uniforms would take, kept on the host as floats.
        uniforms = torch.rand((len(rows),), generator=gen).tolist()
        out[idx] = _draw_compiled(sub, [params[i] for i in rows], uniforms)
    return out


def _draw_compiled(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> torch.Tensor:
    """Rows of the compiled groups, each with its uniform in [0, 1) (a float32 value)."""
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    dev = logits.device
    for group in COMPILED_GROUPS:
        picked = [i for i, p in enumerate(params) if sample_group(p, logits.shape[1]) == group]
        if not picked:
            continue
        x = logits if len(picked) == logits.shape[0] else logits[device_index(picked, dev)]
        # The per-row settings as one float32 array, uploaded at once without waiting for the device's
        # queue (uploads.py): four tensors and a torch.log were ~25 us of a single stream's step.
        settings = np.array([[params[i].temperature if params[i].temperature > 0 else 1.0 for i in picked],
                             [params[i].top_p for i in picked],
                             [math.log(params[i].min_p) if params[i].min_p > 0 else -math.inf for i in picked],
                             [uniforms[i] for i in picked]], dtype=np.float32)
        temps, top_p, log_min_p, u = upload(dev, torch.from_numpy(settings))
        if group == "plain":
            drawn = sample_categorical(x, temps, log_min_p, u)
        elif group == "nucleus":
            drawn = sample_nucleus(x, temps, top_p, log_min_p, u)
        else:
            ks = [params[i].top_k for i in picked]
            # Top-k commutes with a positive temperature: select on the raw logits, scale only k values.
            values, ids = topk_rows(x, max(ks))
            drawn = sample_top_k(values, ids, upload(dev, host_tensor(ks, torch.int64)), temps, top_p, log_min_p, u)
        if len(picked) == logits.shape[0]:
            return drawn
        out[device_index(picked, dev)] = drawn
    return out


def _add_logprobs(
    result: SampleResult, logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> None:
    rows = [i for i, p in enumerate(params) if p.logprobs or p.top_logprobs > 0]
    if not rows:
        return
    idx = device_index(rows, logits.device)
    kmax = max(params[i].top_logprobs for i in rows)
    chosen, vals, ids = row_logprobs(logits if len(rows) == len(params) else logits[idx], tokens[idx], kmax)
    result.logprobs = [None] * len(params)
    for i, v in zip(rows, chosen.tolist()):
        result.logprobs[i] = v
    if kmax == 0:
        return
    vals, ids = vals.tolist(), ids.tolist()
    result.top_logprobs = [[] for _ in params]
    for j, i in enumerate(rows):
        k = params[i].top_logprobs
        # A token the grammar mask or suppression ruled out has logprob -inf: it is no alternative,
        # and JSON cannot carry it (a constrained row with one allowed token made the response a 500).
        result.top_logprobs[i] = [(t, v) for t, v in zip(ids[j][:k], vals[j][:k]) if v != _NEG_INF]


def _uniforms(n: int, gen: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """float32 [n, 1] uniforms from gen (a CPU generator, or the global CPU RNG), on device."""
    return upload(torch.device(device), torch.rand((n, 1), generator=gen))


