"""Optional W&B logging: refused at start-up without the package (naming the key and the pip
command), and, with it, the same metrics as the JSONL files at the same steps. wandb itself is
not a test dependency: a stand-in module records the calls."""

import sys
import types

import pytest

from mcore_rl.config import ConfigError, JobConfig, validate_rl
from mcore_rl.config.data import DataConfig, ToyConfig
from mcore_rl.config.trainer import TrainerConfig
from mcore_rl.config.runtime import RuntimeConfig
from mcore_rl.observability.step_metrics import MetricsLogger


def job(tmp_path, **trainer) -> JobConfig:
    return JobConfig(data=DataConfig(toy=ToyConfig(size=8)),
                     runtime=RuntimeConfig(output_dir=str(tmp_path / "my_run")),
                     trainer=TrainerConfig(tensorboard=False, **trainer))


@pytest.fixture
def no_wandb(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails, find_spec finds nothing


def test_validation_refuses_wandb_project_without_wandb(tmp_path, no_wandb):
    with pytest.raises(ConfigError) as error:
        validate_rl(job(tmp_path, wandb_project="rl"), 1)
    assert "trainer.wandb_project" in str(error.value)
    assert "pip install wandb" in str(error.value)
    validate_rl(job(tmp_path), 1)  # unset: wandb is not needed


def test_validation_of_the_wandb_keys(tmp_path):
    assert TrainerConfig(wandb_run_name="x").errors() == [
        "trainer.wandb_run_name is set but trainer.wandb_project is not"]
    assert any("must not be empty" in error for error in TrainerConfig(wandb_project="").errors())


def test_logger_without_wandb_names_the_key_and_the_command(tmp_path, no_wandb):
    with pytest.raises(RuntimeError, match=r"trainer\.wandb_project.*pip install wandb"):
        MetricsLogger.for_job(job(tmp_path, wandb_project="rl"))


class FakeRun:
    def __init__(self, **init):
        self.init, self.logged, self.finished = init, [], False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


def test_logger_sends_every_metric_to_wandb(tmp_path, monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **init: runs.append(FakeRun(**init)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = job(tmp_path, wandb_project="rl")
    logger = MetricsLogger.for_job(config)
    logger.log(0, {"eval/accuracy": 0.5}, "eval")
    logger.log(1, {"reward/mean": 0.25, "time/step": 2.0})
    logger.close()
    (run,) = runs
    assert run.init["project"] == "rl" and run.init["name"] == "my_run"
    assert run.init["dir"] == config.runtime.output_dir
    assert run.init["config"]["trainer"]["wandb_project"] == "rl"
    assert run.logged == [(0, {"eval/accuracy": 0.5}), (1, {"reward/mean": 0.25, "time/step": 2.0})]
    assert run.finished
