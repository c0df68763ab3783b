"""Settings of the RL job's rollout: how responses are generated each step, and how the
trainer treats samples the engine made (off-policy correction, routing replay, staleness).

The RL job's other sections live beside it: the roles (actor, critic, reference) in roles.py,
the loop (trainer, reward-hacking warning, model selection) in trainer.py. Their names are
re-exported here, where they were first written, so `mcore_rl.config.rl` still offers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .agents import MultiTurnConfig
from .rollout import SamplingConfig

ENGINES = ("vllm", "megatron")
OVERLONG_RESPONSES = ("keep", "filter", "penalty")
IMPORTANCE_LEVELS = ("token", "sequence")
IMPORTANCE_MODES = ("truncate", "mask")
OLD_LOGPROB_SOURCES = ("auto", "update", "trainer", "engine")
ROUTING_REPLAYS = ("none", "r2", "r3")
PARTIAL_ROLLOUTS = ("continue", "abort")


@dataclass(frozen=True)
class RolloutConfig:
    """How responses are generated each step."""

    engine: str = "vllm"
    """vllm (weights pushed by the resharder every step) or megatron (Megatron-Core inference
    on the actor's own parameters: no copy, no sync)."""

    rollout_tp: int = 1
    """vLLM tensor-parallel size (consecutive ranks form an engine); must divide the world."""

    expert_parallel: bool = False
    """vLLM expert parallelism for a Mixture-of-Experts model (vLLM's enable_expert_parallel):
    over all the engine's ranks (data x tensor-parallel), each serves num_experts / ranks
    experts whole instead of a slice of every expert, and the weight sync sends each rank
    only the experts it serves. The experts must divide over the engine's ranks. Needed for
    more engine ranks than rollout_tp (several data-parallel instances)."""

    prompts_per_step: int = 8
    """Prompts per RL step over all data-parallel ranks; each gets `sampling.n` responses."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling for training rollouts (n is the GRPO group size). Its seed is derived from the
    run seed and the step, so a resumed run samples what an uninterrupted one would."""

    eval_sampling: SamplingConfig = field(
        default_factory=lambda: SamplingConfig(n=1, temperature=0.0))
    """Sampling for evaluation on the validation prompts (greedy by default)."""

    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn episodes with an environment and tools (off by default); sampling then
    applies to each model turn (max_new_tokens: per turn)."""

    gpu_memory_utilization: float = 0.4
    """vLLM's share of GPU memory for its weights and KV cache while it generates. The engine
    starts before the training roles and sleeps between generate phases, so this share must be
    free at start-up (checked) and is given back to training after each generate; training
    state that does not fit beside it during generation needs actor/critic.offload."""

    sleep_level: int = 2
    """vLLM's sleep level between generate phases (GPUs): 2 frees weights and KV cache without
    keeping a host copy (the weights are sent again before the next generate anyway); 1 keeps
    a copy of the weights in host memory. CPUs (no sleep mode): 2 drops the layers' packed
    weights, which the next sync packs again; 1 keeps them."""

    cuda_graphs: bool = True
    """Capture CUDA graphs for vLLM's decoding (faster decoding, slower start-up); false runs
    eagerly. CPU engines always run eagerly."""

    prefix_caching: bool = True
    """vLLM reuses the keys and values of prompt prefixes it has computed, in whole KV blocks
    (16 tokens on GPUs, 32 on CPUs): the n samples of a prompt prefill it once, and each turn
    of a multi-turn episode prefills only what follows the earlier turns. Every weight update
    forgets the cache, and responses still in flight (split placement's partial rollouts)
    recompute their tokens so far with the new weights. Logged as
    rollout/prefix_cache_hit_rate. Off where the engine reports each token's experts
    (routing_replay=r3 or router_agreement, said at start): a cached prefix's tokens would
    have no routes. false: every
    request prefills its whole prompt, and requests in flight at an update keep the keys and
    values they have."""

    sync_bucket_mb: int = 512
    """Communication buffers per rank of one weight sync (two halves in flight): a sync's
    peak extra memory is at most this plus one rollout shard of the largest parameter."""

    delta_sync: bool = False
    """After the first sync, send each rollout rank only the elements of its shard whose bit
    pattern (in the engine's dtype) changed since the last sync it received: as runs or a
    bitmask with the values, whichever is smaller per message (a message that changed more
    goes whole). The engine gets the same shards bit for bit. At RL learning rates most bf16
    weights keep their value from one step to the next (docs/resharding.md has the measured
    share); in fp32 nearly all change. Costs memory on the sync's device: every rank keeps a
    copy of what it sent and received in one full sync, and one host synchronisation per
    bucket (the message sizes)."""

    delta_sync_anchor_every: int = 100
    """With delta_sync: every this many syncs one is sent whole (the first always is, also
    after a restart or resume)."""

    delta_sync_verify: bool = False
    """With delta_sync: the trainer sends a checksum of every parameter run of every message
    and the rollout ranks check their rebuilt copies against it; a mismatch is logged as an
    error naming the tensor, and that sync is then resent whole."""

    overlong: str = "keep"
    """Responses cut at max_new_tokens: keep (as they are), filter (no loss on them) or penalty
    (DAPO's soft overlong penalty over the last `overlong_buffer` tokens)."""

    overlong_buffer: int = 16
    """Tokens before max_new_tokens where the soft penalty ramps from 0 to -1."""

    async_rollout: bool = False
    """One-step off-policy: each step trains on the batch generated during the previous step
    and generates the next one before updating, so generation never waits for the update (on
    colocated devices the two still run one after the other; disaggregated placement would
    overlap them). Pair it with importance_cap."""

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop prompts whose responses all scored the same (no GRPO
    signal) and generate further rounds from the dataset until the batch is full again."""

    max_sampling_rounds: int = 3
    """Most generate rounds per step with dynamic sampling."""

    importance_cap: float = 0.0
    """Importance sampling against the engine's (behaviour) log-probs, correcting for the
    engine/trainer mismatch and for stale rollouts (0: off). The engine's log-probs must be
    under the whole tempered distribution, as the trainer's are (`engine_logprobs_whole`: with
    top_p < 1 or top_k, sample at temperature 1). With importance_mode=truncate each
    token's policy loss is weighted by min(ratio, cap), ratio = exp(logp_old - logp_engine);
    with importance_mode=mask, `cap` is the upper end of the kept range."""

    importance_floor: float = 0.0
    """importance_mode=mask: the lower end of the kept ratio range (0: no lower end)."""

    importance_level: str = "token"
    """token: one ratio per token; sequence: one per response, exp of the summed per-token log
    ratios, applied to all its tokens."""

    importance_mode: str = "truncate"
    """truncate: weight by min(ratio, cap) (Yao et al. 2025's truncated IS); mask: drop from the
    loss the tokens (importance_level=token) or whole responses (sequence) whose ratio leaves
    [importance_floor, importance_cap] and weight the rest by their ratio (masked IS)."""

    old_logprobs: str = "auto"
    """Where the PPO ratio's old log-probs come from. update: the update's own forward pass,
    detached (the ratio is exactly 1 and its gradient the policy gradient, as TRL with
    num_iterations=1 and verl's on-policy path), saving a forward pass; only where a batch
    gets one optimizer step over all its rows (trainer.ppo_epochs=1, trainer.mini_batches=1)
    and nothing reads them before the update (algorithm.use_kl_in_reward, a teacher, r2
    routing replay, a Mixture-of-Experts model's routing metrics do): the step's
    engine/trainer mismatch, importance-weight and KL-to-reference metrics then come from
    that pass. trainer: a forward pass of the actor over the batch before the update (exact
    PPO, any number of epochs and mini-batches). auto (default): update where it applies,
    else trainer (`JobConfig.old_logprob_source`; said at start). engine: the engine's
    sampling log-probs (verl's bypass mode); only for batches used for one on-policy optimizer
    step (trainer.ppo_epochs=1, trainer.mini_batches=1, async_rollout=false,
    max_staleness=0, importance_cap=0) whose engine log-probs are under the whole tempered
    distribution (`engine_logprobs_whole`: temperature 1, or top_p=1 and top_k=-1), where
    they differ from the trainer's by the engine/trainer mismatch alone (a bf16 engine's are
    inexact: update is exact at the same cost)."""

    routing_replay: str = "none"
    """Mixture-of-Experts models: which expert routes the trainer's forward passes of a batch
    use. none: the routers' own. r3: the engine's, for every token it computed (rollout routing
    replay, arXiv 2510.11370), in the old-log-prob, reference and update passes. r2: those the
    actor took in the old-log-prob pass, replayed by the reference and the updates (needs
    old_logprobs=trainer). r3 has the vLLM engine report routes (see router_agreement for
    what that costs); the step then logs moe/routes_replayed (the share of the fed tokens'
    routes the engine gave: a row without routes, e.g. an episode ended by a failed reset,
    keeps its routers' own choices and counts against it) and moe/router_agreement: the share
    of (token, layer, k) routes the trainer's routers choose themselves (also while replaying)
    that equal the engine's. Multi-turn episodes replay each token's route from the first
    engine request that fed it (a model turn's from the request that sampled it, an
    observation's from the next turn's prefill)."""

    router_agreement: bool = False
    """Mixture-of-Experts models without routing replay: the vLLM engine still reports the
    experts each token went to, so that the step logs moe/router_agreement (how often the
    trainer's routers choose the engine's experts: the drift r3 would remove). It costs what
    r3's capture costs: decoding without CUDA graphs, no async scheduling, no prefix
    caching (said at start). Off: the engine reports no routes and keeps those settings."""

    max_staleness: int = 0
    """Split placement: a sample trains at most this many policy versions after the version
    whose weights started it (the batch of step i is started with weights of version >= i - k;
    the rollout ranks pause rather than run further ahead). 0 is synchronous and on-policy: the
    rollout ranks wait for each new version. k >= 1 overlaps generating the next batches with
    training on the current one; pair it with importance_cap (off-policy correction)."""

    partial_rollout: str = "continue"
    """Split placement, what a weight update does to responses still being generated: continue
    (they keep their tokens and go on with the new weights; every token's behaviour log-prob
    and the version that sampled it are recorded; with prefix_caching the keys and values of
    their tokens so far are computed again with the new weights) or abort (they are dropped
    and started again with the new weights). Multi-turn episodes take updates while they run,
    and this applies to the turn in flight (abort asks it again from its start; the
    episode's earlier turns stay)."""

    update_check_steps: int = 8
    """Split placement: engine iterations (one token for every running response) between two
    looks for new weights or requests on the rollout ranks. Smaller lets an update land sooner
    (the trainers wait less for the rollout ranks to take it), larger costs fewer checks."""

    def _multi_turn_errors(self) -> list[str]:
        """What multi-turn episodes do not combine with yet."""
        if not self.multi_turn.enabled:
            return []
        unsupported = {"rollout.engine=megatron (no streaming interface)":
                       self.engine != "vllm",
                       "rollout.overlong=penalty (an episode's length is not one response's)":
                       self.overlong == "penalty"}
        return [f"rollout.multi_turn does not work with {what} yet"
                for what, applies in unsupported.items() if applies]

    @property
    def captures_routes(self) -> bool:
        """Whether the engine reports each token's experts (a Mixture-of-Experts model's):
        for r3, or for moe/router_agreement on request."""
        return self.routing_replay == "r3" or self.router_agreement

    @property
    def vllm_raw_logprobs(self) -> bool:
        """Whether the vLLM engine reports raw log-probs (the whole softmax of the logits, before
        top-k/top-p), which are the trainer's distribution only at temperature 1; elsewhere it
        reports processed ones (tempered, then renormalised over the tokens top-k/top-p kept)."""
        return self.sampling.temperature == 1.0

    @property
    def engine_logprobs_whole(self) -> bool:
        """Whether the engine's log-probs of the training samples are under the whole tempered
        distribution, what the trainer scores (the Megatron engine's always), so that a ratio
        against them measures the engine's difference alone, not also the mass top-k/top-p
        cut off."""
        truncated = self.sampling.top_p < 1 or self.sampling.top_k != -1
        return self.engine == "megatron" or self.vllm_raw_logprobs or not truncated

    def importance_correction(self) -> "ImportanceCorrection":
        return ImportanceCorrection(self.importance_cap, self.importance_floor,
                                    self.importance_level, self.importance_mode)

    def errors(self) -> list[str]:
        """Broken rules, each naming its field (empty when valid)."""
        errors = [f"rollout.{message}" for message in self.sampling.errors()]
        errors += [f"rollout.eval_{message}" for message in self.eval_sampling.errors()]
        errors += self.multi_turn.errors() + self._multi_turn_errors()
        if self.engine not in ENGINES:
            errors.append(f"rollout.engine={self.engine!r} must be one of {ENGINES}")
        if not 0 < self.gpu_memory_utilization < 1:
            errors.append(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must "
                          "be in (0, 1): training needs the rest of the GPU")
        if self.sync_bucket_mb < 1:
            errors.append(f"rollout.sync_bucket_mb={self.sync_bucket_mb} must be >= 1")
        if self.delta_sync_anchor_every < 1:
            errors.append(f"rollout.delta_sync_anchor_every={self.delta_sync_anchor_every} must "
                          "be >= 1")
        if self.sleep_level not in (1, 2):
            errors.append(f"rollout.sleep_level={self.sleep_level} must be 1 or 2")
        if self.prompts_per_step < 1:
            errors.append(f"rollout.prompts_per_step={self.prompts_per_step} must be >= 1")
        if self.overlong not in OVERLONG_RESPONSES:
            errors.append(f"rollout.overlong={self.overlong!r} must be one of "
                          f"{OVERLONG_RESPONSES}")
        if self.overlong == "penalty" and not 0 < self.overlong_buffer <= \
                self.sampling.max_new_tokens:
            errors.append(f"rollout.overlong_buffer={self.overlong_buffer} must be in "
                          f"(0, sampling.max_new_tokens={self.sampling.max_new_tokens}]")
        if self.async_rollout and self.dynamic_sampling:
            errors.append("rollout.async_rollout and rollout.dynamic_sampling cannot be combined "
                          "yet")
        if self.max_sampling_rounds < 1:
            errors.append(f"rollout.max_sampling_rounds={self.max_sampling_rounds} must be >= 1")
        if self.importance_cap < 0:
            errors.append(f"rollout.importance_cap={self.importance_cap} must be >= 0")
        if self.importance_level not in IMPORTANCE_LEVELS:
            errors.append(f"rollout.importance_level={self.importance_level!r} must be one of "
                          f"{IMPORTANCE_LEVELS}")
        if self.importance_mode not in IMPORTANCE_MODES:
            errors.append(f"rollout.importance_mode={self.importance_mode!r} must be one of "
                          f"{IMPORTANCE_MODES}")
        if self.old_logprobs not in OLD_LOGPROB_SOURCES:
            errors.append(f"rollout.old_logprobs={self.old_logprobs!r} must be one of "
                          f"{OLD_LOGPROB_SOURCES}")
        if self.routing_replay not in ROUTING_REPLAYS:
            errors.append(f"rollout.routing_replay={self.routing_replay!r} must be one of "
                          f"{ROUTING_REPLAYS}")
        if self.max_staleness < 0:
            errors.append(f"rollout.max_staleness={self.max_staleness} must be >= 0")
        if self.partial_rollout not in PARTIAL_ROLLOUTS:
            errors.append(f"rollout.partial_rollout={self.partial_rollout!r} must be one of "
                          f"{PARTIAL_ROLLOUTS}")
        if self.update_check_steps < 1:
            errors.append(f"rollout.update_check_steps={self.update_check_steps} must be >= 1")
        if self.importance_mode == "mask" and not 0 <= self.importance_floor < \
                self.importance_cap:
            errors.append(f"rollout.importance_floor={self.importance_floor} must be in [0, "
                          f"importance_cap={self.importance_cap}) with importance_mode=mask")
        return errors


@dataclass(frozen=True)
class ImportanceCorrection:
    """The off-policy correction the actor's loss applies (from the rollout.importance_*
    fields; see there)."""

    cap: float = 0.0
    floor: float = 0.0
    level: str = "token"
    mode: str = "truncate"

    @property
    def enabled(self) -> bool:
        return self.cap > 0


def rollout_tp_errors(rollout_tp: int, world_size: int, num_attention_heads: int) -> list[str]:
    """The rules of a rollout tensor-parallel size (the one place they are written): engine
    instances are groups of `rollout_tp` consecutive ranks, each splitting the attention heads."""
    if rollout_tp < 1 or world_size % rollout_tp:
        return [f"rollout_tp={rollout_tp} must be >= 1 and divide the world size {world_size}"]
    if num_attention_heads % rollout_tp:
        return [f"rollout_tp={rollout_tp} must divide num_attention_heads={num_attention_heads}"]
    return []
