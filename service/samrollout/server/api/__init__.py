"""The HTTP API: the OpenAI routes with the RL fields (`openai_routes`, `rl_fields`, `prompt_limits`), the /admin
routes (`admin_routes`, `weight_upload_routes`, what they share in `admin_bodies`), the API key (`auth`) and the
limits on what a request may send (`http_limits`).  No route module imports another.

May import `engine` and everything below it.
"""

MAY_IMPORT = ("vllm_compat", "errors", "settings", "request_state", "weights", "engine")
