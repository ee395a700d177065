"""What the client and the server must agree on, in one place: standard library only.

- `modes`: what a weight update and a pause do to requests in flight (``InFlight``, ``PauseMode``);
- `weight_uploads`: the upload URL, headers, relay spelling and confirmations of pushed weights;
- `areal_checkpoints`: the version an AReaL checkpoint directory stands for;
- `prompt_identity`: what makes two prompts the same prompt, and the drafting groups named after them.

The server (`samrollout`) imports nothing else of the client, and nothing here imports anything outside the
standard library or this package (tests/test_module_layering.py checks both), so the server's dependency on
``samrollout-client`` pulls in no client machinery.
"""
