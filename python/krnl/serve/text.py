"""A choice's text as its tokens arrive: the part that may be sent now, held back while it ends in
an incomplete character (the tokenizer's U+FFFD) or in what could be the start of a stop string,
and cut before the first stop string once one appears (which ends the choice)."""


class ChoiceText:
    def __init__(self, tok, stop=()):
        self.tok, self.stop = tok, tuple(s for s in stop if s)
        self.ids, self.sent, self.text = [], 0, ""

    def add(self, token):
        """(text newly sendable, whether a stop string ended the choice) after one more token."""
        self.ids.append(int(token))
        text = self.tok.decode(self.ids)
        cut = self._first_stop(text)
        if cut is not None:
            out, self.text = text[self.sent:cut], text[:cut]
            self.sent = cut
            return out, True
        self.text = text
        end = len(text) - self._held(text)
        out = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, False

    def flush(self):
        """What is left to send once the choice ends without a stop string."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out.rstrip("\ufffd")

    def _first_stop(self, text):
        # a stop string may begin in text already sent only as far back as its own length
        found = [i for s in self.stop if (i := text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        return min(found) if found else None

    def _held(self, text):
        """The length of the end of text that may not be sent yet."""
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        for k in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0
