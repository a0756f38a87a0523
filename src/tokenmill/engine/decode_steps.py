"""Decode steps in a row on a device (vLLM's "multi-step scheduling"): a decode-only batch runs
`steps` steps back to back, each row's next input its sampled token, which stays on the device; the
host reads all the steps' tokens once, at the end, and the scheduler hands them out one at a time
(Scheduler.update_decode_steps), so a stop token or max_tokens ends a sequence where single steps
would have.

Why: on a GPU the host's share of a step (scheduling, the batch's inputs, the sampler's bookkeeping,
the tokens' way back, the scheduler's update) is a third of a single stream's step and more than half
of a 256-sequence one, and the device waits for it. Here it is paid once per `steps` tokens. The
arithmetic is the ordinary steps' (the same graphs, rows and sampler), so the tokens are the same.

Only where nothing needs the host between two tokens: every row a plain decode, greedy or sampled (no
grammar, logprobs, proposals, forks or copies), no request waiting (it would wait `steps` steps for
its prompt), and room for every sequence's tokens in blocks of its own. Penalties are applied over
windows that hold the run's earlier tokens, gathered on the device; a seeded row draws from its
generator in the order single steps would; a stop string ends a request on the output side, which
drops what a run made after it (as after a speculative step), and it is counted as generated there."""
from __future__ import annotations

import torch

from tokenmill.engine.batch import ScheduledBatch
from tokenmill.engine.request import Sequence
from tokenmill.engine.sampler import SampleResult, Sampler, SamplerInput, suppressed_tokens
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.uploads import device_index


def plain_decode(seq: Sequence) -> bool:
    """A sequence whose next token the device alone can pick: no grammar (its mask is computed on the
    host from the token before) and no logprobs (they come back with every token)."""
    p = seq.params
    return seq.constraint is None and not p.logprobs and not p.top_logprobs and p.prompt_logprobs is None


def steps_for(batch: ScheduledBatch, scheduler: Scheduler, wanted: int) -> int:
    """How many steps this batch may run in a row (1: an ordinary step). Never more than any sequence
    may still take (max_tokens) or than fit its context without reaching its end."""
    if wanted < 2 or len(scheduler.waiting) or not batch.chunks or batch.preempted or batch.finished:
        return 1
    steps = wanted
    for chunk in batch.chunks:
        seq = chunk.seq
        if (chunk.num_new != 1 or not chunk.samples or chunk.draft_ids or chunk.copies or chunk.forked_from
                or seq.num_pending_forks or seq.is_prefilling or seq.num_uncomputed != 1 or not plain_decode(seq)):
            return 1
        left = seq.max_model_len - seq.num_tokens - 1  # the context's end is an ordinary step's business
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - len(seq.output_ids))
        steps = min(steps, left)
        if steps < 2:
            return 1
    return steps


def penalty_windows(batch: ScheduledBatch, step: int, previous: list[torch.Tensor],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The penalty windows of step `step` of a run, laid out as the sampler's apply_penalties lays
    them out: each row's last repeat_last_n tokens of its context, the run's tokens so far (previous:
    one device tensor of the rows' tokens per step) included, gathered on the device."""
    chunks = batch.chunks
    rows = len(chunks)
    ids: list[int] = []
    dest: list[int] = []
    src: list[int] = []
    offsets = [0]
    for r, chunk in enumerate(chunks):
        p = chunk.seq.params
        if p.uses_penalties:
            width = p.repeat_last_n
            from_run = step if width < 0 else min(step, width)
            ids += chunk.seq.last_token_ids(width - from_run if width >= 0 else -1)
            for s in range(step - from_run, step):
                dest.append(len(ids))
                src.append(s * rows + r)
                ids.append(0)
        offsets.append(len(ids))
    windows = device_index(ids, device)
    if dest:
        windows[device_index(dest, device)] = torch.stack(previous).view(-1)[device_index(src, device)]
    return windows, device_index(offsets, device)


def run_model(batch: ScheduledBatch, steps: int, runner, sampler: Sampler, stop_ids) -> list[SampleResult]:
    """The steps' model calls and sampling, each step's tokens as a SampleResult (for
    Scheduler.update_decode_steps); the sequences' blocks already hold every position
    (Scheduler.reserve_decode_steps). Each step's sampler input is what the ordinary step would have
    had: its output counts decide min_tokens' suppression, its windows the penalties."""
    seqs = [c.seq for c in batch.chunks]
    params = [s.params for s in seqs]
    generators = [s.generator for s in seqs]
    num_output = [len(s.output_ids) for s in seqs]
    stops = [stop_ids] * len(seqs)
    penalised = any(p.uses_penalties for p in params)
    min_tokens = [p.min_tokens for p in params]
    any_min = any(min_tokens)
    # What a step suppresses changes only as rows reach their min_tokens: worked out (and uploaded)
    # once for each side of it the rows are on, not for every step.
    suppressions: dict[tuple[int, ...], tuple] = {}

    def sample(logits: torch.Tensor, step: int, previous: list[torch.Tensor]) -> torch.Tensor:
        counts = [n + step for n in num_output]
        inp = SamplerInput(params=params, generators=generators, num_output_tokens=counts, stop_token_ids=stops,
                           penalty_windows=penalty_windows(batch, step, previous, logits.device) if penalised else None)
        below = tuple(i for i, (n, m) in enumerate(zip(counts, min_tokens)) if n < m) if any_min else ()
        inp.suppression = suppressions.get(below)
        if inp.suppression is None:
            inp.suppression = suppressions[below] = suppressed_tokens(inp, logits.shape[1], logits.device)
        return sampler.on_device(logits, inp)

    return [SampleResult(token_ids=r) for r in runner.run_decode_steps(batch, steps, sample)]
