"""What a correct draw from sorted candidates may give (tests of kernels.categorical's nucleus and top_k
draws): computed in float64, every decision within a tolerance of its boundary allowed both ways, since
the kernels and their torch references sum in different orders and precisions."""
from __future__ import annotations

import torch


def sorted_draws_allowed(vals: torch.Tensor, ids: torch.Tensor, top_p: float, log_min_p: float, u: float,
                         tol: float = 1e-5) -> set[int]:
    """The ids a draw may give for one row: vals its candidates' scaled logits sorted descending, ids
    theirs; the shortest prefix whose probability reaches top_p (the nucleus's end within `tol` of top_p
    either way), then min_p, then u * total within `tol` of a candidate's interval either way."""
    w = (vals.double() - vals[0].double()).exp()
    cum = (w / w.sum()).cumsum(0)
    ends = {int((cum < top_p).sum())}  # index of the first candidate whose running mass reaches top_p
    ends |= {j for j in range(max(0, min(ends) - 2), min(len(cum), max(ends) + 3)) if abs(cum[j] - top_p) < tol}
    ok = set()
    for end in ends:
        keep = w[: end + 1].clone()
        keep[vals[: end + 1] < vals[0] + log_min_p] = 0.0
        cdf = keep.cumsum(0)
        target, slack = u * cdf[-1].item(), tol * cdf[-1].item()
        before = torch.cat([torch.zeros(1, dtype=torch.float64), cdf[:-1]])
        hit = (keep > 0) & (cdf > target - slack) & (before <= target + slack)
        ok |= {int(ids[j]) for j in hit.nonzero().flatten().tolist()}
    return ok
