"""Shared pieces of the MoE / AutoEP / AutoTP engine tests: tiny HF models, data, the engine run and the
single-process reference it must match (plain SGD, so a wrong gradient scale cannot hide in Adam)."""

from __future__ import annotations

import math

import torch

VOCAB = 64
SEQ = 8
LR = 0.5
CLIP = 0.05  # small enough that every step clips: the weights then depend on the exact global norm


def tiny_qwen3_moe(seed: int = 0, experts: int = 4, aux_loss: bool = True):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, moe_intermediate_size=32, num_experts=experts, num_experts_per_tok=2,
        vocab_size=VOCAB, output_router_logits=aux_loss, router_aux_loss_coef=0.01, attn_implementation="eager",
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def tiny_mixtral(seed: int = 0, experts: int = 4):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, num_local_experts=experts, num_experts_per_tok=2, vocab_size=VOCAB,
        output_router_logits=True, router_aux_loss_coef=0.01, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return MixtralForCausalLM(config)


def tiny_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, vocab_size=VOCAB, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


class TinyMoELM(torch.nn.Module):
    """A user's own model with rayzero.moe.MoE layers (shared expert, z-loss): the loss includes the
    layers' auxiliary losses, as users write it."""

    def __init__(self, hidden: int = 32, experts: int = 4):
        super().__init__()
        from rayzero.moe import MoE

        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.moe1 = MoE(hidden, 48, experts, top_k=2, num_shared_experts=1, z_loss_coef=0.001)
        self.norm = torch.nn.LayerNorm(hidden)
        self.moe2 = MoE(hidden, 48, experts, top_k=1)
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, input_ids, labels):
        from types import SimpleNamespace

        from rayzero.moe import moe_aux_loss

        h = self.embed(input_ids)
        h = h + self.moe1(h)
        h = h + self.moe2(self.norm(h))
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss + moe_aux_loss(self), logits=logits)


def tiny_rayzero_moe(seed: int = 0):
    torch.manual_seed(seed)
    return TinyMoELM()


def _frozen_experts(model):
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
    return model


MODELS = {
    "rayzero_moe": tiny_rayzero_moe,
    "qwen3_moe": tiny_qwen3_moe,
    # without the router's auxiliary loss the loss is a mean over samples, so any cut of a batch into
    # data shards gives the same gradient: what a checkpoint resumed at another degree needs
    "qwen3_moe_noaux": lambda seed=0: tiny_qwen3_moe(seed, aux_loss=False),
    "qwen3_moe_frozen_experts": lambda seed=0: _frozen_experts(tiny_qwen3_moe(seed, aux_loss=False)),
    "mixtral": tiny_mixtral,
    "qwen3": tiny_qwen3,
}


def batches(steps: int, shards: int, micro: int, gas: int = 1, seed: int = 7) -> torch.Tensor:
    """Token ids ``(steps, gas, shards, micro, SEQ)``: step, micro-step, data shard."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, gas, shards, micro, SEQ), generator=g)


def engine_config(stage: int, ep: int = 1, tp: int = 1, micro: int = 2, gas: int = 1, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000, "allgather_bucket_size": 4000,
                              "stage3_param_persistence_threshold": 64},
        "steps_per_print": 0,
    }
    if ep > 1:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    cfg.update(extra)
    return cfg


def train_engine(
    rank: int, world: int, model_name: str, cfg: dict, steps: int, data: torch.Tensor,
    load_from: str | None = None, save_to: str | None = None, save_after: int = 0,
) -> dict:
    """Run on every rank: train through rayzero (resuming from ``load_from``, saving to ``save_to`` after
    ``save_after`` steps), return losses, norms and the consolidated weights."""
    import rayzero

    model = MODELS[model_name]()
    engine = rayzero.initialize(model, cfg)
    if load_from is not None:
        engine.load_checkpoint(load_from)
    losses, norms = [], []
    for step in range(engine.global_steps, steps):
        if save_to is not None and step == save_after:
            engine.save_checkpoint(save_to)
        for micro in range(engine.gradient_accumulation_steps):
            ids = data[step, micro, engine.dp_rank]
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
            losses.append(out.loss.item())
        norms.append(engine.global_grad_norm)
    weights = engine.full_state_dict()
    info = {"dp_rank": engine.dp_rank, "dp": engine.dp_world_size, "topology": engine.topology}
    engine.destroy()
    return {"losses": losses, "norms": norms, "weights": weights if rank == 0 else None, **info}


def train_reference(model_name: str, steps: int, data: torch.Tensor) -> dict:
    """One process, every data shard: the loss is the mean over shards of each shard's loss, accumulated
    over micro-steps as the engine does (divided by the number of micro-steps)."""
    model = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    _, gas, shards = data.shape[:3]
    for step in range(steps):
        opt.zero_grad()
        for micro in range(gas):
            total = 0.0
            for d in range(shards):
                ids = data[step, micro, d]
                loss = model(input_ids=ids, labels=ids).loss
                (loss / (shards * gas)).backward()
                total += loss.item()
            losses.append(total / shards)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {"losses": losses, "norms": norms, "weights": model.state_dict()}


def assert_matches(result: dict, ref: dict, tol: float = 1e-5) -> None:
    for a, b in zip(result["norms"], ref["norms"]):
        assert math.isclose(a, b, rel_tol=tol), (result["norms"], ref["norms"])
    got, want = result["weights"], ref["weights"]
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, w in want.items():
        assert got[name].shape == w.shape, (name, got[name].shape, w.shape)
        err = (got[name].float() - w.float()).abs().max().item()
        assert err <= tol * max(1.0, w.abs().max().item()), f"{name}: max error {err}"
