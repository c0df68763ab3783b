"""Packed micro-batches (token budget, dense models): rows back to back in one sequence, with
Megatron's packed-sequence parameters, so RoPE restarts per row and attention is causal within
each row only. Log-probs, entropy, the loss and every gradient equal those of the same rows
scored and trained unpacked (fixed micro-batches of padded rows), on a tiny Llama-like model
with RoPE and grouped KV heads; rows of different lengths, a budget that splits them over
several micro-batches and one whose total is not a multiple of anything. The pass reports how
much of what it ran over was padding."""

import pytest
import torch

from mcore_rl.training.batches import PackedRows, packed_micro_batches
from world import run_world

LENGTHS = [23, 5, 17, 9, 12, 3, 20, 2]
WIDTH, VOCAB = 24, 64


def lengths_batch(lengths, width=WIDTH, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=generator) * mask
    prompt = torch.tensor([min(4, length - 1) for length in lengths])
    loss_mask = mask * (torch.arange(width)[None] >= prompt[:, None])
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}


def test_split_and_layout_follow_their_definition():
    batch = dict(lengths_batch(LENGTHS), scores=torch.arange(len(LENGTHS)))
    micro_batches, order = packed_micro_batches(batch, max_tokens=32)
    # First-fit decreasing: 23 | 20 | 17 | 12 -> with 20 (32) | 9 -> with 23 (32) | 5, 3, 2
    # -> with 17 (27).
    assert [m["scores"].tolist() for m in micro_batches] == [[0, 3], [6, 4], [2, 1, 5, 7]]
    assert order.tolist() == [0, 3, 6, 4, 2, 1, 5, 7]
    assert [m["input_ids"].shape for m in micro_batches] == [(2, 23), (2, 20), (4, 17)]
    assert micro_batches[2]["pack_offsets"].tolist() == [0, 17, 22, 25]
    with pytest.raises(ValueError, match="23 tokens does not fit the micro-batch token budget "
                                         "of 20"):
        packed_micro_batches(batch, max_tokens=20)

    micro_batch = micro_batches[2]
    packing = PackedRows.of(micro_batch, length_multiple=4)  # as sequence parallelism asks
    assert packing.segments == (17, 5, 3, 2, 1) and packing.length == 28
    assert packing.cu_seqlens().tolist() == [0, 17, 22, 25, 27, 28]
    packed = packing.pack(micro_batch["input_ids"])
    rows = [micro_batch["input_ids"][row, :length] for row, length in enumerate(packing.lengths)]
    assert torch.equal(packed[0, :27], torch.cat(rows))
    unpacked = packing.unpack(packed) * micro_batch["attention_mask"]
    assert torch.equal(unpacked, micro_batch["input_ids"])


@pytest.mark.parametrize("tensor_parallel", [1, 2], ids=["one-rank", "TP2-SP"])
def test_packed_passes_equal_unpacked_rows(tensor_parallel):
    """TP2-SP: two tensor-parallel ranks with sequence parallelism, whose packed sequences are
    padded at the end to a multiple of 2 (one padding segment)."""
    results = run_world(tensor_parallel, compare_packing, tensor_parallel)[0]
    mask = results["batch"]["attention_mask"].bool()
    used = results["batch"]["loss_mask"].bool()
    rows = results["rows"]
    for name in ("packed", "packed_output_mask"):
        packed = results[name]
        assert packed["micro_batches"] > 1, "the budget splits the rows"
        positions = used if name == "packed_output_mask" else mask
        for output in ("logprobs", "entropy", "logprobs_after"):
            # After one Adam step at lr 1e-2 (which divides each gradient by its own size, so
            # gradients equal to 1e-8 can still move a parameter differently) to 1e-3.
            tolerance = 1e-3 if output == "logprobs_after" else 1e-5
            torch.testing.assert_close(packed[output][positions], rows[output][positions],
                                       atol=tolerance, rtol=tolerance)
            assert (packed[output][~mask] == 0).all()
        assert packed["loss"] == pytest.approx(rows["loss"], rel=1e-5)
        for parameter, gradient in rows["gradients"].items():
            torch.testing.assert_close(packed["gradients"][parameter], gradient, atol=1e-5,
                                       rtol=1e-5, msg=parameter)
    # The padded share of the update's forward: the fixed rows run over 4 x 2 x 24 positions,
    # the packed ones over the tokens alone.
    tokens = sum(LENGTHS)
    assert rows["padded_share"] == pytest.approx(1 - tokens / (len(LENGTHS) * WIDTH))
    if tensor_parallel == 1:
        assert results["packed"]["padded_share"] == 0.0
        # The output layer runs over the used positions alone: every packed token, or with an
        # output mask the positions before a masked token (each row's prompt is skipped,
        # also between rows), in the scoring pass.
        assert results["packed"]["output_positions"] == tokens
        assert results["packed_output_mask"]["output_positions"] == int(used[:, 1:].sum())
    else:  # packed sequences end on a multiple of 2: 32 + 32 + 27 tokens run as 32 + 32 + 28
        assert results["packed"]["padded_share"] == pytest.approx(1 / 92)


def compare_packing(tensor_parallel: int = 1) -> dict:
    from mcore_rl.config import (BatchConfig, JobConfig, ModelConfig, OptimizerConfig,
                                 ParallelConfig)
    from mcore_rl.models import build_gpt_model
    from mcore_rl.runtime import initialize, seed_everything, shutdown
    from mcore_rl.sft.trainer import sft_loss
    from mcore_rl.training import compute_outputs, make_trainable, train_step

    config = JobConfig(model=ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                         num_attention_heads=4, num_kv_heads=2,
                                         vocab_size=VOCAB, max_position_embeddings=32),
                       parallel=ParallelConfig(tensor_model_parallel_size=tensor_parallel,
                                               sequence_parallel=tensor_parallel > 1),
                       optimizer=OptimizerConfig(lr=1e-2),
                       batch=BatchConfig(global_batch_size=len(LENGTHS), micro_batch_size=2,
                                         seq_length=WIDTH))
    place = initialize(config).training
    batch = lengths_batch(LENGTHS)
    results = {"batch": batch}
    for name, rows, budget in (("rows", batch, 0), ("packed", batch, 32),
                               ("packed_output_mask", dict(batch, output_mask=batch["loss_mask"]),
                                32)):
        seed_everything(config.runtime.seed)
        trainable = make_trainable(build_gpt_model(config.model, config.parallel, place=place),
                                   config.optimizer, "fp32")
        output_positions = []
        hook = trainable.chunks[0].module.output_layer.register_forward_hook(
            lambda _, args, output: output_positions.append(output[0].shape[0]))
        outputs = compute_outputs(trainable.chunks, rows, 2, "lm", VOCAB, max_tokens=budget)
        hook.remove()
        metrics = train_step(trainable, rows, 2, sft_loss, "lm", VOCAB, max_tokens=budget)
        gradients = {parameter: param.main_grad.clone()
                     for parameter, param in trainable.chunks[0].named_parameters()}
        after = compute_outputs(trainable.chunks, rows, 2, "lm", VOCAB, max_tokens=budget)
        results[name] = {"logprobs": outputs["logprobs"], "entropy": outputs["entropy"],
                         "loss": metrics["loss"], "gradients": gradients,
                         "logprobs_after": after["logprobs"],
                         "output_positions": sum(output_positions),
                         "padded_share": metrics["padded_tokens"] / metrics["forward_tokens"],
                         "micro_batches": len(packed_micro_batches(batch, budget)[0])
                         if budget else 0}
    shutdown()
    return results
