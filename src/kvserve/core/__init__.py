"""Pure, deterministic logic shared by engine, router and simulator: no I/O, no clock."""
