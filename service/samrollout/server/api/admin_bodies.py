"""What the admin routes share (`admin_routes`, `weight_upload_routes`): the body base, the documented errors, the
help text of ``in_flight``; so that no route module imports another."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {400: {"description": "bad request"}, 401: {"description": "no key"},
                                            409: {"description": "not possible in this state or configuration"}}
"""The error replies every admin route documents."""


class AdminBody(BaseModel):
    """An admin request's JSON body: unknown fields are a 400."""

    model_config = ConfigDict(extra="forbid")


IN_FLIGHT_HELP = ("requests in flight: finish them on the old weights first (wait), abort them (abort), or stop them "
              "at a token boundary and let them go on under the new weights in the same response, their KV cache "
              "computed again under the new weights (continue) or kept as the old weights computed it "
              "(continue-keep-kv: nothing recomputed)")
