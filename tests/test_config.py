"""Config loading, overrides and validation: every bad input names its key and rule."""

import dataclasses

import pytest

from mcore_rl.config import ConfigError, JobConfig, load_config, to_yaml, validate


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_yaml_then_overrides_take_precedence(tmp_path):
    path = write(tmp_path, "job.yaml", "model:\n  num_layers: 6\noptimizer:\n  lr: 0.5\n")
    config = load_config(path, ["optimizer.lr=2e-4", "model.tie_embeddings=true"])
    assert config.model.num_layers == 6
    assert config.optimizer.lr == pytest.approx(2e-4)
    assert config.model.tie_embeddings is True
    assert config.model.hidden_size == JobConfig().model.hidden_size


def test_defaults_include_is_merged_first(tmp_path):
    write(tmp_path, "base.yaml", "model:\n  num_layers: 2\n  hidden_size: 64\n")
    path = write(tmp_path, "job.yaml", "defaults: [base.yaml]\nmodel:\n  num_layers: 8\n")
    config = load_config(path)
    assert (config.model.num_layers, config.model.hidden_size) == (8, 64)


@pytest.mark.parametrize("override, key", [
    (["model.hiden_size=3"], "model.hiden_size"),
    (["model.num_layers=three"], "model.num_layers"),
    (["paralel.tensor_model_parallel_size=2"], "paralel"),
])
def test_unknown_keys_and_wrong_types_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, override)


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["model.num_layers"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/job.yaml")


def test_invalid_yaml_names_file(tmp_path):
    path = write(tmp_path, "bad.yaml", "model: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(path)


@pytest.mark.parametrize("overrides, world, rule", [
    (["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"], 6,
     "world size 6 must be divisible"),
    (["parallel.tensor_model_parallel_size=3"], 3, "num_attention_heads=4 must be divisible"),
    (["model.num_attention_heads=8", "model.num_kv_heads=3"], 1, "num_kv_heads=3 must divide"),
    (["model.num_attention_heads=8", "model.num_kv_heads=4",
      "parallel.tensor_model_parallel_size=8", "model.ffn_hidden_size=256"], 8, None),
    (["model.num_attention_heads=12", "model.num_kv_heads=6", "model.hidden_size=96",
      "parallel.tensor_model_parallel_size=4"], 4, "num_kv_heads=6 must divide or be divisible"),
    (["model.num_layers=3", "parallel.pipeline_model_parallel_size=4"], 4,
     "num_layers=3 must be at least pipeline_model_parallel_size=4"),
    (["batch.global_batch_size=6", "batch.micro_batch_size=4"], 1,
     "global_batch_size=6 must be divisible"),
    (["batch.global_batch_size=8", "batch.micro_batch_size=2"], 8,
     "global_batch_size=8 must be divisible"),
    (["runtime.precision=fp8"], 1, "runtime.precision"),
    (["optimizer.lr_decay_style=exp"], 1, "lr_decay_style"),
    (["batch.seq_length=4096"], 1, "max_position_embeddings"),
    (["parallel.sequence_parallel=true"], 1, "sequence_parallel"),
    (["parallel.context_parallel_size=2"], 2, None),
    (["parallel.context_parallel_size=2", "rollout.engine=megatron"], 2,
     r"context_parallel_size=2 is not supported with rollout.engine=megatron"),
])
def test_validate_rules(overrides, world, rule):
    config = load_config(None, overrides)
    if rule is None:
        assert validate(config, world) == dataclasses.replace(config,
                                                              runtime=config.runtime.resolved())
        return
    with pytest.raises(ConfigError, match=rule):
        validate(config, world)


def test_kv_heads_fewer_than_tp_are_shared_not_refused():
    validate(load_config(None, ["model.num_kv_heads=1", "parallel.tensor_model_parallel_size=4"]),
             4)
    # (8 + 2 x 1) x 2 = 20 QKV rows cannot be cut into 8 equal shards.
    odd_rows = load_config(None, ["model.num_attention_heads=8", "model.num_kv_heads=1",
                                  "model.hidden_size=16", "parallel.tensor_model_parallel_size=8",
                                  "model.ffn_hidden_size=64"])
    with pytest.raises(ConfigError, match="fused QKV rows"):
        validate(odd_rows, 8)


def test_all_errors_reported_together():
    config = load_config(None, ["runtime.precision=fp8", "optimizer.clip_grad=-1"])
    with pytest.raises(ConfigError) as error:
        validate(config, 1)
    assert "runtime.precision" in str(error.value) and "optimizer.clip_grad" in str(error.value)


def test_config_is_frozen_and_round_trips_through_yaml(tmp_path):
    config = load_config(None, ["model.num_layers=2", "model.rope_scaling.factor=4"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.num_layers = 3
    path = write(tmp_path, "resolved.yaml", to_yaml(config))
    assert load_config(path) == config


def test_padded_vocab_follows_megatron_rule():
    config = load_config(None, ["model.vocab_size=1000", "model.make_vocab_size_divisible_by=128"])
    assert config.model.padded_vocab_size(1) == 1024
    assert config.model.padded_vocab_size(3) == 1152
    assert config.model.padded_vocab_size(8) == 1024


def test_a_lora_field_without_enabled_is_refused_naming_enabled(tmp_path):
    """verl users set only the rank: with adapters off that would train every weight."""
    with pytest.raises(ConfigError, match=r"command line: actor\.lora\.rank is set but "
                                          r"actor\.lora\.enabled is false"):
        load_config(None, ["actor.lora.rank=8", "actor.lora.alpha=16"])
    (tmp_path / "job.yaml").write_text("sft:\n  lora:\n    alpha: 32\n")
    with pytest.raises(ConfigError, match=r"job\.yaml: sft\.lora\.alpha is set but sft\.lora\."
                                          r"enabled is false"):
        load_config(str(tmp_path / "job.yaml"))
    enabled = load_config(str(tmp_path / "job.yaml"), ["sft.lora.enabled=true"])
    assert enabled.sft.lora.enabled and enabled.sft.lora.alpha == 32
    (tmp_path / "saved.yaml").write_text(to_yaml(load_config()))  # a run's config: as written
    assert not load_config(str(tmp_path / "saved.yaml")).actor.lora.enabled
