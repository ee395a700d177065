"""AReaL compatibility (``--areal-routes``): AReaL's pause, continue and weight-update routes (`areal_routes`) and
the gate its pause closes (`generation_gate`), which the app installs as the runtime's request hold.

May import `api` (its auth), `engine` and everything below them.
"""

MAY_IMPORT = ("vllm_compat", "errors", "settings", "request_state", "weights", "engine", "api")
