"""rayzero: elastic distributed training for PyTorch on Ray, with ZeRO stages 0-3."""

from rayzero.config import Config, ConfigError, NotSupportedYetError
from rayzero.engine import Engine, NonFiniteGradientError, initialize
from rayzero.train.cluster_config import ClusterConfig
from rayzero.train.failures import NonFiniteLossError
from rayzero.train.fit import Result, fit
from rayzero.train.stop import RunStopped
from rayzero.zero.init import zero_init



def tune(*args, **kwargs):
    """``rayzero.train.tune.tune``: short trials on the cluster that pick the fastest config (docs/tune.md)."""
    from rayzero.train.tune import tune as _tune

    return _tune(*args, **kwargs)


__all__ = [
    "ClusterConfig",
    "Config",
    "ConfigError",
    "Engine",
    "NonFiniteGradientError",
    "NonFiniteLossError",
    "NotSupportedYetError",
    "Result",
    "RunStopped",
    "fit",
    "initialize",
    "tune",
    "zero_init",
]
__version__ = "0.1.0"
