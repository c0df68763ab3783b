"""Split placement: trainer ranks and rollout ranks of one SPMD job, running at the same time.

    remote_rollouts   the trainer ranks' rollout scheduler: weights out, batches in
    rollout_worker    the rollout ranks' loop: generate, score, send, within the staleness bound
    book              what one engine instance is generating, with which weights
    group_scorer      rule rewards of finished groups, beside generation
    protocol          the messages between the two sides
"""
