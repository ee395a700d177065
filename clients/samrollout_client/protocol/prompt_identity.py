"""What makes two prompts "the same prompt", for the trainer's client and the server alike.

A prompt is known by its token ids (the server always has them; the client has them when the
trainer sends ids) or, where only its text is known (a client sending text), by its text.  Its
identity is a BLAKE2b digest (`prompt_digest`, `prompt_id`):

- token ids: of the ids as 4-byte little-endian unsigned integers, concatenated (`token_bytes`);
- text: of its UTF-8 bytes, hashed with the personalisation ``samrollout.text``, so that no text
  has the identity of a token prompt.  The text and the token ids of one prompt have different
  identities: the client has no tokenizer.

The drafting groups named after a prompt or a request are defined here too: `prompt_group`
(requests grouped by their prompt, with the cross-epoch history on) and `sibling_group` (the
``n`` children of one request), which the server's API process and its engine workers must spell
alike.

Who uses it: on the server, `samrollout.history` and `samrollout.spec_decode.session` (the
cross-epoch history's keys, `DIGEST_SIZE` bytes, and prompt groups), the length predictor
(`samrollout.server.engine.length_predictor.prompt_key`), and `sibling_group` in the proposer
(`samrollout.spec_decode.proposer.group_of`) and the length-aware scheduler
(`samrollout.server.engine.scheduled_engine`); in the client, `samrollout_client.placement.LengthHistory`,
history-affine placement (`samrollout_client.placement.place_affine` ranks the servers by a hash of
this identity, so that a prompt finds the server holding its history: its spelling must not change)
and the veRL backend's group ids (`samrollout_client.verl.sampling.group_key`, `GROUP_KEY_SIZE`
bytes: routers and servers in other processes compare them, so their spelling must not change).
The history, the length predictor and the placement history live in one process's memory.

Standard library only: the server imports this module from the client package (the server
distribution depends on ``samrollout-client``), and the client imports neither vLLM nor torch
(nor numpy, which it does not depend on).  A numpy array of ids is converted in one call
(``astype``), not token by token.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from typing import SupportsIndex

# Bytes in a prompt's identity (`prompt_digest`): 128 bits, the history's keys.
DIGEST_SIZE = 16
# Bytes of the prompt's identity in the group ids the veRL backend sends ("{rollout_id}.{key}"): fixed, since
# routers and servers in other processes compare them.
GROUP_KEY_SIZE = 10
# BLAKE2b personalisation for text prompts: no text hashes like a sequence of token ids.
_TEXT_PERSON = b"samrollout.text"

TokenIds = Iterable[SupportsIndex]  # a list of ints, a numpy array, ...
Prompt = str | TokenIds


def token_bytes(token_ids: TokenIds) -> bytes:
    """The ids as 4-byte little-endian unsigned integers, concatenated: what a token prompt's identity hashes.

    A list (or any iterable) of ints must hold ids in [0, 2**32) (else `struct.error`); an array with a
    ``dtype`` (numpy) is cast to 32 bits in one call, as numpy casts.
    """
    if hasattr(token_ids, "dtype") and hasattr(token_ids, "astype"):
        # "<i4" (not "<u4"): the same bytes for every id below 2**31, and no copy of an int32 array.
        data: bytes = token_ids.astype("<i4", copy=False).tobytes()
        return data
    ids = token_ids if isinstance(token_ids, list | tuple) else list(token_ids)
    return struct.pack(f"<{len(ids)}I", *ids)


def prompt_digest(prompt: Prompt, size: int = DIGEST_SIZE) -> bytes:
    """The prompt's identity: ``size`` bytes of BLAKE2b of its token ids, or of its text (see the module)."""
    if isinstance(prompt, str):
        return hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=size,
                               person=_TEXT_PERSON).digest()
    return hashlib.blake2b(token_bytes(prompt), digest_size=size).digest()


def prompt_id(prompt: Prompt, size: int = DIGEST_SIZE) -> str:
    """`prompt_digest` as lowercase hex (``2 * size`` characters)."""
    return prompt_digest(prompt, size).hex()


def prompt_group(digest: bytes) -> str:
    """The drafting group of requests grouped by their prompt (the prompt's `prompt_digest`)."""
    return f"prompt:{digest.hex()}"


def sibling_group(parent_request_id: str) -> str:
    """The drafting group of the ``n`` children of the request ``parent_request_id``."""
    return f"n:{parent_request_id}"
