"""A bench row run in a process of its own: its launcher's command on a spec file, the row's
figures back as JSON. The data-parallel rows (train_dist.py: mpiexec, torchrun) and the peers that
patch transformers for their whole process (fast_peers.py: Liger, Unsloth) run this way."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH_TIMEOUT_S = 3600
# Open MPI's mpiexec refuses to start as root unless told twice (a GPU container runs as root);
# MPICH ignores these.
ROOT_MPI = ({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
            if hasattr(os, "geteuid") and os.geteuid() == 0 else {})


def launch(cmd, spec, log, env=None, timeout=LAUNCH_TIMEOUT_S, window=False):
    """Runs `cmd SPEC.json` once (spec plus "out", the path its figures are written to); the
    figures, or raises with the output's tail. window: keep the figures' "timed_window", whose
    time.perf_counter stamps are CLOCK_MONOTONIC on Linux, one clock for every process there."""
    with tempfile.TemporaryDirectory(prefix="krnl-bench-launch-") as tmp:
        spec = dict(spec, out=str(Path(tmp) / "result.json"))
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        r = subprocess.run(cmd + [str(path)], capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, **ROOT_MPI, **(env or {})))
        said = [x for x in r.stdout.splitlines() if x.startswith("dist:")]  # krnl's choice of allreduce
        if r.returncode != 0 or not Path(spec["out"]).exists():
            lines = (r.stderr.strip() or r.stdout.strip()).splitlines()
            # the failing rank's exception, not the launcher's summary after it (torchrun's)
            errors = [x.strip() for x in lines if re.match(r"\s*[\w.]*(Error|Exception):", x)]
            raise RuntimeError(f"exit status {r.returncode}: {' | '.join(errors[-1:] + lines[-2:])[:300]}")
        res = json.loads(Path(spec["out"]).read_text())
        if not (window and sys.platform.startswith("linux")):
            res.pop("timed_window", None)  # another process's clock
        log(f"krnl bench: train {' '.join(cmd[:4])}...: {time.perf_counter() - t0:.0f} s")
        if said:
            res["allreduce"] = said[0][len("dist: "):]
        return res
