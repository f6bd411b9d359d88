"""Text printed as the tokens come, without ever printing something it must take back.

A token is not always a whole character (byte-level vocabularies split multi-byte characters over
tokens), a chat answer is shown without its surrounding whitespace, and a stop string ends the
text before it. :class:`TextStream` decodes the tokens so far and writes only the part of the
text that can no longer change: it holds back a trailing replacement character (an unfinished
UTF-8 sequence), with ``strip`` leading and trailing whitespace (written once more text follows
it), and any ending that could be the start of a stop string. :meth:`close` writes the rest of
the final text, so what was streamed always equals the text decoded at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TextIO


class TextStream:
    """Writes the decoded text of the tokens passed to :meth:`add` to ``out`` as it settles."""

    def __init__(self, decode: Callable[[list[int]], str], out: TextIO, *, strip: bool = False,
                 stop_strings: Sequence[str] = ()) -> None:
        self.decode, self.out, self.strip = decode, out, strip
        self.stop_strings = tuple(stop_strings)
        self.tokens: list[int] = []
        self.written = 0  # characters of the (left-stripped) text already written

    def _settled(self, text: str) -> str:
        text = text.lstrip() if self.strip else text
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        if cuts:
            return text[:min(cuts)]
        settled = text.rstrip("\ufffd")
        if self.strip:
            settled = settled.rstrip()
        for s in self.stop_strings:  # an ending that may grow into a stop string waits
            for k in range(min(len(s) - 1, len(settled)), 0, -1):
                if settled.endswith(s[:k]):
                    settled = settled[:-k]
                    break
        return settled

    def add(self, token: int) -> None:
        self.tokens.append(token)
        settled = self._settled(self.decode(self.tokens))
        if len(settled) > self.written:
            self.out.write(settled[self.written:])
            self.out.flush()
            self.written = len(settled)

    def close(self, final: str) -> None:
        """Write what is left of ``final``, the whole text as the caller shows it."""
        if len(final) > self.written:
            self.out.write(final[self.written:])
        self.out.flush()


__all__ = ["TextStream"]
