"""The rollout ranks of split placement: generate continuously, within the staleness bound.

    loop:
        send each complete, scored share the trainers have asked for
        take the trainers' control messages (new weights, fetch, evaluate, stop) until none
            is left, sending what they ask for; with nothing to generate, wait for the first
        open every batch the bound allows: batch i starts with weights of version >= i - k
        a few engine steps; score each group of responses as it completes

Each engine instance (rollout.rollout_tp consecutive rollout ranks: the plan's rollout layout
says which, and the engine pools its prompts by instance) generates its contiguous slice of
every batch's prompts (and every instance-th validation prompt) through the engine's streaming
interface, so new weights land between two engine steps. Responses in flight at an
update continue with the new weights or start again (rollout.partial_rollout); either way no
response trains more than max_staleness versions after the version that started it, because a
batch is only opened once the weights are recent enough, and the rollout ranks pause instead.
A batch of multi-turn episodes runs to its end when it opens, but new weights still land while
it runs (updating_engine.py): the episodes take the trainers' messages between engine steps.
Evaluations' episodes run whole with the weights they were asked for.

Only rollout rank 0 reads control messages (from the job's store); it passes them to the other
rollout ranks at every check, so every rank adds, aborts and receives the same things at the
same engine step. An instance's first rank scores (in a thread, beside generation) and sends.
"""

from __future__ import annotations

import contextlib
import datetime

import torch.distributed as dist

from mcore_rl.agents.instance import run_on_instance
from mcore_rl.config import JobConfig
from mcore_rl.observability.step_metrics import PhaseTimer
from mcore_rl.observability.timeline import ROLLOUT_TIMELINE_FILE, Timeline
from mcore_rl.runtime import initialize, read_launch_env, shutdown
from mcore_rl.runtime.messages import ControlBoard, Outbox
from mcore_rl.runtime.preemption import PreemptionFlag

from ..build import (build_episode_runner, build_vllm_engine, settled_config,
                     start_rule_reward, training_layout, weight_plan)
from ..data import load_training_data
from ..rollout_scheduler import evaluation_sampling, training_sampling
from ..weight_sync import SyncFigures
from .book import InstanceBook
from .group_scorer import GroupScorer
from .protocol import Evaluate, Fetch, Share, Start, Stop, Weights
from .updating_engine import UpdatingEngine


class RolloutWorker:
    """One rollout rank's part of a split-placement RL job (every rollout rank builds one)."""

    def __init__(self, config: JobConfig, reward_fn=None):
        launch = read_launch_env()
        config = self.config = settled_config(config, launch)
        PreemptionFlag(config.trainer.save_signal)  # ignored here: the trainers save and stop
        runtime = initialize(config, launch)
        self.split = runtime.split
        self.data = load_training_data(config, dp_rank=0, dp_size=1)
        plan = weight_plan(config, training_layout(config, launch.world_size))
        layout, rank = plan.rollout, self.split.job.rank
        self.instance, self.instances = layout.instance_of(rank), layout.instances
        self.is_leader = layout.is_leader(rank)
        """The instance's first rank: it scores and sends the instance's shares."""
        reward_start = start_rule_reward(config, self.data, reward_fn,
                                         is_scorer=self.is_leader)
        self.engine, self.weight_sync = build_vllm_engine(config, config.sequence_length(),
                                                          plan, self.split.bridge)
        rule_reward = reward_start.result()
        self.scorer = GroupScorer(rule_reward) if self.is_leader else None
        self.episodes = build_episode_runner(config, self.data)
        """Multi-turn jobs: the runner of this rank's episodes (None: one response each)."""
        self.control = ControlBoard(self.split.store, datetime.timedelta(
            minutes=config.runtime.collective_timeout_minutes))
        self.outbox = Outbox(self.split.messages)
        self.book = InstanceBook()
        # Exclusive: a rank does one thing at a time, and the reshard or scoring that runs
        # between the engine steps of an episode batch pauses its generate interval.
        self.timer = PhaseTimer(exclusive=True)
        self.timeline = Timeline(config.runtime.output_dir, ROLLOUT_TIMELINE_FILE,
                                 first_rank=launch.world_size - dist.get_world_size(),
                                 group=self.split.side_group)
        self.version: int | None = None
        """The policy version of the engine's weights (None before the first)."""
        self.next_batch = 0
        """The step whose batch opens next."""
        self.wanted: set[tuple[str, int]] = set()
        """Shares the trainers have asked for and not received yet."""
        self.deferred: list = []
        """Control messages taken while episodes ran and handled once they end."""
        self.syncs: list[SyncFigures] = []
        """Weight syncs since this instance's last share: each figure the largest over the
        rollout ranks."""

    def run(self) -> int:
        """Serve the trainers until they say stop; returns the exit status they give. An error
        is left for the trainers (they stop waiting and fail with it) and raised."""
        try:
            return self._serve()
        except BaseException as error:
            self.split.failure.report(f"rollout rank {self.split.job.rank} failed: "
                                      f"{type(error).__name__}: {error}")
            raise

    def _serve(self) -> int:
        busy = False
        while True:
            self._send_complete_shares(wait=not busy)  # nothing is owed while we wait below
            messages = self.deferred + self._control(wait=not busy and not self.deferred)
            self.deferred = []
            while messages:  # what came in while handling (a fetch right after new weights)
                for message in messages:
                    if isinstance(message, Stop):
                        self.engine.abort(self.book.keys())
                        return message.exit_code
                    self._handle(message)
                self._send_complete_shares(wait=False)  # a batch asked for just now, if scored
                messages = self._control(wait=False)
            self._open_batches()
            busy = self._generate()

    def close(self) -> None:
        self.timeline.record(self.version or 0, self.timer.hand_over())
        self.timeline.close()
        if self.scorer is not None:
            self.scorer.close()
        if self.episodes is not None:
            self.episodes.close()
        self.engine.close()
        shutdown()

    # -- control ---------------------------------------------------------------------------------
    def _control(self, wait: bool) -> list:
        """The trainers' new control messages, the same on every rollout rank (collective);
        with `wait`, at least one (there is nothing else to do)."""
        with self.timer("wait") if wait else contextlib.nullcontext():
            box = [self._read_control(wait) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.split.side_group)
        return box[0]

    def _read_control(self, wait: bool) -> list:
        messages = []
        message = self.control.wait() if wait else self.control.poll()
        while message is not None:
            messages.append(message)
            message = self.control.poll()
        return messages

    def _handle(self, message) -> None:
        if isinstance(message, Start):
            self.data.sampler.load_state_dict(message.sampler)
            self.next_batch = message.version
        elif isinstance(message, Weights):
            self._receive_weights(message.version)
        elif isinstance(message, Fetch):
            self.wanted.add(("batch", message.batch))
        elif isinstance(message, Evaluate):
            self._open_evaluation(message.version)

    def _receive_weights(self, version: int) -> None:
        """Load the weights of `version`. The timeline records the intervals of the version
        held so far as its step; an episode batch still generating (weights taken between its
        engine steps) is paused by the reshard: its part so far goes to that step, the rest to
        the new version's when it ends."""
        with self.timer("reshard"):
            if self.version is not None:
                self.timeline.record(self.version, self.timer.hand_over())
            figures = self.weight_sync.sync({})
        largest = figures.as_tensor()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.split.side_group)
        self.syncs.append(SyncFigures.from_tensor(largest))
        restart = self.config.rollout.partial_rollout == "abort"
        aborted, restarted = self.book.weights_changed(version, self.engine.generated_lengths(),
                                                       restart)
        self.engine.abort(aborted)
        self.engine.add_requests(restarted)
        self.version = version

    # -- generation ------------------------------------------------------------------------------
    def _open_batches(self) -> None:
        """Open every batch whose responses may start with the current weights (up to the
        last step's; a batch of multi-turn episodes runs before the next opens)."""
        if self.version is None:
            return
        last = min(self.version + self.config.rollout.max_staleness,
                   self.config.trainer.total_steps - 1)
        while self.next_batch <= last:
            step = self.next_batch
            records, token_ids = self.data.next_batch()
            share = len(records) // self.instances
            mine = slice(self.instance * share, (self.instance + 1) * share)
            sampling = training_sampling(self.config, self.data.stop_token_ids, step)
            if self.episodes is None:
                self.engine.add_requests(self.book.open("batch", step, records[mine],
                                                        token_ids[mine], sampling,
                                                        self.version))
            else:
                self._run_episodes("batch", step, records[mine], sampling)
            self.next_batch += 1
            if self.episodes is not None:
                return  # a batch of episodes has run: send it before opening the next

    def _open_evaluation(self, version: int) -> None:
        if version != self.version:
            raise RuntimeError(f"asked to evaluate version {version} while holding version "
                               f"{self.version}")
        picked = range(self.instance, len(self.data.validation), self.instances)
        sampling = evaluation_sampling(self.config, self.data.stop_token_ids)
        records = [self.data.validation[i] for i in picked]
        if self.episodes is None:
            self.engine.add_requests(self.book.open(
                "eval", version, records, [self.data.validation_token_ids[i] for i in picked],
                sampling, version))
        else:
            self._run_episodes("eval", version, records, sampling)
        self.wanted.add(("eval", version))

    def _run_episodes(self, kind: str, index: int, records: list, sampling) -> None:
        """A share of multi-turn episodes, run to their end (collective over the rollout
        ranks, which all open the same shares at once), then scored group by group. A
        batch's episodes take new weights while they run (updating_engine.py)."""
        version, updating = self.version, None
        if kind == "batch":
            updating = UpdatingEngine(self.engine, version, self._weights_between_steps,
                                      self.config.rollout.update_check_steps,
                                      restart=self.config.rollout.partial_rollout == "abort")
        with self.timer("generate"):
            generation = run_on_instance(self.episodes, updating or self.engine, records,
                                         sampling, self.config.data.max_prompt_tokens)
        share = self.book.add_generated(kind, index, records, generation, version)
        share.restarts = updating.restarts if updating else 0
        if self.scorer is not None:
            for position in range(len(share.prompts)):
                self.scorer.submit(share, position)

    def _weights_between_steps(self) -> int | None:
        """While episodes run: take the trainers' messages (collective over the rollout
        ranks), loading new weights and noting asks for shares at once, keeping the rest for
        later, and send what is ready. Returns the version of the new weights, if any."""
        version = None
        for message in self._control(wait=False):
            if isinstance(message, Weights):
                self._receive_weights(message.version)
                version = message.version
            elif isinstance(message, Fetch):
                self._handle(message)
            else:
                self.deferred.append(message)
        self._send_complete_shares(wait=False)
        return version

    def _generate(self) -> bool:
        """Up to rollout.update_check_steps engine steps (collective over the rollout ranks);
        complete groups go to scoring. Returns whether responses are still in flight."""
        for _ in range(self.config.rollout.update_check_steps):
            if not self.engine.has_unfinished():
                return False
            with self.timer("generate"):
                finished = self.engine.step()
            for sample in finished:
                group = self.book.finish(sample)
                if group is not None and self.scorer is not None:
                    key, position = group
                    self.scorer.submit(self.book.shares[key], position)
        return True

    def _send_complete_shares(self, wait: bool) -> None:
        """Send every complete share the trainers asked for (its scores awaited only with
        `wait`: when there is nothing to generate meanwhile)."""
        for share in self.book.complete_shares():
            key = (share.kind, share.index)
            if key not in self.wanted:
                continue
            if self.scorer is not None:
                if not (wait or self.scorer.ready(share)):
                    continue
                with self.timer("reward"):
                    results = self.scorer.results(share)
                self.outbox.send(Share(share.kind, share.index, share.records, share.prompts,
                                       share.completions(), results, share.restarts,
                                       self.syncs), destination=0)
            self.syncs = []
            self.wanted.discard(key)
            self.book.close(share)


def run_rollout_ranks(config: JobConfig, reward_fn=None) -> int:
    """A rollout rank's whole job; returns the exit status the trainers asked for."""
    worker = RolloutWorker(config, reward_fn)
    exit_code = worker.run()
    worker.close()
    return exit_code
