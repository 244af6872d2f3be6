"""engine layer: the model, the KV pool and the step loop, with torch (layers and
modules: docs/architecture.md; interfaces: docs/internals.md).

Importing it, before torch loads, asks OpenMP (torch's intra-op threads) to wait
passively: a thread that finishes its share of an op sleeps instead of spinning for the
next one. With spinning siblings, a core shared with other jobs (or more threads than
free cores) goes to threads that only wait: on the 2-core dev box, 2 threads, 16 prompts
of 128 tokens × 32 new on a 1024-wide model took 47–62 s wall and 19–25 CPU s spinning,
9.5–20 s and 6.1 CPU s passive. An explicit ``OMP_WAIT_POLICY`` wins; it has no effect
if torch was imported first (libgomp reads it once, when it loads).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
