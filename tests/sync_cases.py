"""Per-rank runs for tests/test_host_syncs.py: the host syncs of one optimizer step (tests/sync_count.py).

A step here is everything between two optimizer steps: every micro-batch's forward and backward, and the
boundary's ``engine.step()``.  It is counted after one warm-up step (which builds the optimizer state and
records stage 3's gather order), with the data already on the device, and with nothing that reads the loss.
"""

from __future__ import annotations

import torch

import rayzero
from device_cases import use_standin
from sync_count import SyncCounter

WIDTH = 16
# one Linear layer (WIDTH * WIDTH + WIDTH elements) per bucket, so buckets grow with the layers
BUCKET = WIDTH * WIDTH + WIDTH + 8


class Stack(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class MoEStack(torch.nn.Module):
    """``layers`` rayzero MoE layers (4 experts, top-2) with residuals; ``capacity``: their capacity factor."""

    def __init__(self, layers: int, capacity: float | None = None):
        super().__init__()
        from rayzero.moe import MoE

        self.layers = torch.nn.ModuleList(
            MoE(WIDTH, 24, 4, top_k=2, capacity_factor=capacity, num_shared_experts=1) for _ in range(layers))

    def forward(self, x):
        from rayzero.moe import moe_aux_loss

        for layer in self.layers:
            x = x + layer(x)
        return x, moe_aux_loss(self)


def config(stage: int, gas: int, dtype: str = "fp32", offload: str = "none", param_offload: str = "none",
           ep: int = 1, optimizer: str = "AdamW") -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-2}},
        "gradient_clipping": 0.5,
        "steps_per_print": 0,
        "zero_optimization": {
            "stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
            "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": BUCKET,
        },
    }
    if dtype in ("bf16", "fp16"):
        cfg[dtype] = {"enabled": True}
    if offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
    if param_offload != "none":
        cfg["zero_optimization"]["offload_param"] = {"device": param_offload}
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return cfg


def _model(kind: str, layers: int):
    torch.manual_seed(0)
    if kind == "dense":
        return Stack(layers)
    if kind == "moe":
        return MoEStack(layers)
    if kind == "moe_capacity":
        return MoEStack(layers, capacity=1.0)
    if kind == "hf_moe":  # moe_cases.tiny_qwen3_moe with `layers` layers, no KV cache (it is training)
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        from moe_cases import VOCAB

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            vocab_size=VOCAB, output_router_logits=False, attn_implementation="eager", decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True, use_cache=False))
    raise ValueError(kind)


def _inputs(kind: str, device, micro: int, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    if kind == "hf_moe":
        from moe_cases import SEQ, VOCAB

        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        return ids.to(device), torch.ones_like(ids).to(device)
    return torch.randn(4, WIDTH, generator=g).to(device)


def _loss(kind: str, engine, x):
    if kind == "hf_moe":  # with a mask: without one, transformers checks for packed sequences (a scalar read)
        ids, mask = x
        return engine(input_ids=ids, attention_mask=mask, labels=ids).loss
    if kind == "dense":
        return engine(x).square().mean()
    out, aux = engine(x)
    return out.square().mean() + aux


def step_syncs(rank: int, world: int, runs: list[dict], on_device: bool) -> list[dict]:
    """For each run (``kind``, ``layers``, ``config``): build an engine, take a warm-up step, count the
    syncs of the next one.  ``on_device``: the ``standin`` device (counting its tensors), else the
    CPU-storage stand-in (counting every tensor; stage 3 runs only there)."""
    acc = use_standin(on_device=on_device)
    device = acc.device()
    out = []
    for run in runs:
        kind, cfg = run["kind"], run["config"]
        engine = rayzero.initialize(_model(kind, run["layers"]), cfg)
        gas = engine.gradient_accumulation_steps
        # the inputs are on the device beforehand: moving data there is the loader's business
        data = [[_inputs(kind, device, m, s, rank) for m in range(gas)] for s in range(2)]
        losses = []
        counter = SyncCounter("device" if on_device else "all")
        for step in range(2):
            if step == 1:
                counter.__enter__()
            try:
                for x in data[step]:
                    loss = _loss(kind, engine, x)
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.detach())
            finally:
                if step == 1:
                    counter.__exit__(None, None, None)
        out.append({"count": len(counter), "summary": counter.summary(), "loss": float(losses[-1]),
                    "norm": engine.global_grad_norm})
        engine.destroy()
    return out


def counter_kinds(rank: int, world: int) -> dict:
    """Each kind of sync once on the ``standin`` device, the same work on host tensors and a non-blocking
    copy (neither counts), then host work under the ``"all"`` scope: the kinds each counter saw."""
    import standin_device

    standin_device.install()
    d = torch.arange(6, dtype=torch.float32).to("standin")  # (made before counting)
    mask, repeats = (d > 2), torch.tensor([1, 2, 0, 1, 1, 1]).to("standin")
    h = torch.arange(6, dtype=torch.float32)
    with SyncCounter("device") as device:
        d[1].item(); bool(d[2]); float(d[3]); int(d[4])  # noqa: E702 - one line, one stack location
        d.tolist()
        d[mask]
        d.nonzero()
        torch.masked_select(d, mask)
        torch.unique(d)
        d.repeat_interleave(repeats)
        torch.bincount(repeats, minlength=8)
        d.cpu()
        torch.tensor([1.0, 2.0], device="standin")
        # not syncs: the same with sizes given, copies that do not wait, host tensors, device-only work
        d.repeat_interleave(repeats, output_size=6)
        d.to("cpu", non_blocking=True)
        h[h > 2].sum().item(); h.tolist()  # noqa: E702
        (d * 2).sum()
    with SyncCounter("all") as host:
        h[1].item()
        h[h > 2]
        h.tolist()
        (h * 2).sum()
    return {"device": [(s.kind, s.where) for s in device.syncs], "all": [s.kind for s in host.syncs]}
