"""Reasoning split (runtime/reasoning.py): thinking into reasoning_content, the rest content; any
chunking of a stream gives the whole answer's split."""

from __future__ import annotations

import itertools
import random

import pytest

from kiln.runtime.reasoning import ReasoningSplit, split_reasoning

CASES = [  # (output, the prompt ends inside the thinking, (reasoning, content))
    ("<think>\nadd 2 and 2\n</think>\n\nIt is 4.", False, ("\nadd 2 and 2\n", "It is 4.")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("add them</think>\n4", True, ("add them", "4")),
    ("still thinking when max_tokens hit", True, ("still thinking when max_tokens hit", "")),
    ("<think>cut off </thi", False, ("cut off </thi", "")),
    ("No thinking here. <think> is text", False, (None, "No thinking here. <think> is text")),
    ("<thin", False, (None, "<thin")),
    ("", True, ("", "")),
]


@pytest.mark.parametrize("text, inside, want", CASES)
def test_split_and_any_streaming_of_it_agree(text, inside, want):
    assert split_reasoning(text, inside) == want
    rng = random.Random(len(text))
    for cuts in [
        list(range(1, len(text))),
        sorted(rng.sample(range(1, max(len(text), 2)), min(3, max(len(text) - 1, 0)))),
    ]:
        s, got = ReasoningSplit(inside), ["", ""]
        bounds = [0, *cuts, len(text)]
        for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            r, c = s.feed(text[lo:hi], final=k == len(bounds) - 2)
            got[0] += r
            got[1] += c
        assert (got[0] if s.has_reasoning else None, got[1]) == want, cuts


def test_nothing_that_could_be_a_tag_leaves_early():
    s = ReasoningSplit(False)
    assert s.feed("<thi") == ("", "")  # could open
    assert s.feed("nk>plan</th") == ("plan", "")  # could close
    assert s.feed("ink>  ") == ("", "")  # content's leading whitespace held
    assert s.feed("go", final=True) == ("", "go")
