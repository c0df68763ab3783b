"""What the two sides of split placement say to each other.

Trainer rank 0 posts control messages on the job's store (runtime.messages.ControlBoard); rollout
rank 0 reads them in order between two engine steps and passes them to every rollout rank:

    Start(version, sampler)   the run starts (or resumes) at this policy version and prompt
                              position; the weights of that version come next
    Weights(version)          the trainers are sending this version's weights now (the bridge)
    Fetch(batch)              send batch `batch` (the prompts of step `batch`) when it is scored
    Evaluate(version)         answer the validation prompts with this version's weights
    Stop(exit_code)           end the job with this exit status

Each engine instance's leader (its first rank) answers a Fetch or an Evaluate with one `Share`:
its part of the prompts, every response, their scores, as soon as it is complete and scored.
The trainers ask for the next step's batch as soon as they receive one, so it is on its way
before they wait for it (a batch can arrive before an evaluation asked for later; the trainers
keep it). At a stop, a batch asked for ahead may be unsent or in flight: it was never trained
on, and a resumed run generates it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.rollout import Completion


@dataclass(frozen=True)
class Start:
    version: int
    """The first policy version: the step the trainers start from (0, or a resumed step)."""

    sampler: dict
    """The prompt sampler's position before the batch of step `version`."""


@dataclass(frozen=True)
class Weights:
    version: int


@dataclass(frozen=True)
class Fetch:
    batch: int


@dataclass(frozen=True)
class Evaluate:
    version: int


@dataclass(frozen=True)
class Stop:
    exit_code: int


@dataclass
class Share:
    """One engine instance's part of a training batch or of an evaluation, scored."""

    kind: str
    """"batch" or "eval"."""

    index: int
    """The batch's step, or the evaluated version."""

    records: list
    """The instance's prompt records, in the batch's order."""

    prompts: list[list[int]]
    """Their token ids."""

    completions: list[Completion]
    """Every response, `prompt_index` into `records`, versions recorded."""

    results: list
    """One RewardResult per completion."""

    restarts: int = 0
    """Responses restarted at a weight update (partial_rollout=abort)."""

    syncs: list = field(default_factory=list)
    """Weight syncs since this instance's previous share (`SyncFigures`), each figure the
    largest over the rollout ranks."""
