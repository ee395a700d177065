"""The rollout server: vLLM's OpenAI-compatible serving over one in-process AsyncLLM, plus RL controls.

`samrollout serve` starts it (`command`); `app.build_app` builds the FastAPI application for a given
`settings.ServerSettings`.  Its parts, lowest first; each may import only the parts below it (its
``__init__``'s ``MAY_IMPORT``, checked by tests/test_module_layering.py), and of the client only
`samrollout_client.protocol`:

- `vllm_compat`: vLLM's serving layer as each supported release lays it out;
- `errors`, `settings`: the OpenAI-style error replies, the server's flags;
- `request_state`: what one HTTP request holds while it runs (in-flight ids, queue place, its end);
- `weights`: weight files (uploads, relay, peers, checks, values), weight versions (labels, epochs), update modes;
- `engine`: the running engine (start-up, runtime and its RL operations, admission, continuation);
- `api`: the HTTP routes of the OpenAI API and of /admin, auth, request limits;
- `areal`: AReaL's routes and the pause gate they close;
- `app`, `command`: the application and ``samrollout serve``.
"""

MAY_IMPORT = ("vllm_compat", "errors", "settings", "request_state", "weights", "engine", "api", "areal")
"""The parts of the server its top modules (`app`, `command`) may import."""
BASE_MAY_IMPORT = ("vllm_compat",)
"""The parts `errors` and `settings`, which every part above relies on, may import."""
