"""The agent runner: a rank's episodes driven by the user's own agent, written against the
OpenAI API, instead of an Environment.

Many agents exist already (the OpenAI SDK, openai-agents, LangChain); rewriting them as
Environments would change what is trained. Here the user's `async def run(row, base_url) ->
reward` drives each episode through the rank's ChatEndpoint while this thread keeps the engine
loop exactly as the EpisodeRunner does (one collective has_unfinished per iteration, a step when
it says so), so both runners serve the rollout scheduler alike. The agents run in an asyncio
loop of their own thread: an agent is the user's code, not the model's, so it runs in the rank's
process with its own tools (no sandbox).

Each completion's prompt ids, sampled ids and log-probs are recorded; an episode's trajectory
is assembled from them, the sampled spans masked 1 and everything else (tool results, the
template's text) 0, as in the Environment path: the same conversation gives the same tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import queue
import secrets
import threading
import time

from mcore_rl.config.agents import MultiTurnConfig
from mcore_rl.config.rollout import SamplingConfig
from mcore_rl.rollout import Generation, RolloutEngine, SampleRequest

from .chat import ChatFormat
from .episode import Episode
from .openai_endpoint import AgentEpisode, ChatEndpoint, Turn
from .runner import IDLE_POLL_SECONDS, TURN_SEED_STRIDE, episode_row, episodes_generation
from .tool_calls import resolve

logger = logging.getLogger("mcore_rl.agents")


@dataclasses.dataclass(frozen=True)
class AgentResult:
    """What an agent's run returned for an episode."""

    episode_id: str
    reward: float | None
    error: str | None = None
    """The exception that ended the run (its reward is then 0)."""


class AgentRunner:
    """Runs a rank's agent episodes (one per prompt and sample) on its engine."""

    def __init__(self, config: MultiTurnConfig, agent, tokenizer):
        self.config = config
        self.agent = agent
        """The user's `async def run(row, base_url) -> reward`."""
        self.events: queue.Queue = queue.Queue()
        """Turns to sample and finished runs (AgentResult)."""
        self.endpoint = ChatEndpoint(tokenizer, config, self.events.put)
        self.end_of_turn_id = self.endpoint.chat(None).end_of_turn_id
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agents",
                                        daemon=True)
        self._thread.start()
        self._calls = 0

    @classmethod
    def build(cls, config: MultiTurnConfig, tokenizer) -> "AgentRunner":
        """A runner for `config.agent`, after checking that it names an async function, that
        the tokenizer has a chat template and, with template_mismatch=error, that the template
        keeps a probe conversation."""
        agent = resolve(config.agent, "rollout.multi_turn.agent")
        if not inspect.iscoroutinefunction(agent):
            raise ValueError(f"rollout.multi_turn.agent={config.agent!r} must be an async "
                             "function run(row, base_url) -> reward")
        if config.template_mismatch == "error":
            ChatFormat(tokenizer, None, dict(config.template_kwargs)).check_prefix_preserving()
        return cls(config, agent, tokenizer)

    def run(self, engine: RolloutEngine, records: list, sampling: SamplingConfig,
            max_prompt_tokens: int) -> Generation:
        """`sampling.n` agent episodes for each record (PromptRecord), until every run has
        returned. max_prompt_tokens is not applied: the agent writes its prompts, and
        rollout.multi_turn.max_episode_tokens bounds them."""
        started = time.perf_counter()
        self._calls += 1
        # Unguessable ids: the endpoint listens on loopback, where any local user can connect.
        episodes = {f"{secrets.token_urlsafe(16)}-p{index}-s{sample}":
                    AgentEpisode(f"e{self._calls}/p{index}/s{sample}", index, sample)
                    for index in range(len(records)) for sample in range(sampling.n)}
        self.endpoint.episodes = episodes
        for episode_id, episode in episodes.items():
            asyncio.run_coroutine_threadsafe(
                self._episode(episode_id, episode_row(records[episode.prompt_index])),
                self._loop)
        try:
            results = self._drive(engine, sampling, len(episodes))
        finally:
            self.endpoint.episodes = {}
        assembled = [self._assembled(episode, results[episode_id],
                                     records[episode.prompt_index])
                     for episode_id, episode in episodes.items()]
        return episodes_generation(assembled, len(records), started)

    def close(self) -> None:
        """Stop the endpoint and the agents' event loop."""
        self.endpoint.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # -- the engine loop ---------------------------------------------------------------------
    def _drive(self, engine: RolloutEngine, sampling: SamplingConfig, episodes: int
               ) -> dict[str, AgentResult]:
        """Sample the agents' requests until every run has returned: one has_unfinished and,
        when true, one step per iteration on every rank (the engine's data-parallel instances
        agree on them, so all ranks stop together)."""
        results: dict[str, AgentResult] = {}
        sampling_turns: dict[str, Turn] = {}
        while True:
            requests = []
            for event in self._take_events(wait=not sampling_turns):
                if isinstance(event, AgentResult):
                    results[event.episode_id] = event
                    continue
                request = self._turn_request(event, sampling)
                sampling_turns[request.key] = event
                requests.append(request)
            if requests:
                engine.add_requests(requests)
            if not engine.has_unfinished(local_work=len(results) < episodes):
                return results
            for finished in engine.step():
                turn = sampling_turns.pop(finished.key)
                turn.episode.prompt_tokens += finished.prompt_tokens
                turn.episode.cached_tokens += finished.cached_tokens
                turn.routes, turn.versions = finished.routed_experts, finished.versions
                self.endpoint.finish(turn, finished.token_ids, finished.logprobs,
                                     finished.finish_reason)

    def _take_events(self, wait: bool) -> list:
        """The events queued so far (waiting a moment for the first when `wait`)."""
        events = []
        try:
            events.append(self.events.get(timeout=IDLE_POLL_SECONDS) if wait
                          else self.events.get_nowait())
            while True:
                events.append(self.events.get_nowait())
        except queue.Empty:
            return events

    def _turn_request(self, turn: Turn, sampling: SamplingConfig) -> SampleRequest:
        """The engine request of an agent's completion: the job's sampling (the request's
        temperature and top_p do not apply: the trainer's log-probs assume the job's), its
        max_tokens as a further limit, and the seed of the episode's turn, as the
        EpisodeRunner draws it."""
        episode = turn.episode
        turn_sampling = dataclasses.replace(
            sampling, n=1, max_new_tokens=min(sampling.max_new_tokens, turn.max_new_tokens),
            seed=sampling.seed + turn.turn * TURN_SEED_STRIDE,
            stop_token_ids=tuple(dict.fromkeys((*sampling.stop_token_ids,
                                                self.end_of_turn_id))))
        return SampleRequest(f"{episode.key}/t{turn.turn}", list(turn.prompt_ids),
                             turn_sampling, episode.prompt_index, episode.sample_index)

    async def _episode(self, episode_id: str, row: dict) -> None:
        """One run of the agent; its reward (or failure) goes to the engine's thread."""
        try:
            reward = await asyncio.wait_for(self.agent(row, self.endpoint.base_url(episode_id)),
                                            self.config.agent_timeout_seconds)
            result = AgentResult(episode_id, None if reward is None else float(reward))
        except Exception as error:  # the user's code: counted, the job goes on
            logger.error("agent run of episode %s failed (reward 0): %r", episode_id, error)
            result = AgentResult(episode_id, 0.0, f"{type(error).__name__}: {error}")
        self.events.put(result)

    # -- the trajectory ------------------------------------------------------------------------
    def _assembled(self, agent_episode: AgentEpisode, result: AgentResult, record) -> Episode:
        """The episode's trajectory from its completions (`longest_chain`), with its counts;
        its messages are the conversation as the template rendered it (the model's turns as
        their sampled text, as in the Environment path)."""
        episode = Episode(agent_episode.key, agent_episode.prompt_index,
                          agent_episode.sample_index, episode_row(record))
        chain = longest_chain(agent_episode.completions)
        if chain:
            _add_chain(episode, chain, self.endpoint.chat(None))
        else:  # the agent never got an answer: its prompt alone
            messages = [{"role": "user", "content": record.prompt}] \
                if isinstance(record.prompt, str) else list(record.prompt)
            episode.start(messages, self.endpoint.chat(None).prompt_ids(messages))
        truncated = agent_episode.truncated or bool(chain) and chain[-1].finish_reason == "length"
        episode.finish_reason = "length" if truncated else "stop"
        counts = agent_episode.counts
        episode.counts.update(tool_calls=counts["tool_calls"],
                              parse_failures=counts["parse_failures"])
        episode.flags.update(history_rewrites=counts["history_rewrites"],
                             template_mismatches=counts["template_mismatches"],
                             agent_failures=int(result.error is not None))
        episode.reward = result.reward
        episode.count_prefill(agent_episode)
        return episode


def _add_chain(episode: Episode, chain: list[Turn], chat: ChatFormat) -> None:
    """The chain's tokens into `episode`: the first prompt, then each completion's sampled ids
    (mask 1) and the ids the next prompt adds (mask 0)."""
    episode.start(chain[0].history, chain[0].prompt_ids)
    for turn, following in zip(chain, chain[1:] + [None]):
        episode.add_turn(turn.sampled_ids, turn.logprobs, turn.versions)
        episode.add_routes(turn.routes)
        if following is not None:
            episode.add_observation([], following.prompt_ids[_covered(turn):])
    episode.messages = chain[-1].history + [chat.assistant_message(chain[-1].sampled_ids)]


def longest_chain(completions: list[Turn]) -> list[Turn]:
    """The longest run of completions, in request order and ending with the last one, in which
    each prompt starts with the previous completion's prompt and sampled ids: the whole
    episode when the client sent back every answer as it got it. A client that rewrote its
    history (edited an earlier message, dropped a turn) breaks the chain there: the completions
    left out are not trained (their tokens are observations of the last prompt, if anywhere),
    and the endpoint counted the rewrite (episode/history_rewrites)."""
    ordered = sorted(completions, key=lambda turn: turn.turn)
    chains: list[list[Turn]] = []
    """chains[i]: the longest chain ending with ordered[i]."""
    for index, turn in enumerate(ordered):
        before = [chains[j] for j in range(index) if _extends(turn, ordered[j])]
        chains.append(max(before, key=len, default=[]) + [turn])
    return chains[-1] if chains else []


def _covered(turn: Turn) -> int:
    """Tokens of `turn`'s prompt and answer."""
    return len(turn.prompt_ids) + len(turn.sampled_ids)


def _extends(turn: Turn, earlier: Turn) -> bool:
    """Whether `turn`'s prompt starts with `earlier`'s prompt and sampled ids."""
    return turn.prompt_ids[:_covered(earlier)] == earlier.prompt_ids + earlier.sampled_ids
