"""Fault isolation: an exception caused by one request fails that request alone.

A step runs many requests' tokens in one forward pass, so an exception from it names no culprit. The
engine treats the step's requests as suspects and runs them one at a time (`isolated`): a suspect whose
step succeeds and samples a token is cleared, one whose step fails alone is blamed and failed, and the
rest of the batch goes on. A failed step leaves the engine consistent: progress (`num_computed_tokens`,
appended tokens, prefix-cache hashes) only moves in `Scheduler.update`, after the forward pass, so the
innocent requests simply run that step again.

Only a fault that is not any one request's marks the engine unhealthy: an error the device reports
(a CUDA error leaves the context unusable), or a known-good probe request that fails too after several
failed steps in a row (`needs_probe`): then every request is failing, not one.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import torch

MAX_FAILED_STEPS_BEFORE_PROBE = 4


class EngineFault(RuntimeError):
    """A fault of the engine or its device, not of any one request: the engine cannot go on."""


def is_device_error(e: BaseException) -> bool:
    """Errors after which the device cannot be trusted (CUDA's are sticky: the context is lost)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return "CUDA error" in str(e) or "device-side assert" in str(e)


class FaultIsolator:
    """The suspects of failed steps, run one at a time until each is cleared or blamed."""

    def __init__(self, max_failed_steps: int = MAX_FAILED_STEPS_BEFORE_PROBE) -> None:
        self.suspects: list[str] = []  # request ids, oldest failure first
        self.max_failed_steps = max_failed_steps
        self.num_failed_in_a_row = 0
        self.num_blamed = 0
        self.num_isolated_steps = 0

    def isolated(self, live: Container[str]) -> str | None:
        """The request the next step must run alone (None: schedule normally)."""
        if not self.suspects:  # every step asks: nothing to allocate when all is well
            return None
        self.suspects = [r for r in self.suspects if r in live]
        return self.suspects[0] if self.suspects else None

    def unschedulable(self, request_id: str) -> None:
        """The isolated request could not be scheduled alone (no free blocks): run it with the rest again
        rather than stall; if it is the culprit, the next failure suspects it anew."""
        if request_id in self.suspects:
            self.suspects.remove(request_id)

    def succeeded(self, isolated: str | None, sampled: Iterable[str]) -> None:
        """A step ran; `sampled`: the requests that got a token from it."""
        self.num_failed_in_a_row = 0
        if isolated is not None:
            self.num_isolated_steps += 1
            if isolated in sampled:  # it went through the sampler too: everything a step does to it
                self.suspects.remove(isolated)

    def failed(self, request_ids: list[str]) -> str | None:
        """A step over `request_ids` raised: the one to blame when it ran alone, else None (all become
        suspects, to run alone)."""
        self.num_failed_in_a_row += 1
        if len(request_ids) == 1:
            culprit = request_ids[0]
            if culprit in self.suspects:
                self.suspects.remove(culprit)
            self.num_blamed += 1
            return culprit
        self.suspects.extend(r for r in request_ids if r not in self.suspects)
        return None

    @property
    def needs_probe(self) -> bool:
        """So many steps failed in a row that the device itself may be broken: check with a known-good request."""
        return self.num_failed_in_a_row >= self.max_failed_steps

    def probe_passed(self) -> None:
        self.num_failed_in_a_row = 0
