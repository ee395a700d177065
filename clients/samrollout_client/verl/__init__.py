"""samrollout as veRL's rollout backend (``actor_rollout_ref.rollout.name=samrollout``).

veRL (0.9.x) loads `samrollout_client.verl.plugin` through its ``verl.plugins`` entry
point in every process that imports it; the plugin registers:

- `replica.SamrolloutReplica` under the rollout name ``samrollout``: each veRL rollout
  replica is a Ray actor (`server_actor.SamrolloutServer`) that forwards veRL's
  token-in-token-out calls to a running samrollout server over HTTP;
- `adapter.SamrolloutServerAdapter`, the trainer-side weight sink: after each step the
  trainer's tensors are streamed to every server (`AsyncRolloutClient.push_weights`), no shared disk;
- `router.GroupStickyLoadBalancer`, an optional veRL router that sends the responses to
  one prompt to one server, so they draft from one group automaton.

Nothing here is imported by `samrollout_client` itself: the client works without veRL.
"""
