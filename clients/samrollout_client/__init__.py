"""samrollout-client: call a samrollout server (or several) as the rollout engine of an RL trainer.

    from samrollout_client import RolloutClient, Sampling

    with RolloutClient("http://127.0.0.1:8000", model="smollm2-135m-instruct") as client:
        groups = client.generate(["What is 2 + 3?"], n=8, sampling=Sampling(max_tokens=64), rollout_id="step-0")
        print(client.report("step-0"))
"""

from samrollout_client.client import AsyncRolloutClient
from samrollout_client.errors import NoEndpointAvailable, RequestRejected, RolloutFailed, SamrolloutError
from samrollout_client.protocol.modes import InFlight
from samrollout_client.rollouts.partial import PartialRollout
from samrollout_client.sync import RolloutClient, SyncPartialRollout
from samrollout_client.types import (
    GroupResult,
    PartialRolloutStats,
    RolloutReport,
    Sample,
    SampleFailure,
    SamplePiece,
    Sampling,
    SpecStats,
    StalePolicy,
    WeightPush,
    WeightVersionSpan,
)
from samrollout_client.weight_sync.weight_commit import EndpointWeights, WeightsSplit
from samrollout_client.weight_sync.weight_push import StagedWeights

__all__ = ["AsyncRolloutClient", "EndpointWeights", "GroupResult", "InFlight", "NoEndpointAvailable",
           "PartialRollout", "PartialRolloutStats", "RequestRejected", "RolloutClient", "RolloutFailed",
           "RolloutReport", "Sample", "SampleFailure", "SamplePiece", "Sampling", "SamrolloutError", "SpecStats",
           "StagedWeights", "StalePolicy", "SyncPartialRollout", "WeightPush", "WeightVersionSpan", "WeightsSplit"]
