"""The training loop's throughput figures."""

import time


class Rate:
    """Tokens per second over the last `window` steps (what the progress bar and metrics call
    tokens_per_s: the first steps' start-up, graph recording included, drops out of it), and
    since the run (or the resume) began (tokens_per_s_cumulative)."""

    def __init__(self, window=10):
        self.window = int(window)
        self.t0 = time.perf_counter()
        self.ends = [(self.t0, 0)]  # (time a step ended, its tokens); the first entry is the start
        self.total = 0

    def add(self, tokens):
        self.ends.append((time.perf_counter(), int(tokens)))
        self.total += int(tokens)
        if len(self.ends) > self.window + 1:
            del self.ends[0]

    def recent(self):
        dt = self.ends[-1][0] - self.ends[0][0]
        return sum(n for _, n in self.ends[1:]) / dt if dt > 0 else 0.0

    def cumulative(self):
        dt = self.ends[-1][0] - self.t0
        return self.total / dt if dt > 0 else 0.0
