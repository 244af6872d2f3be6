"""engine layer: the model, the KV pool and the step loop, with torch (layers and
modules: docs/architecture.md; interfaces: docs/internals.md).

Importing it, before torch loads, sets how long an OpenMP thread (torch's intra-op
threads, libgomp) spins after its share of an op before it sleeps. A step runs a
hundred-odd parallel ops back to back, and waking a sleeping sibling for each costs more
than the op's split saves: on the 2-core dev VM, 1,000 spins (18 µs) made ~3,500 wakes a
round of the shared-prefix benchmark and ran 102–117 tok/s on two threads; 100,000 spins
(about 2 ms, which also spans the engine's work between steps) made 31–72 wakes and ran
104–148. Spinning that long is wrong on cores shared with other busy jobs (beside two CPU
hogs: 31 tok/s against 44 with short waits), so where Linux counts how long the engine's
threads wait for a CPU, the model runner watches that and shortens their waits while the
cores are shared (:mod:`kvserve.engine.thread_governor`); elsewhere the spin stays at
1,000. Between requests the threads sleep after their spin. Measurements:
docs/benchmarks.md, "Spinning through a step, short waits on shared cores". An explicit
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins, and then nothing is governed; neither has
an effect if torch was imported first (libgomp reads them once, when it loads: its own
default is a 300,000-spin wait, which the governor then watches).
"""

import os

# The spin the thread governor makes safe (kvserve.engine.thread_governor): a process that
# runs with another wait (the user's) is not governed.
GOVERNED_SPINCOUNT = "100000"

if "OMP_WAIT_POLICY" not in os.environ:
    _GOVERNED = os.path.exists("/proc/self/schedstat")  # what the governor reads
    os.environ.setdefault("GOMP_SPINCOUNT", GOVERNED_SPINCOUNT if _GOVERNED else "1000")
