"""Policy weights: files pushed over HTTP and staged (`weight_uploads`), relayed to peers (`weight_relay`,
`weight_peers`), checked before a load (`weights_check`, `weight_values`, `weights_root`); the versions that
sampled each token (`weight_labels`), the prefix-cache epoch by load (`weight_epoch`); what each ``in_flight``
mode of an update does (`update_modes`).

May import `request_state`, `errors`, `settings` and `vllm_compat`; not the engine that loads the weights.
"""

MAY_IMPORT = ("vllm_compat", "errors", "settings", "request_state")
