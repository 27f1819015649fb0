from mimw.engine.detokenize import IncrementalDetokenizer, StopMatcher


class Bytes:
    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, prompt: bytes = b"hi ") -> list[str]:
    d = IncrementalDetokenizer(Bytes(), list(prompt))
    deltas = [d.push(b) for b in text.encode()]
    deltas.append(d.finish())
    return deltas


def test_multibyte_characters_are_never_split():
    text = "añ€😀 ok ✓"
    deltas = stream(text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)
    # each character appears whole in exactly one delta, when its last byte arrives
    assert [x for x in deltas if x] == list(text)


def test_prompt_context_does_not_leak_into_output():
    assert "".join(stream("abc", prompt="€€€€€€".encode())) == "abc"


def test_finish_flushes_an_incomplete_character_once():
    d = IncrementalDetokenizer(Bytes(), [])
    assert d.push(0xE2) == "" and d.push(0x82) == ""
    assert d.finish() == "\ufffd" and d.finish() == ""


def test_stop_string_is_cut_and_never_emitted():
    m = StopMatcher(["STOP"])
    out = []
    for ch in "abc ST":
        out.append(m.feed(ch)[0])
    assert "".join(out) == "abc "  # "ST" is held back: it may become STOP
    text, stopped = m.feed("OP and more")
    assert stopped and text == "" and m.text == "abc "


def test_held_back_prefix_is_released_when_it_cannot_match():
    m = StopMatcher(["STOP"])
    assert m.feed("x ST") == ("x ", False)
    assert m.feed("ay") == ("STay", False)
    assert m.feed("S", final=True) == ("S", False)


def test_earliest_of_several_stop_strings_wins():
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)


def test_stop_string_spanning_deltas_after_emission():
    m = StopMatcher(["\n\n"])
    assert m.feed("a\n") == ("a", False)
    assert m.feed("\nb") == ("", True)
    assert m.text == "a"


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)


def test_text_stream_cuts_at_stop_strings_and_flushes_held_text():
    from mimw.engine.detokenize import TextStream

    ts = TextStream(Bytes(), [], ("o w",))
    out = []
    for b in b"Hello world":  # the caller stops at the first stop
        out.append(ts.push(b))
        if out[-1][1]:
            break
    assert "".join(d for d, _ in out) == "Hell" and len(out) == 7
    ts = TextStream(Bytes(), [], ("xyz",))
    deltas = [ts.push(b)[0] for b in b"abcx"]
    assert "".join(deltas) == "abc" and ts.finish() == "x"


class Pieces:
    """A byte-level vocabulary: id i decodes to ``pieces[i]`` (1 to 3 bytes, or nothing), invalid bytes as U+FFFD."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def full_window_deltas(tok, prompt, ids) -> list[str]:
    """What every push returns when each push decodes its whole window (the rule the detokenizer keeps)."""
    window, prefix, read, out = list(prompt[-4:]), 0, len(prompt[-4:]), []
    for final, new in [(False, [t]) for t in ids] + [(True, [])]:
        window += new
        if read >= len(window):
            out.append("")
            continue
        old, text = tok.decode(window[prefix:read]), tok.decode(window[prefix:])
        if not final and (len(text) <= len(old) or text.endswith("\ufffd")):
            out.append("")
            continue
        out.append(text[len(old):])
        prefix, read = read, len(window)
    return out


def test_long_held_windows_give_the_deltas_of_whole_window_decoding():
    import random

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    valid = [c.encode() for c in "aZ ñ€😀✓\n"]
    invalid = [b"\x80", b"\xbf", b"\xe2", b"\xe2\x82", b"\xf0\x9f", b"\xff", b"\xc3"]
    for _ in range(40):
        pieces = [b""] + [rng.choice(valid)[:rng.randint(1, 4)] for _ in range(40)] + invalid
        pieces += [b"".join(rng.sample(valid, 2)) for _ in range(10)]
        tok = Pieces(pieces)
        ids: list[int] = []
        while len(ids) < 120:  # runs of invalid bytes longer than the tail, split characters, empty pieces
            kind = rng.random()
            if kind < 0.3:
                ids += [rng.randrange(41, 41 + len(invalid))] * rng.randint(1, 30)
            elif kind < 0.4:
                ids += [0] * rng.randint(1, 4)
            else:
                ids += [rng.randrange(len(pieces))]
        prompt = [rng.randrange(len(pieces)) for _ in range(rng.randint(0, 6))]
        d = IncrementalDetokenizer(tok, prompt)
        got = [d.push(t) for t in ids] + [d.finish()]
        assert got == full_window_deltas(tok, prompt, ids), f"seed {seed}"
        if not prompt:  # (a prompt's incomplete last character may absorb the first output bytes)
            assert "".join(got) == tok.decode(ids)


def test_a_character_spread_over_more_held_tokens_than_the_tail_comes_out_when_complete():
    # a 4-byte character whose first byte lies before 8 tokens that decode to nothing
    tok = Pieces([b"", b"\xf0", b"\xbf", b"\x80"])
    ids = [3] * 3 + [1] + [0] * 9 + [2, 2, 2]
    d = IncrementalDetokenizer(tok, [])
    got = [d.push(t) for t in ids] + [d.finish()]
    assert got == full_window_deltas(tok, [], ids)
    assert got[-2] == "\ufffd" * 3 + "\U0003ffff"


def test_a_long_invalid_run_is_held_until_a_character_completes_it():
    d = IncrementalDetokenizer(Bytes(), list(b"hi "))
    assert [d.push(0x80) for _ in range(50)] == [""] * 50
    assert d.push(ord("a")) == "\ufffd" * 50 + "a"
    assert [d.push(b) for b in "€".encode()] == ["", "", "€"]
