"""engine layer: the model, the KV pool and the step loop, with torch (layers and
modules: docs/architecture.md; interfaces: docs/internals.md).

Importing it, before torch loads, bounds how long an OpenMP thread (torch's intra-op
threads, libgomp) spins after its share of an op before it sleeps: 1,000 spins, tens of
microseconds. A step runs a hundred-odd parallel ops back to back, and waking a sleeping
sibling for each costs far more than the op's split saves (on the 2-core dev box, a VM,
passive waiting made 2 threads slower than 1 on a shared-prefix batch: 117–125 against
156 tok/s; with the bounded spin, 220–260). Between steps and when the engine is idle the
threads sleep, so they do not take cores from other jobs; spinning longer (5,000 spins and
up) does: with two CPU hogs beside it a 2-thread engine fell to 17–30 tok/s, against
77–102 with 1,000 spins and 63–132 passive. Measurements: docs/benchmarks.md, "Engine vs
vLLM (CPU)". An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins; neither has an
effect if torch was imported first (libgomp reads them once, when it loads).
"""

import os

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")
