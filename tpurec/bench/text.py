"""A small text model trained over random sequence lengths: compilations with and without buckets.

A tiny BERT masked-LM (``transformers``, built from a config: no download) trains
``--steps`` steps of batch ``--batch-size``, each of a random length in 1..``--max-length``,
on the tpu device in fused mode or under ``torch.compile(backend="tpu", dynamic=False)``.
With ``--buckets`` (the default: powers of two from 16 up to ``--max-length``) every
batch is padded with :class:`tpurec.buckets.SequenceBuckets` (attention mask 0, labels
-100 on the padding), so at most one step program is compiled per bucket; ``--no-buckets``
shows the cost of one compilation per new length.

Reported per configuration: XLA compilations asked for (``compile_requests``, disk cache
hits included), distinct lengths and buckets seen (and the buckets some length fits exactly:
such a batch is not padded, its attention mask is all ones, and ``transformers`` skips the
mask then, a branch on the data that makes another program), total and median step wall time,
and the last loss next to the same model trained unpadded on PyTorch CPU (``--check``).

Example::

    python -m tpurec.bench text --steps 100 --max-length 128
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

import tpurec
from tpurec.buckets import SequenceBuckets, power_of_two_buckets
from tpurec.cli import HelpFormatter, add_batch_size, positive_int

PAD = {"input_ids": 0, "attention_mask": 0, "labels": -100}
VOCAB = 128


def tiny_bert(hidden: int, intermediate: int, positions: int, vocab: int = VOCAB) -> torch.nn.Module:
    """A ``transformers`` BERT masked-LM of 2 layers and 2 heads, built from a config (seed 0, no dropout).

    Args:
        hidden: the hidden size.
        intermediate: the feed-forward size.
        positions: the longest sequence it takes.
        vocab: the vocabulary size.
    """
    import transformers

    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=intermediate,
        max_position_embeddings=positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


def _model() -> torch.nn.Module:
    return tiny_bert(hidden=32, intermediate=64, positions=1024)


def run(how: str, buckets: SequenceBuckets | None, lengths: list[int], batch: int, check: bool) -> dict:
    """Trains the model over ``lengths`` in configuration ``how`` ("fused" or "compiled"); returns its figures."""
    cpu = _model()
    model = copy.deepcopy(cpu).to("tpu")
    forward = torch.compile(model, backend="tpu", dynamic=False) if how == "compiled" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    cpu_optimizer = torch.optim.SGD(cpu.parameters(), lr=0.05)
    times, loss, cpu_loss = [], float("nan"), float("nan")
    before = tpurec.stats()["compile_requests"]
    with tpurec.mode("fused"):
        for step, length in enumerate(lengths):
            ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(step))
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            if check:
                reference = cpu(**inputs).loss
                reference.backward()
                cpu_optimizer.step()
                cpu_optimizer.zero_grad()
                cpu_loss = reference.item()
            padded = buckets.pad(inputs, PAD) if buckets is not None else inputs
            start = time.perf_counter()
            out = forward(**{name: tensor.to("tpu") for name, tensor in padded.items()}).loss
            out.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss = out.item()
            times.append(time.perf_counter() - start)
    result = {
        "compile_requests": tpurec.stats()["compile_requests"] - before,
        "distinct_lengths": len(set(lengths)),
        "buckets_seen": len({buckets.size_for(n) for n in lengths}) if buckets is not None else None,
        # A batch whose length is a bucket size is not padded: its attention mask is all ones, and
        # transformers then skips the mask (a data-dependent branch), so that step is another program.
        "exact_fit_buckets": len(set(lengths) & set(buckets.sizes)) if buckets is not None else None,
        "total_s": sum(times),
        "median_step_ms": statistics.median(times) * 1e3,
        "last_loss": loss,
    }
    if check:
        result["cpu_last_loss"] = cpu_loss
        result["loss_relative_difference"] = abs(loss - cpu_loss) / abs(cpu_loss)
    return result


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench text") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=100, help="training steps, one random length each")
    parser.add_argument("--max-length", type=positive_int, default=128, help="lengths are drawn from 1..MAX_LENGTH")
    add_batch_size(parser, "sequences per step", type=positive_int, default=4)
    parser.add_argument(
        "--how", nargs="+", default=["fused", "compiled"], choices=["fused", "compiled"], help="execution modes to run"
    )
    parser.add_argument("--no-buckets", action="store_true", help="no padding: one compilation per new length")
    parser.add_argument("--check", action="store_true", help="also train unpadded on PyTorch CPU and compare losses")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the lengths")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    lengths = [rng.randint(1, args.max_length) for _ in range(args.steps)]
    buckets = None if args.no_buckets else power_of_two_buckets(args.max_length)
    result: dict = {
        "benchmark": "text",
        "platform": tpurec.platform(),
        "steps": args.steps,
        "max_length": args.max_length,
        "buckets": list(buckets.sizes) if buckets is not None else None,
    }
    for how in args.how:
        result[how] = run(how, buckets, lengths, args.batch, args.check)
    return result
