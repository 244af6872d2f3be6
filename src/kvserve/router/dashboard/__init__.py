"""The router's live dashboard (``/dashboard``): what an operator watches while the fleet
serves, computed from what the router already holds plus a bounded poll of the workers'
``/metrics``, so that watching costs the request path nothing."""
