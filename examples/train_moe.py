"""Train a tiny Qwen3-MoE language model with expert parallelism (AutoEP) on Ray with rayzero.

    python examples/train_moe.py                          # EP=2 on 2 workers, local Ray cluster
    python examples/train_moe.py --ep 1 --workers 2       # the same model, experts replicated (plain ZeRO)
    python examples/train_moe.py --max-steps 20 --workers 4 --ep 2    # 2 EP groups of 2, 2 copies of each expert
    python examples/train_moe.py --tp 2 --ep 1 --workers 2            # tensor parallel instead

The model is a Hugging Face ``Qwen3MoeForCausalLM`` built in code from a ``Qwen3MoeConfig`` (4 experts,
top-2 routing, nothing is downloaded).  It reads the byte-level text that ``examples/train.py`` trains on,
through that script's own data helpers.  With ``"expert_parallel": {"enabled": true, "autoep_size": N}``
the engine's AutoEP swaps every MoE block's experts for expert-parallel ones: each rank of an EP group
keeps ``4 / N`` experts and tokens travel to their experts with all-to-all.  The loss is the model's own
``out.loss`` (next-byte cross-entropy plus the router's load-balancing loss).  Prints the start-up phases and
progress lines as it trains, then the loss summary and the held-out loss of the exported weights.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import rayzero
from rayzero.train.fit import ClusterTooSmallError

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import train as shipped  # noqa: E402  (examples/train.py: the text, the byte tokenisation, the windows)

import ray.cloudpickle  # noqa: E402

# Ray workers cannot import examples/ by name: send the code of both scripts along with the objects that use it.
ray.cloudpickle.register_pickle_by_value(shipped)
if __name__ != "__main__":
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

NUM_EXPERTS = 4


def build_model(context: int = 64, experts: int = NUM_EXPERTS):
    """A tiny Qwen3-MoE: hidden 64, 2 layers, 4 heads (2 key/value heads), ``experts`` experts, top-2."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=shipped.VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,  # dense MLP size; unused, every layer is MoE (mlp_only_layers=[])
        moe_intermediate_size=64,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=context + 1,
        output_router_logits=True,  # out.loss then includes the load-balancing loss
        router_aux_loss_coef=0.01,
        use_cache=False,
        attn_implementation="eager",
    )
    return Qwen3MoeForCausalLM(config)


class LMWindows(shipped.ByteWindows):
    """The shipped byte windows as Hugging Face inputs: ``context + 1`` bytes, labels = input ids (the model
    shifts them itself), so every window has ``context`` next-byte targets like examples/train.py."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        ids = torch.cat([x, y[-1:]])
        return {"input_ids": ids, "labels": ids}


def hf_loss(out, batch):
    return out.loss


def engine_config(args) -> dict:
    config = shipped.engine_config(args)
    config["expert_parallel"] = {"enabled": True, "autoep_size": args.ep, "preset_model": "qwen3_moe"}
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp}
    return config


def parse_args(argv=None):
    """The command line, checked: a bad value ends in argparse's one-line error (exit code 2), before Ray starts
    (examples/train.py's pattern and types)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=shipped.HelpFormatter)
    p.add_argument("--max-steps", type=shipped.positive_int, default=60, help="optimizer steps for the whole run (>= 1)")
    p.add_argument("--workers", type=shipped.parse_workers, default=2, help="N workers, or MIN,MAX for an elastic run")
    p.add_argument("--ep", type=shipped.positive_int, default=2,
                   help=f"expert-parallel size (autoep_size): the ranks that share the {NUM_EXPERTS} experts; must "
                        f"divide {NUM_EXPERTS}")
    p.add_argument("--tp", type=shipped.positive_int, default=1,
                   help="tensor-parallel size (autotp_size): the ranks that share each weight matrix")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2], help="ZeRO stage")
    p.add_argument("--storage", default=shipped.default_storage(),
                   help=f"local path or pyarrow.fs URI for checkpoints and metrics (${shipped.STORAGE_ENV} sets "
                        "the default)")
    p.add_argument("--name", default="tiny-moe", help="run name; the run is stored as NAME-YYYYmmdd-HHMMSS under --storage")
    p.add_argument("--global-batch", type=shipped.positive_int, default=8,
                   help="samples per optimizer step, all workers; a multiple of the data shards (workers / tp)")
    p.add_argument("--context", type=shipped.positive_int, default=64, help="tokens (bytes) per training window")
    p.add_argument("--lr", type=shipped.positive_float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--checkpoint-every", type=shipped.non_negative_int, default=0,
                   help="steps between checkpoints (0: only at the end)")
    p.add_argument("--cpus-per-worker", type=shipped.positive_int, default=1,
                   help="CPUs each worker reserves (and uses as threads)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out loss after training")
    p.add_argument("--verbose", action="store_true",
                   help="also show Ray's own console output (Ray Train's INFO lines and reports, Ray core log "
                        "lines, every rank's repeated lines)")
    args = p.parse_args(argv)
    if not args.name or "/" in args.name or args.name in (".", ".."):
        p.error(f"argument --name: {args.name!r} is not a run name (no '/', not empty)")
    if NUM_EXPERTS % args.ep:
        p.error(f"argument --ep: {args.ep} does not divide the model's {NUM_EXPERTS} experts (use 1, 2 or 4)")
    low, high = args.workers if isinstance(args.workers, tuple) else (args.workers, args.workers)
    from rayzero.train.planning import plan_range

    try:  # the layout and the batch cut at both ends of the range, as fit plans them
        plan_range(args.global_batch, low, high, None, args.tp, args.ep)
    except rayzero.ConfigError as e:
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip())  # one line
        p.error(f"arguments --workers/--tp/--ep/--global-batch: {reason}")
    return args


def run(args) -> rayzero.Result:
    text = open(shipped.TEXT, "rb").read()
    split = int(len(text) * 0.9)
    cluster = rayzero.ClusterConfig(
        workers=args.workers,
        storage=args.storage,
        name=f"{args.name}-{time.strftime('%Y%m%d-%H%M%S')}",
        checkpoint_every=args.checkpoint_every,
        max_failures=1,
        elastic_check_interval_s=5,
        resources_per_worker={"CPU": args.cpus_per_worker},
        verbose=getattr(args, "verbose", False),
    )
    os.environ.setdefault("RAYZERO_THREADS_PER_WORKER", str(args.cpus_per_worker))
    context = args.context
    return rayzero.fit(
        lambda: build_model(context),
        cluster,
        config=engine_config(args),
        data=LMWindows(text[:split], context),
        loss_fn=hf_loss,
        max_steps=args.max_steps,
        seed=0,
    )


def held_out_loss(result: rayzero.Result, context: int, batches: int = 4) -> float:
    """The exported full weights (experts gathered from their EP slices) in one plain process."""
    from rayzero.checkpoint.tools import export

    text = open(shipped.TEXT, "rb").read()
    held_out = LMWindows(text[int(len(text) * 0.9):], context)
    weights = os.path.join(result.run_dir, "final_weights.pt")
    export(result.checkpoint, weights)
    model = build_model(context)
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(torch.utils.data.DataLoader(held_out, batch_size=16)):
            total += model(**batch).loss.item() * batch["input_ids"].shape[0]
            count += batch["input_ids"].shape[0]
            if i + 1 == batches:
                break
    return total / count


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        result = run(args)
    except ClusterTooSmallError as e:  # --workers / --cpus-per-worker the cluster cannot host: one line, no traceback
        sys.exit(f"{os.path.basename(__file__)}: error: {e}")
    losses = result.losses
    print(
        f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {len(losses)} steps, world sizes "
        f"{result.world_sizes}, ep {args.ep}, tp {args.tp}  (a uniform byte model scores ln 256 = {math.log(256):.2f})"
    )
    if not args.no_eval:
        print(f"held-out loss of the exported weights: {held_out_loss(result, args.context):.4f}")
    print(f"run directory: {result.run_dir}   (plot it: rayzero plot {result.run_dir})")


if __name__ == "__main__":
    main()
