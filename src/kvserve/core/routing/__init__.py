"""Pure routing logic shared by the router and the simulator: no I/O, clock passed in."""
