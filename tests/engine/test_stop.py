from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.stop import StopStringMatcher, TokenTextTracker


def feed(stops, deltas):
    """Push every delta; returns (emitted pieces, stopped, flushed text)."""
    m = StopStringMatcher(stops)
    pieces, stopped = [], False
    for d in deltas:
        r = m.push(d)
        pieces.append(r.emit)
        if r.stopped:
            stopped = True
            break
    return pieces, stopped, ("" if stopped else m.flush()), m


def test_no_stops_passes_text_straight_through():
    pieces, stopped, rest, _ = feed([], ["Hel", "lo"])
    assert pieces == ["Hel", "lo"] and not stopped and rest == ""


def test_stop_across_three_deltas():
    pieces, stopped, _, m = feed(["\nUser:"], ["Hel", "lo\nUs", "er:", " never"])
    assert stopped
    assert pieces == ["Hel", "lo", ""]
    assert "".join(pieces) == "Hello"
    assert m.stop_string == "\nUser:"
    assert m.emitted_chars == 5


def test_partial_match_is_held_then_released_when_it_diverges():
    m = StopStringMatcher(["\nUser:"])
    assert m.push("Hi\nUs").emit == "Hi"
    r = m.push("ual")
    assert r.emit == "\nUsual" and not r.stopped
    assert m.flush() == ""


def test_holdback_released_on_flush():
    m = StopStringMatcher(["</answer>"])
    assert m.push("42 </ans").emit == "42 "
    assert m.flush() == "</ans"
    assert m.emitted_chars == len("42 </ans")


def test_stop_at_the_very_start():
    pieces, stopped, _, m = feed(["###"], ["###", " more"])
    assert stopped and pieces == [""] and m.emitted_chars == 0


def test_earliest_of_several_stops_wins():
    pieces, stopped, _, m = feed(["END", "b"], ["a", "bcEND"])
    assert stopped and "".join(pieces) == "a" and m.stop_string == "b"
    # Both complete in the same delta: the one starting first wins, not the first listed.
    pieces, stopped, _, m = feed(["zz", "yy"], ["x yy zz"])
    assert "".join(pieces) == "x " and m.stop_string == "yy"


def test_same_start_prefers_the_shorter_stop():
    _, _, _, m = feed(["User:", "User"], ["Hi User: x"])
    assert m.stop_string == "User"


def test_first_to_complete_wins_over_an_earlier_start():
    # ":b:" starts first but "b" completes first; splitting the text differently must not matter.
    for deltas in (["::b:"], ["::b", ":"], [":", ":", "b", ":"]):
        pieces, stopped, _, m = feed(["b", ":b:"], deltas)
        assert stopped and "".join(pieces) == "::" and m.stop_string == "b"


def test_same_end_prefers_the_longer_stop():
    _, _, _, m = feed(["b", "ab"], ["xab"])
    assert m.stop_string == "ab" and m.emitted_chars == 1


def test_overlapping_prefixes_hold_back_enough():
    # "aab" must be caught even though "a", "aa" are both live partial matches.
    pieces, stopped, _, _ = feed(["aab"], ["xa", "a", "a", "b"])
    assert stopped and "".join(pieces) == "xa"


def test_holdback_uses_the_longest_live_prefix_of_any_stop():
    m = StopStringMatcher(["abc", "bcd"])
    assert m.push("zab").emit == "z"  # "ab" may become "abc"
    assert m.push("c").stopped


def test_unicode_stops():
    pieces, stopped, _, m = feed(["。\n", "👋"], ["こんにちは", "。", "\n次"])
    assert stopped and "".join(pieces) == "こんにちは" and m.stop_string == "。\n"
    pieces, stopped, _, _ = feed(["👋"], ["héllo ", "👋", "x"])
    assert stopped and "".join(pieces) == "héllo "


def test_after_stop_everything_is_dropped():
    m = StopStringMatcher(["X"])
    assert m.push("aXb").emit == "a"
    r = m.push("more")
    assert r.stopped and r.emit == ""
    assert m.flush() == ""


def test_empty_delta():
    m = StopStringMatcher(["ab"])
    assert m.push("xa").emit == "x"
    assert m.push("").emit == ""
    assert m.push("b").stopped


def test_empty_and_duplicate_stops_are_ignored():
    m = StopStringMatcher(["", "x", "x"])
    assert m.stops == ["x"]
    assert m.push("abc").emit == "abc"


ALPHABET = "ab\n:é"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_emitted_text_is_text_up_to_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]

    # The first stop string to complete wins; on the same last character, the longest.
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(hits)[1]] if hits else text

    m = StopStringMatcher(stops)
    out = ""
    stopped = False
    for d in deltas:
        r = m.push(d)
        out += r.emit
        assert expected.startswith(out)  # nothing emitted ever has to be taken back
        if r.stopped:
            stopped = True
            break
    if not stopped:
        out += m.flush()
    assert stopped == bool(hits)
    assert out == expected
    assert m.emitted_chars == len(expected)


# ---------------------------------------------------------------- logprob alignment


def tracker(*pieces):
    t = TokenTextTracker()
    for p in pieces:
        t.add(p)
    return t


def test_tokens_before_cut():
    t = tracker("Hel", "lo", "\nUs", "er", ":")
    assert len(t) == 5
    # "Hello\nUser:" cut at 5: "\nUs" starts at 5 -> dropped with everything after it.
    assert t.tokens_before(5) == 2
    # A token straddling the cut is kept: cut at 4 still needs "lo" (starts at 3).
    assert t.tokens_before(4) == 2
    assert t.tokens_before(3) == 1
    assert t.tokens_before(0) == 0
    assert t.tokens_before(100) == 5


def test_empty_pieces_follow_the_token_that_completes_the_character():
    # A multi-byte character split over two tokens: the first decodes to "".
    t = tracker("a", "", "é", "b")
    assert t.tokens_before(1) == 1  # cut right before "é": both of its tokens go
    assert t.tokens_before(2) == 3  # "é" kept: both of its tokens stay


def test_tracker_with_matcher_end_to_end():
    pieces = ["The", " answer", " is", " 4", "2.", "\n\n", "Q", ":"]
    m, t = StopStringMatcher(["\n\nQ:"]), TokenTextTracker()
    for p in pieces:
        t.add(p)
        if m.push(p).stopped:
            break
    assert m.stopped
    n = t.tokens_before(m.emitted_chars)
    assert pieces[:n] == ["The", " answer", " is", " 4", "2."]
