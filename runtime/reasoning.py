"""Reasoning models' thinking, split from the answer: ``<think>`` ... ``</think>`` in the output
becomes a chat reply's ``reasoning_content``, the rest its ``content``.

The server turns the split on for a model whose chat template marks thinking (the template text
holds ``<think>``: Qwen3, DeepSeek-R1 and their kin). An output is in one of two shapes: it opens
with ``<think>`` (Qwen3), or its prompt already ends inside the thinking (``starts_inside``: the
rendered prompt ends with ``<think>``, as DeepSeek-R1's generation prompt does), so the output
starts with the reasoning. The reasoning runs to ``</think>``; the content is what follows, without
its leading whitespace. Output of neither shape is all content. A stream (:class:`ReasoningSplit`)
sends the reasoning and the content as they come, holding only what could still be a tag; the whole
answer is the same split fed at once (:func:`split_reasoning`), so streamed and whole replies agree.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningSplit:
    """One output's reasoning and content, fed as it streams (module docstring)."""

    def __init__(self, starts_inside: bool):
        self.starts_inside = starts_inside
        self.text = ""
        self.sent = [0, 0]  # characters of reasoning, content sent
        self.has_reasoning = starts_inside

    def _parts(self, final: bool) -> tuple[str, str]:
        t, start = self.text, 0
        if not self.starts_inside:
            body = t.lstrip()
            if body.startswith(OPEN):
                start = len(t) - len(body) + len(OPEN)
            elif not final and OPEN.startswith(body):  # could still open: hold it all
                return "", ""
            else:
                return "", t
        self.has_reasoning = True
        end = t.find(CLOSE, start + self.sent[0])  # the reasoning sent holds no tag: search past it
        if end < 0:
            reasoning = t[start:]
            return (reasoning if final else reasoning[: len(reasoning) - _held_suffix(reasoning, CLOSE)]), ""
        return t[start:end], t[end + len(CLOSE) :].lstrip()

    def feed(self, new_text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content to send for ``new_text`` (``final``: the output ended)."""
        self.text += new_text
        reasoning, content = self._parts(final)
        out = reasoning[self.sent[0] :], content[self.sent[1] :]
        self.sent = [max(self.sent[0], len(reasoning)), max(self.sent[1], len(content))]
        return out


def split_reasoning(text: str, starts_inside: bool) -> tuple[str | None, str]:
    """``(reasoning or None, content)`` of a whole output."""
    s = ReasoningSplit(starts_inside)
    reasoning, content = s.feed(text, final=True)
    return (reasoning if s.has_reasoning else None), content
