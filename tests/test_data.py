"""Prompt datasets: verl-style files, bad rows, chat templates, length filter, the DP sampler,
reasoning-gym and toy sources."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers
from omegaconf import OmegaConf

from mcore_rl.config.data import DataConfig, ReasoningGymConfig, ToyConfig
from mcore_rl.data import (REASONING_GYM_ENTRY_KEY, TOY_VOCAB_SIZE, DataError, PromptRecord,
                           PromptSampler, encode_prompts, load_records, toy_copy_records,
                           write_toy_tokenizer)

MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is two plus two"}]
VERL_ROWS = [
    {"prompt": MESSAGES, "data_source": "openai/gsm8k",
     "reward_model": {"ground_truth": "4", "style": "rule"},
     "extra_info": {"split": "train", "index": 7}},
    {"prompt": [{"role": "user", "content": "say hello"}], "data_source": "hello",
     "reward_model": {"ground_truth": "hello", "style": "rule"},
     "extra_info": {"split": "train", "index": 8}},
]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }} "
          "{{ message['content'] }}<|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
CHAT_WORDS = ("system", "user", "assistant", "be", "brief", "what", "is", "two", "plus",
              "say", "hello", "world")


def write_jsonl(path, rows) -> str:
    with open(path, "w") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def load(path, **fields) -> tuple[list[PromptRecord], int]:
    return load_records(DataConfig(train_files=[str(path)], **fields))


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A word-level tokenizer with a ChatML-like template and a BOS post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    vocab.update({word: 5 + position for position, word in enumerate(CHAT_WORDS)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHATML
    folder = str(tmp_path_factory.mktemp("chat_tokenizer"))
    fast.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def toy_tokenizer(tmp_path_factory):
    folder = write_toy_tokenizer(str(tmp_path_factory.mktemp("toy") / "tokenizer"))
    return transformers.AutoTokenizer.from_pretrained(folder)


# ---------------------------------------------------------------- files


def test_jsonl_verl_rows_parsed(tmp_path):
    rows = VERL_ROWS + [{"prompt": "plain text", "data_source": "text"}]
    records, skipped = load(write_jsonl(tmp_path / "train.jsonl", rows))
    assert skipped == 0
    assert [record.index for record in records] == [0, 1, 2]
    assert records[0].prompt == MESSAGES
    assert records[0].data_source == "openai/gsm8k"
    assert records[0].ground_truth == "4"
    assert records[0].extra_info == {"split": "train", "index": 7}
    assert records[2] == PromptRecord(2, "plain text", "text", None, {})


def test_parquet_matches_jsonl_and_indices_continue_over_files(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", VERL_ROWS)
    parquet = write_parquet(tmp_path / "b.parquet", VERL_ROWS)
    json_array = tmp_path / "c.json"
    json_array.write_text(json.dumps(VERL_ROWS))
    records, skipped = load_records(DataConfig(train_files=[jsonl, parquet, str(json_array)]))
    assert skipped == 0 and [record.index for record in records] == list(range(6))
    strip = [(r.prompt, r.data_source, r.ground_truth, r.extra_info) for r in records]
    assert strip[0:2] == strip[2:4] == strip[4:6]
    assert records[3].prompt == [{"role": "user", "content": "say hello"}]


def test_parquet_prompt_key_and_missing_columns(tmp_path):
    rows = [{"question": "say hello", "data_source": "hello"}]
    path = write_parquet(tmp_path / "q.parquet", rows)
    records, _ = load(path, prompt_key="question")
    assert records[0].prompt == "say hello" and records[0].ground_truth is None
    with pytest.raises(DataError, match=r"q\.parquet: no 'prompt' column"):
        load(path)
    no_source = write_parquet(tmp_path / "s.parquet", [{"prompt": "hi"}])
    with pytest.raises(DataError, match=r"s\.parquet: no 'data_source' column"):
        load(no_source, on_bad_row="skip")


BAD_ROWS = [
    ('{"prompt": "ok", "data_source": "x"', "malformed JSON"),
    ({"data_source": "x"}, "no 'prompt' column"),
    ({"prompt": [{"role": "user"}], "data_source": "x"},
     "prompt messages must be dicts with role and content"),
    ({"prompt": ["hello"], "data_source": "x"},
     "prompt messages must be dicts with role and content"),
    ({"prompt": "   ", "data_source": "x"}, "prompt is empty"),
    ({"prompt": 5, "data_source": "x"}, "prompt must be text or a list of chat messages"),
    ({"prompt": "hi"}, "'data_source' must be a non-empty string"),
    ({"prompt": "hi", "data_source": "x", "reward_model": "4"}, "'reward_model' must be a dict"),
    ({"prompt": "hi", "data_source": "x", "extra_info": [1]}, "'extra_info' must be a dict"),
    ("[1, 2]", "a row must be a JSON object"),
]


@pytest.mark.parametrize("bad_row, rule", BAD_ROWS)
def test_bad_row_error_names_file_line_and_rule(tmp_path, bad_row, rule):
    good = {"prompt": "hi", "data_source": "x"}
    path = write_jsonl(tmp_path / "x.jsonl", [good, "", bad_row, good])
    with pytest.raises(DataError) as raised:
        load(path)
    assert str(raised.value).startswith(f"{path} line 3: {rule}")


def test_bad_rows_skipped_and_counted(tmp_path):
    good = {"prompt": "hi", "data_source": "x"}
    rows = [good, "{not json", good, {"data_source": "x"}, good]
    records, skipped = load(write_jsonl(tmp_path / "x.jsonl", rows), on_bad_row="skip")
    assert skipped == 2
    assert [record.index for record in records] == [0, 1, 2]
    with pytest.raises(DataError, match="all 1 rows were skipped"):
        load(write_jsonl(tmp_path / "bad.jsonl", ["{"]), on_bad_row="skip")


def test_parquet_bad_row_names_row(tmp_path):
    rows = [{"prompt": "hi", "data_source": "x"}, {"prompt": None, "data_source": "x"}]
    path = write_parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(DataError, match=r"p\.parquet row 1: no 'prompt' column"):
        load(path)
    assert load(path, on_bad_row="skip")[1] == 1


def test_unreadable_files_fail_even_when_skipping(tmp_path):
    with pytest.raises(DataError, match="missing.jsonl: prompt file not found"):
        load(tmp_path / "missing.jsonl", on_bad_row="skip")
    garbage = tmp_path / "g.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="g.parquet: not a readable parquet file"):
        load(garbage, on_bad_row="skip")
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="e.jsonl: the file has no rows"):
        load(empty)
    truncated = tmp_path / "t.json"
    truncated.write_text('[{"prompt": "hi", "data_source": "x"},')
    with pytest.raises(DataError, match="t.json: malformed JSON array"):
        load(truncated, on_bad_row="skip")


# ---------------------------------------------------------------- config


def test_config_errors_name_fields():
    config = DataConfig(train_files=["x.csv"], max_prompt_tokens=0, apply_chat_template="maybe",
                        on_bad_row="ignore", prompt_key="",
                        reasoning_gym=ReasoningGymConfig(tasks=["no_such_task"], size=0),
                        toy=ToyConfig(size=-1))
    errors = "\n".join(config.errors())
    for expected in ("data.train_files: 'x.csv'", "data.max_prompt_tokens=0",
                     "data.apply_chat_template='maybe'", "data.on_bad_row='ignore'",
                     "data.prompt_key", "data.reasoning_gym.size=0", "['no_such_task']",
                     "data.toy.size=-1"):
        assert expected in errors
    assert "no training prompts" in "\n".join(DataConfig().errors())
    with pytest.raises(DataError, match="data.max_prompt_tokens=0"):
        load_records(config)


def test_config_is_an_omegaconf_structured_config():
    yaml = ("train_files: [a.parquet, b.jsonl]\napply_chat_template: true\n"
            "reasoning_gym: {tasks: [chain_sum], size: 5}\n")
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.create(yaml),
                             OmegaConf.from_dotlist(["toy.size=3", "tokenizer=/tok"]))
    config = OmegaConf.to_object(merged)
    assert isinstance(config, DataConfig) and config.errors() == []
    assert config.train_files == ["a.parquet", "b.jsonl"] and config.toy.size == 3
    assert config.chat_template_mode() == "true" and config.reasoning_gym.tasks == ["chain_sum"]


# ---------------------------------------------------------------- encoding


def test_chat_template_is_the_tokenizers_own(chat_tokenizer):
    records = [PromptRecord(0, MESSAGES, "x"), PromptRecord(1, "say hello", "x")]
    encoded = encode_prompts(records, chat_tokenizer, 64, "auto")
    own = chat_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    own = own["input_ids"] if hasattr(own, "keys") else own
    assert encoded.token_ids[0] == list(own)
    words = "<|im_start|> system be brief <|im_end|> <|im_start|> user what is two plus two " \
            "<|im_end|> <|im_start|> assistant"
    assert encoded.token_ids[0] == chat_tokenizer.convert_tokens_to_ids(words.split())
    # text: the tokenizer's defaults (its BOS), no template
    assert encoded.token_ids[1] == [1] + chat_tokenizer.convert_tokens_to_ids(["say", "hello"])
    forced = encode_prompts(records[1:], chat_tokenizer, 64, True).token_ids[0]
    assert chat_tokenizer.convert_ids_to_tokens(forced) == \
        "<|im_start|> user say hello <|im_end|> <|im_start|> assistant".split()
    with pytest.raises(DataError, match="apply_chat_template=false"):
        encode_prompts(records, chat_tokenizer, 64, "false")


def test_chat_messages_without_template_fail_naming_tokenizer(toy_tokenizer):
    with pytest.raises(DataError, match="has no chat template"):
        encode_prompts([PromptRecord(0, MESSAGES, "x")], toy_tokenizer, 64)


def test_too_long_prompts_dropped_and_counted(chat_tokenizer):
    records = [PromptRecord(index, " ".join(["two"] * length), "x")
               for index, length in enumerate([1, 5, 3, 8, 4])]
    encoded = encode_prompts(records, chat_tokenizer, max_prompt_tokens=5)
    assert encoded.dropped_too_long == 2
    assert [record.index for record in encoded.records] == [0, 2, 4]
    assert [len(ids) for ids in encoded.token_ids] == [2, 4, 5]


# ---------------------------------------------------------------- sampler


def run_ranks(num_records, per_step, dp_size, steps, seed=3, **kwargs):
    """Per step, the list of every rank's indices."""
    samplers = [PromptSampler(num_records, per_step, rank, dp_size, seed, **kwargs)
                for rank in range(dp_size)]
    return [[sampler.next_indices() for sampler in samplers] for _ in range(steps)]


def test_sampler_epoch_is_a_permutation_split_over_ranks():
    steps = run_ranks(num_records=24, per_step=8, dp_size=4, steps=6)
    for step in steps:
        assert all(len(rank_indices) == 2 for rank_indices in step)
    first_epoch = [index for step in steps[:3] for rank in step for index in rank]
    second_epoch = [index for step in steps[3:] for rank in step for index in rank]
    assert sorted(first_epoch) == sorted(second_epoch) == list(range(24))
    assert first_epoch != second_epoch
    assert first_epoch != list(range(24))


def test_sampler_drops_the_tail_and_never_repeats_within_an_epoch():
    sampler = PromptSampler(10, 4, 0, 1, seed=0)
    assert sampler.steps_per_epoch == 2
    epoch0 = sampler.next_indices() + sampler.next_indices()
    assert len(set(epoch0)) == 8
    assert sampler.next_indices() and sampler.epoch == 1
    unshuffled = run_ranks(10, 4, 2, 3, shuffle=False)
    assert unshuffled[0] == [[0, 1], [2, 3]] and unshuffled[2] == [[0, 1], [2, 3]]


def test_sampler_resume_continues_exactly():
    reference = PromptSampler(30, 6, 1, 3, seed=9)
    expected = [reference.next_indices() for _ in range(12)]
    first = PromptSampler(30, 6, 1, 3, seed=9)
    for _ in range(7):
        first.next_indices()
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSampler(30, 6, 1, 3, seed=9)
    resumed.load_state_dict(state)
    assert [resumed.next_indices() for _ in range(5)] == expected[7:]
    # the state is global: resuming at another DP size takes the same prompts
    halves = [PromptSampler(30, 6, rank, 2, seed=9) for rank in range(2)]
    for sampler in halves:
        sampler.load_state_dict(state)
    whole = PromptSampler(30, 6, 0, 1, seed=9)
    whole.load_state_dict(state)
    assert halves[0].next_indices() + halves[1].next_indices() == whole.next_indices()


def test_sampler_state_identical_on_every_rank_and_refused_elsewhere():
    steps_ranks = [PromptSampler(20, 4, rank, 2, seed=1) for rank in range(2)]
    for sampler in steps_ranks:
        for _ in range(6):
            sampler.next_indices()
    assert steps_ranks[0].state_dict() == steps_ranks[1].state_dict()
    with pytest.raises(DataError, match="seed=1"):
        PromptSampler(20, 4, 0, 2, seed=2).load_state_dict(steps_ranks[0].state_dict())
    with pytest.raises(DataError, match="num_records=20"):
        PromptSampler(21, 4, 0, 2, seed=1).load_state_dict(steps_ranks[0].state_dict())


def test_sampler_refuses_bad_sizes():
    with pytest.raises(DataError, match="multiple of the data-parallel size"):
        PromptSampler(100, 6, 0, 4, seed=0)
    with pytest.raises(DataError, match="fewer than the 8 one step needs"):
        PromptSampler(5, 8, 0, 2, seed=0)


# ---------------------------------------------------------------- built-in sources


def test_reasoning_gym_entries_score_after_json_round_trip():
    import reasoning_gym

    tasks = ["basic_arithmetic", "chain_sum"]
    config = DataConfig(reasoning_gym=ReasoningGymConfig(tasks=tasks, size=3, val_size=2,
                                                         seed=5))
    train, _ = load_records(config, "train")
    val, _ = load_records(config, "val")
    assert [record.data_source for record in train] == ["reasoning_gym/basic_arithmetic"] * 3 + \
        ["reasoning_gym/chain_sum"] * 3
    assert len(val) == 4 and [record.index for record in train] == list(range(6))
    for record in train + val:
        system, user = record.prompt
        assert system["role"] == "system" and "<answer>" in system["content"]
        entry = json.loads(json.dumps(record.extra_info))[REASONING_GYM_ENTRY_KEY]
        assert user == {"role": "user", "content": entry["question"]}
        assert record.ground_truth == entry["answer"]
        task = record.data_source.split("/", 1)[1]
        scorer = reasoning_gym.create_dataset(task, size=1, seed=0)
        assert scorer.score_answer(entry["answer"], entry) == 1.0
        assert scorer.score_answer("certainly wrong", entry) < 1.0
    train_questions = {record.prompt[1]["content"] for record in train}
    assert not train_questions & {record.prompt[1]["content"] for record in val}


def test_reasoning_gym_task_that_loses_its_types_in_json_is_refused():
    config = DataConfig(reasoning_gym=ReasoningGymConfig(tasks=["rearc"], size=2))
    with pytest.raises(DataError, match="'rearc'.*JSON round trip"):
        load_records(config)


def test_toy_tokenizer_round_trip_and_copy_records(toy_tokenizer):
    assert len(toy_tokenizer) == TOY_VOCAB_SIZE < 32
    assert toy_tokenizer.pad_token_id == 0 and toy_tokenizer.eos_token_id == 1
    ids = toy_tokenizer("copy 7 3")["input_ids"]
    assert toy_tokenizer.decode(ids + [1, 0], skip_special_tokens=True) == "copy 7 3"
    records = toy_copy_records(50, seed=4, start_index=10)
    assert [record.index for record in records] == list(range(10, 60))
    assert len({record.ground_truth for record in records}) > 5
    for record in records:
        ids = toy_tokenizer(record.prompt)["input_ids"]
        assert ids[-1] == toy_tokenizer.convert_tokens_to_ids(record.ground_truth)
        assert record.data_source == "toy/copy" and isinstance(record.ground_truth, str)
    config = DataConfig(toy=ToyConfig(size=40, val_size=40, seed=4))
    train, val = load_records(config, "train")[0], load_records(config, "val")[0]
    assert [r.ground_truth for r in train] == [r.ground_truth for r in records[:40]]
    assert [r.ground_truth for r in train] != [r.ground_truth for r in val]
    encoded = encode_prompts(train, toy_tokenizer, 2)
    assert encoded.dropped_too_long == 0 and all(len(ids) == 2 for ids in encoded.token_ids)


def test_reasoning_gym_task_kwargs_reach_the_generator_and_bad_ones_are_named():
    import re

    from mcore_rl.data.reasoning_gym_source import reasoning_gym_records

    easy = ReasoningGymConfig(tasks=["basic_arithmetic"], task_kwargs={"basic_arithmetic": {
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"]}})
    records = reasoning_gym_records(easy, 20, seed=3)
    for record in records:  # "Calculate ( -( -8 + -7 ) )." : two one-digit terms, added
        question = record.prompt[-1]["content"]
        expression = re.fullmatch(r"Calculate (.*)\.", question).group(1)
        assert re.fullmatch(r"[\d+\-() ]+", expression), question  # no * or /
        terms = re.findall(r"\d+", expression)
        assert len(terms) == 2 and all(len(term) == 1 for term in terms), question
        assert expression.count("+") == 1, question
        assert int(record.ground_truth) == eval(expression)  # the task's own answer
    with pytest.raises(DataError, match=r"'basic_arithmetic' cannot be created with size=2, "
                                        r"seed=3, max_termz=2 \(data.reasoning_gym.task_kwargs\)"):
        reasoning_gym_records(ReasoningGymConfig(tasks=["basic_arithmetic"], task_kwargs={
            "basic_arithmetic": {"max_termz": 2}}), 2, seed=3)
    errors = DataConfig(reasoning_gym=ReasoningGymConfig(
        tasks=["chain_sum"], task_kwargs={"basic_arithmetic": {}})).errors()
    assert any("task_kwargs has settings for ['basic_arithmetic']" in error for error in errors)


def test_fewer_validation_prompts_than_data_parallel_ranks_are_refused(tmp_path):
    """A rank without a validation prompt cannot evaluate while its peers wait for it: refused
    at load, naming the fields (measured before: rank 1 raised "no prompts were given")."""
    from mcore_rl.config import load_config
    from mcore_rl.rl.data import load_training_data

    tokenizer = write_toy_tokenizer(str(tmp_path))
    config = load_config("configs/grpo_toy.yaml", [f"data.tokenizer={tokenizer}",
                                                   "data.toy.val_size=1"])
    assert len(load_training_data(config, 0, 1).validation) == 1
    with pytest.raises(DataError, match=r"data\.toy\.val_size.* has 1 prompts for 2 "
                                        r"data-parallel ranks"):
        load_training_data(config, 0, 2)


def test_too_few_validation_prompts_are_accepted_when_nothing_evaluates(tmp_path):
    """trainer.eval_every=0 never evaluates: one validation prompt for two data-parallel ranks
    is no reason to refuse the job (issue 62); evaluating it by hand is still refused, on every
    rank alike, before any rank waits for another."""
    from mcore_rl.config import load_config
    from mcore_rl.rl.data import load_training_data
    from mcore_rl.rl.evaluator import RLEvaluator

    tokenizer = write_toy_tokenizer(str(tmp_path))
    config = load_config("configs/grpo_toy.yaml", [f"data.tokenizer={tokenizer}",
                                                   "data.toy.val_size=1", "trainer.eval_every=0"])
    data = load_training_data(config, 1, 2)
    assert len(data.validation) == 1 and data.validation_shard() == ([], [])
    evaluator = RLEvaluator(config, data, responses=None, roles=None, dp_group=None)
    with pytest.raises(DataError, match="has 1 prompts for 2 data-parallel ranks"):
        evaluator.evaluate(trainer=None, step=0)  # Trainer.evaluate() called by hand
