"""server/thinking.py's split of a thinking model's text into reasoning and answer: the same however
the text arrives in pieces, no tag ever sent in part, and nothing but whitespace around the block lost."""
from __future__ import annotations

import pytest

from tokenmill.server.thinking import Thinking, ThinkingSplit

CASES = [
    # (text, starts inside the block, reasoning, answer)
    ("<think>\nLet me add.\n2 + 2 is 4.\n</think>\n\nIt is 4.", False, "Let me add.\n2 + 2 is 4.", "It is 4."),
    ("  <think>a < b</think>b", False, "a < b", "b"),
    ("<think>\n\n</think>\n\nHi", False, "", "Hi"),
    ("No block here. <think>x</think>", False, "", "No block here. <think>x</think>"),
    ("\n  Indented answer", False, "", "\n  Indented answer"),
    ("<thinking> is not the tag", False, "", "<thinking> is not the tag"),
    ("<thi", False, "", "<thi"),
    ("Okay, so.\n</think>\n\nThe answer.", True, "Okay, so.", "The answer."),
    ("still thinking when the tokens ran out </", True, "still thinking when the tokens ran out </", ""),
    ("<think>unclosed", False, "unclosed", ""),
    ("<think>x</think>a </think> b", False, "x", "a </think> b"),
    ("", False, "", ""),
]


def _pieces(text: str, cuts: tuple[int, ...]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _run(pieces: list[str], inside: bool) -> tuple[str, str, list[tuple[str, str]]]:
    split = ThinkingSplit(inside)
    outs = [split.feed(p) for p in pieces] + [split.finish()]
    return "".join(r for r, _ in outs), "".join(a for _, a in outs), outs


@pytest.mark.parametrize("text,inside,reasoning,answer", CASES)
def test_whole_and_in_every_two_or_three_pieces(text, inside, reasoning, answer):
    assert Thinking(inside).split_text(text) == (reasoning, answer)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            got_r, got_a, outs = _run(_pieces(text, (i, j)), inside)
            assert (got_r, got_a) == (reasoning, answer), (i, j)
            for r, a in outs:  # a tag is never sent, whole or in part, from inside the block
                assert "<think>" not in r and "</think" not in r


def test_one_character_at_a_time_sends_reasoning_before_the_block_ends():
    split = ThinkingSplit()
    sent = [split.feed(c) for c in "<think>Step one. Step two.</think>Done"]
    reasoning_sent_early = "".join(r for r, _ in sent[:len("<think>Step one.")])
    assert reasoning_sent_early == "Step one."  # streamed as it comes, not at the block's end
    assert "".join(r for r, _ in sent) == "Step one. Step two."
    assert "".join(a for _, a in sent) + split.finish()[1] == "Done"
