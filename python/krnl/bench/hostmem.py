"""How much host memory a row's training steps take on top of what the process held before them:
the figure that shows what a trainer keeps in host memory instead of on the device (Unsloth's
offloaded gradient checkpointing keeps each layer's input there, in pinned buffers). Sampled on a
thread from Linux's /proc/self/statm; elsewhere (macOS: one memory for both) there is no figure."""

import os
import threading
from pathlib import Path

STATM = Path("/proc/self/statm")


def rss_bytes():
    """This process's resident set in bytes, or None where /proc is not there."""
    try:
        return int(STATM.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HostGrowth:
    """with HostGrowth() as g: ... then g.bytes: the largest resident set seen while inside, less
    the one on entering (None without /proc). Sampled every `every` seconds: a buffer that lives
    for less than that can be missed, which the steps' buffers (a whole forward and backward) do not."""

    def __init__(self, every=0.005):
        self.every, self.bytes = every, None
        self._stop = threading.Event()

    def __enter__(self):
        self._start = self._peak = rss_bytes()
        if self._start is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.every):
            self._peak = max(self._peak, rss_bytes() or 0)

    def __exit__(self, *exc):
        if self._start is None:
            return False
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, rss_bytes() or 0)
        self.bytes = self._peak - self._start
        return False
