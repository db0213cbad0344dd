"""What rayzero.fit refuses on the driver before Ray starts (no Ray cluster in this module: every case must stop
before one is started or joined), which worker errors end a run without retry, and the loss fit takes from a
Hugging Face model's own output.  The Ray runs of the same: tests/test_ray_errors.py."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import rayzero
from moe_cases import tiny_mixtral, tiny_qwen3
from ray_cases import CONFIG, MoERegression, Regression, model_factory, mse

ray = pytest.importorskip("ray")


@pytest.fixture(autouse=True)
def no_ray_started():
    assert not ray.is_initialized()
    yield
    assert not ray.is_initialized(), "the case reached Ray: its check did not run on the driver before launch"


# ---- ClusterConfig: every field, a wrong type and a wrong range, each named in the error

BAD_CLUSTER = [
    ("workers", "2", r"workers='2' \(str\): must be an int >= 1"),
    ("workers", 0, "workers=0"),
    ("workers", True, r"workers=True \(bool\)"),
    ("workers", (3, 1), r"workers=\(3, 1\).*1 <= min <= max"),
    ("workers", (1, 2, 3), r"workers=\(1, 2, 3\)"),
    ("use_gpu", "yes", r"use_gpu='yes' \(str\): must be True or False"),
    ("resources_per_worker", {"CPU": -1}, r"resources_per_worker=\{'CPU': -1\}.*amount >= 0"),
    ("resources_per_worker", {"CPU": "1"}, "resources_per_worker="),
    ("resources_per_worker", 1, r"resources_per_worker=1 \(int\)"),
    ("storage", "", "storage='' .*non-empty"),
    ("storage", 5, r"storage=5 \(int\)"),
    ("name", "", "name=''"),
    ("name", "a/b", "name='a/b'.*without '/'"),
    ("name", 7, r"name=7 \(int\)"),
    ("max_failures", -1, r"max_failures=-1 \(int\): must be an int >= 0"),
    ("max_failures", 1.5, "max_failures=1.5"),
    ("checkpoint_every", "5", r"checkpoint_every='5' \(str\): must be an int >= 0"),
    ("checkpoint_every", -1, "checkpoint_every=-1"),
    ("keep_checkpoints", 0, r"keep_checkpoints=0 \(int\): must be an int >= 1"),
    ("keep_checkpoints", 2.0, "keep_checkpoints=2.0 \\(float\\)"),
    ("address", "", "address=''"),
    ("address", 6379, "address=6379"),
    ("micro_batch_sizes", [], r"micro_batch_sizes=\[\]"),
    ("micro_batch_sizes", [2, 0], r"micro_batch_sizes=\[2, 0\].*ints >= 1"),
    ("micro_batch_sizes", 4, r"micro_batch_sizes=4 \(int\)"),
    ("elastic_check_interval_s", -1.0, r"elastic_check_interval_s=-1.0 \(float\): must be a number of seconds > 0"),
    ("elastic_check_interval_s", 0, "elastic_check_interval_s=0"),
    ("elastic_check_interval_s", "10", "elastic_check_interval_s='10'"),
    ("elastic_check_interval_s", float("nan"), "elastic_check_interval_s=nan"),
    ("start_timeout_s", -5, r"start_timeout_s=-5 \(int\): must be a number of seconds >= 0"),
    ("start_timeout_s", None, "start_timeout_s=None"),
    ("progress", 1, r"progress=1 \(int\): must be True or False"),
    ("verbose", "no", "verbose='no'"),
    ("resume_from", -1, r"resume_from=-1 \(int\): must be None"),
    ("resume_from", "/", "resume_from='/'"),
    ("resume_from", 2.0, r"resume_from=2.0 \(float\)"),
    ("save_on_stop", "no", r"save_on_stop='no' \(str\): must be True"),
]


def test_every_cluster_config_field_has_a_check_and_a_case():
    from rayzero.train.cluster_config import FIELD_CHECKS

    names = [f.name for f in dataclasses.fields(rayzero.ClusterConfig)]
    assert sorted(FIELD_CHECKS) == sorted(names)
    assert sorted({key for key, _, _ in BAD_CLUSTER}) == sorted(names)


@pytest.mark.parametrize("key,value,match", BAD_CLUSTER, ids=[f"{k}={v!r}" for k, v, _ in BAD_CLUSTER])
def test_a_bad_cluster_config_value_names_its_field(key, value, match, tmp_path):
    with pytest.raises(rayzero.ConfigError, match=rf"ClusterConfig\.{match}"):
        rayzero.ClusterConfig.from_any({"storage": str(tmp_path), key: value})
    # and from fit, before Ray starts
    with pytest.raises(rayzero.ConfigError, match=rf"ClusterConfig\.{match}"):
        rayzero.fit(model_factory, {"storage": str(tmp_path), key: value}, config=CONFIG, data=Regression(),
                    loss_fn=mse)


def test_good_cluster_config_values_pass(tmp_path):
    cfg = rayzero.ClusterConfig.from_any({
        "workers": [1, 3], "use_gpu": False, "resources_per_worker": {"CPU": 0.5, "memory": 1 << 30},
        "storage": tmp_path / "runs", "name": "run-1", "max_failures": 0, "checkpoint_every": 0,
        "keep_checkpoints": 1, "address": "auto", "micro_batch_sizes": (1, 2), "elastic_check_interval_s": 0.5,
        "start_timeout_s": 0, "progress": False, "verbose": True,
    })
    assert cfg.workers == (1, 3) and cfg.storage == str(tmp_path / "runs")


# ---- fit's own arguments


def _fit(tmp_path, model=model_factory, **kwargs):
    args = {"config": CONFIG, "data": Regression(), "loss_fn": mse, **kwargs}
    return rayzero.fit(model, {"workers": 1, "storage": str(tmp_path)}, **args)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield torch.zeros(7), torch.zeros(5)


BAD_FIT = [
    ({"max_steps": "5"}, r"fit\(max_steps=...\) must be an int >= 1.*'5' \(str\)"),
    ({"max_steps": 0}, r"fit\(max_steps=...\) must be an int >= 1.*got 0"),
    ({"max_steps": 2.0}, r"fit\(max_steps=...\).*2.0 \(float\)"),
    ({"seed": -1}, r"fit\(seed=...\) must be an int in \[0, 2\*\*44\)"),
    ({"seed": 1.0}, r"fit\(seed=...\).*1.0 \(float\)"),
    ({"seed": 2**44}, r"fit\(seed=...\)"),
    ({"shuffle": "no"}, r"fit\(shuffle=...\) must be True or False"),
    ({"record_samples": 1}, r"fit\(record_samples=...\) must be True or False"),
    ({"zero_init": "yes"}, r"fit\(zero_init=...\) must be None"),
    ({"loss_fn": "mse"}, r"fit\(loss_fn=...\) must be None or a function loss_fn\(model_output, batch\)"),
    ({"train_step": 3}, r"fit\(train_step=...\) must be None or a function train_step\(engine, batch\)"),
    ({"collate": [1]}, r"fit\(collate=...\) must be None or a function collate"),
    ({"data": None}, r"fit\(data=...\) is missing: pass a torch map-style Dataset"),
    ({"data": None, "train_step": lambda engine, batch: 0.0}, r"fit\(data=...\) is missing.*itertools.repeat"),
    ({"data": 42}, r"fit\(data=...\) got int, which fit cannot read"),
    ({"data": _Stream()}, r"fit\(data=...\) got _Stream.*wrap it in a factory"),
    ({"data": iter([1, 2])}, r"fit\(data=...\) got list_iterator.*wrap it in a factory"),
    ({"data": []}, r"fit\(data=...\) is an empty list"),
]


@pytest.mark.parametrize("kwargs,match", BAD_FIT, ids=[",".join(f"{k}={v!r}" for k, v in a.items()) for a, _ in BAD_FIT])
def test_a_bad_fit_argument_names_itself(kwargs, match, tmp_path):
    with pytest.raises(rayzero.ConfigError, match=match):
        _fit(tmp_path, **kwargs)


def test_every_fit_argument_is_covered():
    import inspect

    covered = {key for args, _ in BAD_FIT for key in args} | {"model", "cluster_cfg", "config"}
    assert covered == set(inspect.signature(rayzero.fit).parameters)


def test_model_must_be_a_module_or_factory(tmp_path):
    with pytest.raises(TypeError, match=r"fit\(model=...\) got 'a model' \(str\)"):
        _fit(tmp_path, model="a model")
    with pytest.raises(rayzero.ConfigError, match="unknown cluster config key 'worker'.*did you mean 'workers'"):
        rayzero.fit(model_factory, {"worker": 2}, config=CONFIG, data=Regression())


# ---- the model, on the driver


class NoParameters(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [torch.nn.Linear(7, 5)]  # a plain list: not registered, so not the model's parameters

    def forward(self, x):
        return self.layers[0](x)


def _frozen():
    model = model_factory()
    model.requires_grad_(False)
    return model


def test_a_model_with_nothing_to_train_is_refused(tmp_path):
    with pytest.raises(rayzero.ConfigError, match=r"the model NoParameters has no parameters.*nn.ModuleList"):
        _fit(tmp_path, model=NoParameters())
    with pytest.raises(rayzero.ConfigError, match=r"NoParameters \(built by the model factory\) has no parameters"):
        _fit(tmp_path, model=NoParameters)
    with pytest.raises(rayzero.ConfigError, match=r"every parameter of the model Sequential \(built by the model factory\) has requires_grad=False"):
        _fit(tmp_path, model=_frozen)


def test_expert_count_that_autoep_size_does_not_divide_is_refused(tmp_path):
    moe = {**CONFIG, "train_batch_size": 6, "expert_parallel": {"enabled": True, "autoep_size": 3}}
    # rayzero's own MoE layer (4 experts), as a factory and as a module
    for model in (MoERegression, MoERegression()):
        with pytest.raises(rayzero.ConfigError,
                           match=r"cannot be laid out.*autoep_size=3 does not divide the 4 experts of moe.*\(1, 2, 4\)"):
            rayzero.fit(model, {"workers": 3, "storage": str(tmp_path)}, config=moe, data=Regression(), loss_fn=mse)
    # a Hugging Face Mixtral's experts modules
    with pytest.raises(rayzero.ConfigError, match=r"autoep_size=3 does not divide the 4 experts of model.layers.0"):
        rayzero.fit(tiny_mixtral, {"workers": 3, "storage": str(tmp_path)}, config=moe, data=Regression())


def test_heads_that_autotp_size_does_not_divide_are_refused(tmp_path):
    tp = {**CONFIG, "train_batch_size": 6, "tensor_parallel": {"autotp_size": 3}}
    with pytest.raises(rayzero.ConfigError,
                       match=r"autotp_size=3 does not divide .*num_attention_heads=4, num_key_value_heads=2"):
        rayzero.fit(tiny_qwen3, {"workers": 3, "storage": str(tmp_path)}, config=tp, data=Regression())


# ---- which worker errors end the run (Ray Train's own policy objects, no cluster)


def _decision(failures: dict, max_failures: int = 3):
    from ray.train import FailureConfig, WorkerGroupError

    from rayzero.train.failure_policy import FatalErrorPolicy

    policy = FatalErrorPolicy(FailureConfig(max_failures=max_failures))
    # the exceptions come to the controller pickled, as from the workers
    failures = {rank: pickle.loads(pickle.dumps(e)) for rank, e in failures.items()}
    return policy.make_decision(WorkerGroupError("worker errors", failures)).value


def test_fatal_worker_errors_are_not_retried():
    from ray.exceptions import RayActorError

    from rayzero.checkpoint.format import CheckpointError
    from rayzero.train.failures import mark_fatal

    assert _decision({0: rayzero.ConfigError("bad layout"), 1: rayzero.ConfigError("bad layout")}) == "RAISE"
    assert _decision({1: rayzero.NonFiniteLossError("nan")}) == "RAISE"
    assert _decision({0: rayzero.NonFiniteGradientError("nan")}) == "RAISE"
    assert _decision({0: mark_fatal(CheckpointError("checksum"))}) == "RAISE"
    # retried as before: an error of another kind, a checkpoint error not from a load (a failed save), and any
    # failure in which a worker was lost (the other ranks' errors may follow from it)
    assert _decision({0: RuntimeError("connection reset")}) == "RETRY"
    assert _decision({0: CheckpointError("rank 1 did not finish writing")}) == "RETRY"
    assert _decision({0: rayzero.ConfigError("x"), 1: RayActorError()}) == "RETRY"
    assert _decision({0: RuntimeError("x")}, max_failures=0) == "RAISE"
    # StorageFullError: the next attempt meets the same full volume at the same save
    from rayzero.checkpoint.format import StorageFullError

    assert _decision({0: StorageFullError("no room"), 1: StorageFullError("no room")}) == "RAISE"


def test_workers_that_stopped_on_a_preemption_notice_are_a_preemption_not_a_failure():
    """Workers that saved on a node's preemption notice and saw no teardown raise NodePreempted: charged to
    Ray Train's preemption budget (unlimited by default), not max_failures, even at max_failures=0."""
    from ray.train.v2.api.preemption import PreemptionInfo

    from rayzero.train.failures import NodePreempted

    info = PreemptionInfo(deadline_ms=1, preempted_node_to_ranks={"n1": [0]})
    both = {0: NodePreempted("saved at step 3", info), 1: NodePreempted("saved at step 3", info)}
    assert _decision(both, max_failures=0) == "RETRY"
    # one rank's other error is a failure like any other
    assert _decision({0: NodePreempted("saved", info), 1: RuntimeError("x")}, max_failures=0) == "RAISE"


# ---- the loss of a Hugging Face model's own output


def test_model_loss_is_the_hugging_face_outputs_loss():
    from rayzero.train.worker import model_loss

    model = tiny_qwen3()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)
    assert model_loss(out) is out.loss
    assert model_loss({"loss": out.loss, "logits": out.logits}) is out.loss
    scalar = torch.tensor(2.5)
    assert model_loss(scalar) is scalar
    assert model_loss(torch.tensor([1.0, 3.0])).item() == 2.0
    with pytest.raises(rayzero.ConfigError, match=r"returned a CausalLMOutputWithPast \(keys \['logits'.*no loss.*labels"):
        model_loss(model(input_ids=ids))


def test_a_checkpoint_a_worker_cannot_load_ends_the_run(tmp_path):
    from rayzero.checkpoint.format import ChecksumError
    from rayzero.checkpoint.storage import Storage
    from rayzero.train.failures import FATAL_ATTR
    from rayzero.train.worker import _load_checkpoint

    torch.manual_seed(0)
    engine = rayzero.initialize(model_factory(), {"zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(4, 7)).pow(2).mean())
    engine.step()
    tag = engine.save_checkpoint(str(tmp_path), tag="checkpoint_step00000001")
    frag = tmp_path / tag / "rank_00000.arrow"
    data = bytearray(frag.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside the first fragment's data
    frag.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="rank_00000.arrow") as info:
        _load_checkpoint(engine, Storage.resolve(str(tmp_path)), tag)
    engine.destroy()
    assert getattr(info.value, FATAL_ATTR) is True
    assert _decision({0: info.value}) == "RAISE"  # the mark survives the trip to Ray Train's controller
