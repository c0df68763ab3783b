"""What one engine instance of the rollout ranks is generating, and with which weights.

The rollout loop streams responses through the engine (`RolloutEngine.add_requests` / `step`):
the book turns a share of prompts (this instance's part of a training batch or of an
evaluation) into one request per response, records each finished response as a Completion, and
says when a prompt's group of responses is complete (it can be scored) and when a whole share
is (it can be sent). At a weight update it applies the partial-rollout rule to the training
responses still in flight: `continue` records from which token on the new version sampled,
`abort` restarts them from the prompt under the new version. A share of multi-turn episodes is
generated whole (weights may change meanwhile: its completions record their versions) and
recorded complete (`add_generated`).

Every rank of an engine instance keeps the same book (they add the same requests and see the
same responses finish), so all of them add and abort the same requests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mcore_rl.config.rollout import SamplingConfig
from mcore_rl.rollout import Completion, FinishedSample, Generation, SampleRequest

ShareKey = tuple[str, int]
"""("batch", step) or ("eval", version)."""


@dataclass
class _Response:
    """A response in flight."""

    share: ShareKey
    request: SampleRequest
    versions: list[tuple[int, int]]
    """(first token, version) stretches so far; the first is the version that started it."""

    attempt: int = 0
    """How often it was restarted (partial_rollout=abort)."""


@dataclass
class OpenShare:
    """A share whose responses are being generated."""

    kind: str
    index: int
    records: list
    prompts: list[list[int]]
    samples_per_prompt: int
    finished: dict[int, dict[int, Completion]] = field(default_factory=dict)
    """Prompt position -> sample index -> its finished response."""

    restarts: int = 0
    """Responses restarted at a weight update (partial_rollout=abort)."""

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.prompts) and all(
            len(group) == self.samples_per_prompt for group in self.finished.values())

    def group(self, position: int) -> list[Completion]:
        """A complete group's responses in sample order."""
        return [self.finished[position][sample] for sample in range(self.samples_per_prompt)]

    def completions(self) -> list[Completion]:
        """Every response, by prompt, then sample."""
        return [completion for position in range(len(self.prompts))
                for completion in self.group(position)]


class InstanceBook:
    """The shares and responses of one engine instance (see the module docstring)."""

    def __init__(self):
        self.shares: dict[ShareKey, OpenShare] = {}
        self.in_flight: dict[str, _Response] = {}
        """Responses not finished yet, by request key."""

    def open(self, kind: str, index: int, records: list, prompts: list[list[int]],
             sampling: SamplingConfig, version: int) -> list[SampleRequest]:
        """Start a share: the requests of its responses (`sampling.n` per prompt), started
        with weights of `version`."""
        key = (kind, index)
        if key in self.shares:
            raise ValueError(f"{kind} {index} is already being generated")
        self.shares[key] = OpenShare(kind, index, records, prompts, sampling.n)
        requests = []
        for position, prompt in enumerate(prompts):
            for sample in range(sampling.n):
                request = SampleRequest(f"{kind}{index}/p{position}/s{sample}/a0", prompt,
                                        sampling, position, sample)
                self.in_flight[request.key] = _Response(key, request, [(0, version)])
                requests.append(request)
        return requests

    def add_generated(self, kind: str, index: int, records: list, generation: Generation,
                      version: int) -> OpenShare:
        """A share generated whole (multi-turn episodes), recorded complete: started with
        weights of `version`, and with the versions its completions recorded where weights
        changed while they ran."""
        key = (kind, index)
        if key in self.shares:
            raise ValueError(f"{kind} {index} is already being generated")
        samples = len(generation.completions) // max(len(generation.prompts), 1)
        share = self.shares[key] = OpenShare(kind, index, records, generation.prompts, samples)
        for completion in generation.completions:
            share.finished.setdefault(completion.prompt_index, {})[completion.sample_index] = \
                dataclasses.replace(completion, versions=completion.versions or ((0, version),))
        return share

    def finish(self, sample: FinishedSample) -> tuple[ShareKey, int] | None:
        """Record a finished response; (its share, its prompt position) when that completes
        the prompt's group."""
        response = self.in_flight.pop(sample.key)
        share, request = self.shares[response.share], response.request
        group = share.finished.setdefault(request.prompt_position, {})
        group[request.sample_index] = Completion(
            request.prompt_position, request.sample_index, sample.token_ids, sample.logprobs,
            sample.finish_reason, tuple(response.versions), sample.routed_experts,
            prompt_tokens=sample.prompt_tokens, cached_tokens=sample.cached_tokens)
        if len(group) == share.samples_per_prompt:
            return response.share, request.prompt_position
        return None

    def weights_changed(self, version: int, generated: dict[str, int], restart: bool
                        ) -> tuple[list[str], list[SampleRequest]]:
        """Apply new weights to the training responses in flight (`generated`: tokens each
        has so far). Returns the request keys to abort and the requests that replace them
        (restart=True: partial_rollout=abort); with restart=False every response continues,
        its tokens from here on recorded as sampled by `version`."""
        training = [key for key, response in self.in_flight.items()
                    if response.share[0] == "batch"]
        aborted, again = apply_update(self.in_flight, training, generated, version, restart)
        for response in again:
            self.shares[response.share].restarts += 1
        return aborted, [response.request for response in again]

    def complete_shares(self) -> list[OpenShare]:
        return [share for share in self.shares.values() if share.complete]

    def close(self, share: OpenShare) -> None:
        del self.shares[(share.kind, share.index)]

    def keys(self) -> list[str]:
        return list(self.in_flight)



def apply_update(in_flight: dict, keys: list[str], generated: dict[str, int], version: int,
                 restart: bool) -> tuple[list[str], list]:
    """New weights of `version` for the requests `keys` of `in_flight` (key -> an entry with
    request, versions and attempt; `generated`: the tokens each has so far). Each goes on,
    its tokens from here on recorded as sampled by `version` (one not begun simply starts
    with it); with `restart` (partial_rollout=abort) one that has begun is asked again from
    its start, under its key up to any earlier attempt's suffix, then /a<attempt>. Returns
    the keys to abort and the restarted entries (in `in_flight` under their new keys)."""
    aborted, again = [], []
    for key in keys:
        entry = in_flight[key]
        tokens = generated.get(key, 0)
        if not restart or tokens == 0:
            entry.versions = [(0, version)] if tokens == 0 \
                else entry.versions + [(tokens, version)]
            continue
        del in_flight[key]
        entry.attempt += 1
        entry.request = dataclasses.replace(
            entry.request, key=f"{entry.request.key.rsplit('/a', 1)[0]}/a{entry.attempt}")
        entry.versions = [(0, version)]
        in_flight[entry.request.key] = entry
        aborted.append(key)
        again.append(entry)
    return aborted, again
