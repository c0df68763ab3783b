"""The episode runner: a rank's conversations, driven concurrently through the engine's
streaming interface.

Each episode alternates between the engine (a model turn) and its sandboxed environment (the
observation). Neither waits for the other episodes: every engine step runs the turns in flight,
and every reply from a sandbox queues that episode's next turn at once (continuous batching
across turns, no barrier per turn). The result is an ordinary Generation whose completions carry
a per-token `sampled` mask, so the rest of the RL step needs no second path.

Each turn draws its own random numbers: the request seed follows the prompt, the sample and the
turn, so a resumed run replays an uninterrupted one wherever the environment is deterministic.
"""

from __future__ import annotations

import dataclasses
import os
import time

from mcore_rl.config.agents import MultiTurnConfig
from mcore_rl.config.rollout import SamplingConfig
from mcore_rl.rollout import Completion, Generation, RolloutEngine, SampleRequest

from .chat import ChatFormat, TemplateMismatch
from .episode import Episode
from ..sandbox import Reply, Sandbox, SandboxLimits
from ..sandbox.errors import setting_hint
from .session import EpisodeSpec

SESSION = "mcore_rl.agents.session:EpisodeSession"
TURN_SEED_STRIDE = 1_000_033
IDLE_POLL_SECONDS = 0.01


class EpisodeRunner:
    """Runs a rank's episodes on its engine (one per prompt and sample)."""

    def __init__(self, config: MultiTurnConfig, chat: ChatFormat, spec: EpisodeSpec,
                 sandbox: Sandbox):
        self.config = config
        self.chat = chat
        self.spec = spec
        self.sandbox = sandbox
        self._calls = 0

    @classmethod
    def build(cls, config: MultiTurnConfig, chat: ChatFormat, spec: EpisodeSpec,
              probe_record=None) -> "EpisodeRunner":
        """A runner with its sandbox, after checking that the environment can be made there
        and reset on `probe_record` (a real row; a broken environment class, or one the
        sandbox keeps from its files, variables or memory, fails here, before any rollout),
        and, with template_mismatch=error, that the chat template keeps a probe
        conversation."""
        if config.template_mismatch == "error":
            chat.check_prefix_preserving()
        limits = config.sandbox
        sandbox = Sandbox(SandboxLimits(
            timeout_seconds=limits.timeout_seconds, memory_mb=limits.memory_mb,
            cpu_seconds=limits.cpu_seconds, max_processes=limits.max_processes,
            network=limits.network, environment=tuple(limits.environment),
            readable=tuple(limits.readable), allow_unconfined=limits.allow_unconfined),
            name="environments", preload=spec.modules(), main_objects=spec.main_objects())
        runner = cls(config, chat, spec, sandbox)
        runner._check_environment(probe_record)
        return runner

    def run(self, engine: RolloutEngine, records: list, sampling: SamplingConfig,
            max_prompt_tokens: int) -> Generation:
        """`sampling.n` episodes for each record (PromptRecord), until every one has ended."""
        started = time.perf_counter()
        self._calls += 1
        episodes = {f"e{self._calls}/p{index}/s{sample}":
                    Episode(f"e{self._calls}/p{index}/s{sample}", index, sample,
                            episode_row(record))
                    for index, record in enumerate(records) for sample in range(sampling.n)}
        for key, episode in episodes.items():
            self.sandbox.open(key, SESSION, self.spec)
            self.sandbox.send(key, ("reset", episode.row))
        waiting = {key: "reset" for key in episodes}
        """Episodes waiting for their environment, and for what."""
        unopened, in_flight = set(episodes), 0
        # One has_unfinished and, when true, one step per iteration on every rank: the
        # engine's data-parallel instances agree on them, so all ranks stop together.
        while True:
            requests = []
            for reply in self.sandbox.poll(0 if in_flight else IDLE_POLL_SECONDS):
                if reply.key in unopened:  # the reply to `open`; the reset's follows
                    unopened.discard(reply.key)
                    if reply.ok:
                        continue
                phase = waiting.pop(reply.key, None)
                if phase is None:  # an episode that ended unplayed (its reset's late reply)
                    continue
                next_phase, request = self._on_reply(episodes[reply.key], phase, reply,
                                                     sampling, max_prompt_tokens, records)
                if next_phase:
                    waiting[reply.key] = next_phase
                if request:
                    requests.append(request)
            if requests:
                engine.add_requests(requests)
                in_flight += len(requests)
            if not engine.has_unfinished(local_work=bool(waiting)):
                break
            for finished in engine.step():
                in_flight -= 1
                key = finished.key.rpartition("/t")[0]
                waiting[key] = self._on_turn(episodes[key], finished)
        return episodes_generation(list(episodes.values()), len(records), started)

    def close(self) -> None:
        self.sandbox.shutdown()

    # -- one event of one episode ------------------------------------------------------------
    def _on_reply(self, episode: Episode, phase: str, reply: Reply, sampling: SamplingConfig,
                  max_prompt_tokens: int, records: list) -> tuple[str | None, object]:
        """An environment answered: (the phase the episode waits in next, a request to add)."""
        if phase == "reset":
            record_prompt = records[episode.prompt_index].prompt
            messages = _messages(reply.value if reply.ok else None, record_prompt)
            prompt_ids = self.chat.prompt_ids(messages)
            if len(prompt_ids) > min(max_prompt_tokens, self.config.max_episode_tokens - 1):
                raise ValueError(f"prompt {episode.prompt_index} opens its episode with "
                                 f"{len(prompt_ids)} tokens, more than data.max_prompt_tokens="
                                 f"{max_prompt_tokens} allows")
            episode.start(messages, prompt_ids)
            if not reply.ok:  # the environment raised or hung: the episode ends unplayed
                episode.flags["environment_failures"] += 1
                episode.finish_reason = "length"
                self.sandbox.close(episode.key)
                return None, None
            return None, self._turn_request(episode, sampling)
        if phase == "step":
            return self._on_observation(episode, reply, sampling)
        if reply.ok and reply.value is not None:  # the reward
            episode.reward = float(reply.value)
        self.sandbox.close(episode.key)
        return None, None

    def _on_turn(self, episode: Episode, finished) -> str:
        """The engine finished a model turn: hand it to the environment, or end the episode."""
        episode.add_turn(finished.token_ids, finished.logprobs, finished.versions)
        episode.count_prefill(finished)
        episode.add_routes(finished.routed_experts)
        if finished.finish_reason == "length":
            return self._end(episode, "length")
        if episode.last_turn[-1:] != [self.chat.end_of_turn_id]:
            return self._end(episode, "stop")  # another stop token: the model ended the episode
        message = self.chat.assistant_message(episode.last_turn)
        episode.messages.append(message)
        self.sandbox.send(episode.key, ("step", message["content"]))
        return "step"

    def _on_observation(self, episode: Episode, reply: Reply, sampling: SamplingConfig
                        ) -> tuple[str | None, object]:
        if not reply.ok:
            episode.flags["tool_timeouts" if reply.error.startswith("timeout")
                          else "environment_failures"] += 1
            return self._end(episode, "length"), None
        observation, counts = reply.value
        episode.counts.update(counts)
        if observation is None:
            return self._end(episode, "stop"), None
        if episode.turns >= self.config.max_turns:
            return self._end(episode, "length"), None
        messages = [self._truncated(episode, message) for message in _messages(observation)]
        history = episode.messages[:-1]
        try:
            ids = self.chat.observation_ids(history, episode.last_turn, messages, episode.turns)
        except TemplateMismatch:  # what the model wrote, the template renders otherwise
            episode.flags["template_mismatches"] += 1
            return self._end(episode, "length"), None
        if len(episode.token_ids) + len(ids) >= self.config.max_episode_tokens:
            return self._end(episode, "length"), None
        episode.add_observation(messages, ids)
        return None, self._turn_request(episode, sampling)

    def _end(self, episode: Episode, finish_reason: str) -> str:
        """Ask the environment for its reward; the episode is over once it answers."""
        episode.finish_reason = finish_reason
        self.sandbox.send(episode.key, ("reward", episode.messages))
        return "reward"

    def _turn_request(self, episode: Episode, sampling: SamplingConfig) -> SampleRequest:
        room = self.config.max_episode_tokens - len(episode.token_ids)
        turn_sampling = dataclasses.replace(
            sampling, n=1, max_new_tokens=min(sampling.max_new_tokens, room),
            seed=sampling.seed + episode.turns * TURN_SEED_STRIDE,
            stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids,
                                                self.chat.end_of_turn_id))))
        return SampleRequest(f"{episode.key}/t{episode.turns}", list(episode.token_ids),
                             turn_sampling, episode.prompt_index, episode.sample_index)

    def _truncated(self, episode: Episode, message: dict) -> dict:
        message, cut = self.chat.truncate(message, self.config.max_observation_tokens)
        episode.flags["observations_truncated"] += cut
        return message

    def _check_environment(self, record) -> None:
        """Make the environment in a session and reset it on `record` (when given); ValueError
        naming the row, the error and the sandbox setting that would allow it."""
        self.sandbox.open("check", SESSION, self.spec)
        if record is not None:
            self.sandbox.send("check", ("reset", episode_row(record)))
        replies = []
        while len(replies) < 1 + (record is not None) and not any(r.ended for r in replies):
            replies += self.sandbox.poll(self.config.sandbox.timeout_seconds)
        self.sandbox.close("check")
        failed = next((reply for reply in replies if not reply.ok), None)
        if failed is not None:
            where = "made in its sandbox" if failed is replies[0] else \
                f"reset on row {record.index} (data_source {record.data_source!r})"
            hint = setting_hint(failed.error, "rollout.multi_turn.sandbox")
            raise ValueError(f"rollout.multi_turn.environment={self.spec.environment!r} could "
                             f"not be {where}: {failed.error}" + (f" ({hint})" if hint else ""))


def episode_row(record) -> dict:
    """What the environment's reset sees of a PromptRecord."""
    return {"prompt": record.prompt, "data_source": record.data_source,
            "ground_truth": record.ground_truth, "extra_info": dict(record.extra_info)}


def _messages(observation, default=None) -> list[dict]:
    """reset/step output as messages (text: one user message; None: `default`)."""
    observation = default if observation is None else observation
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return [dict(message) for message in observation]


def episodes_generation(episodes: list[Episode], prompts: int, started: float) -> Generation:
    """The episodes as completions: each prompt's shared opening (the tokens every one of its
    episodes began with) is its prompt; the rest of an opening counts as observation."""
    openings = [[] for _ in range(prompts)]
    for prompt_index in range(prompts):
        starts = [e.token_ids[:e.prompt_length] for e in episodes
                  if e.prompt_index == prompt_index]
        openings[prompt_index] = list(os.path.commonprefix(starts)) if starts else []
    completions = []
    for episode in episodes:
        shared = len(openings[episode.prompt_index])
        completions.append(Completion(
            episode.prompt_index, episode.sample_index, episode.token_ids[shared:],
            episode.logprobs[shared:], episode.finish_reason,
            sampled=tuple(episode.sampled[shared:]), response_text=episode.final_text(),
            episode={**episode.summary(), "reward": episode.reward},
            routed_experts=episode.routes, versions=episode.response_versions(shared),
            prompt_tokens=episode.prompt_tokens, cached_tokens=episode.cached_tokens))
    return Generation.finished(completions, openings, 0, started)
