"""The agents and the codec of tests/test_temporal_workers.py (several workers
on one task queue; an encrypting payload codec).

The models answer from the context they are sent, not from a counter: a
context that arrived incomplete (it is passed by reference, and a worker may
have rebuilt it) shows as a wrong answer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Final

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

from agentfsm import (
    Abort,
    Decision,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopState,
    PendingTransition,
    UserMessage,
    tool,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import TemporalAgent
from agentfsm.testing import call, calls, text

STEPS: Final = 10
"""Tool calls per loop of the `steps` agent: 11 model requests."""


@tool
async def step(n: int) -> str:
    """One numbered step."""
    return f"step {n} done"


def _outputs(request: InferenceInput) -> list[str]:
    return [
        i.output for i in request.context.items if isinstance(i, FunctionCallOutputItem)
    ]


def steps_model(request: InferenceInput) -> InferenceOutput:
    """`step(0)` ... `step(9)`, one a turn, then an answer naming every output."""
    done = _outputs(request)
    if len(done) < STEPS:
        return calls(call("step", call_id=f"s{len(done)}", n=len(done)))
    return text("; ".join(done))


STEPS_ANSWER: Final = "; ".join(f"step {n} done" for n in range(STEPS))


@tool
async def remember(fact: str) -> str:
    """Keep a fact."""
    return f"kept: {fact}"


def secret_model(request: InferenceInput) -> InferenceOutput:
    """Sends the prompt to `remember`, then answers with what it kept."""
    done = _outputs(request)
    if not done:
        prompt = next(
            i.content for i in request.context.items if isinstance(i, UserMessage)
        )
        return calls(call("remember", call_id="r1", fact=str(prompt)))
    return text(done[-1])


def tool_budget(pending: PendingTransition) -> Decision | None:
    """docs/how-to/temporal-production.md's patched handler: v2 stops a loop
    at its fourth tool call (v1 had no limit)."""
    if (
        pending.dest is LoopState.function_call
        and workflow.patched("tool-budget-v2")
        and pending.tool_calls >= 3
    ):
        return Abort("tool budget of 3 calls reached")
    return None


AGENTS: Final = (
    TemporalAgent(name="steps", model="steps:scripted", tools=[step]),
    TemporalAgent(
        name="budget", model="steps:scripted", tools=[step], handlers=[tool_budget]
    ),
    TemporalAgent(name="secret", model="secret:scripted", tools=[remember]),
)
PROVIDERS: Final = {
    "steps": FunctionProvider(steps_model),
    "secret": FunctionProvider(secret_model),
}


class AESGCMCodec(PayloadCodec):
    """Encrypts every payload with AES-GCM (a fresh 96-bit nonce each), the
    shape docs/how-to/temporal-production.md shows: what the server stores
    and shows is ciphertext; clients and workers holding the key decode."""

    ENCODING: Final = b"binary/encrypted"

    def __init__(self, key: bytes, key_id: str) -> None:
        self._cipher = AESGCM(key)
        self._key_id = key_id.encode()

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        encoded = []
        for payload in payloads:
            nonce = os.urandom(12)
            sealed = self._cipher.encrypt(nonce, payload.SerializeToString(), None)
            encoded.append(
                Payload(
                    metadata={
                        "encoding": self.ENCODING,
                        "encryption-key-id": self._key_id,
                    },
                    data=nonce + sealed,
                )
            )
        return encoded

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        decoded = []
        for payload in payloads:
            if payload.metadata.get("encoding") != self.ENCODING:
                decoded.append(payload)  # not ours (written before the codec)
                continue
            if payload.metadata.get("encryption-key-id") != self._key_id:
                raise ValueError(
                    "payload encrypted with key "
                    f"{payload.metadata.get('encryption-key-id')!r}, "
                    f"this codec holds {self._key_id!r}"
                )
            nonce, sealed = payload.data[:12], payload.data[12:]
            decoded.append(
                Payload.FromString(self._cipher.decrypt(nonce, sealed, None))
            )
        return decoded
